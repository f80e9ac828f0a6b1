"""Dynamic batching: a queue that forms batches and a pool of instances that runs them.

Contract: `Scheduler.submit` queues one request and resolves with exactly its own rows
(or with the error of its execution, its rejection or its timeout). A batch is formed
whenever an instance is idle, so batches grow while every instance is busy; one instance
forms at a time, so no two race for the same requests.

The device is never left waiting for the event loop: an instance's own thread forms its
next batch from the queue (under the scheduler's lock) as soon as it has finished one, runs
and times it (`stats.timed_run`), and hands the results to the loop, which resolves the
requests' futures in one callback for whatever finished since it last looked. The loop
only queues requests, resolves them and, for an idle instance, starts its thread on a
batch. While requests wait, an instance goes from batch to batch without the loop.

Faults: whatever fails in queueing a request, forming a batch, running it or answering it
fails only the requests it concerns (a 500, logged), and the scheduler goes on serving: a
runtime that raises, or answers other than one result per request, fails its batch; a fault
while forming a batch fails the request the batch began with, while queueing one fails that
request, while answering a batch fails that batch. A caller that goes away (its task
cancelled) leaves the queue at once, counted CANCELED; in a running batch, its answer is
dropped.

Admission: a request whose queue timeout (REJECT) the requests ahead of it cannot meet, as
the queue's cost model predicts, is refused on arrival (503) rather than left to time out
(see `BatchQueue.put`).

Device health: an execution that outlives the execution timeout, or fails with a fatal
`DeviceError` (a context the device poisoned), takes its instance out of rotation: it is
never handed another batch, and the other instances go on. With none left, queued and new
requests fail with ModelNotReady until the model is reloaded (fresh instances).

`dynamic_batching` as Triton defines it: `max_queue_delay_microseconds`,
`preferred_batch_size`, `priority_levels` (1 is the most urgent) with
`default_priority_level`, and queue policies (`default_queue_policy`,
`priority_queue_policy`: `max_queue_size`, `default_timeout_microseconds`,
`allow_timeout_override`, `timeout_action` REJECT or DELAY).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import logging
import threading
import time
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from . import tracing
from .adaptive import AdaptiveBatchLimit, CostModel
from .errors import AscendError, DeviceError, InternalError, InvalidInput, ModelNotReady, Unavailable
from .stats import RequestTiming, VersionStats, now_ns, timed_run

# Runs one batch: a list of requests' inputs in, a list of their outputs out (same order).
BatchRunner = Callable[[Sequence[Mapping[str, np.ndarray]]], list[dict[str, np.ndarray]]]
# Told that an instance left rotation: its index, why, and whether its thread is stuck in the execution.
InstanceLost = Callable[[int, str, bool], None]

log = logging.getLogger(__name__)


class ExecutionTimeout(AscendError):
    """An execution outlived the model's execution timeout: its device stopped answering (a server fault)."""


class Pending:
    """A request waiting in the queue (then in its batch)."""

    __slots__ = ("inputs", "rows", "future", "arrival", "shape_key", "level", "timer", "span", "timing", "record", "taken", "counted")

    def __init__(
        self,
        inputs: Mapping[str, np.ndarray],
        rows: int,
        future: asyncio.Future,
        arrival: float,
        shape_key: tuple = (),
        level: int = 0,
    ):
        self.inputs, self.rows, self.future, self.arrival = inputs, rows, future, arrival  # arrival: time.monotonic()
        #: Requests batch together only when their non-batch dimensions agree.
        self.shape_key = shape_key
        self.level = level
        #: Its queue timeout, if its policy has one.
        self.timer: asyncio.TimerHandle | None = None
        #: Its `queue` span, while tracing.
        self.span: tracing.Span | None = None
        #: Its way through the server, for the statistics; stamped at its execution.
        self.timing: RequestTiming | None = None
        #: Whether the scheduler records it (the caller gave no timing of its own to record once it has answered).
        self.record = False
        #: Whether a batch took it (it is no longer queued).
        self.taken = False
        #: Whether its queue counts it as waiting, ahead of later requests (see `BatchQueue._admit`).
        self.counted = False


class QueuePolicy:
    """One `ModelQueuePolicy`: how many requests may wait, and for how long."""

    def __init__(self, policy: mc.ModelQueuePolicy | None = None):
        policy = policy or mc.ModelQueuePolicy()
        self.max_size = policy.max_queue_size
        self.timeout_s = policy.default_timeout_microseconds / 1e6
        self.allow_override = policy.allow_timeout_override
        self.delay_on_timeout = policy.timeout_action == mc.ModelQueuePolicy.DELAY

    def timeout(self, requested_us: int | None) -> float:
        """Seconds the request may wait (0: no limit); a request's own timeout only if allowed."""
        if requested_us and self.allow_override:
            return requested_us / 1e6
        return self.timeout_s


class BatchQueue:
    """Requests by priority level, FIFO within a level; `poll` applies `dynamic_batching`.

    Not thread-safe: the scheduler calls it under its lock, from the event loop and from
    its instances' threads.
    """

    def __init__(self, max_batch_size: int, dynamic: mc.ModelDynamicBatching | None, latency_target_ms: float = 0):
        dynamic = dynamic if max_batch_size > 0 else None
        self.dynamic = dynamic is not None
        dynamic = dynamic or mc.ModelDynamicBatching()
        self.priority_levels = dynamic.priority_levels
        levels = max(self.priority_levels, 1)
        self._levels = [collections.deque() for _ in range(levels)]
        self._delayed: collections.deque[Pending] = collections.deque()  # timed out under DELAY: served last
        self._policies = [
            QueuePolicy(dynamic.priority_queue_policy[level] if level in dynamic.priority_queue_policy else dynamic.default_queue_policy)
            for level in range(1, levels + 1)
        ]
        self.default_level = (dynamic.default_priority_level or levels) - 1
        self.max_batch_size = max(max_batch_size, 1)
        self.delay_s = dynamic.max_queue_delay_microseconds / 1e6
        self.preferred = frozenset(dynamic.preferred_batch_size)
        #: What an execution costs, fitted to those seen: for admission, and adaptive batching's limit.
        self.cost = CostModel()
        self.adaptive = (
            AdaptiveBatchLimit(latency_target_ms / 1000, self.delay_s, self.max_batch_size, self.cost)
            if latency_target_ms and self.dynamic
            else None
        )
        # Per level: [requests, rows] queued whose callers still wait (the delayed ones are behind them all).
        self._counts = [[0, 0] for _ in range(levels)]

    def _queues(self) -> Iterator[collections.deque]:
        return itertools.chain(self._levels, (self._delayed,))

    @property
    def batch_limit(self) -> int:
        return self.adaptive.limit if self.adaptive else self.max_batch_size

    def level_of(self, priority: int | None) -> int:
        """Queue index of a request's `priority` parameter (0 or absent: the default level).

        A model without `priority_levels` has one level and takes any priority, as Triton does.
        """
        if not priority or not self.priority_levels:
            return self.default_level
        if not 1 <= priority <= self.priority_levels:
            raise InvalidInput(f"priority {priority!r} is outside the model's priority levels 1..{len(self._levels)}")
        return priority - 1

    def put(self, pending: Pending, timeout_us: int | None = None, instances: int = 1) -> float:
        """Queues a request, or raises Unavailable when its level's queue is full, or when its queue
        timeout cannot be met (`instances`: those in rotation, which share the queue).

        Returns the seconds it may wait (0: no limit); then `expire` is due.
        """
        policy = self._policies[pending.level]
        if policy.max_size and self._counts[pending.level][0] >= policy.max_size:
            raise Unavailable(
                f"Exceeds maximum queue size: {policy.max_size} requests wait at priority level {pending.level + 1}"
            )
        timeout = policy.timeout(timeout_us)
        if timeout and not policy.delay_on_timeout:
            self._admit(pending.level, timeout, instances)
        self._levels[pending.level].append(pending)
        self._count(pending, 1)
        return timeout

    def _admit(self, level: int, timeout_s: float, instances: int) -> None:
        """Refuses (Unavailable) a request that would time out behind the requests ahead of it.

        Those at its level and the more urgent ones run before it. Predicted wait: their full
        batches, in rounds over the instances, at the cost the queue's model gives a full batch.
        It errs low, so that only a request that clearly cannot make it is refused: it leaves out
        the batches running, the queue delay, and batches left short by shapes or row counts;
        and no request is refused before an execution gave the model a cost.
        """
        ahead = sum(count[0] for count in self._counts[: level + 1])
        if not ahead:
            return
        limit = self.batch_limit
        cost = self.cost.estimate(limit)
        if cost is None:
            return
        rows = sum(count[1] for count in self._counts[: level + 1])
        predicted = rows // limit // max(instances, 1) * cost
        if predicted > timeout_s:
            raise Unavailable(
                f"Request cannot be served within its timeout: {ahead} requests ahead,"
                f" predicted {predicted * 1000:.0f} ms > {timeout_s * 1000:g} ms"
            )

    def _count(self, pending: Pending, sign: int) -> None:
        count = self._counts[pending.level]
        count[0] += sign
        count[1] += sign * pending.rows
        pending.counted = sign > 0

    def withdraw(self, pending: Pending) -> None:
        """Its caller left: it no longer counts as waiting (it leaves the queue when next looked at)."""
        if pending.counted:
            self._count(pending, -1)

    def expire(self, pending: Pending) -> bool:
        """A request outlived its queue timeout: True if it is to be rejected (it left the queue); under
        DELAY it moves behind every other. False if a batch took it, or its caller left, meanwhile."""
        if pending.taken or pending.future.done():
            return False
        self._levels[pending.level].remove(pending)
        self.withdraw(pending)
        if self._policies[pending.level].delay_on_timeout:
            self._delayed.append(pending)
            return False
        return True

    def waiting(self) -> bool:
        return self._head() is not None

    def _head(self) -> tuple[collections.deque, Pending] | None:
        """The next request by priority, then arrival (dropping those whose caller left)."""
        for queue in self._queues():
            while queue and queue[0].future.done():
                self._take(queue)
            if queue:
                return queue, queue[0]
        return None

    def _take(self, queue: collections.deque) -> Pending:
        pending = queue.popleft()
        pending.taken = True
        self.withdraw(pending)
        return pending

    def take_head(self) -> Pending | None:
        """Takes the next request out of the queue, due or not (after a fault in forming a batch)."""
        head = self._head()
        return self._take(head[0]) if head is not None else None

    def drain(self) -> list[Pending]:
        """Removes and returns every request whose caller still waits (on the event loop: it cancels their timers)."""
        live = [p for q in self._queues() for p in q if not p.future.done()]
        for queue in self._queues():
            queue.clear()
        for count in self._counts:
            count[:] = 0, 0
        for pending in live:
            pending.counted = False
            pending.taken = True
            if pending.timer is not None:
                pending.timer.cancel()
        return live

    def poll(self, idle_since: float, now: float) -> tuple[list[Pending] | None, float | None]:
        """Takes the batch that is due now: (batch, None). Else (None, seconds until one may be due),
        or (None, None) when no request waits.

        Asked by an instance idle since `idle_since` (time.monotonic, as `now` and arrivals).
        A batch is due when it is full (the batch limit, or the largest preferred size within
        it), when the next request cannot join it (other shapes, too many rows: in order, that
        request starts the next batch rather than being overtaken), at a preferred size with
        no more requests waiting, or when the delay is up. The delay bounds how long an idle
        instance waits for a batch to fill, so it counts from the later of the oldest
        request's arrival and the instance becoming free: requests left over while every
        instance was busy still get one window to gather the clients whose answers just went
        out. Counting from arrival alone would send those leftovers as a small batch of their
        own, halving throughput in a closed loop (batches alternate 8 and 2 with 10 clients).
        """
        head = self._head()
        if head is None:
            return None, None
        if not self.dynamic:
            return [self._take(head[0])], None
        first = head[1]
        limit = self.batch_limit
        full = min(limit, max((p for p in self.preferred if p <= limit), default=limit))
        rows, oldest, closed = 0, first.arrival, False
        prefixes = []  # per queue, how many of its first requests the batch takes (or drops: caller gone)
        for queue in self._queues():
            count = 0
            for pending in queue:
                if not pending.future.done():
                    if rows and rows + pending.rows > limit or pending.shape_key != first.shape_key:
                        closed = True
                        break
                    rows += pending.rows
                    oldest = min(oldest, pending.arrival)
                count += 1
                if rows >= full:
                    break
            prefixes.append((queue, count))
            if closed or rows >= full:
                break
        deadline = max(oldest, idle_since) + self.delay_s
        if not (closed or rows >= full or rows in self.preferred or now >= deadline):
            return None, deadline - now
        batch = []
        for queue, count in prefixes:
            for _ in range(count):
                pending = self._take(queue)
                if not pending.future.done():
                    batch.append(pending)
        return batch, None

    def observe(self, rows: int, seconds: float) -> None:
        """An execution of `rows` took `seconds` (feeds the cost model, and adaptive batching)."""
        if self.adaptive:
            self.adaptive.observe(rows, seconds)
        else:
            self.cost.observe(rows, seconds)


class _Running:
    """The batch an instance executes, since `start` (time.monotonic); `abandoned` once it timed out."""

    __slots__ = ("batch", "start", "abandoned")

    def __init__(self, batch: list[Pending], start: float):
        self.batch, self.start, self.abandoned = batch, start, False


class Scheduler:
    """Feeds the batches of one queue to a pool of instances (one per runner, each on its executor's thread).

    `span_attributes`: per instance, what its `execute` spans say (model, version, device).
    `execution_timeout_s`: how long one execution may take (None: no limit).
    `on_instance_lost`: told when an instance leaves rotation.
    """

    def __init__(
        self,
        runners: Sequence[BatchRunner],
        executors: Sequence,
        queue: BatchQueue,
        stats: VersionStats | None = None,
        span_attributes: Sequence[Mapping[str, object]] = (),
        execution_timeout_s: float | None = None,
        on_instance_lost: InstanceLost | None = None,
    ):
        self.queue = queue
        self.stats = stats if stats is not None else VersionStats()
        self._instances = list(zip(runners, executors, span_attributes or itertools.repeat({})))
        #: Per instance: "" while it is in rotation, else why it left.
        self.health = [""] * len(self._instances)
        self.execution_timeout_s = execution_timeout_s
        self._on_instance_lost = on_instance_lost
        # Guards the queue and what follows (event loop and instance threads); instances wait on it for a batch to fill.
        self._lock = threading.Condition(threading.Lock())
        self._idle = collections.deque(range(len(self._instances)))  # instances whose thread has no batch to run
        self._forming = False  # whether an instance forms a batch (one at a time)
        self._running: list[_Running | None] = [None] * len(self._instances)
        self._closed = False
        # What the instance threads finished, for the event loop to resolve in one callback.
        self._finished: collections.deque = collections.deque()
        self._resolving = False  # whether that callback is scheduled
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task | None = None
        self.outstanding = 0  # requests submitted and not yet answered
        self._answered_all = asyncio.Event()

    @property
    def in_rotation(self) -> int:
        """Instances still handed batches."""
        return self.health.count("")

    @property
    def executing(self) -> int:
        """Requests in a running batch whose caller still waits (one cancelled meanwhile is no longer outstanding)."""
        return sum(not p.future.done() for running in list(self._running) if running is not None for p in running.batch)

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (submitted, not yet executing)."""
        return self.outstanding - self.executing

    async def submit(
        self,
        inputs: Mapping[str, np.ndarray],
        rows: int,
        shape_key: tuple,
        priority: int | None = None,
        timeout_us: int | None = None,
        timing: RequestTiming | None = None,
    ) -> dict[str, np.ndarray]:
        """Resolves with the request's outputs; `timing`: the caller's, which it records once it has
        answered (`RequestTiming.answering`); without one, the request is recorded as its execution ends."""
        if not self.in_rotation:
            raise self._none_left()
        loop = self._loop
        if loop is None:  # once: on CPython 3.11, each get_running_loop() is a getpid() system call
            self._loop = loop = asyncio.get_running_loop()
        if self.execution_timeout_s and (self._watchdog is None or self._watchdog.done()):
            # In a context of its own: it outlives the request that starts it, whose id is not its own.
            # (Created inside an empty context, which the task copies: create_task's context= is 3.11+.)
            self._watchdog = contextvars.Context().run(loop.create_task, self._watch())
        pending = Pending(inputs, rows, loop.create_future(), time.monotonic(), shape_key, self.queue.level_of(priority))
        pending.record = timing is None
        pending.timing = timing = RequestTiming() if timing is None else timing
        timing.stats, timing.enqueued = self.stats, now_ns()
        if tracing.enabled:
            pending.span = tracing.start_queue()
        try:
            with self._lock:
                timeout = self.queue.put(pending, timeout_us, self.in_rotation)
                if self._forming:
                    self._lock.notify()  # the instance forming a batch sees it
                else:
                    self._hand_out()
        except Exception as error:
            if pending.span is not None:
                tracing.leave_queue(pending.span)
            if isinstance(error, Unavailable):
                self.stats.record_failure(timing.enqueued - timing.start, "REJECTED")
                raise
            # A fault of the queue's or of an instance's thread: this request fails, the others go on.
            log.exception("queueing a request failed")
            pending.future.cancel()  # if it was queued, it is dropped from there
            with self._lock:
                self.queue.withdraw(pending)
            self.stats.record_failure(now_ns() - timing.start, "OTHER")
            raise InternalError(f"queueing the request failed: {type(error).__name__}: {error}") from error
        if timeout:
            pending.timer = loop.call_later(timeout, self._expire, pending)
        self.outstanding += 1
        try:
            return await pending.future
        except asyncio.CancelledError:
            # Its caller went away (a client disconnected, a gRPC call was cancelled): cancelling the task
            # cancelled the future, so it leaves the queue; in a running batch, its answer is dropped.
            with self._lock:
                self.queue.withdraw(pending)
            self.stats.record_failure(now_ns() - timing.start, "CANCELED")
            raise
        except Exception as error:
            # Failure reasons as Triton's metrics name them: refused by the queue, or the execution failed.
            reason = "REJECTED" if isinstance(error, Unavailable) else "CANCELED" if isinstance(error, ModelNotReady) else "BACKEND"
            self.stats.record_failure(now_ns() - timing.start, reason)
            raise
        finally:
            if pending.timer is not None:
                pending.timer.cancel()
            if pending.span is not None:
                tracing.leave_queue(pending.span)  # if it never joined a batch
            self.outstanding -= 1
            if not self.outstanding:
                self._answered_all.set()

    async def drain(self) -> None:
        """Waits until every request submitted so far has been answered.

        For a version taken out of service: it receives no new requests, so this ends once
        the queue is empty and the last batch has run; then `close` loses nothing.
        """
        while self.outstanding:
            self._answered_all.clear()
            await self._answered_all.wait()

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
                self._running[index] = running = _Running(batch, time.monotonic())
                try:
                    self._hand_out()  # for requests left over
                except Exception:
                    log.exception("instance %d: starting another instance failed; this one takes the requests left over next", index)
            results = execution = error = None
            try:
                with tracing.execution(batch, attributes):
                    results, execution = timed_run(runner, [pending.inputs for pending in batch])
            except Exception as caught:  # a failed execution fails every request in it, and only those
                error = caught
            except BaseException as caught:  # (SystemExit and the like: raised on the loop, they would stop the server)
                error = InternalError(f"the execution raised {type(caught).__name__}: {caught}")
            if error is None and (not isinstance(results, list) or len(results) != len(batch)):
                count = len(results) if isinstance(results, list) else type(results).__name__
                error = InternalError(f"the execution answered {count} results for a batch of {len(batch)} requests")
            with self._lock:
                if running.abandoned:
                    return  # timed out: failed, and the instance left rotation (see `_time_out`)
                self._running[index] = None
            if execution is not None:
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
        done = now_ns()
        for pending, result in zip(batch, results):
            if pending.future.done():
                continue  # its caller left (counted CANCELED): the answer is dropped
            pending.timing.execution = execution
            if pending.record:
                self.stats.record_success(pending.timing, done)
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
        """Never hands the instance another batch; with none left, fails what waits."""
        self.health[index] = reason
        if not self.in_rotation:
            with self._lock:
                waiting = self.queue.drain()
            self._fail(waiting, self._none_left())
        if self._on_instance_lost is not None:
            self._on_instance_lost(index, reason, hung)

    def _none_left(self) -> ModelNotReady:
        return ModelNotReady(self.health_report())

    def health_report(self) -> str:
        """Which instances left rotation, and why."""
        lost = [f"instance {i}: {reason}" for i, reason in enumerate(self.health) if reason]
        return ("no instance is healthy: " if not self.in_rotation else "") + "; ".join(lost)

    def close(self, reason: Exception) -> None:
        """Stops handing out batches and fails the requests still queued with `reason`.

        Batches already running finish on their instance threads and resolve as usual.
        """
        with self._lock:
            self._closed = True
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
