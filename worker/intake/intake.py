"""The intake: files the observer or a rescan saw, taken once complete (settled, not cut short) and
submitted as jobs, once each; it only enqueues."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


from worker.intake.complete import cut_short
from worker.intake.scan import extension_of, is_candidate, not_an_image_name, walk
from worker.intake.jobs import Job
from worker.host.names import as_text

log = logging.getLogger("worker.intake.watch")


# files left in the inbox for their names (notes.txt, photo.heic), each said once per start: up to this many
LEFT_ALONE_SAID = 10_000


@dataclass
class _Pending:
    size: int
    mtime_ns: int
    since: float
    ready: bool  # a close-write or moved-in event said the file is complete
    judged: bool = False  # cut_short was asked at this size and mtime (once per change: it reads the file)
    cut: str | None = None  # its answer: why the file looks unfinished
    held: bool = False  # the log has said that it waits


class Intake:
    """Collects candidate paths and submits each complete file once."""

    def __init__(self, root: Path, extensions: tuple[str, ...], settle_s: float, rescan_s: float,
                 submit: Callable[[Job], object], skip: tuple[Path, ...] = (),
                 done: Callable[[str, tuple[int, int]], bool] | None = None, incomplete_s: float = 0.0) -> None:
        """`done(rel, (size, mtime_ns))`: whether that content was processed and left in the inbox on purpose
        (`inputs: keep`); such a file is not submitted again. `incomplete_s`: how long a file that looks
        cut short (worker.intake.complete) must stay unchanged before it is taken anyway; 0: not held."""
        self.root, self.extensions, self.settle_s, self.rescan_s = root, extensions, settle_s, rescan_s
        self.incomplete_s = incomplete_s
        self.submit, self.skip, self.done = submit, skip, done
        self._pending: dict[Path, _Pending] = {}
        self._inflight: dict[str, tuple[int, int]] = {}  # rel -> (size, mtime_ns) submitted, not finished
        self._left_alone: set[str] = set()  # rels of files not taken for their names, said once
        self._lock = threading.Lock()
        self._wake = threading.Event()

    # called from the observer thread: record and return, never block
    def notify(self, path: Path, ready: bool) -> None:
        if not is_candidate(path.name, self.extensions):
            if not_an_image_name(path.name, self.extensions):
                self._say_left_alone(path)
            return
        with self._lock:
            p = self._pending.get(path)
            if p is None:
                self._pending[path] = _Pending(-1, -1, time.monotonic(), ready)
            else:
                p.ready = p.ready or ready
        self._wake.set()

    def forget(self, job: Job) -> None:
        """The pipeline finished a job: its path may be submitted again if new content arrives."""
        with self._lock:
            if self._inflight.get(job.rel) == (job.size, job.mtime_ns):
                del self._inflight[job.rel]

    def pending(self) -> int:
        """Files seen and not yet taken (settling, or held as cut short)."""
        with self._lock:
            return len(self._pending)

    def held(self) -> int:
        """Files waiting because they look cut short (see `_held`), for the status line."""
        with self._lock:
            return sum(p.held for p in self._pending.values())

    def rescan(self) -> None:
        for path in walk(self.root, self.extensions, self.skip, others=self._say_left_alone):
            self.notify(path, ready=False)

    def _say_left_alone(self, path: Path) -> None:
        """A file that will never be taken for its name: said once (per start), or a user waits for
        results of photos saved as .heic, or of a folder of .jp2 scans, with nothing in the log."""
        try:
            rel = path.relative_to(self.root).as_posix()
        except ValueError:
            return
        with self._lock:
            if rel in self._left_alone or len(self._left_alone) >= LEFT_ALONE_SAID:
                return
            self._left_alone.add(rel)
            last = len(self._left_alone) == LEFT_ALONE_SAID
        log.warning("%s: left in the inbox: its name does not end in an image extension (%s; `extensions` in the "
                    "config lists those taken)%s", as_text(rel), extension_of(path.name),
                    f"; the next such files are not named ({LEFT_ALONE_SAID} were)" if last else "")

    def run(self, stop: threading.Event | None = None, burst: bool = False,
            check: Callable[[], object] | None = None) -> int:
        """Submit complete files until `stop` is set; burst: scan once, submit what settles, return.
        `check` is called every pass (the inbox guard: `WatchedInbox.check`)."""
        self.rescan()
        submitted = 0
        last_scan = time.monotonic()
        while True:
            if check is not None:
                check()
            submitted += self.tick(stop, check)
            with self._lock:
                idle = not self._pending
            if burst and idle:
                return submitted
            if stop is not None and stop.is_set():
                return submitted
            if self.rescan_s and time.monotonic() - last_scan >= self.rescan_s:
                self.rescan()
                last_scan = time.monotonic()
            self._wake.wait(min(0.1, self.settle_s / 4 if self.settle_s else 0.1))
            self._wake.clear()

    def tick(self, stop: threading.Event | None = None, check: Callable[[], object] | None = None) -> int:
        """One pass of `run`: submit what is complete; returns how many. A backlog (thousands of files at
        start) takes as long as the pipeline takes to make room for each: `stop` and `check` are looked at
        before every file, so the first Ctrl-C ends intake at once (the rest stay in the inbox) and the
        status line and the inbox guard keep their pace."""
        now = time.monotonic()
        with self._lock:
            items = list(self._pending.items())
        submitted = 0
        for path, p in items:
            if stop is not None and stop.is_set():
                break
            if check is not None:
                check()
            try:
                st = path.lstat()
            except OSError:
                self._drop(path)  # gone (renamed away, deleted): nothing to do
                continue
            changed = (st.st_size, st.st_mtime_ns) != (p.size, p.mtime_ns)
            if changed:
                p.size, p.mtime_ns, p.since, p.judged = st.st_size, st.st_mtime_ns, now, False
            if not (p.ready or (not changed and now - p.since >= self.settle_s)):
                continue
            rel = path.relative_to(self.root).as_posix()
            sig = (st.st_size, st.st_mtime_ns)
            if self.done is not None and self.done(rel, sig):
                self._drop(path)
                continue  # kept in the inbox after it was processed: each rescan sees it again (unread)
            if self._held(path, rel, p, st, now):
                continue
            self._drop(path)
            with self._lock:
                if self._inflight.get(rel) == sig:
                    continue  # already submitted (a second event for the same content)
                self._inflight[rel] = sig
            if not self._still_there(path, rel, sig):
                continue
            self.submit(Job(path=path, rel=rel, size=st.st_size, mtime_ns=st.st_mtime_ns))
            submitted += 1
        return submitted

    def _held(self, path: Path, rel: str, p: _Pending, st: os.stat_result, now: float) -> bool:
        """Whether a file that looks cut short waits for its writer to come back (worker.intake.complete).
        It is taken once the intake has seen it unchanged for incomplete_s, or once a new close event
        finds it complete. (Not by its mtime: a copy that keeps the original's times, or an SMB client
        that sets them first, gives an old mtime to a file still being written.)"""
        if not self.incomplete_s or not stat.S_ISREG(st.st_mode):
            return False
        if now - p.since >= self.incomplete_s:
            return False  # then taken as it is: a file still cut short fails with the reason
        if not p.judged:
            p.cut, p.judged = cut_short(path, st.st_size), True
        if p.cut is None:
            return False
        if not p.held:
            p.held = True
            log.info("%s looks cut short (%s): waiting for its writer to finish it (taken once it is complete, "
                     "or as it is once unchanged for %g s: watch.incomplete_s)", as_text(rel), p.cut, self.incomplete_s)
        p.ready = False  # a close event alone no longer takes it: a new one (after more writes) may
        return True

    def _still_there(self, path: Path, rel: str, sig: tuple[int, int]) -> bool:
        """Look again once the path is reserved. Its earlier job may have finished since the lstat:
        the pipeline moves an input to the archive before it calls `forget`, so a file finished in
        between is gone by now; a second job for it would record a phantom "file disappeared"."""
        if os.path.lexists(path):
            return True
        with self._lock:
            if self._inflight.get(rel) == sig:
                del self._inflight[rel]
        return False

    def _drop(self, path: Path) -> None:
        with self._lock:
            self._pending.pop(path, None)
