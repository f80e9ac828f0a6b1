"""Per-version inference statistics: Triton's statistics extension, and what metrics add to it.

Updated only on the event loop (by the scheduler), so no locking. The scheduler times
an execution from dispatch to completion, so `compute_infer` includes assembling and
splitting the batch; `compute_input` and `compute_output` are not measured apart.

A reader on another thread (a metrics scrape) copies a container before walking it
(`list(...)` of a dict or list is atomic in CPython); it may see a request counted in
one field and not yet in the next, which the following scrape settles.
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
class VersionStats:
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    #: batch size -> compute time of the executions of that size
    batches: dict[int, Duration] = field(default_factory=dict)
    #: successful requests by latency: [i] counts those above LATENCY_BUCKETS_S[i - 1] and
    #: at most LATENCY_BUCKETS_S[i] (the last slot: above every bound); `success` has their sum
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(_LATENCY_BOUNDS_NS) + 1))
    #: failed requests by reason (FAILURE_REASONS)
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))

    def record_execution(self, rows: int, requests: int, compute_ns: int) -> None:
        self.execution_count += 1
        self.inference_count += rows
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.batches.setdefault(rows, Duration()).add(compute_ns)
        self.compute_infer.add(compute_ns * requests, requests)

    def record_success(self, total_ns: int, queue_ns: int) -> None:
        self.success.add(total_ns)
        self.queue.add(queue_ns)
        self.latency_counts[bisect.bisect_left(_LATENCY_BOUNDS_NS, total_ns)] += 1

    def record_failure(self, total_ns: int, reason: str) -> None:
        """`reason` as Triton's failure metric labels it: REJECTED, CANCELED, BACKEND or OTHER."""
        self.fail.add(total_ns)
        self.failures[reason] += 1

    def as_dict(self, name: str, version: int, padding_rows: int = 0) -> dict:
        """Triton's ModelStatistics, plus `batch_padding_rows`: zero rows added to fill batches up to a
        batch size the model file takes (counted by the instances, which pad)."""
        zero = Duration().as_dict()
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
                "compute_input": zero,
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": zero,
                "cache_hit": zero,
                "cache_miss": zero,
            },
            "batch_stats": [
                {"batch_size": size, "compute_input": zero, "compute_infer": d.as_dict(), "compute_output": zero}
                for size, d in sorted(self.batches.items())
            ],
        }
