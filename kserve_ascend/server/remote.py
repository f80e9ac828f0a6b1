"""A frontend's data plane (`--workers N`): `DataPlane`'s interface, served by the engine process.

The edges (REST, gRPC, KServe's V1 routes) run unchanged on `RemoteDataPlane`. What they
ask synchronously (readiness, metadata, configuration, statistics, the index, the shared
memory registry, metrics) is a blocking call to the engine (`ipc.Caller`); loading and
unloading are messages whose answers are awaited. `infer` writes the decoded request's
tensors into this frontend's arena (or, for an input a client placed in a registered
shared memory region, only says where it lies: the engine reads it there too), sends
where they are, and encodes the answer from the engine's arena in place. The time spent
encoding goes back to the engine, which adds it to the version's statistics.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import itertools
import logging
import mmap
import os
import socket
from typing import Any, Awaitable, Callable, Mapping, NamedTuple, Sequence, TypeVar

import kserve
import numpy as np
from kserve.errors import ModelNotFound as KServeModelNotFound
from opentelemetry import propagate
from tritonclient.grpc import model_config_pb2 as mc

from ..core import datatypes, tracing
from ..core.errors import InvalidInput
from ..core.signature import Signature
from ..core.stats import RequestTiming, now_ns
from . import logs
from .arena import Arena, Mapped, write
from .codec import InferRequest
from .dataplane import DataPlane
from .ipc import Caller, Channel, ChannelClosed, remote_error
from .model import AscendModel
from .shm import SharedMemoryRegistry

log = logging.getLogger(__name__)

T = TypeVar("T")


class Served(NamedTuple):
    """The version that answered, as the edges read it from `infer`."""

    name: str
    version: int


class RemoteDataPlane:
    """The engine's data plane, seen from a frontend. `on_stop(now)`: the engine asks the frontend to stop
    (now: the engine is gone, nothing in flight can be answered)."""

    metadata = staticmethod(DataPlane.metadata)

    def __init__(self, channel: socket.socket, calls: socket.socket, on_stop: Callable[[bool], None]):
        self.channel = Channel(channel, self._received, self._engine_gone)
        # What this frontend reported goes first: the engine reads it before answering (statistics count what
        # a client was answered before it asked).
        self.calls = Caller(calls, before=self.channel.flush)
        self.on_stop = on_stop
        self.inputs = Arena(self.channel.send)  # requests' tensors, written here, read by the engine
        self.outputs = Mapped(lambda block: self.channel.send(["free", block[0], block[1]]))  # answers', the engine's
        self.shm = RemoteSharedMemory(self.calls)
        self.stopping = False  # the engine is shutting down (it refuses new inferences): see app.ClosesWhenStopping
        self._pending: dict[int, tuple[asyncio.Future, bool]] = {}
        self._ids = itertools.count()

    def start(self) -> None:
        """Starts reading the engine's messages (on the running loop)."""
        self.channel.start()

    # ------------------------------------------------------------ what the edges ask

    def ready(self) -> bool:
        return self.calls.call("ready")

    def model(self, name: str) -> "RemoteModel":
        return RemoteModel(self, name)

    def unready_reason(self, name: str, version: str | None = None) -> str:
        return self.calls.call("unready_reason", name, version)

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        return self.calls.call("model_metadata", name, version)

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        return self.calls.call("model_config", name, version)

    def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        return self.calls.call("statistics", name, version)

    def index(self) -> list[dict]:
        return self.calls.call("index")

    def metric_families(self) -> list:
        return self.calls.call("metrics")

    async def load_model(self, name: str, config_json: str | None = None) -> None:
        await self._ask("call", "load_model", [name, config_json])

    async def unload_model(self, name: str) -> None:
        await self._ask("call", "unload_model", [name])

    async def model_state(self, name: str) -> bool | None:
        """Whether the model is ready; None if the repository has no such model."""
        return await self._ask("call", "model_state", [name])

    async def infer(
        self,
        name: str,
        version: str | None,
        request: InferRequest,
        timing: RequestTiming | None,
        encode: Callable[..., T | Awaitable[T]],
    ) -> tuple[Served, T]:
        """Runs a decoded request in the engine and answers it: `encode(model_name, version, request, outputs)`
        (or an awaitable of the answer, which the encoder makes off the event loop).

        `timing` (None for a request without an edge) starts the request's statistics: the
        engine records them with this start, and adds the time `encode` takes.
        """
        block, inputs = self._write_inputs(request.inputs)
        carrier: dict | None = None
        if tracing.enabled:
            carrier = {}
            propagate.inject(carrier)  # the engine's queue and execute spans join this request's trace
        call, answer = self._send(
            "infer", name, version or None, request.id, request.parameters, list(request.outputs), request.classification,
            timing.start if timing is not None else None, logs.request_id(), carrier, block, inputs,
        )
        model_name, number, out_block, outputs = await self._answer(call, answer)
        arrays = self.outputs.tensors(out_block, outputs)  # in place: freed once the last array made of them is gone
        start, answered = now_ns(), False
        try:
            answer = encode(model_name, number, request, arrays)
            if inspect.isawaitable(answer):  # a large answer, encoded off the event loop (offload.off_loop)
                answer = await answer
            answered = True
            return Served(model_name, number), answer
        finally:
            # Leaves with this loop iteration's other messages; a call this frontend makes writes it first (`Caller`).
            self.channel.send(["done", call, now_ns() - start, answered])

    def _write_inputs(self, inputs: Mapping[str, np.ndarray]) -> tuple[list | None, list[list]]:
        """Where each input lies, in the request's order: in this frontend's arena (written there now), or, for one a
        client placed in a registered shared memory region, in that region ([..., region] ending its place)."""
        regions = {name: self.shm.locate(array) for name, array in inputs.items() if array.dtype.kind not in "OSU"}
        block, written = write(self.inputs, ((name, array) for name, array in inputs.items() if regions.get(name) is None))
        places = iter(written)
        return block, [
            next(places) if regions.get(name) is None
            else [name, datatypes.from_numpy(array.dtype), list(array.shape), regions[name][1], array.nbytes, regions[name][0]]
            for name, array in inputs.items()
        ]

    # ------------------------------------------------------------ the channel

    async def _ask(self, kind: str, *fields: Any) -> Any:
        return await self._answer(*self._send(kind, *fields))

    def _send(self, kind: str, *fields: Any) -> tuple[int, asyncio.Future]:
        """Sends a call (or an inference): its number, and the future of its answer."""
        if self.channel.closed:
            raise ChannelClosed("the engine process is gone")
        call = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call] = future, kind == "infer"
        self.channel.send([kind, call, *fields])
        return call, future

    async def _answer(self, call: int, future: asyncio.Future) -> Any:
        """Waits for the answer; a caller that leaves cancels the call in the engine."""
        try:
            return await future
        except asyncio.CancelledError:
            self.channel.send(["cancel", call])  # the engine answers anyway: what it wrote is freed then
            raise

    def _received(self, message: list) -> None:
        kind = message[0]
        if kind == "ok" or kind == "error":
            self._answered(message)
        elif kind == "free":
            self.inputs.free(message[1], message[2])
        elif kind == "segment":
            self.outputs.add(message[1], message[2], self.channel.take_fd())
        elif kind == "drop":
            self.outputs.drop(message[1])
        elif kind == "control":
            self.shm.map_changes(message[1], self.channel.take_fd())
        elif kind == "regions":
            self.shm.follow(message[1], message[2])
        elif kind == "stopping":
            self.stopping = True
        elif kind == "stop":
            self.on_stop(False)

    def _answered(self, message: list) -> None:
        entry = self._pending.pop(message[1], None)
        if entry is None:
            return
        future, infer = entry
        if future.done():  # its caller left: free what the engine wrote for it, and count it nowhere
            if infer and message[0] == "ok":
                if message[2][2] is not None:
                    self.channel.send(["free", message[2][2][0], message[2][2][1]])
                self.channel.send(["done", message[1], 0, None])
            return
        if message[0] == "ok":
            future.set_result(message[2])
        else:
            future.set_exception(remote_error(*message[2:]))

    def _engine_gone(self) -> None:
        if self._closing:
            return
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed("the engine process is gone"))
        self._pending.clear()
        self.outputs.close()
        self.on_stop(True)

    def close(self) -> None:
        self._closing = True
        self.channel.close()
        self.calls.close()
        self.outputs.close()
        self.shm.close()

    _closing = False


class RemoteSharedMemory:
    """The engine's system shared memory registry, seen from a frontend.

    Registering, unregistering and status are calls to the engine, whose registry serves
    every frontend. This frontend maps the same regions, to decode inputs and write outputs
    in place. The engine sends every frontend the regions each time they change (so one
    unregistered is unmapped here too); and since a client may use a region through this
    frontend before that message is read, a region is looked up only once the engine's
    count of changes (a number in shared memory) is the one this frontend mapped at.
    """

    def __init__(self, calls: Caller):
        self.calls = calls
        self.local = SharedMemoryRegistry()
        self._changes: np.ndarray | None = None  # the engine's count, once it has sent it
        self._mapped_at = -1
        self._serials: dict[str, int] = {}  # which registration each local mapping is of

    def map_changes(self, size: int, fd: int) -> None:
        try:
            self._changes = np.frombuffer(mmap.mmap(fd, size, prot=mmap.PROT_READ), np.int64, 1)
        finally:
            os.close(fd)

    def register(self, name: str, key, offset, byte_size) -> None:
        self.calls.call("shm_register", name, key, offset, byte_size)

    def unregister(self, name: str = "") -> None:
        self.calls.call("shm_unregister", name)

    def status(self, name: str = "") -> list[dict]:
        return self.calls.call("shm_status", name)

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        if self._changes is None or int(self._changes[0]) != self._mapped_at:
            self.follow(*self.calls.call("shm_registrations"))
        return self.local.view(name, offset, byte_size, what)

    def locate(self, array: np.ndarray) -> tuple[str, int] | None:
        return self.local.locate(array)

    def follow(self, changes: int, registrations: list[list]) -> None:
        """Maps the regions the engine's registry holds after `changes` changes (unless this frontend is further)."""
        if changes <= self._mapped_at:
            return
        wanted = {name: (key, offset, size, serial) for name, key, offset, size, serial in registrations}
        for name in [region["name"] for region in self.local.status()]:
            if wanted.get(name, (None,))[-1] != self._serials.get(name):
                self.local.unregister(name)
                self._serials.pop(name, None)
        for name, (key, offset, size, serial) in wanted.items():
            if name not in self._serials:
                try:
                    self.local.register(name, key, offset, size)
                    self._serials[name] = serial
                except InvalidInput as error:  # gone from /dev/shm since: a request naming it is refused
                    log.warning("cannot map shared memory region '%s' here: %s", name, error)
        self._mapped_at = changes

    def close(self) -> None:
        self.local.close()


class RemoteModel:
    """A repository model seen from a frontend: what the gRPC edge and `AscendModel` (KServe's V1 routes) use of one."""

    def __init__(self, dataplane: RemoteDataPlane, name: str):
        self.dataplane = dataplane
        self.name = name

    @property
    def ready(self) -> bool:
        return bool(self.dataplane.calls.call("model_state", self.name))

    def load(self) -> list:
        return []  # the engine owns the lifecycle: a frontend never loads a model

    def close(self) -> None:
        pass

    def version(self, version: str | None = None) -> "RemoteVersion":
        """The version a request names, else the one `version_weights` picks: requests through it go to that version."""
        number, config = self.dataplane.calls.call("model_version", self.name, version)
        return RemoteVersion(self.dataplane, self.name, number, mc.ModelConfig.FromString(base64.b64decode(config)))


class RemoteVersion:
    def __init__(self, dataplane: RemoteDataPlane, name: str, version: int, config: mc.ModelConfig):
        self.dataplane = dataplane
        self.name = name
        self.version = version
        self.config = config
        self.signature = Signature(config)

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str] | None = None,
        parameters: Mapping[str, object] | None = None,
        timing: RequestTiming | None = None,
    ) -> dict[str, np.ndarray]:
        request = InferRequest(dict(inputs), outputs=dict.fromkeys(output_names or (), False), parameters=dict(parameters or {}))
        _, outputs = await self.dataplane.infer(self.name, str(self.version), request, timing, _outputs)
        return outputs


def _outputs(model_name: str, version: int, request: InferRequest, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return outputs


class RemoteModelRepository(kserve.ModelRepository):
    """KServe's model registry in a frontend: every repository model, as the engine knows them now."""

    def __init__(self, dataplane: RemoteDataPlane):
        super().__init__()
        self.dataplane = dataplane

    def get_model(self, name: str) -> AscendModel:
        # Whether the model exists is asked when KServe asks whether it is ready (below), without a call here.
        return AscendModel(RemoteModel(self.dataplane, name))

    def get_models(self) -> dict[str, AscendModel]:
        return {name: self.get_model(name) for name in self.dataplane.calls.call("model_names")}

    async def is_model_ready(self, name: str) -> bool:
        ready = await self.dataplane.model_state(name)
        if ready is None:
            raise KServeModelNotFound(name)  # as KServe answers a model it does not have
        return ready
