"""Timings, percentiles, the RSS trend and the memory sampler."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


class LatencyWindow:
    """Constant-memory latency record: the first `head` values and a ring of the last `tail` values.

    A growing list would itself be a leak in a days-long watch or soak run."""

    def __init__(self, head: int = 1000, tail: int = 10_000) -> None:
        self._document_head = np.empty(head, dtype=np.float64)
        self._tail = np.empty(tail, dtype=np.float64)
        self.count = 0

    def add(self, value: float) -> None:
        if self.count < self._document_head.size:
            self._document_head[self.count] = value
        self._tail[self.count % self._tail.size] = value
        self.count += 1

    def first(self) -> np.ndarray:
        return self._document_head[: min(self.count, self._document_head.size)].copy()

    def last(self) -> np.ndarray:
        """The most recent values (up to `tail` of them), oldest first."""
        n = min(self.count, self._tail.size)
        start = self.count % self._tail.size if self.count > self._tail.size else 0
        return np.roll(self._tail, -start)[:n] if self.count > self._tail.size else self._tail[:n].copy()


def percentiles(values: Sequence[float] | np.ndarray, qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    if len(values) == 0:
        return {f"p{int(q)}": float("nan") for q in qs}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{int(q)}": float(np.percentile(arr, q)) for q in qs}


def slope_per_hour(seconds: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of values against time, per hour; nan with fewer than 3 points."""
    if len(seconds) < 3:
        return float("nan")
    t = np.asarray(seconds, dtype=np.float64)
    if np.ptp(t) == 0:
        return float("nan")
    slope = np.polyfit(t, np.asarray(values, dtype=np.float64), 1)[0]
    return float(slope * 3600.0)


# consecutive memory samples are not independent (RSS wanders with the buffers in flight over minutes):
# a slope's uncertainty is read from the means of this many consecutive runs of samples instead
SLOPE_BLOCKS = 8


def slope_se_per_hour(seconds: Sequence[float], values: Sequence[float], blocks: int = SLOPE_BLOCKS) -> float:
    """Standard error of `slope_per_hour(seconds, values)`, per hour, from the scatter about the line of
    the means of `blocks` consecutive runs of samples; nan with fewer than 2 samples per block.

    The samples' own scatter would understate it: a series that wanders for minutes at a time moves
    every sample of those minutes together, and a least-squares line through it tilts with them."""
    if len(seconds) < 2 * blocks or blocks < 3:
        return float("nan")
    t = np.asarray(seconds, dtype=np.float64) / 3600.0
    y = np.asarray(values, dtype=np.float64)
    runs = np.array_split(np.arange(len(t)), blocks)
    tb = np.array([t[r].mean() for r in runs])
    yb = np.array([y[r].mean() for r in runs])
    spread = ((tb - tb.mean()) ** 2).sum()
    if spread == 0:
        return float("nan")
    residuals = yb - np.polyval(np.polyfit(tb, yb, 1), tb)
    return float(np.sqrt((residuals ** 2).sum() / (blocks - 2) / spread))


# RSS moves by about this much from sample to sample with no trend (the buffers in flight at that
# moment; seen here: a standard deviation of 0.7-1.3 MB over 7-minute windows of a flat soak): a
# slope over a window of T hours is resolved only above RSS_NOISE_MB / T. A run whose RSS wanders more
# (+-4 MB over minutes, seen at 200 images/s) resolves only what its own wandering allows:
# twice the slope's standard error (slope_se_per_hour above), when that is more
RSS_NOISE_MB = 1.0


def resolvable_slope(mem: dict[str, Any]) -> tuple[float, str, bool]:
    """(MB/h, why, wandered): the smallest RSS slope that a run's second half after warm-up tells from
    noise (`run_stats(...)["memory"]`): RSS_NOISE_MB over its span, or twice the slope's standard error
    where RSS wandered more than that (wandered True); inf for a window of no length."""
    span_h = mem.get("late_span_s", 0.0) / 3600
    se = mem.get("late_slope_se_mb_per_h", float("nan"))
    resolved = RSS_NOISE_MB / span_h if span_h > 0 else math.inf
    if math.isfinite(se) and 2 * se > resolved:
        return 2 * se, f"twice the slope's standard error, {se:.2f} MB/h, from how far RSS wandered", True
    return resolved, f"RSS noise about {RSS_NOISE_MB:.0f} MB", False


def judge_memory(mem: dict[str, Any], limit: float, warmup_s: float) -> tuple[list[str], list[str], list[str]]:
    """(failures, inconclusive, notes) for a run's memory trend (`run_stats(...)["memory"]`).

    Judged on the second half of the samples after warm-up: settling steps early in a run are not a
    leak; a leak grows to the end. A slope over the limit, but within what RSS noise makes of so short
    a window, is neither a pass nor a leak shown."""
    failures: list[str] = []
    inconclusive: list[str] = []
    notes: list[str] = []
    late = mem.get("late_slope_mb_per_h", float("nan"))
    span_h = mem.get("late_span_s", 0.0) / 3600
    resolved, why, wandered = resolvable_slope(mem)
    longer = (f"soak for {2 * RSS_NOISE_MB / limit + warmup_s / 3600:.1f} h or more to judge {limit} MB/h"
              if limit > 0 else "no soak resolves a limit of 0 MB/h")
    if wandered and limit > 0:
        longer = f"a longer soak to judge {limit} MB/h"
    beyond = f"slopes above about {resolved:.0f} MB/h ({why}): {longer}"
    if math.isnan(late):  # a run stopped, or set, shorter than its warm-up: no trend either way
        inconclusive.append(f"too few memory samples after the {warmup_s:.0f} s warm-up to judge the trend "
                            f"({longer})")
    elif late > max(limit, resolved):
        failures.append(f"RSS grows {late:.2f} MB/h over the second half after warm-up "
                        f"(limit {limit} MB/h, soak.max_rss_slope_mb_per_h)")
    elif late > limit:
        inconclusive.append(f"RSS grew {late:.2f} MB/h over the second half after warm-up (limit {limit} MB/h), "
                            f"but its {_span(span_h)} resolve only {beyond}")
    elif resolved > limit:  # flat as far as it can tell, but it cannot tell a slope at the limit from noise
        inconclusive.append(f"the second half after warm-up lasted {_span(span_h)}, which resolves only "
                            f"{beyond}")
    return failures, inconclusive, notes


def _span(hours: float) -> str:
    return f"{hours * 3600:.0f} s" if hours < 2 / 60 else f"{hours * 60:.0f} min"
