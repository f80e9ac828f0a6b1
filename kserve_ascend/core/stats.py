"""Per-version inference statistics: Triton's statistics extension, and what metrics add to it.

What each figure measures here (Triton's `extension_statistics.md` leaves the split to the
backend; every clock is `time.perf_counter_ns`):

- `queue`: from the request entering the batch queue to its execution starting on the
  instance's thread (so the hop to that thread counts as waiting), and the time it waited for
  its model to load on demand (`--load_on_demand`).
- `compute_input`: the request's preparation before it queues (decoding at the edge: JSON,
  binary, gRPC or shared memory to numpy; its checks against the model's signature; a
  pipeline's pre-processing) plus its execution's input phase: gathering the batch's rows
  into one array per input, converting them to the model file's precision and padding to a
  batch size the file takes.
- `compute_infer`: the rest of the execution: the runtime's run, reshapes, and for an
  oversized batch its several runs. Host-to-device and device-to-host copies are in it:
  onnxruntime does them inside `run`, and the pyACL runtime queues them on one stream with
  the execution and waits once, so they cannot be timed apart without stalling the stream.
- `compute_output`: the execution's output phase (dropping padding rows, converting to the
  config's datatypes, splitting the batch into its requests) plus making the request's
  answer of its outputs and encoding it at the edge.
- `success`: from the edge starting to decode the request (its body received) to its answer
  encoded, so it holds the four above and the hops between them.

As in Triton, `inference_stats` count requests, each charged with its whole execution's
phases, and `batch_stats` count executions by batch size (rows), with the execution's own
phases (the edges' decoding and encoding belong to requests, not to an execution). A
request's figures are recorded together once it has its answer, so any snapshot has equal
`compute_*` counts (perf_analyzer refuses a server whose counts differ). `RequestTiming` is the
one place a request is recorded.

Updated only on the event loop, so no locking. A reader on another thread (a metrics scrape)
copies a container before walking it (`list(...)` of a dict or list is atomic in CPython);
it may see a request counted in one field and not yet in the next, which the following
scrape settles.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

#: Why a request failed, as Triton's `nv_inference_request_failure` labels it.
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")

#: Upper bounds of the request latency histogram, seconds: a small model's millisecond to a large batch's seconds.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LATENCY_BOUNDS_NS = tuple(round(bound * 1e9) for bound in LATENCY_BUCKETS_S)

now_ns = time.perf_counter_ns


class Execution:
    """The phases of one execution (a batch on an instance), nanoseconds; `start` on the perf_counter clock.

    The scheduler makes one per execution and hands it to the runner, which notes how long its own
    input phase (gathering, converting, padding) and output phase (unpadding, splitting) took;
    `ran` then charges the rest of the run to `infer_ns`. A runner that notes nothing is all infer.
    """

    __slots__ = ("infer_ns", "input_ns", "output_ns", "start")

    def __init__(self, start: int = 0, input_ns: int = 0, infer_ns: int = 0, output_ns: int = 0):
        self.start, self.input_ns, self.infer_ns, self.output_ns = start, input_ns, infer_ns, output_ns

    def ran(self, end: int) -> Execution:
        """The run ended at `end`: what its runner did not note as input or output was inference."""
        self.infer_ns = end - self.start - self.input_ns - self.output_ns
        return self


class RequestTiming:
    """One request's way through the server, and the one place it is recorded in its version's statistics.

    Made when the request's body is in, before decoding (`start`: perf_counter_ns, the same
    CLOCK_MONOTONIC in every process of the host). The scheduler that takes it calls `queued`
    and, once its batch has run, `executed`; whoever then makes the answer calls `answering` before
    and `answered` after (compute_output covers both). A request that fails once queued is recorded
    by `failed` with Triton's reason. Recorded once, whichever comes first; a request refused
    before a scheduler took it is never recorded, as in Triton.
    """

    __slots__ = (
        "answer_start", "cache_hit_ns", "cache_miss_ns", "enqueued", "execution", "load_wait_ns", "start", "stats",
        "trace",
    )

    def __init__(self, start: int | None = None) -> None:
        self.start = now_ns() if start is None else start
        self.enqueued = 0
        self.execution: Execution | None = None
        self.stats: VersionStats | None = None
        self.answer_start = 0
        #: The cache's part when the response cache answered it / did not (Triton's cache_hit / cache_miss), else None.
        self.cache_hit_ns: int | None = None
        self.cache_miss_ns: int | None = None
        #: How long it waited for its model to load (on demand): queue time, not compute.
        self.load_wait_ns = 0
        #: The request's trace, if the trace extension samples it: ended with what is recorded here.
        self.trace = None

    def queued(self, stats: VersionStats) -> None:
        """A scheduler took the request: from now on it is counted, in `stats`."""
        self.stats, self.enqueued = stats, now_ns()

    def executed(self, execution: Execution) -> None:
        self.execution = execution

    def cache_hit(self, stats: VersionStats, enqueued: int, lookup_start: int, lookup_end: int) -> None:
        """The response cache answered the request: from `enqueued` to the lookup (hashing it) it queued, as
        Triton counts a hit's queue time; no execution ran (empty phases)."""
        self.stats, self.enqueued, self.cache_hit_ns = stats, enqueued, lookup_end - lookup_start
        self.execution = Execution(lookup_start)

    def cache_missed(self, ns: int) -> None:
        """The response cache did not have the answer: `ns` spent looking it up and storing it."""
        self.cache_miss_ns = ns

    def answering(self) -> None:
        """Making the answer of the outputs begins (classification, encoding)."""
        self.answer_start = now_ns()

    def answered(self, ok: bool = True, answer_ns: int | None = None) -> None:
        """The answer is made (`ok`), or making it failed. `answer_ns`: how long making it took, when not
        all of it since `answering` was this process's (with `--workers N` the engine adds the time the
        frontend spent encoding to its own)."""
        stats = self.stats
        if stats is None or self.execution is None:
            return  # never queued, or recorded already
        self.stats = None
        end = now_ns()
        if ok and self.cache_hit_ns is not None:
            stats.record_cache_hit(self, end)
        elif ok:
            stats.record_success(self, end, end - self.answer_start if answer_ns is None else answer_ns)
        else:
            stats.record_failure(end - self.start, "OTHER")
        if self.trace is not None:
            self.trace.end(self, end)

    def failed(self, reason: str) -> None:
        """The request failed once queued, for `reason` (Triton's: REJECTED, CANCELED, BACKEND, OTHER)."""
        stats = self.stats
        if stats is not None:
            self.stats = None
            end = now_ns()
            stats.record_failure(end - self.start, reason)
            if self.trace is not None:
                self.trace.end(self, end)


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_dict(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ComputeStats:
    """compute_input, compute_infer and compute_output, always recorded together."""

    input: Duration = field(default_factory=Duration)
    infer: Duration = field(default_factory=Duration)
    output: Duration = field(default_factory=Duration)

    def add(self, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.input.add(input_ns)
        self.infer.add(infer_ns)
        self.output.add(output_ns)

    def as_dict(self) -> dict:
        return {"compute_input": self.input.as_dict(), "compute_infer": self.infer.as_dict(), "compute_output": self.output.as_dict()}


@dataclass
class VersionStats:
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    #: per request
    compute: ComputeStats = field(default_factory=ComputeStats)
    #: batch size (rows) -> the phases of the executions of that size
    batches: dict[int, ComputeStats] = field(default_factory=dict)
    #: successful requests by latency: [i] counts those above LATENCY_BUCKETS_S[i - 1] and
    #: at most LATENCY_BUCKETS_S[i] (the last slot: above every bound); `success` has their sum
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(_LATENCY_BOUNDS_NS) + 1))
    #: failed requests by reason (FAILURE_REASONS)
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    #: requests the response cache answered (their lookup), and requests it looked up in vain (lookup and insertion)
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)

    def record_execution(self, rows: int, execution: Execution) -> None:
        self.execution_count += 1
        self.inference_count += rows
        self.last_inference_ms = time.time_ns() // 1_000_000
        batch = self.batches.get(rows)
        if batch is None:
            batch = self.batches[rows] = ComputeStats()
        batch.add(execution.input_ns, execution.infer_ns, execution.output_ns)

    def record_success(self, timing: RequestTiming, end: int, answer_ns: int = 0) -> None:
        """A request answered at `end` (perf_counter_ns), `answer_ns` of it making and encoding its answer."""
        execution = timing.execution
        total = end - timing.start
        self.success.add(total)
        waited = timing.load_wait_ns
        self.queue.add(execution.start - timing.enqueued + waited)
        self.compute.add(timing.enqueued - timing.start - waited + execution.input_ns, execution.infer_ns, execution.output_ns + answer_ns)
        self.latency_counts[bisect.bisect_left(_LATENCY_BOUNDS_NS, total)] += 1
        if timing.cache_miss_ns is not None:
            self.cache_miss.add(timing.cache_miss_ns)

    def record_cache_hit(self, timing: RequestTiming, end: int) -> None:
        """A request the response cache answered: a success with its queue time and no compute, as Triton
        counts it (core `InferenceStatsAggregator::UpdateSuccessCacheHit`: no inference, no execution)."""
        total = end - timing.start
        self.success.add(total)
        self.queue.add(timing.execution.start - timing.enqueued + timing.load_wait_ns)
        self.cache_hit.add(timing.cache_hit_ns)
        self.latency_counts[bisect.bisect_left(_LATENCY_BOUNDS_NS, total)] += 1

    def record_failure(self, total_ns: int, reason: str) -> None:
        """`reason` as Triton's failure metric labels it: REJECTED, CANCELED, BACKEND or OTHER."""
        self.fail.add(total_ns)
        self.failures[reason] += 1

    def as_dict(self, name: str, version: int, padding_rows: int = 0) -> dict:
        """Triton's ModelStatistics, plus `batch_padding_rows`: zero rows added to fill batches up to a
        batch size the model file takes (counted by the instances, which pad)."""
        return {
            "name": name,
            "version": str(version),
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "batch_padding_rows": padding_rows,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                **self.compute.as_dict(),
                # Both at zero for a model without a response cache, as Triton reports them.
                "cache_hit": self.cache_hit.as_dict(),
                "cache_miss": self.cache_miss.as_dict(),
            },
            # Per-response figures: a backend reports them itself (TRITONBACKEND_ModelInstanceReportResponseStatistics),
            # which neither Triton's python backend nor its repeat backend does: Triton 2.51 answers {} for decoupled
            # models served by the `ascend` backend too (measured), and so does this server (scheduling.decoupled).
            "response_stats": {},
            "batch_stats": [{"batch_size": size, **batch.as_dict()} for size, batch in sorted(self.batches.items())],
            # Memory a backend reports having allocated for the model: none is, as Triton's python backend
            # reports none for the same models.
            "memory_usage": [],
        }
