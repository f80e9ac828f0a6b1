"""Adaptive batching: the largest batch whose device time plus queue delay meets a latency target.

`parameters { key: "latency_target_ms" }` turns it on (the idea of MindIE's
DynamicBatchOptimizer). A device's cost per execution is close to fixed + per_item·b, so
the controller fits that line to the executions it sees (least squares, with old
observations fading) and steps the batch limit one size at a time toward the largest b
the fit allows. A deadband keeps it still: it grows only when the next size is predicted
to fit with a margin, and shrinks only when the current one is predicted not to fit.
"""

from __future__ import annotations

#: Weight kept by past observations at each new one: about the last 20 executions count.
FORGETTING = 0.95
#: Growing needs this much headroom under the target, so noise cannot flip the limit back and forth.
GROW_MARGIN = 0.95


class AdaptiveBatchLimit:
    def __init__(self, target_s: float, delay_s: float, max_batch_size: int):
        self.target_s = target_s
        self.delay_s = delay_s
        self.max_batch_size = max_batch_size
        self.limit = max_batch_size
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def predicted(self, rows: int) -> float | None:
        """Fitted seconds for one execution of `rows`, or None before two sizes were seen."""
        variance = self._n * self._sxx - self._sx**2
        if self._n < 2 or variance <= 1e-9 * max(self._n * self._sxx, 1e-12):
            return None
        per_item = (self._n * self._sxy - self._sx * self._sy) / variance
        fixed = (self._sy - per_item * self._sx) / self._n
        return fixed + max(per_item, 0.0) * rows

    def observe(self, rows: int, seconds: float) -> None:
        """One execution of `rows` took `seconds`: refit and move the limit at most one step."""
        self._n = self._n * FORGETTING + 1
        self._sx = self._sx * FORGETTING + rows
        self._sy = self._sy * FORGETTING + seconds
        self._sxx = self._sxx * FORGETTING + rows * rows
        self._sxy = self._sxy * FORGETTING + rows * seconds
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
