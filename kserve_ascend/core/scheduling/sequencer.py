"""Triton's sequence batcher for the KServe server: the scheduler of a model with `sequence_batching`.

Every request names its sequence (`sequence_id`, batch size 1). A sequence starts with
`sequence_start`, which gives it a slot on one instance (the lowest free slot, else it
waits in a backlog, first come first served, for one to free); all its requests run on
that instance, one at a time and in order, each with its control inputs and implicit
state; it ends with `sequence_end` or after `max_sequence_idle_microseconds` without a
request, and its slot goes to the backlog's first sequence. A request of a sequence the
server does not know (never started, ended, released when idle) is refused as Triton
refuses it.

Each instance has a `batcher.DynamicBatcher` of its own (so execution timeouts, device health,
statistics and tracing are the dynamic batcher's) with the strategy's queue:
- oldest: a dynamic batching queue (`max_queue_delay_microseconds`, `preferred_batch_size`)
  over its `max_candidate_sequences` slots. A sequence has at most one request in a batch,
  and an instance runs its batches one after another in arrival order, so responses keep
  their order (`preserve_ordering`) by construction.
- direct: `SlotQueue`: a batch holds one request per slot, each in its slot's row, empty
  rows below the highest filled slot as null requests (READY false, zeros), and waits for
  `minimum_slot_utilization` of the slots at most `max_queue_delay_microseconds`.

Triton's src/sequence_batch_scheduler/sequence_batch_scheduler.cc is the reference for
each of these rules.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..contracts import Request, RequestOptions, RequestScheduler
from ..errors import InvalidInput, ModelNotReady, Unavailable
from ..stats import Execution, VersionStats
from .batcher import BatchRunner, DynamicBatcher, InstanceLost
from .queue import BatchQueue, Pending
from .rate_limiter import Gate
from .sequences import CorrelationId, SequenceBatching, SequenceRequest, missing_start

log = logging.getLogger(__name__)

#: A slot: (index within its instance, instance). Ordered so the lowest index is taken first, as in Triton.
Slot = tuple[int, int]


class SlotRequest(dict):
    """A request's inputs (controls and state included) and the batch slot of its sequence: its row."""

    def __init__(self, inputs: Mapping[str, np.ndarray], slot: int):
        super().__init__(inputs)
        self.slot = slot


class SlotQueue:
    """The direct strategy's queue of one instance: at most one request per slot (its sequence's next one).

    Batches as Triton's DirectSequenceBatch: the waiting request of every slot, in slot
    order, those whose shapes differ from the lowest slot's waiting for a later batch; held
    back while fewer than `minimum_slot_utilization` of the slots wait and the oldest has
    waited less than `max_queue_delay_microseconds` (with either setting 0, sent at once).
    """

    #: A batch holds a request per slot, of the same shapes.
    batches = True

    def __init__(self, slots: int, direct: mc.ModelSequenceBatching.StrategyDirect):
        self.slots = slots
        self.delay_s = direct.max_queue_delay_microseconds / 1e6
        self.utilization = direct.minimum_slot_utilization
        self._waiting: dict[int, Pending] = {}

    def level_of(self, priority: int | None) -> int:
        return 0  # Triton's sequence batcher has no priority levels

    def put(self, pending: Pending, timeout_us: int | None = None, instances: int = 1) -> float:
        self._waiting[pending.inputs.slot] = pending
        return 0  # no queue timeout: the sequence's own `timeout` bounds its wait for a slot

    def expire(self, pending: Pending) -> bool:
        return False  # never asked: `put` sets no queue timeout

    def waiting(self) -> bool:
        return bool(self._waiting)

    def withdraw(self, pending: Pending) -> None:
        pass  # its caller left: dropped at the next poll

    def take_head(self) -> Pending | None:
        """Takes the lowest slot's request, due or not (after a fault in forming a batch)."""
        return self._waiting.pop(min(self._waiting)) if self._waiting else None

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def drain(self) -> list[Pending]:
        live = [p for p in self._waiting.values() if not p.future.done()]
        self._waiting.clear()
        return live

    def poll(self, idle_since: float, now: float) -> tuple[list[Pending] | None, float | None]:
        """As `BatchQueue.poll`: the batch due now, else how long until it may be (None: nothing waits)."""
        for slot in [s for s, p in self._waiting.items() if p.future.done()]:
            del self._waiting[slot]  # its caller left
        if not self._waiting:
            return None, None
        wait = self._hold(now)
        if wait > 0:
            return None, wait
        slots = sorted(self._waiting)
        shape_key = self._waiting[slots[0]].shape_key
        return [self._waiting.pop(s) for s in slots if self._waiting[s].shape_key == shape_key], None

    def _hold(self, now: float) -> float:
        """Seconds the batch may still wait for more slots to fill (0 or less: send it)."""
        if not self.delay_s or not self.utilization or len(self._waiting) / self.slots >= self.utilization:
            return 0
        return min(p.arrival for p in self._waiting.values()) + self.delay_s - now


def fill_slots(run_batch: BatchRunner, sequences: SequenceBatching) -> BatchRunner:
    """A runner of direct batches: each request in its slot's row, null requests in the empty rows below the highest."""

    def run(requests: Sequence[SlotRequest], execution: Execution) -> list[dict[str, np.ndarray]]:
        placed = {request.slot: request for request in requests}
        rows = max(placed) + 1
        null = _null_request(requests[0], sequences) if rows > len(placed) else None
        outputs = run_batch([placed.get(slot, null) for slot in range(rows)], execution)
        return [outputs[request.slot] for request in requests]

    return run


def _null_request(like: Mapping[str, np.ndarray], sequences: SequenceBatching) -> dict[str, np.ndarray]:
    """An empty slot's row: zeros shaped as a real request's, with the controls of a slot that is not ready."""
    zeros = {name: np.full(a.shape, b"", object) if a.dtype == object else np.zeros_like(a) for name, a in like.items()}
    return {**zeros, **sequences.control_tensors(0, start=False, end=False, ready=False)}


@dataclass(eq=False)
class _Sequence:
    id: CorrelationId
    #: Resolves with the sequence's slot, or with None if it never gets one (then `error` says why).
    slot: asyncio.Future
    #: The state inputs of its next request (empty: the initial state).
    state: dict[str, np.ndarray] = field(default_factory=dict)
    #: Resolved when its latest request is answered: the next one waits for it.
    last: asyncio.Future | None = None
    idle: asyncio.TimerHandle | None = None
    #: Ended (END, idle, its instance lost): no request may join it; its slot is freed after its last request.
    over: bool = False
    released: bool = False
    error: Exception | None = None


class SequenceScheduler(RequestScheduler):
    """The scheduler of a sequence model: sequences on slots of instances, each instance a `DynamicBatcher`."""

    def __init__(
        self,
        sequences: SequenceBatching,
        output_names: Sequence[str],
        runners: Sequence[BatchRunner],
        executors: Sequence,
        stats: VersionStats,
        span_attributes: Sequence[Mapping[str, object]],
        execution_timeout_s: float | None = None,
        on_instance_lost: InstanceLost | None = None,
        gates: Sequence[Gate | None] = (),
    ):
        super().__init__()
        self.sequences = sequences
        self.output_names = list(output_names)
        self.stats = stats
        self._on_instance_lost = on_instance_lost
        self._schedulers: list[DynamicBatcher] = []
        gates = list(gates) or [None] * len(runners)
        for index, (runner, executor, attributes, gate) in enumerate(zip(runners, executors, span_attributes, gates)):
            if sequences.oldest is not None:
                dynamic = mc.ModelDynamicBatching(
                    max_queue_delay_microseconds=sequences.oldest.max_queue_delay_microseconds,
                    preferred_batch_size=sequences.oldest.preferred_batch_size,
                )
                queue = BatchQueue(sequences.max_batch_size, dynamic)
            else:
                queue, runner = SlotQueue(sequences.slots, sequences.direct), fill_slots(runner, sequences)
            lost = self._lost_callback(index)
            self._schedulers.append(
                DynamicBatcher([runner], [executor], queue, stats, [attributes], execution_timeout_s, lost, [gate])
            )
        self._free: list[Slot] = [(slot, i) for slot in range(sequences.slots) for i in range(len(self._schedulers))]
        heapq.heapify(self._free)
        self._active: dict[CorrelationId, _Sequence] = {}
        self._backlog: collections.deque[_Sequence] = collections.deque()
        self._closed: Exception | None = None

    def _lost_callback(self, index: int) -> InstanceLost:
        def lost(_: int, reason: str, hung: bool) -> None:
            if not self.in_rotation:  # nothing will free a slot for the backlog any more
                for waiting in list(self._backlog):
                    self._end(waiting, self._none_left())
            if self._on_instance_lost is not None:
                self._on_instance_lost(index, reason, hung)
        return lost

    @property
    def health(self) -> list[str]:
        return [scheduler.health[0] for scheduler in self._schedulers]

    def _none_left(self) -> ModelNotReady:
        return ModelNotReady(self.health_report())

    @property
    def executing(self) -> int:
        return sum(scheduler.executing for scheduler in self._schedulers)

    @property
    def queued(self) -> int:
        """Requests not executing yet: queued on an instance, behind their sequence's previous one, or in the backlog."""
        return self.outstanding - self.executing

    def close(self, reason: Exception) -> None:
        """Fails what waits for a slot or an instance with `reason`; running batches finish."""
        self._closed = reason
        for sequence in list(self._active.values()) + list(self._backlog):
            self._end(sequence, reason)
        for scheduler in self._schedulers:
            scheduler.close(reason)

    def abandon(self, reason: Exception) -> list[int]:
        """Fails the batches still executing (see DynamicBatcher.abandon); returns their instances."""
        return [index for index, scheduler in enumerate(self._schedulers) if scheduler.abandon(reason)]

    # -- requests

    async def submit(self, request: Request) -> dict[str, np.ndarray]:
        """Runs one request of a sequence; resolves with the config's outputs.

        The request's `timeout` bounds how long it may wait in the backlog for a slot; past it,
        Triton rejects the sequence's waiting requests, and so does this.
        """
        sequence = self._join(request.options.sequence, request.rows)
        previous, done = sequence.last, asyncio.get_running_loop().create_future()
        sequence.last = done
        self._entered()
        timing, queued = request.timing, False
        try:
            if previous is not None:
                await asyncio.wait([previous])  # in order, whatever became of it
            index, instance = await self._slot(sequence, request.options.timeout_us)
            if self._closed is not None:
                raise self._closed
            scheduler = self._schedulers[instance]
            if scheduler.health[0]:
                self._end(sequence, ModelNotReady(
                    f"sequence {sequence.id} ran on instance {instance}, which is out of rotation until the model"
                    f" is reloaded: {scheduler.health[0]}"
                ))
                raise sequence.error
            starts = request.options.sequence.start
            state = sequence.state if not starts and sequence.state else self.sequences.initial_states()
            feed = {**request.inputs, **self.sequences.control_tensors(sequence.id, starts, request.options.sequence.end), **state}
            if self.sequences.direct is not None:
                feed = SlotRequest(feed, index)
            queued = True
            outputs = await scheduler.submit(Request(feed, 1, (), RequestOptions.NONE, timing))
            sequence.state = self.sequences.output_states(outputs)
            return {name: outputs[name] for name in self.output_names}
        except asyncio.CancelledError:
            if not queued:  # its caller left while it waited for its turn or a slot (once queued, its instance counts it)
                timing.queued(self.stats)
                timing.failed("CANCELED")
            raise
        finally:
            done.set_result(None)  # first: the sequence's next request goes on whatever happens below
            try:
                if sequence.over and sequence.last is done:
                    self._release(sequence)
            finally:
                self._left()

    def _join(self, request: SequenceRequest, rows: int) -> _Sequence:
        """The sequence a request belongs to, started if the request starts it; Triton's refusals otherwise."""
        name = self.sequences.model_name
        if self._closed is not None:
            raise self._closed
        if rows > 1:
            raise InvalidInput(
                f"inference request to model '{name}' must specify batch-size 1 due to requirements of sequence batcher"
            )
        if not request.id:
            raise InvalidInput(f"inference request to model '{name}' must specify a non-zero or non-empty correlation ID")
        self.sequences.check_correlation_id(request.id)
        if not self.in_rotation:
            raise self._none_left()
        sequence = self._active.get(request.id)
        if sequence is None:
            if not request.start:
                raise missing_start(request.id, name)
            sequence = self._begin(request.id)
        elif request.start:
            # Triton goes on in the same slot (the START resets the implicit state) and says so.
            log.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not end before this sequence"
                " start. Previous sequence will be terminated early.", request.id, name,
            )
        if sequence.idle is not None:
            sequence.idle.cancel()
        sequence.idle = asyncio.get_running_loop().call_later(self.sequences.idle_s, self._idle, sequence)
        if request.end:
            self._end(sequence)
        return sequence

    def _begin(self, correlation_id: CorrelationId) -> _Sequence:
        sequence = _Sequence(correlation_id, asyncio.get_running_loop().create_future())
        self._active[correlation_id] = sequence
        slot = self._take_free()
        if slot is None:
            self._backlog.append(sequence)
        else:
            sequence.slot.set_result(slot)
        return sequence

    async def _slot(self, sequence: _Sequence, timeout_us: int | None) -> Slot:
        if not sequence.slot.done():
            try:
                await asyncio.wait_for(asyncio.shield(sequence.slot), timeout_us / 1e6 if timeout_us else None)
            except asyncio.TimeoutError:
                if not sequence.slot.done():
                    self._end(sequence, Unavailable("timeout of the corresponding sequence has been expired"))
        slot = sequence.slot.result()
        if slot is None:
            raise sequence.error
        return slot

    def _idle(self, sequence: _Sequence) -> None:
        """No request for max_sequence_idle_microseconds: the sequence is released (one in the backlog waits on)."""
        if sequence.over:
            return
        if not sequence.slot.done():
            sequence.idle = asyncio.get_running_loop().call_later(self.sequences.idle_s, self._idle, sequence)
            return
        log.info(
            "sequence %s of model '%s' released: no request for max_sequence_idle_microseconds %d",
            sequence.id, self.sequences.model_name, round(self.sequences.idle_s * 1e6),
        )
        self._end(sequence)
        if sequence.last is None or sequence.last.done():
            self._release(sequence)

    def _end(self, sequence: _Sequence, error: Exception | None = None) -> None:
        """No further request joins the sequence; with `error`, those waiting for its slot fail with it."""
        sequence.over = True
        if self._active.get(sequence.id) is sequence:
            del self._active[sequence.id]
        if sequence.idle is not None:
            sequence.idle.cancel()
        if error is not None and not sequence.slot.done():
            sequence.error = error
            sequence.slot.set_result(None)
            if sequence in self._backlog:
                self._backlog.remove(sequence)

    def _release(self, sequence: _Sequence) -> None:
        """Frees the slot of a sequence whose last request is answered: to the backlog's first sequence, else free."""
        if sequence.released:
            return
        sequence.released, sequence.state = True, {}
        slot = sequence.slot.result() if sequence.slot.done() else None
        if slot is None:
            if sequence in self._backlog:
                self._backlog.remove(sequence)
            return
        if self._schedulers[slot[1]].health[0]:
            return  # its instance left rotation: the slot goes with it
        while self._backlog:
            waiting = self._backlog.popleft()
            if not waiting.slot.done():
                waiting.slot.set_result(slot)
                return
        heapq.heappush(self._free, slot)

    def _take_free(self) -> Slot | None:
        while self._free:
            slot = heapq.heappop(self._free)
            if not self._schedulers[slot[1]].health[0]:
                return slot
        return None

