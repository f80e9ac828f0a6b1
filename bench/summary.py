"""One summary for every load generator, so hey, gRPC and in-process figures compare."""

from __future__ import annotations

import numpy as np


def summarize(latencies_s: list[float], window_s: float, errors: int = 0, rows_per_call: int = 1) -> dict:
    """Throughput over the measured window and latency percentiles of the calls answered in it."""
    ms = np.asarray(latencies_s) * 1000
    empty = not len(ms)
    return {
        "qps": len(ms) * rows_per_call / window_s,
        "mean_ms": None if empty else float(ms.mean()),
        "p50_ms": None if empty else float(np.percentile(ms, 50)),
        "p99_ms": None if empty else float(np.percentile(ms, 99)),
        "count": len(ms),
        "errors": errors,
        "window_s": window_s,
    }
