"""Dynamic batching: a queue that forms batches and a pool of instances that runs them.

Contract: `Scheduler.submit` queues one request and resolves with exactly its own rows
(or with the error of its execution, its rejection or its timeout). One coroutine forms
a batch whenever an instance is idle, so batches grow while every instance is busy and
no two instances race for the same requests. Batches run on the instance's own thread,
which also times them (`stats.timed_run`); the event loop only queues and resolves.

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
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from . import tracing
from .adaptive import AdaptiveBatchLimit
from .errors import AscendError, DeviceError, InvalidInput, ModelNotReady, Unavailable
from .stats import RequestTiming, VersionStats, now_ns, timed_run

# Runs one batch: a list of requests' inputs in, a list of their outputs out (same order).
BatchRunner = Callable[[Sequence[Mapping[str, np.ndarray]]], list[dict[str, np.ndarray]]]
# Told that an instance left rotation: its index, why, and whether its thread is stuck in the execution.
InstanceLost = Callable[[int, str, bool], None]


class ExecutionTimeout(AscendError):
    """An execution outlived the model's execution timeout: its device stopped answering (a server fault)."""


@dataclass(eq=False)
class Pending:
    """A request waiting in the queue."""

    inputs: Mapping[str, np.ndarray]
    rows: int
    future: asyncio.Future
    arrival: float
    #: Requests batch together only when their non-batch dimensions agree.
    shape_key: tuple = field(default=())
    level: int = 0
    timer: asyncio.TimerHandle | None = None
    #: Its `queue` span, while tracing.
    span: tracing.Span | None = None
    #: Its way through the server, for the statistics; stamped at its execution.
    timing: RequestTiming | None = None
    #: Whether the scheduler records it (the caller gave no timing of its own to record once it has answered).
    record: bool = False


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
    """Requests by priority level, FIFO within a level; `next_batch` applies `dynamic_batching`."""

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
        self._arrived = asyncio.Event()
        self.max_batch_size = max(max_batch_size, 1)
        self.delay_s = dynamic.max_queue_delay_microseconds / 1e6
        self.preferred = frozenset(dynamic.preferred_batch_size)
        self.adaptive = (
            AdaptiveBatchLimit(latency_target_ms / 1000, self.delay_s, self.max_batch_size)
            if latency_target_ms and self.dynamic
            else None
        )

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

    def put(self, pending: Pending, timeout_us: int | None = None) -> None:
        """Queues a request, or raises Unavailable when its level's queue is full."""
        policy = self._policies[pending.level]
        queue = self._levels[pending.level]
        if policy.max_size and len(queue) >= policy.max_size:
            raise Unavailable(
                f"Exceeds maximum queue size: {policy.max_size} requests wait at priority level {pending.level + 1}"
            )
        queue.append(pending)
        timeout = policy.timeout(timeout_us)
        if timeout:
            pending.timer = asyncio.get_running_loop().call_later(timeout, self._expire, pending, policy)
        self._arrived.set()

    def _expire(self, pending: Pending, policy: QueuePolicy) -> None:
        """A request outlived its queue timeout: rejected, or (DELAY) moved behind every other."""
        if pending.future.done():
            return
        self._levels[pending.level].remove(pending)
        if policy.delay_on_timeout:
            self._delayed.append(pending)
        else:
            pending.future.set_exception(Unavailable("Request timeout expired: it waited in the queue past its timeout"))

    async def _wait_for_arrival(self, timeout: float | None) -> bool:
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _head(self) -> tuple[collections.deque, Pending] | None:
        """The next request by priority, then arrival (dropping those whose caller left)."""
        for queue in self._queues():
            while queue and queue[0].future.done():
                queue.popleft()
            if queue:
                return queue, queue[0]
        return None

    @staticmethod
    def _take(queue: collections.deque) -> Pending:
        pending = queue.popleft()
        if pending.timer is not None:
            pending.timer.cancel()
        return pending

    def drain(self) -> list[Pending]:
        """Removes and returns every request whose caller still waits."""
        live = [p for q in self._queues() for p in q if not p.future.done()]
        for queue in self._queues():
            queue.clear()
        for pending in live:
            if pending.timer is not None:
                pending.timer.cancel()
        return live

    async def next_batch(self) -> list[Pending]:
        """Waits for a request, then gathers more until the batch is full or the delay is up.

        Called when an instance is idle. The delay bounds how long that idle instance waits
        for a batch to fill, so it counts from the later of the first request's arrival and
        the instance becoming free: requests left over while every instance was busy still
        get one window to gather the clients whose answers just went out. Counting from
        arrival alone would send those leftovers as a small batch of their own, halving
        throughput in a closed loop (batches alternate 8 and 2 with 10 clients).
        """
        idle_since = asyncio.get_running_loop().time()
        head = self._head()
        while head is None:
            await self._wait_for_arrival(None)
            head = self._head()
        first = self._take(head[0])
        batch, rows = [first], first.rows
        if not self.dynamic:
            return batch
        loop = asyncio.get_running_loop()
        deadline = max(first.arrival, idle_since) + self.delay_s
        limit = self.batch_limit
        full = min(limit, max((p for p in self.preferred if p <= limit), default=limit))
        while rows < full:
            head = self._head()
            if head is None:
                # A preferred size already reached is sent at once rather than waiting for more.
                remaining = deadline - loop.time()
                if rows in self.preferred or remaining <= 0 or not await self._wait_for_arrival(remaining):
                    break
                continue
            queue, pending = head
            if rows + pending.rows > limit or pending.shape_key != first.shape_key:
                break  # in order: the head starts the next batch rather than being overtaken
            batch.append(self._take(queue))
            rows += pending.rows
        return batch

    def observe(self, rows: int, seconds: float) -> None:
        """An execution of `rows` took `seconds` (feeds adaptive batching)."""
        if self.adaptive:
            self.adaptive.observe(rows, seconds)


class Scheduler:
    """Feeds the batches of one queue to a pool of instances (one per runner).

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
        self._idle: asyncio.Queue = asyncio.Queue()
        for index in range(len(self._instances)):
            self._idle.put_nowait(index)
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self.outstanding = 0  # requests submitted and not yet answered
        self.executing = 0  # of those, the requests in a running batch
        self._answered_all = asyncio.Event()

    @property
    def in_rotation(self) -> int:
        """Instances still handed batches."""
        return self.health.count("")

    def _ensure_started(self) -> None:
        # Started lazily so a model can be loaded off the event loop (in a thread), in a context
        # of its own: it outlives the request that starts it, whose id and span are not its own.
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._dispatch(), context=contextvars.Context())

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
        self._ensure_started()
        loop = asyncio.get_running_loop()
        pending = Pending(inputs, rows, loop.create_future(), loop.time(), shape_key, self.queue.level_of(priority))
        pending.record = timing is None
        pending.timing = timing = RequestTiming() if timing is None else timing
        timing.stats, timing.enqueued = self.stats, now_ns()
        try:
            self.queue.put(pending, timeout_us)
        except Unavailable:
            self.stats.record_failure(timing.enqueued - timing.start, "REJECTED")
            raise
        self.outstanding += 1
        if tracing.enabled:
            pending.span = tracing.start_queue()
        try:
            return await pending.future
        except Exception as error:
            # Failure reasons as Triton's metrics name them: refused by the queue, or the execution failed.
            reason = "REJECTED" if isinstance(error, Unavailable) else "CANCELED" if isinstance(error, ModelNotReady) else "BACKEND"
            self.stats.record_failure(now_ns() - timing.start, reason)
            raise
        finally:
            if pending.span is not None:
                tracing.leave_queue(pending.span)  # if it never joined a batch
            self.outstanding -= 1
            if not self.outstanding:
                self._answered_all.set()

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (submitted, not yet executing)."""
        return self.outstanding - self.executing

    async def drain(self) -> None:
        """Waits until every request submitted so far has been answered.

        For a version taken out of service: it receives no new requests, so this ends once
        the queue is empty and the last batch has run; then `close` loses nothing.
        """
        while self.outstanding:
            self._answered_all.clear()
            await self._answered_all.wait()

    async def _dispatch(self) -> None:
        while True:
            index = await self._idle.get()
            # No local name for the batch: holding it until the next one would keep its tensors alive.
            task = asyncio.get_running_loop().create_task(self._execute(index, await self.queue.next_batch()))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _execute(self, index: int, batch: list[Pending]) -> None:
        runner, executor, span_attributes = self._instances[index]
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.executing += len(batch)
        try:
            with tracing.execution(batch, span_attributes):
                execution = loop.run_in_executor(executor, timed_run, runner, [pending.inputs for pending in batch])
                if not (await asyncio.wait((execution,), timeout=self.execution_timeout_s))[0]:
                    # The thread stays in the call (a device call cannot be interrupted): stop waiting for it.
                    execution.cancel()
                    raise ExecutionTimeout(f"the execution did not finish within execution_timeout_ms {self.execution_timeout_s * 1000:g}")
                results, phases = execution.result()
        except ExecutionTimeout as error:
            self._fail(batch, ExecutionTimeout(f"{error}: instance {index} is out of rotation until the model is reloaded"))
            self._take_out(index, str(error), hung=True)
        except Exception as error:  # a failed execution fails every request in it, and only those
            self._fail(batch, error)
            if isinstance(error, DeviceError) and error.fatal:
                self._take_out(index, str(error), hung=False)
        else:
            rows = sum(p.rows for p in batch)
            self.queue.observe(rows, loop.time() - start)
            self.stats.record_execution(rows, phases)
            done = now_ns()
            for pending, result in zip(batch, results):
                pending.timing.execution = phases
                if pending.record:
                    self.stats.record_success(pending.timing, done)
                if not pending.future.done():
                    pending.future.set_result(result)
        finally:
            self.executing -= len(batch)
            if not self.health[index]:
                self._idle.put_nowait(index)

    @staticmethod
    def _fail(batch: list[Pending], error: Exception) -> None:
        for pending in batch:
            if not pending.future.done():
                pending.future.set_exception(error)

    def _take_out(self, index: int, reason: str, hung: bool) -> None:
        """Never hands the instance another batch; with none left, fails what waits."""
        self.health[index] = reason
        if not self.in_rotation:
            self._fail(self.queue.drain(), self._none_left())
        if self._on_instance_lost is not None:
            self._on_instance_lost(index, reason, hung)

    def _none_left(self) -> ModelNotReady:
        return ModelNotReady(self.health_report())

    def health_report(self) -> str:
        """Which instances left rotation, and why."""
        lost = [f"instance {i}: {reason}" for i, reason in enumerate(self.health) if reason]
        return ("no instance is healthy: " if not self.in_rotation else "") + "; ".join(lost)

    def close(self, reason: Exception) -> None:
        """Stops dispatching and fails the requests still queued with `reason`.

        Batches already running finish on their instance threads and resolve as usual.
        """
        if self._task is not None:
            self._task.cancel()
        for pending in self.queue.drain():
            pending.future.set_exception(reason)

