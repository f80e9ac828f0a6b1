"""A decoupled model's scheduler (`model_transaction_policy { decoupled: true }`): each request is one execution
on the next idle instance, in arrival order, and its responses reach the caller as the runtime yields them.

Contract (`RequestScheduler.stream`): an async iterator of the request's responses (their outputs); its end
is the final flag. The runtime runs on the instance's own thread; each response it yields is handed to the
event loop at once. A caller that stops reading (its client cancelled the stream: the iterator is closed, or
its task cancelled) sets the execution's `stop`, and the runtime produces nothing more; the instance takes
the next request once the runtime has returned.

Statistics, as Triton's python backend (and its repeat backend, src/repeat.cc) report a decoupled request,
measured on Triton 2.51 with the `ascend` backend: one request and one execution of batch size 1, recorded
once the runtime has returned, a success also when the model ended the stream with an error or its caller
cancelled it (the request was executed; only a runtime's fault is a failure); `compute_infer` is the whole
execution (every response); `response_stats` stay empty, as the python backend reports none. A request
whose caller left while it waited for an instance is failed, CANCELED.

With the rate limiter (`gates`), an instance takes its resources before each execution and gives them back
once the runtime has returned, as the batcher's instances do; the wait counts as queue time.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence

import numpy as np

from ..contracts import Request, RequestScheduler
from ..errors import AscendError, InternalError, ModelNotReady
from ..stats import Execution, VersionStats, now_ns
from .rate_limiter import Gate

#: Runs one request on an instance's thread: its inputs in, each response's outputs out until `stop` is set.
StreamRunner = Callable[[Mapping[str, np.ndarray], threading.Event], Iterator[dict[str, np.ndarray]]]

_END = object()  # the runtime returned: the final flag


class _Fault(InternalError):
    """A runtime raised other than a core error: it broke its contract (500 / INTERNAL, counted a failure)."""


class StreamScheduler(RequestScheduler):
    """Feeds one request at a time to each instance (one per runner, each on its executor's thread, through its
    gate of the rate limiter if it has one)."""

    def __init__(self, runners: Sequence[StreamRunner], executors: Sequence, stats: VersionStats, gates: Sequence[Gate | None] = ()):
        super().__init__()
        self.stats = stats
        self._instances = list(zip(runners, executors, list(gates) or [None] * len(runners)))
        self._idle = collections.deque(range(len(self._instances)))
        self._waiting: collections.deque[asyncio.Future] = collections.deque()  # callers waiting for an instance
        self._running: set[threading.Event] = set()  # the `stop` of every execution under way
        self._closed: Exception | None = None

    @property
    def health(self) -> list[str]:
        return [""] * len(self._instances)

    @property
    def queued(self) -> int:
        return sum(not waiter.done() for waiter in self._waiting)

    async def submit(self, request: Request) -> dict[str, np.ndarray]:
        raise InternalError("a decoupled model answers with a stream of responses, not one")

    async def stream(self, request: Request) -> AsyncIterator[dict[str, np.ndarray]]:
        if self._closed is not None:
            raise self._closed
        timing = request.timing
        timing.queued(self.stats)
        self._entered()
        try:
            index = await self._acquire()
        except BaseException as error:  # its caller left, or the model was unloaded, while it waited
            timing.failed("CANCELED" if isinstance(error, (asyncio.CancelledError, ModelNotReady)) else "OTHER")
            self._left()
            raise
        loop = asyncio.get_running_loop()
        delivered: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        self._running.add(stop)
        runner, executor, gate = self._instances[index]

        def produce() -> None:  # on the instance's thread
            if gate is not None:
                gate.acquire()  # its resources, in its turn (the request waits as queued)
            execution = Execution(now_ns())
            last: object = _END
            try:
                for outputs in runner(request.inputs, stop):
                    loop.call_soon_threadsafe(delivered.put_nowait, outputs)
                    if stop.is_set():
                        break
            except AscendError as error:  # the model's answer to this request: its last response
                last = error
            except BaseException as error:  # a runtime's fault fails this request alone
                last = _Fault(f"the execution raised {type(error).__name__}: {error}")
            finally:
                if gate is not None:
                    gate.release()
            execution.ran(now_ns())
            loop.call_soon_threadsafe(self._finished, index, stop, execution, timing, last)
            loop.call_soon_threadsafe(delivered.put_nowait, last)

        try:
            executor.submit(produce)
        except BaseException:
            self._finished(index, stop, Execution(now_ns()), timing, _Fault("the instance's thread is gone"))
            raise
        try:
            while (item := await delivered.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                yield {name: item[name] for name in request.outputs} if request.outputs else item
        finally:
            stop.set()  # its caller went away (or the stream ended): the runtime produces nothing more

    def _finished(self, index: int, stop: threading.Event, execution: Execution, timing, last: object) -> None:
        """The runtime returned: the request is recorded as Triton's backends record it, by its execution (a
        stream the model ended with an error, or that its caller cancelled, was executed all the same); a runtime
        fault counts as a failure."""
        if isinstance(last, _Fault):
            timing.failed("BACKEND")
        else:
            self.stats.record_execution(1, execution)
            timing.executed(execution)
            timing.answered(True, 0)
        self._left()
        self._release(index, stop)

    async def _acquire(self) -> int:
        """The next idle instance, in the order callers asked."""
        if self._idle and not self._waiting:
            return self._idle.popleft()
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())  # handed an instance as it left: the next caller has it
            raise
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)

    def _release(self, index: int, stop: threading.Event | None = None) -> None:
        self._running.discard(stop)
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(index)
                return
        self._idle.append(index)

    def close(self, reason: Exception) -> None:
        """Takes no more requests; fails those waiting for an instance (running ones finish)."""
        self._closed = reason
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_exception(reason)

    def abandon(self, reason: Exception) -> list[int]:
        """Stops every execution under way (their runtimes produce nothing more); none is left stuck."""
        for stop in list(self._running):
            stop.set()
        return []
