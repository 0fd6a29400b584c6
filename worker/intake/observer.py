"""The watchdog observer on the inbox: native (inotify) or polling, chosen by the filesystem; its events
turned into the intake's notices; the folders inotify could not watch counted against its limit."""

from __future__ import annotations

import errno
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from worker.intake.scan import walk
from worker.host.mounts import network_filesystem
from worker.intake.intake import Intake

log = logging.getLogger("worker.intake.watch")


# watchdog's inotify backend holds each IN_MOVED_FROM for 0.5 s to pair it with its IN_MOVED_TO, and
# its reader sleeps out the whole wait even when the pair is already there: a file renamed into place
# (the safe way to deliver one, and rsync's) reached the intake 0.5 s late (watchdog issue #649). A
# rename queues both events at once, so a short wait still pairs them; a pair missed anyway arrives as
# a "created" event and goes through the settle check instead: later, never lost.
MOVE_PAIRING_S = 0.05


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
