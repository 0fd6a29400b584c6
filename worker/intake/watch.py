"""Hot-folder intake: watchdog events -> settled files -> jobs.

The watchdog handler only records paths (it never blocks); the intake loop decides when a file is
complete and submits it. Complete means: a close-after-write or moved-in event, or (polling
observers, copy tools that keep the file open) size and mtime unchanged for `settle_s`; and, for a
file that still looks cut short (worker.intake.complete: its writer may come back), unchanged for
`incomplete_s`. A periodic rescan finds files whose events were missed (queue overflow, restarts,
network shares).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from worker.errors import WorkerError
from worker.intake.complete import cut_short
from worker.intake.scan import extension_of, is_candidate, not_an_image_name, walk
from worker.jobs import Job
from worker.locks import flocked
from worker.mounts import network_filesystem
from worker.names import as_text

log = logging.getLogger(__name__)

# watchdog's inotify backend holds each IN_MOVED_FROM for 0.5 s to pair it with its IN_MOVED_TO, and
# its reader sleeps out the whole wait even when the pair is already there: a file renamed into place
# (the safe way to deliver one, and rsync's) reached the intake 0.5 s late (watchdog issue #649). A
# rename queues both events at once, so a short wait still pairs them; a pair missed anyway arrives as
# a "created" event and goes through the settle check instead: later, never lost.
MOVE_PAIRING_S = 0.05
# how often the intake loop checks that the inbox is still the folder the observer watches
INBOX_CHECK_S = 1.0
# how often it counts the folders inotify does not watch (a walk of the inbox's folders)
COVERAGE_CHECK_S = 60.0
# files left in the inbox for their names (notes.txt, photo.heic), each said once per start: up to this many
LEFT_ALONE_SAID = 10_000


class _StopRace(logging.Filter):
    """watchdog 7's inotify emitter logs an ERROR when the observer stops while its thread is between
    two reads ("queue_events() called when the thread is inactive"): a shutdown race with nothing lost,
    which only alarmed whoever read the log of a clean stop."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


_STOP_RACE = _StopRace()


def quiet_rewatch_warning() -> None:
    """watchdog's inotify backend warns "Callback with id ... already exists for watch ... It will be
    Overwritten." when a folder made in the inbox is added twice, by its parent's recursive walk and by
    its own creation event: the same callback replaces itself, nothing is missed (the review of watchdog
    PR #1278 says as much), and the RuntimeWarning only alarmed whoever read the worker's stderr.
    Installed when an observer is made, not at import: a caller's `catch_warnings` around the import
    (pytest's around collection) would drop it again. Adding it again replaces it."""
    warnings.filterwarnings("ignore", r"Callback with id .* already exists for watch", RuntimeWarning)


def observer_kind(kind: str, root: Path, poll_interval_s: float = 1.0) -> str:
    """`watch.observer` for the inbox at `root`: auto is polling on a network share (an NFS or SMB mount:
    inotify makes no event for a file another machine writes there), native elsewhere. A native
    observer asked for on a share is kept, with a warning."""
    share = network_filesystem(root) if kind != "polling" else None
    if share is not None and kind == "auto":
        log.info("%s is on a network share (%s): polling it every %g s (watch.observer: auto)", root, share,
                 poll_interval_s)
        return "polling"
    if share is not None:
        log.warning("%s is on a network share (%s): inotify makes no event for a file another machine writes "
                    "there, so such files wait for the rescan (watch.rescan_interval_s); watch.observer: auto "
                    "or polling polls it", root, share)
    return "polling" if kind == "polling" else "native"


def make_observer(kind: str, poll_interval_s: float = 1.0) -> BaseObserver:
    """The only place that picks the observer backend: native (inotify, ...) or polling (network shares),
    and the one place that tunes watchdog's inotify backend (its move-pairing wait, its stop-race log,
    its warning for a folder added twice)."""
    if kind == "polling":
        return PollingObserver(timeout=poll_interval_s)
    try:
        from watchdog.observers.inotify_move_event_grouper import InotifyMoveEventGrouper
    except ImportError:  # not Linux: other backends have no such wait
        pass
    else:
        InotifyMoveEventGrouper.delay = MOVE_PAIRING_S
        logging.getLogger("watchdog.observers.inotify").addFilter(_STOP_RACE)  # adding it again is a no-op
        quiet_rewatch_warning()
    return Observer()


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


class _Handler(FileSystemEventHandler):
    """Turns watchdog's events into `Intake.notify` calls, with paths under the intake's root even where
    the observer watches the folder a symbolic link points to (see `watched_path`)."""

    def __init__(self, intake: Intake, watched: Path) -> None:
        self.intake, self.watched = intake, watched

    def _path(self, raw: str | bytes) -> Path:
        path = Path(os.fsdecode(raw))
        if self.watched != self.intake.root and path.is_relative_to(self.watched):
            return self.intake.root / path.relative_to(self.watched)
        return path

    def on_created(self, event: FileSystemEvent) -> None:
        if not event.is_directory:
            self.intake.notify(self._path(event.src_path), ready=False)
        else:  # a folder moved or copied in: its files may have no events of their own
            for path in walk(self._path(event.src_path), self.intake.extensions):
                self.intake.notify(path, ready=False)

    def on_modified(self, event: FileSystemEvent) -> None:
        if not event.is_directory:
            self.intake.notify(self._path(event.src_path), ready=False)

    def on_closed(self, event: FileSystemEvent) -> None:  # close after write (inotify)
        if not event.is_directory:
            self.intake.notify(self._path(event.src_path), ready=True)

    def on_moved(self, event: FileSystemEvent) -> None:  # renamed into place: complete
        dest = self._path(event.dest_path)
        if event.is_directory:
            for path in walk(dest, self.intake.extensions):
                self.intake.notify(path, ready=True)
        elif dest.is_relative_to(self.intake.root):
            self.intake.notify(dest, ready=True)


def watched_path(root: Path) -> Path:
    """The folder the observer watches: the inbox, or the folder it points to when the inbox itself is a
    symbolic link (`/srv/inbox -> /data/inbox`). inotify, as watchdog asks it, does not follow a link it
    is given: no event came from such an inbox, and its files waited for the rescan (30 s by default).
    Links below the inbox are still not followed."""
    return root.resolve() if root.is_symlink() else root


def start_observer(intake: Intake, kind: str, poll_interval_s: float) -> BaseObserver:
    """The observer on the inbox, started. Where inotify cannot watch every folder under it (its watch
    limit), watchdog 7.0 watches what it can, and 7.1 refuses to start: then the inbox folder alone is
    watched, and `unwatched_folders` counts the rest (found by the rescan) until the limit is raised."""
    watched = watched_path(intake.root)
    try:
        return _started(make_observer(kind, poll_interval_s), _Handler(intake, watched), watched, recursive=True)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EMFILE):
            raise
        log.debug("%s: inotify cannot watch every folder under it (%s): the inbox folder alone is watched", watched, e)
    return _started(make_observer(kind, poll_interval_s), _Handler(intake, watched), watched, recursive=False)


def _started(observer: BaseObserver, handler: _Handler, watched: Path, recursive: bool) -> BaseObserver:
    observer.schedule(handler, str(watched), recursive=recursive)
    try:
        observer.start()
    except BaseException:
        observer.stop()  # its emitters, of which some may have started
        raise
    return observer


def unwatched_folders(observer: BaseObserver, root: Path) -> tuple[int, int] | None:
    """(folders under root that the inotify observer does not watch, folders in all), or None when
    that cannot be told (another backend, another watchdog). watchdog adds a watch per folder and
    silently skips a folder it cannot watch, as when `fs.inotify.max_user_watches` is reached: no event
    comes from there, and only the rescan finds its files."""
    watched: set[bytes] = set()
    for emitter in list(getattr(observer, "emitters", ())):
        group = getattr(emitter, "_inotify", None)  # watchdog 7's InotifyWatchGroup
        paths = _watched_paths(group)
        if paths is None:
            return None
        watched.update(paths)
    if not watched:
        return None
    total = missing = 0
    for dirpath, dirnames, _ in os.walk(root, followlinks=False):  # as watchdog walks it
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        total += 1
        missing += os.fsencode(dirpath) not in watched
    return missing, total


def _watched_paths(group: Any) -> set[bytes] | None:
    """The folders a watchdog InotifyWatchGroup watches (7.0 keeps their paths, 7.1 a tree of nodes by
    watch descriptor); None for a watchdog that keeps neither."""
    paths = getattr(group, "_active_callbacks_by_path", None)
    if isinstance(paths, dict):
        return {os.fsencode(p) for p in paths}
    nodes, resolve = getattr(group, "_nodes_by_wd", None), getattr(group, "_resolve_path", None)
    if not isinstance(nodes, dict) or resolve is None:
        return None
    return {os.fsencode(os.path.normpath(path)) for wd in list(nodes) if (path := resolve(wd)) is not None}


# the machine's limit on inotify watches per user, and this user namespace's own (a container's); both hold
LIMITS = (Path("/proc/sys/fs/inotify/max_user_watches"), Path("/proc/sys/user/max_inotify_watches"))


def inotify_limit() -> tuple[str, str]:
    """The inotify watch limit that holds for this process and the setting that sets it: ("8192",
    "fs.inotify.max_user_watches"), or this user namespace's where that is lower."""
    found: list[tuple[int, str]] = []
    for path in LIMITS:
        try:
            found.append((int(path.read_text()), ".".join(path.parts[3:])))
        except (OSError, ValueError):
            continue
    if not found:
        return "unknown", LIMITS[0].name
    value, name = min(found)
    return str(value), name


def folder_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the folder at `path`; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


class WatchedInbox:
    """The observer on the inbox folder, armed again when that folder is replaced.

    An inbox deleted and made again (a cleanup script, an operator) or unmounted and mounted again is a
    new folder: the observer on the old one sees nothing more, and the one-watcher lock (taken on the
    old folder by `inbox_lock`) guards nothing. `check()` notices within `INBOX_CHECK_S`, says so in
    the log, takes the lock on the new folder, watches it and rescans it. While the path is gone the
    log says so once, and nothing is taken."""

    def __init__(self, intake: Intake, kind: str, poll_interval_s: float) -> None:
        self.intake, self._configured, self._poll_interval_s = intake, kind, poll_interval_s
        self._kind = observer_kind(kind, intake.root, poll_interval_s)  # auto resolved: native or polling
        self._identity = folder_identity(intake.root)
        self._observer: BaseObserver | None = start_observer(intake, self._kind, poll_interval_s)
        self._lock = contextlib.ExitStack()  # inbox_lock on a replacement folder (the first one is the caller's)
        self._state = "watching"  # or "gone", "taken" (another worker watches the replacement)
        self._next_check = time.monotonic() + INBOX_CHECK_S
        self._unwatched = 0  # folders inotify did not watch, as last said in the log
        self._limit = inotify_limit()  # when the observer started
        self._check_coverage()
        self._next_coverage = time.monotonic() + COVERAGE_CHECK_S

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + INBOX_CHECK_S
        if now >= self._next_coverage:
            self._next_coverage = now + COVERAGE_CHECK_S
            self._check_coverage()
        root, identity = self.intake.root, folder_identity(self.intake.root)
        if identity is not None and identity == self._identity and self._state == "watching":
            return
        if identity is None:
            if self._state != "gone":
                log.error("%s: the inbox is gone (deleted, or its filesystem unmounted): no new file is taken "
                          "until a folder is there again", root)
                self._state = "gone"
                self._stop_observer()
            return
        self._stop_observer()
        self._lock.close()
        try:
            self._lock.enter_context(inbox_lock(root))
        except WorkerError:
            if self._state != "taken":
                log.error("%s: the inbox was replaced and another worker watches the new folder: this one "
                          "takes no new file", root)
                self._state = "taken"
            return
        self._identity, self._state = identity, "watching"
        self._kind = observer_kind(self._configured, root, self._poll_interval_s)  # mounted again: maybe a share now
        self._observer = start_observer(self.intake, self._kind, self._poll_interval_s)
        log.warning("%s: the inbox was replaced (deleted and made again, or mounted again): watching the new "
                    "folder", root)
        self.intake.rescan()

    def _check_coverage(self) -> None:
        """Say when inotify watches fewer folders than the inbox has (once, and again when it changes);
        once the limit is raised, watch again (watchdog never retries a folder it could not watch)."""
        if self._observer is None or self._kind != "native":
            return
        counted = unwatched_folders(self._observer, watched_path(self.intake.root))
        if counted is not None and counted[0] and (limit := inotify_limit()) != self._limit:
            self._limit = limit
            self._stop_observer()
            self._observer = start_observer(self.intake, self._kind, self._poll_interval_s)
            self.intake.rescan()  # what landed while no observer ran
            counted = unwatched_folders(self._observer, watched_path(self.intake.root))
            log.warning("%s: the inotify watch limit is now %s (%s): watching the inbox again", self.intake.root,
                        *self._limit)
        if counted is None or counted[0] == self._unwatched:
            return
        missing, total = counted
        self._unwatched = missing
        if not missing:
            log.warning("%s: inotify watches all %d folders under the inbox again", self.intake.root, total)
            return
        rescan = self.intake.rescan_s
        when = f"only by the rescan every {rescan:g} s" if rescan else "not at all (watch.rescan_interval_s is 0)"
        value, setting = self._limit
        log.error("%s: inotify watches %d of the %d folders under the inbox (its limit is %s, %s): files in the "
                  "others are found %s. Raise the limit (sysctl %s=...; the watcher notices within %g s), or set "
                  "watch.observer: polling", self.intake.root, total - missing, total, value, setting, when, setting,
                  COVERAGE_CHECK_S)

    @property
    def kind(self) -> str:
        """The observer watching the inbox: native or polling (watch.observer's auto resolved)."""
        return self._kind

    def stop(self) -> None:
        self._stop_observer()
        self._lock.close()

    def _stop_observer(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join()
            self._observer = None


@contextlib.contextmanager
def outbox_lock(outbox: Path, inbox: Path) -> Iterator[None]:
    """Hold an exclusive lock on the outbox folder while watching into it.

    Outputs are named by the input's path relative to its inbox, so two watchers of two inboxes writing
    into one outbox would overwrite each other's results for same-named files (line1/in/a.jpg and
    line2/in/a.jpg both write a.jpg.json); the second one refuses to start instead."""
    outbox.mkdir(parents=True, exist_ok=True)
    with flocked(outbox, wait=False) as held:
        if held is False:
            raise WorkerError(f"{outbox}: another worker watches into this outbox (outputs are named by their "
                              f"path in the inbox, so same-named images from two inboxes would overwrite each "
                              f"other's results); give the watcher of {inbox} its own --outbox")
        yield


@contextlib.contextmanager
def inbox_lock(inbox: Path) -> Iterator[None]:
    """Hold an exclusive lock on the inbox folder itself (no lock file) while watching it.

    Two watchers on one inbox would each take files the other is processing and move them away from
    under it; the second one refuses to start instead. Where the filesystem cannot lock a folder
    (NFS), a warning says so and watching goes on."""
    with flocked(inbox, wait=False) as held:
        if held is False:
            raise WorkerError(f"{inbox}: another worker is watching this inbox (one watcher per inbox; "
                              f"stop it first, or give this one another --inbox)")
        if held is None:
            log.warning("cannot lock %s: make sure no other worker watches it", inbox)
        yield
