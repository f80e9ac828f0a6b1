"""Per-version inference statistics with the fields of Triton's statistics extension.

Updated only on the event loop (by the scheduler), so no locking. The scheduler times
an execution from dispatch to completion, so `compute_infer` includes assembling and
splitting the batch; `compute_input` and `compute_output` are not measured apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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

    def record_execution(self, rows: int, requests: int, compute_ns: int) -> None:
        self.execution_count += 1
        self.inference_count += rows
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.batches.setdefault(rows, Duration()).add(compute_ns)
        self.compute_infer.add(compute_ns * requests, requests)

    def record_success(self, total_ns: int, queue_ns: int) -> None:
        self.success.add(total_ns)
        self.queue.add(queue_ns)

    def record_failure(self, total_ns: int, reason: str) -> None:
        """`reason` as Triton's failure metric labels it: REJECTED, CANCELED, BACKEND or OTHER."""
        self.fail.add(total_ns)

    def as_dict(self, name: str, version: int) -> dict:
        zero = Duration().as_dict()
        return {
            "name": name,
            "version": str(version),
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
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
