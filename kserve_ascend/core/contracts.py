"""What the servers rely on in the core, declared once: a served version, a request scheduler, the
options of a request and the health snapshot metrics read.

A served version is a plain model version (`models.version.ModelVersion`: instances fed by a
batcher or a sequence batcher) or an ensemble version (`models.ensemble.EnsembleVersion`: its
scheduler runs the steps on other versions). The data plane and the metrics see only this.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .cache import ResponseCache
from .errors import InternalError, InvalidInput, ModelNotReady
from .scheduling.sequences import SequenceRequest
from .signature import Signature
from .stats import RequestTiming, VersionStats, now_ns

log = logging.getLogger(__name__)

Tensors = Mapping[str, np.ndarray]
#: A decoupled model's answer to one request (config `model_transaction_policy { decoupled: true }`): each
#: response's outputs as the model produces them, zero or more; the iterator's end is the final flag, which
#: comes alone (without outputs). Closing it early (`aclose`: the client cancelled) stops the model producing.
#: The one shape of a stream of responses in every layer: scheduler, served version, data plane, edges.
Responses = AsyncIterator[dict[str, np.ndarray]]


class RequestOptions:
    """A request's parameters, parsed once as the request enters the core.

    `priority` (1 is the most urgent level) and `timeout` (microseconds in the queue, where the
    queue policy allows it) for any scheduler; Triton's sequence parameters for a sequence
    model's (`sequence`); all of them (`parameters`) for a runtime that reads its own (detection
    thresholds) and for every step of an ensemble.
    """

    __slots__ = ("_sequence", "parameters", "priority", "timeout_us")

    NONE: ClassVar[RequestOptions]

    def __init__(self, parameters: Mapping[str, object], priority: int | None = None, timeout_us: int | None = None):
        self.parameters = parameters
        self.priority = priority
        self.timeout_us = timeout_us
        self._sequence: SequenceRequest | None = None

    @classmethod
    def parse(cls, parameters: Mapping[str, object] | None) -> RequestOptions:
        """InvalidInput names a parameter the core reads that is malformed."""
        if not parameters:
            return cls.NONE
        return cls(parameters, _non_negative(parameters, "priority"), _non_negative(parameters, "timeout"))

    @property
    def sequence(self) -> SequenceRequest:
        """Where the request stands in a sequence (asked only by a sequence model's scheduler)."""
        if self._sequence is None:
            self._sequence = SequenceRequest.from_parameters(self.parameters)
        return self._sequence


RequestOptions.NONE = RequestOptions({})


def _non_negative(parameters: Mapping[str, object], key: str) -> int | None:
    value = parameters.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"request parameter '{key}' must be a non-negative integer, got {value!r}")
    return value


@dataclass(slots=True)
class Request:
    """One request as a scheduler takes it: checked against the model and prepared."""

    inputs: Tensors
    #: Its batch size (1 for a model that does not batch).
    rows: int
    #: The outputs asked for (empty: every output).
    outputs: Collection[str]
    options: RequestOptions
    timing: RequestTiming


@dataclass(frozen=True)
class InstanceHealth:
    device_id: int
    #: Why the instance left rotation ("" while it is in rotation).
    out_of_rotation: str
    #: Whether its runtime serves below what the config asked (the CPU instead of the CANN provider).
    degraded: bool
    #: How busy its device is, in percent (None where the runtime cannot tell).
    utilization: float | None


@dataclass(frozen=True)
class VersionHealth:
    """What metrics read of a served version, besides its statistics."""

    #: Requests waiting for an execution.
    queued: int
    #: Zero rows added so far to fill batches up to a size the model file takes.
    padding_rows: int
    instances: tuple[InstanceHealth, ...] = ()


class RequestScheduler(ABC):
    """Takes a version's requests and answers each with its outputs: a dynamic batcher, a sequence
    batcher, or an ensemble's steps.

    Counts what it holds (`outstanding`), so that retiring a version and shutting down wait
    for exactly those requests (`drain`).
    """

    def __init__(self) -> None:
        #: Requests submitted and not yet answered.
        self.outstanding = 0
        self._answered_all = asyncio.Event()
        self._answered_all.set()

    @abstractmethod
    async def submit(self, request: Request) -> dict[str, np.ndarray]:
        """Resolves with the request's outputs (at least those asked for), or raises its error."""

    def stream(self, request: Request) -> Responses:
        """A decoupled model's scheduler only (`scheduling.decoupled`): the request's responses."""
        raise InternalError("this model answers every request with one response: it has no stream of responses")

    @property
    @abstractmethod
    def health(self) -> list[str]:
        """Per instance: "" while it is in rotation, else why it left."""

    @property
    @abstractmethod
    def queued(self) -> int:
        """Requests waiting for an execution."""

    @abstractmethod
    def close(self, reason: Exception) -> None:
        """Takes no more requests; fails those still waiting with `reason` (running ones finish)."""

    @abstractmethod
    def abandon(self, reason: Exception) -> list[int]:
        """Fails what is still executing with `reason` (a shutdown that can wait no longer); returns the
        instances whose execution nothing waits for any more."""

    @property
    def in_rotation(self) -> int:
        return self.health.count("")

    def health_report(self) -> str:
        """Which instances left rotation, and why."""
        lost = [f"instance {i}: {reason}" for i, reason in enumerate(self.health) if reason]
        return ("no instance is healthy: " if not self.in_rotation else "") + "; ".join(lost)

    def _entered(self) -> None:
        self.outstanding += 1
        self._answered_all.clear()

    def _left(self) -> None:
        self.outstanding -= 1
        if not self.outstanding:
            self._answered_all.set()

    async def drain(self) -> None:
        """Waits until every request submitted so far has been answered (for a version that receives
        no new ones: retiring, shutting down)."""
        while self.outstanding:
            await self._answered_all.wait()


class ServedVersion(ABC):
    """One version of a model, serving requests: what the data plane, the repository and the metrics use.

    `infer` is the one way into it: the request is checked against the config (a malformed one
    never reaches a scheduler, so no statistic counts it, as in Triton), prepared (`accept`),
    handed to the scheduler, and answered with the outputs asked for.
    """

    name: str
    version: int
    config: mc.ModelConfig
    signature: Signature
    #: The outputs' classification labels (config `label_filename`), read at load as Triton does.
    labels: Mapping[str, tuple[bytes, ...]]
    stats: VersionStats
    scheduler: RequestScheduler
    #: The version's directory, or its model file.
    path: Path
    #: The config as read (before completion), to tell whether a reload changes the version.
    source: bytes
    #: The model file's sha256 ("" where there is none).
    sha256: str = ""
    #: Bytes the version holds on each device it has instances on, as measured at its load
    #: (`models.memory`; none for an ensemble, whose steps hold theirs).
    memory: Mapping[int, int] = {}
    #: Told why when the version can no longer serve (set by the Model that serves this version).
    on_unavailable: Callable[[str], None] | None = None
    #: The server's response cache, where the server has one and the config enables it (`response_cache`),
    #: and what this version's keys in it start with (`ResponseCache.scope`).
    cache: ResponseCache | None = None
    cache_scope: bytes = b""
    #: Whether it answers a request with a stream of responses (`stream`) rather than one (`infer`).
    decoupled: bool = False

    async def infer(
        self, inputs: Tensors, outputs: Collection[str], options: RequestOptions, timing: RequestTiming
    ) -> dict[str, np.ndarray]:
        """Runs one request; returns the outputs asked for (all of them when `outputs` is empty).

        `timing`: the caller's, which records the request once the caller has made its answer.
        """
        if outputs:
            self.signature.check_outputs(outputs)
        if self.cache is not None:
            return await self._infer_cached(self.cache, inputs, outputs, options, timing)
        return await self._run(inputs, outputs, options, timing)

    async def _run(
        self, inputs: Tensors, outputs: Collection[str], options: RequestOptions, timing: RequestTiming
    ) -> dict[str, np.ndarray]:
        rows, inputs = self.accept(inputs, options)
        answer = await self.scheduler.submit(Request(inputs, rows, outputs, options, timing))
        return {name: answer[name] for name in outputs} if outputs else answer

    async def _infer_cached(
        self, cache: ResponseCache, inputs: Tensors, outputs: Collection[str], options: RequestOptions, timing: RequestTiming
    ) -> dict[str, np.ndarray]:
        """As Triton's schedulers use its cache: looked up as the request enters the scheduler, the answer
        stored once the model made it. A hit runs nothing. The lookup precedes the request's checks, as a
        request equal to one answered before passes them as that one did."""
        enqueued = now_ns()
        key = cache.key(self.cache_scope, inputs, outputs)
        lookup_start = now_ns()
        answer = cache.lookup(key)
        lookup_end = now_ns()
        if answer is not None:
            timing.cache_hit(self.stats, enqueued, lookup_start, lookup_end)
            return answer
        answer = await self._run(inputs, outputs, options, timing)
        insert_start = now_ns()
        if cache.insert(key, answer):
            timing.cache_missed(lookup_end - lookup_start + now_ns() - insert_start)
        return answer

    def stream(self, inputs: Tensors, outputs: Collection[str], options: RequestOptions, timing: RequestTiming) -> Responses:
        """A decoupled version's answer to one request: its responses, each with the outputs asked for (all of them
        when `outputs` is empty). Checked as `infer` checks it, at once: a malformed request raises here, before
        any response; what fails later (in the model) raises from the iterator. The request is recorded in the
        statistics once the iterator ends."""
        if outputs:
            self.signature.check_outputs(outputs)
        rows, inputs = self.accept(inputs, options)
        return self.scheduler.stream(Request(inputs, rows, outputs, options, timing))

    def accept(self, inputs: Tensors, options: RequestOptions) -> tuple[int, Tensors]:
        """The request's batch size and what its scheduler takes of it; InvalidInput if it does not fit the model."""
        return self.signature.check_inputs(inputs), inputs

    @property
    def waiting_for(self) -> str:
        """What the version waits for before it can serve ("" when nothing: an ensemble waits for its steps)."""
        return ""

    @property
    def healthy(self) -> bool:
        """Whether every instance is in rotation (a reload replaces a version that is not)."""
        return self.scheduler.in_rotation == len(self.scheduler.health)

    @property
    def runtime_info(self) -> dict[str, str]:
        """What the version runs on and how, for model metadata `parameters`."""
        return {}

    @abstractmethod
    def health_snapshot(self) -> VersionHealth:
        """What metrics read of the version now."""

    @abstractmethod
    def unchanged(self, source: bytes, model_dir: Path) -> bool:
        """Whether the version still is what `source` (a config as read) and its files describe."""

    @property
    def padding_rows(self) -> int:
        """Zero rows added so far to fill batches up to a size the model file takes."""
        return 0

    def statistics(self) -> dict:
        """This version in Triton's statistics extension, with `batch_padding_rows` added."""
        return self.stats.as_dict(self.name, self.version, self.padding_rows)

    async def retire(self) -> None:
        """Takes the version out of service without losing a request: the caller has stopped handing it
        requests; this waits until those it holds are answered, then releases its devices off the loop."""
        await self.scheduler.drain()
        self.scheduler.close(self._unloaded())
        await asyncio.to_thread(self.release)
        log.info("model '%s' version %d unloaded", self.name, self.version)

    def abandon(self, reason: Exception) -> None:
        """Fails every request it holds, queued or executing, with `reason` (a shutdown that can wait no longer)."""
        self.scheduler.close(reason)
        self.scheduler.abandon(reason)

    def close(self) -> None:
        """Fails queued requests, waits for running batches, then releases every device (blocking)."""
        self.scheduler.close(self._unloaded())
        self.release()

    def release(self) -> None:
        """Releases what the version holds on devices (nothing, for a version with no instance)."""

    def _unloaded(self) -> ModelNotReady:
        return ModelNotReady(f"model '{self.name}' version {self.version} was unloaded")


__all__ = [
    "InstanceHealth", "Request", "RequestOptions", "RequestScheduler", "Responses", "ServedVersion", "Tensors", "VersionHealth",
]
