"""A frontend's data plane (`--workers N`): the `DataPlane` the engine serves, seen from a frontend.

Every method of the interface but `infer` is forwarded as it is (`FORWARDED`, a `messages.Call`
answered by the engine's data plane): adding a method to `DataPlane` adds it here. Model
metadata and configurations are cached until the engine says the repository changed. `infer`
writes the request's tensors into this frontend's arena (or, for an input a client placed in a
registered shared memory region, only says where it lies: the engine reads it there too), and
the answer's tensors are read in place from the engine's arena; the time the edge spends
encoding them goes back to the engine (`messages.Done`), which adds it to the statistics.

Nothing here waits on the engine outside an `await`. What a frontend must know at once (the
models' names for KServe's registry, the shared memory regions for decoding) it mirrors, kept
current by the engine's messages and the control page's counts (`control`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import socket
from typing import Any, Callable, Mapping

import numpy as np
from opentelemetry import propagate

from ...core import datatypes, tracing
from ...core.errors import InvalidInput
from ...core.stats import now_ns
from ..dataplane import DataPlane, InferRequest
from ..dataplane.shm import SharedMemoryRegistry
from ..observability import logs
from . import messages
from .arena import Arena, Mapped, write
from .channel import Channel, ChannelClosed
from .control import MODELS, REGIONS, ControlPage

log = logging.getLogger(__name__)

#: The data-plane methods a frontend forwards to the engine as they are.
FORWARDED = frozenset(
    name for name, method in inspect.getmembers(DataPlane, inspect.iscoroutinefunction) if name != "infer"
)
#: Of those, what is cached until the repository changes.
CACHED = frozenset({"model_metadata", "model_config"})


class RemoteAnswer:
    """An inference's answer, its outputs over the engine's arena; `answering` reports the encoding to the engine."""

    __slots__ = ("model_name", "model_version", "outputs", "_channel", "_call", "_start")
    streamed = False

    def __init__(self, channel: Channel, call: int, answer: messages.Inferred, outputs: dict[str, np.ndarray]):
        self.model_name, self.model_version, self.outputs = answer.model_name, answer.model_version, outputs
        self._channel, self._call = channel, call

    def answering(self) -> RemoteAnswer:
        return self

    def __enter__(self) -> None:
        self._start = now_ns()

    def __exit__(self, kind, error, traceback) -> None:
        # Written to the engine before the edge writes the answer: statistics read through any frontend after a
        # client had its answer count the request (the engine reads what its frontends sent before it answers).
        self._channel.send(messages.Done(self._call, now_ns() - self._start, kind is None))
        self._channel.flush()


class RemoteStream:
    """A decoupled model's responses (`ResponseStream`), as the engine sends them: each one's outputs read in place
    from the engine's arena. Closing it before the final flag cancels the request in the engine."""

    __slots__ = ("model_name", "model_version", "_dataplane", "_call", "_queue", "_ended")
    streamed = True

    def __init__(self, dataplane: RemoteDataPlane, call: int, started: messages.Streaming, queue: asyncio.Queue):
        self.model_name, self.model_version = started.model_name, started.model_version
        self._dataplane, self._call, self._queue, self._ended = dataplane, call, queue, False

    async def __aiter__(self):
        while not self._ended:
            message = await self._queue.get()
            kind = type(message)
            if kind is messages.Response:
                yield self._dataplane.outputs.tensors(message.block, message.outputs)
                continue
            self._ended = True
            self._dataplane._streams.pop(self._call, None)
            if kind is messages.Failed:
                raise messages.raised(message)
            if kind is not messages.Final:
                raise message  # the engine is gone

    async def aclose(self) -> None:
        if self._ended:
            return
        self._ended = True
        self._dataplane._streams.pop(self._call, None)
        self._dataplane.channel.send(messages.Cancel(self._call))
        while not self._queue.empty():  # responses nobody will read: their blocks go back to the engine
            self._dataplane.free(self._queue.get_nowait())


class _Forwarded:
    """Every `FORWARDED` method, as a coroutine that asks the engine."""


def _forward(name: str, cached: bool) -> Callable:
    async def forwarded(self: RemoteDataPlane, *args: Any) -> Any:
        return await (self._cached(name, args) if cached else self._ask(name, args))

    forwarded.__name__ = forwarded.__qualname__ = name
    forwarded.__signature__ = inspect.signature(getattr(DataPlane, name))
    forwarded.__doc__ = f"`DataPlane.{name}`, asked of the engine."
    return forwarded


for _name in FORWARDED:
    setattr(_Forwarded, _name, _forward(_name, _name in CACHED))


class RemoteDataPlane(_Forwarded):
    """The engine's data plane, over `sock`. `on_stop(now)`: the engine asks the frontend to stop (now: the
    engine is gone, nothing in flight can be answered)."""

    def __init__(self, sock: socket.socket, on_stop: Callable[[bool], None]):
        self.channel = Channel(sock, self._received, self._engine_gone)
        self.on_stop = on_stop
        self.inputs = Arena(self.channel.send)  # requests' tensors, written here, read by the engine
        self.outputs = Mapped(lambda block: self.channel.send(messages.Free(block.segment, block.offset)))  # answers'
        self.regions = RemoteRegions(self)
        self.stopping = False  # the engine is shutting down (it refuses new inferences)
        self._control: ControlPage | None = None
        self._names: list[str] = []
        self._models_seen = -1
        self._cache: dict[tuple, Any] = {}
        self._pending: dict[int, tuple[asyncio.Future, bool]] = {}
        self._streams: dict[int, asyncio.Queue] = {}  # decoupled requests under way: what the engine sent for each
        self._ids = itertools.count()
        self._closing = False

    def start(self) -> None:
        """Starts reading the engine's messages (on the running loop)."""
        self.channel.start()
        self.channel.send(messages.Hello(messages.VERSION))

    # ------------------------------------------------------------ what the edges ask

    def model_names(self) -> list[str]:
        self.catch_up(MODELS, lambda: self._models_seen)
        return list(self._names)

    async def infer(self, request: InferRequest, streaming: bool = False) -> RemoteAnswer | RemoteStream:
        block, inputs = self._write_inputs(request.inputs)
        trace = None
        if tracing.enabled:
            trace = {}
            propagate.inject(trace)  # the engine's queue and execute spans join this request's trace
        call, future = self._send(True, lambda call: messages.Infer(
            call, request.model_name, request.model_version, request.id, list(request.outputs), request.parameters,
            request.classification, request.received_ns, block, inputs, logs.request_id(), trace, request.protocol,
            streaming,
        ))
        answer = await self._answer(call, future)
        if type(answer) is messages.Streaming:
            return RemoteStream(self, call, answer, self._streams[call])
        # Read in place: the engine's block is freed once the last array made of it is gone.
        return RemoteAnswer(self.channel, call, answer, self.outputs.tensors(answer.block, answer.outputs))

    def _write_inputs(self, inputs: Mapping[str, np.ndarray]) -> tuple[messages.Block | None, list[messages.Tensor]]:
        """Where each input lies, in the request's order: in this frontend's arena (written there now), or, for one a
        client placed in a registered shared memory region, in that region."""
        regions = {name: self.regions.locate(array) for name, array in inputs.items() if array.dtype.kind not in "OSU"}
        block, written = write(self.inputs, ((name, array) for name, array in inputs.items() if regions.get(name) is None))
        in_arena = iter(written)
        return block, [
            next(in_arena) if regions.get(name) is None
            else messages.Tensor(name, datatypes.from_numpy(array.dtype), list(array.shape), regions[name][1], array.nbytes, regions[name][0])
            for name, array in inputs.items()
        ]

    # ------------------------------------------------------------ asking the engine

    async def _ask(self, method: str, args: tuple) -> Any:
        call, future = self._send(False, lambda call: messages.Call(call, method, list(args)))
        return await self._answer(call, future)

    async def _cached(self, method: str, args: tuple) -> Any:
        """The engine's answer, kept while the repository is unchanged (and only if it did not change meanwhile)."""
        self.catch_up(MODELS, lambda: self._models_seen)
        key = (method, *args)
        if key in self._cache:
            return self._cache[key]
        seen = self._models_seen
        value = await self._ask(method, args)
        if self._models_seen == seen:
            self._cache[key] = value
        return value

    def _send(self, infer: bool, message: Callable[[int], messages.Message]) -> tuple[int, asyncio.Future]:
        """Sends a call (or an inference): its number, and the future of its answer."""
        if self.channel.closed:
            raise ChannelClosed("the engine process is gone")
        call = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call] = future, infer
        self.channel.send(message(call))
        return call, future

    async def _answer(self, call: int, future: asyncio.Future) -> Any:
        """Waits for the answer; a caller that leaves cancels the call in the engine."""
        try:
            return await future
        except asyncio.CancelledError:
            self.channel.send(messages.Cancel(call))  # the engine answers anyway: what it wrote is freed then
            raise

    def catch_up(self, count: int, seen: Callable[[], int]) -> None:
        """Reads what the engine has sent if the control page's `count` is ahead of what this frontend has `seen`:
        the message that moved it is then in the socket (see `control`)."""
        if self._control is not None and self._control[count] != seen():
            self.channel.drain()

    # ------------------------------------------------------------ what the engine sends

    def _received(self, message: messages.Message) -> None:
        kind = type(message)
        if kind is messages.Response or kind is messages.Final or (kind is messages.Failed and message.call in self._streams):
            stream = self._streams.get(message.call)
            if stream is not None:
                stream.put_nowait(message)
            else:  # its caller closed the stream
                self.free(message)
        elif kind is messages.Inferred or kind is messages.Returned or kind is messages.Failed or kind is messages.Streaming:
            self._answered(message)
        elif kind is messages.Free:
            self.inputs.free(message.segment, message.offset)
        elif kind is messages.Segment:
            self.outputs.add(message.number, message.size, self.channel.take_fd())
        elif kind is messages.Drop:
            self.outputs.drop(message.number)
        elif kind is messages.ModelsChanged:
            self._names, self._models_seen = message.names, message.generation
            self._cache.clear()
        elif kind is messages.Regions:
            self.regions.follow(message.changes, message.regions)
        elif kind is messages.Control:
            self._control = ControlPage(self.channel.take_fd(), writable=False)
        elif kind is messages.Hello:
            refusal = messages.mismatch(message, "engine")
            if refusal is not None:
                log.error("%s", refusal)
                self.channel.close()
        elif kind is messages.LogSettings:
            logs.apply(message.settings)
        elif kind is messages.TraceSpans:
            tracing.enabled = message.on
        elif kind is messages.Stopping:
            self.stopping = True
        elif kind is messages.Stop:
            self.on_stop(False)

    def _answered(self, message: messages.Inferred | messages.Returned | messages.Failed) -> None:
        entry = self._pending.pop(message.call, None)
        if entry is None:
            return
        future, infer = entry
        if type(message) is messages.Streaming:
            if future.done():  # its caller left before the model took it: stop the model
                self.channel.send(messages.Cancel(message.call))
                return
            self._streams[message.call] = asyncio.Queue()  # now: its responses may follow in this same read
        if future.done():  # its caller left: free what the engine wrote for it, and count it nowhere
            if infer and type(message) is messages.Inferred:
                self.free(message)
                self.channel.send(messages.Done(message.call, 0, None))
            return
        if type(message) is messages.Failed:
            future.set_exception(messages.raised(message))
        else:
            future.set_result(message if infer else message.value)

    def free(self, message: messages.Message) -> None:
        """An answer or a decoupled model's response nobody reads: its block goes back to the engine."""
        if (type(message) is messages.Response or type(message) is messages.Inferred) and message.block is not None:
            self.channel.send(messages.Free(message.block.segment, message.block.offset))

    def _engine_gone(self) -> None:
        if self._closing:
            return
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed("the engine process is gone"))
        self._pending.clear()
        for stream in self._streams.values():
            stream.put_nowait(ChannelClosed("the engine process is gone"))
        self._streams.clear()
        self.outputs.close()
        self.on_stop(True)

    def close(self) -> None:
        self._closing = True
        self.channel.close()
        self.outputs.close()
        self.regions.close()


class RemoteRegions:
    """The shared memory regions registered with the engine, mapped in this frontend too, to decode inputs and
    write outputs in place. Registering, unregistering and status are the engine's (forwarded calls)."""

    def __init__(self, dataplane: RemoteDataPlane):
        self.dataplane = dataplane
        self.local = SharedMemoryRegistry()
        self._mapped_at = -1
        self._serials: dict[str, int] = {}  # which registration each local mapping is of

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        self.dataplane.catch_up(REGIONS, lambda: self._mapped_at)
        return self.local.view(name, offset, byte_size, what)

    def locate(self, array: np.ndarray) -> tuple[str, int] | None:
        return self.local.locate(array)

    def follow(self, changes: int, registrations: list[messages.Region]) -> None:
        """Maps the regions the engine's registry holds after `changes` changes (unless this frontend is further)."""
        if changes <= self._mapped_at:
            return
        wanted = {region.name: region for region in registrations}
        for name in [region["name"] for region in self.local.status()]:
            if name not in wanted or wanted[name].serial != self._serials.get(name):
                self.local.unregister(name)
                self._serials.pop(name, None)
        for name, region in wanted.items():
            if name not in self._serials:
                try:
                    self.local.register(name, region.key, region.offset, region.byte_size)
                    self._serials[name] = region.serial
                except InvalidInput as error:  # gone from /dev/shm since: a request naming it is refused
                    log.warning("cannot map shared memory region '%s' here: %s", name, error)
        self._mapped_at = changes

    def close(self) -> None:
        self.local.close()
