"""Large bodies decoded and encoded off the event loop, in a codec process of its own.

A request with more than `OFF_LOOP_BYTES` of JSON (or of gRPC typed contents, which decode through
Python numbers too), and a JSON answer that large, take a millisecond or more to convert: the edges
have that done here, so that no other request, nor a health probe, waits for it. Smaller ones stay
on the loop, where they cost less than the hop. Binary tensor data is only viewed (decoding) or
copied once (encoding): it stays on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Mapping

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ..dataplane import RegionViews
from .codec import AnswerFormat, Decoded, decode_grpc, decode_rest, encode_rest

log = logging.getLogger(__name__)

#: About a millisecond of conversion.
OFF_LOOP_BYTES = 256 * 2**10

#: Where that work runs: a process of its own, started with the first such body. A thread would not
#: do: orjson and numpy hold the GIL through each conversion (orjson.loads of a yolov8n image, 23 MB
#: of JSON, is one 75 ms call; numpy's conversion of its numbers another 27 ms), and the loop needs
#: the GIL each time it wakes. Measured with /v2/health/live polled every 10 ms while 2-3 clients sent
#: such images (tests/faults/test_loop.py): the slowest probe waited 300-700 ms with decoding on the
#: loop, 200-380 ms with it in a thread, 20-80 ms with it in this process.
_process: ProcessPoolExecutor | None = None
#: The codec process's niceness, above the edges': on a busy host its bulk conversions yield the CPU
#: to the loops that answer probes and small requests.
CODEC_NICENESS = 10


async def off_loop(function, *args):
    """`function(*args)` in the codec process (started now if it is not running)."""
    global _process
    if _process is None:
        # A frontend of --workers is a daemonic process, which multiprocessing lets start no child lest it
        # be orphaned: this one ends with its parent (`_codec_process_start`).
        multiprocessing.current_process().daemon = False
        _process = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_codec_process_start)
        log.info("decoding and encoding bodies of more than %d bytes of JSON in a codec process", OFF_LOOP_BYTES)
    try:
        return await asyncio.get_running_loop().run_in_executor(_process, function, *args)
    except BrokenProcessPool:
        _process = None  # it died (killed, out of memory): the next large body starts another
        raise


def _codec_process_start() -> None:
    """How the codec process starts: at a lower priority than the edges, and set to end with its parent,
    whose death its work queue does not show (the process holds both ends of that pipe)."""
    os.nice(CODEC_NICENESS)
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (parent.join(), os._exit(0)), name="parent-watch", daemon=True).start()


class _NeedsRegions(Exception):
    """The request names a shared memory region, which the codec process does not map."""


class _NoRegions:
    """The codec process's shared memory regions: none."""

    def view(self, *args) -> memoryview:
        raise _NeedsRegions()

    def locate(self, array: np.ndarray) -> None:
        return None


def _decode_rest_unmapped(body: bytes, header_length: str | None, name: str, version: str, received_ns: int) -> Decoded:
    return decode_rest(body, header_length, _NoRegions(), name, version, received_ns)


def _decode_grpc_unmapped(message: bytes, received_ns: int) -> Decoded:
    # Serialized to cross: tritonclient's message classes pickle under a module name no process can import.
    return decode_grpc(pb.ModelInferRequest.FromString(message), _NoRegions(), received_ns)


async def decode_rest_off_loop(
    body: bytes, header_length: str | None, regions: RegionViews, name: str, version: str, received_ns: int
) -> Decoded:
    """`decode_rest`, in the codec process (here if the request uses shared memory, which only this process maps)."""
    try:
        return await off_loop(_decode_rest_unmapped, body, header_length, name, version, received_ns)
    except _NeedsRegions:
        return decode_rest(body, header_length, regions, name, version, received_ns)


async def decode_grpc_off_loop(request: pb.ModelInferRequest, regions: RegionViews, received_ns: int) -> Decoded:
    """`decode_grpc`, in the codec process (here if the request uses shared memory)."""
    try:
        return await off_loop(_decode_grpc_unmapped, request.SerializeToString(), received_ns)
    except _NeedsRegions:
        return decode_grpc(request, regions, received_ns)


async def encode_rest_off_loop(
    model_name: str, version: int, request_id: str, outputs: Mapping[str, np.ndarray], answer: AnswerFormat
) -> tuple[bytes, int | None]:
    """`encode_rest`, in the codec process when the answer holds more than OFF_LOOP_BYTES of JSON (unless
    outputs go to shared memory, which only this process maps)."""
    if rest_answer_json_bytes(answer, outputs) <= OFF_LOOP_BYTES or answer.shm_outputs:
        return encode_rest(model_name, version, request_id, outputs, answer)
    return await off_loop(encode_rest, model_name, version, request_id, outputs, answer)


def rest_json_bytes(body: bytes, header_length: str | None) -> int:
    """How much JSON a REST body holds: all of it, or its header (the binary part is only viewed)."""
    if header_length is None:
        return len(body)
    try:
        return min(int(header_length), len(body))
    except ValueError:
        return 0  # refused by decode_rest at once


def rest_answer_json_bytes(answer: AnswerFormat, outputs: Mapping[str, np.ndarray]) -> int:
    """How many bytes of tensors `encode_rest` writes as JSON numbers or strings."""
    return sum(
        array.nbytes
        for name, array in outputs.items()
        if name not in answer.shm_outputs and not answer.binary.get(name, answer.binary_default)
    )


def grpc_typed_bytes(request: pb.ModelInferRequest) -> int:
    """About how many bytes of typed contents (`contents` rather than raw) a gRPC request holds."""
    return sum(4 * len(values) for tensor in request.inputs for _, values in tensor.contents.ListFields())


def stop() -> None:
    """Ends the codec process, if one runs. A frontend of `--workers` calls it before it returns:
    multiprocessing joins a child process's own children as it exits, before the pool's exit hook
    has told this one to end, and this one ends only with its parent — the two would wait forever."""
    global _process
    if _process is not None:
        _process.shutdown(wait=True, cancel_futures=True)
        _process = None
