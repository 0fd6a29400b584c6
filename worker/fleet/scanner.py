"""The scanner: the one run at a time that lists a folder and puts each file in the claim queue.

`FolderScan` (`worker run`) walks the whole folder every `fleet.scan_s`, a chunk per step; `InboxScan`
(`worker watch`) takes files once complete, through the intake's settle and cut-short checks. Neither
reads a file: a row holds its path, size and modification time; the claimer reads it."""

from __future__ import annotations

import itertools
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator

from worker.fleet.queue import ClaimQueue
from worker.host.names import as_text
from worker.intake.intake import Intake
from worker.intake.jobs import Job

CHUNK = 500  # files listed (and enqueued in one statement) per step of the feeder's loop


class FolderScan:
    """`worker run DIR`: every file under the folder, walked again only when a run joins (it waits for a scan begun
    after it started, so that it knows the folder is done), at most every `every_s`."""

    def __init__(self, queue: ClaimQueue, files: Callable[[], Iterator[Path]], root: Path, every_s: float) -> None:
        self.queue, self.files, self.root, self.every_s = queue, files, root, every_s
        self._walk: Iterator[Path] | None = None
        self._started: datetime | None = None
        self._last = -float("inf")  # time.monotonic() of the last scan's start

    def step(self) -> None:
        if self._walk is None:
            if time.monotonic() - self._last < self.every_s or not self.queue.scan_wanted():
                return
            self._last = time.monotonic()
            self._started, self._walk = self.queue.scan_started(), self.files()
        chunk = []
        for path in itertools.islice(self._walk, CHUNK):
            try:
                st = os.stat(path)
            except OSError:
                continue  # gone since it was listed
            chunk.append((as_text(path.relative_to(self.root).as_posix()), st.st_size, st.st_mtime_ns))
        self.queue.enqueue(chunk)
        if len(chunk) < CHUNK:  # (a step may skip a vanished file and end early: the next scan sees the rest)
            assert self._started is not None
            self.queue.scan_finished(self._started)
            self._walk = None

    def stop(self) -> None:
        """No longer the scanner: a scan half done is left to the next one."""
        self._walk = None


# files a scanner of kept inputs remembers as queued (their names and stamps), so that each rescan does not
# offer them to the database again; past this many it starts over (they are offered once more, and kept out)
REMEMBERED = 200_000


class InboxScan:
    """`worker watch`: files complete in the inbox (settled, not cut short: the intake's checks), listed again every
    `every_s`; a file dropped again after its row was finished (moved or deleted inputs) is queued again. With
    inputs kept (`requeue_after_s` None) the files queued are remembered and not offered again."""

    def __init__(self, queue: ClaimQueue,
                 make_intake: Callable[[Callable[[Job], object], Callable[[str, tuple[int, int]], bool] | None], Intake],
                 every_s: float, requeue_after_s: float | None) -> None:
        self.queue, self.every_s, self.requeue_after_s = queue, every_s, requeue_after_s
        self._found: list[Job] = []
        self._queued: dict[str, tuple[int, int]] = {}  # rel -> (size, mtime_ns): kept inputs queued already
        self.intake = make_intake(self._found.append, self._was_queued if requeue_after_s is None else None)
        self._started: datetime | None = None
        self._last = -float("inf")

    def step(self) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            if self._started is None:
                self._started = self.queue.scan_started()
            self.intake.rescan()
        self.intake.tick()
        found, self._found[:] = list(self._found), []
        self.queue.enqueue([(as_text(job.rel), job.size, job.mtime_ns) for job in found], self.requeue_after_s)
        if self.requeue_after_s is None:
            if len(self._queued) + len(found) > REMEMBERED:
                self._queued.clear()
            self._queued.update((job.rel, (job.size, job.mtime_ns)) for job in found)
        for job in found:  # the queue remembers it now
            self.intake.forget(job)
        if self._started is not None and not self.intake.pending():
            self.queue.scan_finished(self._started)
            self._started = None

    def _was_queued(self, rel: str, sig: tuple[int, int]) -> bool:
        return self._queued.get(rel) == sig

    def stop(self) -> None:
        self._started = None
