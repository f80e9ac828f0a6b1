"""Dynamic batching: a pool of instances running the batches their queue (`queue.BatchQueue`) forms.

Contract: `DynamicBatcher.submit` queues one request and resolves with exactly its own rows
(or with the error of its execution, its rejection or its timeout). A batch is formed
whenever an instance is idle, so batches grow while every instance is busy; one instance
forms at a time, so no two race for the same requests.

The device is never left waiting for the event loop: an instance's own thread forms its
next batch from the queue (under the batcher's lock) as soon as it has finished one, runs
and times it (the runner notes its input and output phases in the batch's `Execution`), and
hands the results to the loop, which resolves the requests' futures in one callback for
whatever finished since it last looked. The loop only queues requests, resolves them and,
for an idle instance, starts its thread on a batch. While requests wait, an instance goes
from batch to batch without the loop.

Faults: whatever fails in queueing a request, forming a batch, running it or answering it
fails only the requests it concerns (a 500, logged), and the batcher goes on serving: a
runtime that raises, or answers other than one result per request, fails its batch; a fault
while forming a batch fails the request the batch began with, while queueing one fails that
request, while answering a batch fails that batch. A caller that goes away (its task
cancelled) leaves the queue at once, counted CANCELED; in a running batch, its answer is
dropped.

Rate limiter (`--rate_limit execution_count`): an instance given a `rate_limiter.Gate` holds it
around each execution, acquired on its own thread after forming the batch (until then the batch's
requests count as queued, and their queue time goes on); without one, nothing is asked.

Device health: an execution that outlives the execution timeout, or fails with a fatal
`DeviceError` (a context the device poisoned), takes its instance out of rotation: it is
never handed another batch, and the other instances go on. With none left, queued and new
requests fail with ModelNotReady until the model is reloaded (fresh instances).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from .. import tracing
from ..contracts import Request, RequestScheduler
from ..errors import AscendError, DeviceError, InternalError, ModelNotReady, Unavailable
from ..stats import Execution, VersionStats, now_ns
from .queue import Pending
from .rate_limiter import Gate

#: Runs one batch: the requests' inputs in, their outputs out (same order); notes its input and output
#: phases in the Execution it is handed.
BatchRunner = Callable[[Sequence[Mapping[str, np.ndarray]], Execution], list[dict[str, np.ndarray]]]
#: Told that an instance left rotation: its index, why, and whether its thread is stuck in the execution.
InstanceLost = Callable[[int, str, bool], None]

log = logging.getLogger(__name__)


class ExecutionTimeout(AscendError):
    """An execution outlived the model's execution timeout: its device stopped answering (a server fault)."""


class Queue(Protocol):
    """What the batcher asks of its queue (`queue.BatchQueue`; a sequence model's `sequencer.SlotQueue`), under its lock."""

    #: Whether requests of several callers share an execution (then only those of the same shapes).
    batches: bool

    def level_of(self, priority: int | None) -> int: ...
    def put(self, pending: Pending, timeout_us: int | None = None, instances: int = 1) -> float: ...
    def expire(self, pending: Pending) -> bool: ...
    def waiting(self) -> bool: ...
    def withdraw(self, pending: Pending) -> None: ...
    def take_head(self) -> Pending | None: ...
    def poll(self, idle_since: float, now: float) -> tuple[list[Pending] | None, float | None]: ...
    def observe(self, rows: int, seconds: float) -> None: ...
    def drain(self) -> list[Pending]: ...


class _Running:
    """The batch an instance executes, since `start` (time.monotonic); `abandoned` once it timed out."""

    __slots__ = ("abandoned", "batch", "start")

    def __init__(self, batch: list[Pending], start: float):
        self.batch, self.start, self.abandoned = batch, start, False


class DynamicBatcher(RequestScheduler):
    """Feeds the batches of one queue to a pool of instances (one per runner, each on its executor's thread).

    `span_attributes`: per instance, what its `execute` spans say (model, version, device).
    `execution_timeout_s`: how long one execution may take (None: no limit).
    `on_instance_lost`: told when an instance leaves rotation.
    `gates`: per instance, its way through the server's rate limiter (none: not limited).
    """

    def __init__(
        self,
        runners: Sequence[BatchRunner],
        executors: Sequence,
        queue: Queue,
        stats: VersionStats,
        span_attributes: Sequence[Mapping[str, object]] = (),
        execution_timeout_s: float | None = None,
        on_instance_lost: InstanceLost | None = None,
        gates: Sequence[Gate | None] = (),
    ):
        super().__init__()
        self.queue = queue
        self.stats = stats
        self._instances = list(zip(runners, executors, span_attributes or itertools.repeat({})))
        self._health = [""] * len(self._instances)
        self._gates = list(gates) or [None] * len(self._instances)
        self.execution_timeout_s = execution_timeout_s
        self._on_instance_lost = on_instance_lost
        # Guards the queue and what follows (event loop and instance threads); instances wait on it for a batch to fill.
        self._lock = threading.Condition(threading.Lock())
        self._idle = collections.deque(range(len(self._instances)))  # instances whose thread has no batch to run
        self._forming = False  # whether an instance forms a batch (one at a time)
        self._running: list[_Running | None] = [None] * len(self._instances)
        self._closed: Exception | None = None  # why it takes no more requests, once closed
        # What the instance threads finished, for the event loop to resolve in one callback.
        self._finished: collections.deque = collections.deque()
        self._resolving = False  # whether that callback is scheduled
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task | None = None

    @property
    def health(self) -> list[str]:
        return self._health

    @property
    def executing(self) -> int:
        """Requests in a running batch whose caller still waits (one cancelled meanwhile is no longer outstanding)."""
        return sum(not p.future.done() for running in list(self._running) if running is not None for p in running.batch)

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (submitted, not yet executing)."""
        return self.outstanding - self.executing

    async def submit(self, request: Request) -> dict[str, np.ndarray]:
        if self._closed is not None:  # a version retired under a caller that had resolved it (an ensemble's step)
            raise type(self._closed)(str(self._closed))
        if not self.in_rotation:
            raise self._none_left()
        loop = self._loop
        if loop is None:  # once: on CPython 3.11, each get_running_loop() is a getpid() system call
            self._loop = loop = asyncio.get_running_loop()
        if self.execution_timeout_s and (self._watchdog is None or self._watchdog.done()):
            # In a context of its own: it outlives the request that starts it, whose id is not its own.
            # (Created inside an empty context, which the task copies: create_task's context= is 3.11+.)
            self._watchdog = contextvars.Context().run(loop.create_task, self._watch())
        inputs = request.inputs
        # Requests batch together only when they have the same inputs, of the same shapes past the batch dimension.
        shape_key = tuple((name, array.shape[1:]) for name, array in inputs.items()) if self.queue.batches else ()
        level = self.queue.level_of(request.options.priority)
        pending = Pending(inputs, request.rows, loop.create_future(), time.monotonic(), shape_key, level)
        pending.timing = timing = request.timing
        timing.queued(self.stats)
        if tracing.enabled:
            pending.span = tracing.start_queue()
        try:
            with self._lock:
                timeout = self.queue.put(pending, request.options.timeout_us, self.in_rotation)
                if self._forming:
                    self._lock.notify()  # the instance forming a batch sees it
                else:
                    self._hand_out()
        except Exception as error:
            if pending.span is not None:
                tracing.leave_queue(pending.span)
            if isinstance(error, Unavailable):
                timing.failed("REJECTED")
                raise
            # A fault of the queue's or of an instance's thread: this request fails, the others go on.
            log.exception("queueing a request failed")
            pending.future.cancel()  # if it was queued, it is dropped from there
            with self._lock:
                self.queue.withdraw(pending)
            timing.failed("OTHER")
            raise InternalError(f"queueing the request failed: {type(error).__name__}: {error}") from error
        if timeout:
            pending.timer = loop.call_later(timeout, self._expire, pending)
        self._entered()
        try:
            return await pending.future
        except asyncio.CancelledError:
            # Its caller went away (a client disconnected, a gRPC call was cancelled): cancelling the task
            # cancelled the future, so it leaves the queue; in a running batch, its answer is dropped.
            with self._lock:
                self.queue.withdraw(pending)
            timing.failed("CANCELED")
            raise
        except Exception as error:
            # Failure reasons as Triton's metrics name them: refused by the queue, or the execution failed.
            reason = "REJECTED" if isinstance(error, Unavailable) else "CANCELED" if isinstance(error, ModelNotReady) else "BACKEND"
            timing.failed(reason)
            raise
        finally:
            if pending.timer is not None:
                pending.timer.cancel()
            if pending.span is not None:
                tracing.leave_queue(pending.span)  # if it never joined a batch
            self._left()

    # -- batches (under the lock: from the event loop as requests come, from instance threads as batches end)

    def _hand_out(self) -> None:
        """No instance forming a batch: an idle one starts forming the next, if a request waits."""
        if self._idle and not self._closed and self.queue.waiting():
            index = self._idle.popleft()
            self._forming = True
            try:
                self._instances[index][1].submit(self._work, index, True)
            except BaseException:
                self._forming = False
                self._idle.append(index)  # behind the others: the next hand-out tries another first
                raise

    def _expire(self, pending: Pending) -> None:
        """Its queue timeout (on the event loop)."""
        try:
            with self._lock:
                rejected = self.queue.expire(pending)
            error: Exception = Unavailable("Request timeout expired: it waited in the queue past its timeout")
        except Exception as fault:
            log.exception("expiring a request failed")
            rejected, error = True, InternalError(f"expiring the request failed: {type(fault).__name__}: {fault}")
        if rejected and not pending.future.done():
            pending.future.set_exception(error)

    # -- an instance's side (its own thread)

    def _work(self, index: int, forming: bool) -> None:
        """Runs batches on instance `index` back to back while requests wait, then leaves it idle.

        `forming`: the instance was started to form the next batch (else it finished one and
        forms the next only if no other instance is forming already).
        """
        try:
            self._serve(index, forming)
        except BaseException as fault:  # a fault of the scheduler's own: the instance must not be lost with it
            log.exception("instance %d: the scheduler failed between batches; the instance waits for the next request", index)
            with self._lock:
                running, self._running[index] = self._running[index], None
                if not self.health[index] and index not in self._idle:
                    self._idle.append(index)
            if running is not None and not running.abandoned:
                self._finish(index, running.batch, None, None, InternalError(f"scheduling failed: {type(fault).__name__}: {fault}"))

    def _serve(self, index: int, forming: bool) -> None:
        runner, _, attributes = self._instances[index]
        gate = self._gates[index]
        idle_since = time.monotonic()
        while True:
            with self._lock:
                if not forming and self._forming:
                    self._idle.append(index)  # the instance forming will start this one if requests remain
                    return
                self._forming = True
                try:
                    batch = self._next_batch(idle_since)
                except Exception as fault:  # the request the batch began with fails, the others wait on
                    log.exception("instance %d: forming a batch failed", index)
                    head = self.queue.take_head()
                    if head is None:
                        self._idle.append(index)
                        return
                    self._finish(index, [head], None, None, InternalError(f"forming a batch failed: {type(fault).__name__}: {fault}"))
                    continue
                finally:
                    self._forming = forming = False
                if batch is None:
                    self._idle.append(index)
                    return
                running = _Running(batch, time.monotonic())
                if gate is None:
                    self._running[index] = running
                try:
                    self._hand_out()  # for requests left over
                except Exception:
                    log.exception("instance %d: starting another instance failed; this one takes the requests left over next", index)
            if gate is not None:
                gate.acquire()  # its resources, in its turn (the batch waits as queued, outside the execution timeout)
                with self._lock:
                    running.start = time.monotonic()
                    self._running[index] = running
            results = error = None
            execution = Execution(now_ns())
            try:
                with tracing.execution(batch, attributes):
                    results = runner([pending.inputs for pending in batch], execution)
                execution.ran(now_ns())
            except Exception as caught:  # a failed execution fails every request in it, and only those
                error = caught
            except BaseException as caught:  # (SystemExit and the like: raised on the loop, they would stop the server)
                error = InternalError(f"the execution raised {type(caught).__name__}: {caught}")
            finally:
                if gate is not None:
                    gate.release()
            if error is None and (not isinstance(results, list) or len(results) != len(batch)):
                count = len(results) if isinstance(results, list) else type(results).__name__
                error = InternalError(f"the execution answered {count} results for a batch of {len(batch)} requests")
            with self._lock:
                if running.abandoned:
                    return  # timed out: failed, and the instance left rotation (see `_time_out`)
                self._running[index] = None
            if error is None:
                seconds = (execution.input_ns + execution.infer_ns + execution.output_ns) / 1e9
                try:
                    with self._lock:
                        self.queue.observe(sum(p.rows for p in batch), seconds)
                except Exception:
                    log.exception("instance %d: updating the cost model failed", index)
            if not self._finish(index, batch, results, execution, error):
                return
            if isinstance(error, DeviceError) and error.fatal:
                return  # out of rotation (see `_resolve`)
            idle_since = time.monotonic()

    def _finish(self, index: int, batch: list[Pending], results, execution, error) -> bool:
        """Hands a finished batch to the event loop to answer; False if the loop is gone (nobody waits)."""
        self._finished.append((index, batch, results, execution, error))
        if not self._resolving:
            self._resolving = True
            try:
                self._loop.call_soon_threadsafe(self._resolve)
            except RuntimeError:  # the event loop is closed: nobody waits for these answers
                return False
        return True

    def _next_batch(self, idle_since: float) -> list[Pending] | None:
        """Under the lock: the next batch, once it is due (waiting for it to fill); None when no request waits."""
        while not self._closed:
            batch, wait = self.queue.poll(idle_since, time.monotonic())
            if batch:
                return batch
            if batch is None:  # (an empty batch: the callers of all it took had left; look again)
                if wait is None:
                    return None
                self._lock.wait(wait)
        return None

    # -- answers (event loop)

    def _resolve(self) -> None:
        """Resolves the requests of every batch the instances finished since the last call."""
        self._resolving = False  # first: a batch finished from now on schedules another call
        finished = self._finished
        while finished:
            index, batch, results, execution, error = finished.popleft()
            try:
                self._answer(index, batch, results, execution, error)
            except Exception as fault:  # this batch's requests fail; the other batches are answered
                log.exception("answering a batch of instance %d failed", index)
                self._fail(batch, InternalError(f"answering the batch failed: {type(fault).__name__}: {fault}"))

    def _answer(self, index: int, batch: list[Pending], results, execution, error) -> None:
        if error is not None:
            self._fail(batch, error)
            if isinstance(error, DeviceError) and error.fatal:
                self._take_out(index, str(error), hung=False)
            return
        self.stats.record_execution(sum(p.rows for p in batch), execution)
        for pending, result in zip(batch, results):
            if pending.future.done():
                continue  # its caller left (counted CANCELED): the answer is dropped
            pending.timing.executed(execution)
            pending.future.set_result(result)

    async def _watch(self) -> None:
        """Fails an execution that outlives the execution timeout and takes its instance out of rotation.

        Sleeps until the earliest deadline of the executions running: one starting later has a later one.
        """
        timeout = self.execution_timeout_s
        while True:
            now = time.monotonic()
            starts = []
            for index, running in enumerate(list(self._running)):
                if running is None:
                    continue
                if now - running.start < timeout:
                    starts.append(running.start)
                    continue
                try:
                    self._time_out(index, running)
                except Exception:  # the watch goes on for the other instances
                    log.exception("timing out the execution of instance %d failed", index)
            running = None  # not kept while asleep: it holds a finished batch's inputs (a shm region's mapping)
            await asyncio.sleep(min(starts) + timeout - now if starts else timeout)

    def _time_out(self, index: int, running: _Running) -> None:
        with self._lock:
            if self._running[index] is not running:
                return  # it finished meanwhile
            running.abandoned = True
            self._running[index] = None
        # The thread stays in the call (a device call cannot be interrupted): nothing waits for it any more.
        reason = f"the execution did not finish within execution_timeout_ms {self.execution_timeout_s * 1000:g}"
        self._fail(running.batch, ExecutionTimeout(f"{reason}: instance {index} is out of rotation until the model is reloaded"))
        self._take_out(index, reason, hung=True)

    @staticmethod
    def _fail(batch: list[Pending], error: Exception) -> None:
        for pending in batch:
            if not pending.future.done():
                pending.future.set_exception(error)

    def _take_out(self, index: int, reason: str, hung: bool) -> None:
        """Never hands the instance another batch; with none left, fails what waits. It leaves the rate
        limiter: what a hung execution holds there goes to the other instances."""
        self._health[index] = reason
        gate = self._gates[index]
        if gate is not None:
            gate.limiter.unregister([gate])
        if not self.in_rotation:
            with self._lock:
                waiting = self.queue.drain()
            self._fail(waiting, self._none_left())
        if self._on_instance_lost is not None:
            self._on_instance_lost(index, reason, hung)

    def _none_left(self) -> ModelNotReady:
        return ModelNotReady(self.health_report())

    def close(self, reason: Exception) -> None:
        """Stops handing out batches and fails the requests still queued with `reason`.

        Batches already running finish on their instance threads and resolve as usual.
        """
        with self._lock:
            self._closed = reason
            waiting = self.queue.drain()
            self._lock.notify_all()
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._fail(waiting, reason)

    def abandon(self, reason: Exception) -> list[int]:
        """Fails the batches still executing with `reason` (a shutdown that can wait no longer); returns their
        instances, whose threads nothing waits for any more (their results, if they come, are dropped)."""
        with self._lock:
            running = [(index, r) for index, r in enumerate(self._running) if r is not None]
            for index, r in running:
                r.abandoned = True
                self._running[index] = None
        for _, r in running:
            self._fail(r.batch, reason)
        return [index for index, _ in running]
