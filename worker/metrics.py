"""Timings, percentiles, the RSS trend and the memory sampler."""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np
import psutil

from worker.store.recorder import Sample


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    if not values:
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


def take_sample(queue_depth: int, images_done: int) -> Sample:
    proc = psutil.Process()
    try:
        fds = proc.num_fds()
    except AttributeError:  # Windows
        fds = proc.num_handles()  # type: ignore[attr-defined]
    return Sample(rss_bytes=proc.memory_info().rss, fds=fds, threads=proc.num_threads(),
                  queue_depth=queue_depth, images_done=images_done, gpu_bytes=None)


class MemorySampler:
    """Calls `sink(sample)` every `period_s` seconds on its own thread until `stop()`."""

    def __init__(self, period_s: float, sink: Callable[[Sample], None], state: Callable[[], tuple[int, int]]) -> None:
        self._period = period_s
        self._sink = sink
        self._state = state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._sink(take_sample(*self._state()))
            if self._stop.wait(self._period):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sink(take_sample(*self._state()))  # the last sample shows the end state
