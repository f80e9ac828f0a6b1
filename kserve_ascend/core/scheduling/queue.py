"""The dynamic batcher's queue: requests by priority level, and the batches `dynamic_batching` forms of them.

`dynamic_batching` as Triton defines it: `max_queue_delay_microseconds`,
`preferred_batch_size`, `priority_levels` (1 is the most urgent) with
`default_priority_level`, and queue policies (`default_queue_policy`,
`priority_queue_policy`: `max_queue_size`, `default_timeout_microseconds`,
`allow_timeout_override`, `timeout_action` REJECT or DELAY).

Admission: a request whose queue timeout (REJECT) the requests ahead of it cannot meet, as
the queue's cost model predicts, is refused on arrival (503) rather than left to time out
(see `BatchQueue.put`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Iterator, Mapping

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .. import tracing
from ..errors import Unavailable
from ..stats import RequestTiming
from .adaptive import AdaptiveBatchLimit, CostModel


class Pending:
    """A request waiting in the queue (then in its batch)."""

    __slots__ = ("arrival", "counted", "future", "inputs", "level", "rows", "shape_key", "span", "taken", "timer", "timing")

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
        #: Whether several requests share a batch (else each runs alone).
        self.batches = self.dynamic
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
        """Queue index of a request's `priority` parameter: 0, absent or beyond the model's levels is the
        default level, as in Triton (core's infer_request.cc `InferenceRequest::SetPriority`)."""
        if not priority or priority > self.priority_levels:
            return self.default_level
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
