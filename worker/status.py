"""The watcher's periodic status line: a log alone shows that it is alive and what it did.

`worker watch` logs nothing per image (at a hundred images a second that would drown the log), so
without this an operator reading `journalctl` or a container's log could not tell a quiet inbox
from a hung worker. Every `watch.status_log_s` one INFO line says what happened since the last one.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import psutil

from worker.host.disks import LowDisk
from worker.host.durations import span_text
from worker.pipeline import Counts

log = logging.getLogger("worker.status")


class StatusLog:
    """Call `tick()` often (the intake loop does, every pass); it logs once per `period_s`."""

    def __init__(self, period_s: float, counts: Counts, in_flight: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic, held: Callable[[], int] = lambda: 0,
                 disks: LowDisk | None = None) -> None:
        """`held`: how many files the intake holds because they look cut short (`Intake.held`); `disks`:
        the filesystems written to, whose lack of room the line then says, as a WARNING."""
        self._period, self._counts, self._in_flight, self._clock = period_s, counts, in_flight, clock
        self._held, self._disks = held, disks
        self._since = clock()
        self._last = self._snapshot()

    def _snapshot(self) -> tuple[int, int, int, int]:
        c = self._counts
        return c.done, c.failed, c.skipped, c.latencies_ms.count

    def tick(self) -> None:
        now = self._clock()
        if self._period <= 0 or now - self._since < self._period:
            return
        snap = self._snapshot()
        low = self._disks.check() if self._disks is not None else None
        line = self.line(now - self._since, snap)
        log.log(logging.WARNING if low else logging.INFO, "%s", f"{line}; {low}" if low else line)
        self._since, self._last = now, snap

    def line(self, seconds: float, snap: tuple[int, int, int, int]) -> str:
        done, failed, skipped = (a - b for a, b in zip(snap[:3], self._last[:3]))
        new_latencies = snap[3] - self._last[3]
        window = f"the last {span_text(seconds)}"
        rss = f"RSS {psutil.Process().memory_info().rss / 2**20:.0f} MB"
        in_flight, held = self._in_flight(), self._held()
        # a held file sits in the inbox with nothing in flight: say why, or "idle" would mislead
        waiting = f"{in_flight} in flight" + (f", {held} held as cut short (watch.incomplete_s)" if held else "")
        if not (done or failed or skipped):
            if in_flight:  # a stall: the lines before this one in the log say why
                return f"status: nothing finished in {window}; {waiting}; {rss}"
            return f"status: idle for {window}; {waiting}; {rss}"
        parts = [f"{done} done", f"{failed} failed"] + ([f"{skipped} skipped (already done)"] if skipped else [])
        rate = f"{(done + failed) / max(seconds, 1e-9):.1f} images/s"
        latency = ""
        if new_latencies:  # the ring holds the latest values: those since the last line are its end
            recent = self._counts.latencies_ms.last()[-new_latencies:]
            p50, p99 = np.percentile(recent, (50, 99))
            latency = f"; latency p50 {p50:.0f} ms, p99 {p99:.0f} ms"
        return f"status: {', '.join(parts)} in {window} ({rate}){latency}; {waiting}; {rss}"
