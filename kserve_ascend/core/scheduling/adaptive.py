"""What a batch costs on the device, and adaptive batching, which sizes batches by it.

A device's cost per execution is close to fixed + per_item·b. `CostModel` fits that line to
the executions it sees (least squares, with old observations fading); every batch queue keeps
one, for its admission of requests with a deadline (batching.BatchQueue.put).

`parameters { key: "latency_target_ms" }` turns adaptive batching on (the idea of MindIE's
DynamicBatchOptimizer): `AdaptiveBatchLimit` steps the batch limit one size at a time toward
the largest b the fit allows. A deadband keeps it still: it grows only when the next size is
predicted to fit with a margin, and shrinks only when the current one is predicted not to fit.
"""

from __future__ import annotations

#: Weight kept by past observations at each new one: about the last 20 executions count.
FORGETTING = 0.95
#: Growing needs this much headroom under the target, so noise cannot flip the limit back and forth.
GROW_MARGIN = 0.95


class CostModel:
    """Seconds per execution as fixed + per_item·rows, fitted to the executions seen.

    Not thread-safe: fed and read under the batch queue's lock.
    """

    def __init__(self) -> None:
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        self._n = self._n * FORGETTING + 1
        self._sx = self._sx * FORGETTING + rows
        self._sy = self._sy * FORGETTING + seconds
        self._sxx = self._sxx * FORGETTING + rows * rows
        self._sxy = self._sxy * FORGETTING + rows * seconds

    def predicted(self, rows: int) -> float | None:
        """Fitted seconds for one execution of `rows`, or None before two sizes were seen."""
        variance = self._n * self._sxx - self._sx**2
        if self._n < 2 or variance <= 1e-9 * max(self._n * self._sxx, 1e-12):
            return None
        per_item = (self._n * self._sxy - self._sx * self._sy) / variance
        fixed = (self._sy - per_item * self._sx) / self._n
        return fixed + max(per_item, 0.0) * rows

    def estimate(self, rows: int) -> float | None:
        """Seconds one execution of `rows` takes, erring low; None before any execution was seen.

        The fit once two sizes were seen. Before (a model that always runs one size, as under
        overload every batch is full), the line through the origin and the mean execution
        bounds the cost from below, as neither a device's fixed cost nor its cost per row is
        negative: the mean at the mean size or above, proportionally less below it.
        """
        if not self._n:
            return None
        fitted = self.predicted(rows)
        if fitted is not None:
            return max(fitted, 0.0)
        mean_rows, mean_s = self._sx / self._n, self._sy / self._n
        return mean_s * min(1.0, rows / mean_rows) if mean_rows else mean_s


class AdaptiveBatchLimit:
    def __init__(self, target_s: float, delay_s: float, max_batch_size: int, cost: CostModel | None = None):
        self.target_s = target_s
        self.delay_s = delay_s
        self.max_batch_size = max_batch_size
        self.limit = max_batch_size
        self.cost = cost if cost is not None else CostModel()

    def predicted(self, rows: int) -> float | None:
        return self.cost.predicted(rows)

    def observe(self, rows: int, seconds: float) -> None:
        """One execution of `rows` took `seconds`: refit and move the limit at most one step."""
        self.cost.observe(rows, seconds)
        budget = self.target_s - self.delay_s
        current = self.predicted(self.limit)
        if current is None:
            # One size seen so far: step down from a size that missed, to learn the slope.
            if rows == self.limit and seconds > budget and self.limit > 1:
                self.limit -= 1
            return
        if current > budget and self.limit > 1:
            self.limit -= 1
        elif self.limit < self.max_batch_size and self.predicted(self.limit + 1) <= budget * GROW_MARGIN:
            self.limit += 1
