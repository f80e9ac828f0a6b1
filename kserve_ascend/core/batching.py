"""Dynamic batching: a queue that forms batches and a pool of instances that runs them.

Contract: `Scheduler.submit` queues one request and resolves with exactly its own rows.
One coroutine forms a batch whenever an instance is idle, so batches grow while
every instance is busy and no two instances race for the same requests. Batches
run on the instance's own thread; the event loop only queues and resolves futures.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .stats import VersionStats

# Runs one batch: a list of requests' inputs in, a list of their outputs out (same order).
BatchRunner = Callable[[Sequence[Mapping[str, np.ndarray]]], list[dict[str, np.ndarray]]]


@dataclass(eq=False)
class Pending:
    """A request waiting in the queue."""

    inputs: Mapping[str, np.ndarray]
    rows: int
    future: asyncio.Future
    arrival: float
    #: Requests batch together only when their non-batch dimensions agree.
    shape_key: tuple = field(default=())


class BatchQueue:
    """FIFO of pending requests; `next_batch` applies the `dynamic_batching` policy."""

    def __init__(self, max_batch_size: int, dynamic: mc.ModelDynamicBatching | None):
        self._queue: collections.deque[Pending] = collections.deque()
        self._arrived = asyncio.Event()
        self.max_batch_size = max(max_batch_size, 1)
        self.dynamic = dynamic is not None and max_batch_size > 0
        self.delay_s = dynamic.max_queue_delay_microseconds / 1e6 if dynamic else 0.0
        self.preferred = frozenset(dynamic.preferred_batch_size) if dynamic else frozenset()
        self.largest_preferred = max(self.preferred, default=self.max_batch_size)

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, pending: Pending) -> None:
        self._queue.append(pending)
        self._arrived.set()

    async def _wait_for_arrival(self, timeout: float | None) -> bool:
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _pop_live(self) -> Pending | None:
        """The oldest request whose caller still waits (cancelled ones are dropped)."""
        while self._queue:
            pending = self._queue.popleft()
            if not pending.future.done():
                return pending
        return None

    def drain(self) -> list[Pending]:
        """Removes and returns every request whose caller still waits."""
        live = [p for p in self._queue if not p.future.done()]
        self._queue.clear()
        return live

    async def next_batch(self) -> list[Pending]:
        """Waits for a request, then gathers more until the batch is full or the delay is up."""
        first = self._pop_live()
        while first is None:
            await self._wait_for_arrival(None)
            first = self._pop_live()
        batch, rows = [first], first.rows
        if not self.dynamic:
            return batch
        loop = asyncio.get_running_loop()
        deadline = first.arrival + self.delay_s
        while rows < self.max_batch_size and rows < self.largest_preferred:
            head = self._queue[0] if self._queue else None
            if head is None:
                # A preferred size already reached is sent at once rather than waiting for more.
                remaining = deadline - loop.time()
                if rows in self.preferred or remaining <= 0 or not await self._wait_for_arrival(remaining):
                    break
                continue
            if head.future.done():
                self._queue.popleft()
                continue
            if rows + head.rows > self.max_batch_size or head.shape_key != first.shape_key:
                break  # FIFO: the head starts the next batch rather than being overtaken
            batch.append(self._queue.popleft())
            rows += head.rows
        return batch


class Scheduler:
    """Feeds the batches of one queue to a pool of instances (one per runner)."""

    def __init__(self, runners: Sequence[BatchRunner], executors: Sequence, queue: BatchQueue, stats: VersionStats | None = None):
        self.queue = queue
        self.stats = stats if stats is not None else VersionStats()
        self._idle: asyncio.Queue = asyncio.Queue()
        for instance in zip(runners, executors):
            self._idle.put_nowait(instance)
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    def _ensure_started(self) -> None:
        # Started lazily so a model can be loaded off the event loop (in a thread).
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._dispatch())

    async def submit(self, inputs: Mapping[str, np.ndarray], rows: int, shape_key: tuple) -> dict[str, np.ndarray]:
        self._ensure_started()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.queue.put(Pending(inputs, rows, future, loop.time(), shape_key))
        return await future

    async def _dispatch(self) -> None:
        while True:
            instance = await self._idle.get()
            batch = await self.queue.next_batch()
            task = asyncio.get_running_loop().create_task(self._execute(instance, batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _execute(self, instance, batch: list[Pending]) -> None:
        runner, executor = instance
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            results = await loop.run_in_executor(executor, runner, [pending.inputs for pending in batch])
        except Exception as error:  # a failed execution fails every request in it, and only those
            done = loop.time()
            for pending in batch:
                self.stats.record_failure(_ns(done - pending.arrival))
                if not pending.future.done():
                    pending.future.set_exception(error)
        else:
            done = loop.time()
            self.stats.record_execution(sum(p.rows for p in batch), len(batch), _ns(done - start))
            for pending, result in zip(batch, results):
                self.stats.record_success(_ns(done - pending.arrival), _ns(start - pending.arrival))
                if not pending.future.done():
                    pending.future.set_result(result)
        finally:
            self._idle.put_nowait(instance)

    def close(self, reason: Exception) -> None:
        """Stops dispatching and fails the requests still queued with `reason`.

        Batches already running finish on their instance threads and resolve as usual.
        """
        if self._task is not None:
            self._task.cancel()
        for pending in self.queue.drain():
            pending.future.set_exception(reason)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
