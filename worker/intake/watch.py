"""Hot-folder intake: watchdog events -> settled files -> jobs.

The watchdog handler only records paths (it never blocks); the intake loop decides when a file is
complete and submits it. Complete means: a close-after-write or moved-in event, or (polling
observers, copy tools that keep the file open) size and mtime unchanged for `settle_s`; and, for a
file that still looks cut short (worker.intake.complete: its writer may come back), unchanged for
`incomplete_s`. A periodic rescan finds files whose events were missed (queue overflow, restarts,
network shares)."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from pathlib import Path
from typing import Iterator

from watchdog.observers.api import BaseObserver

from worker.errors import WorkerError
from worker.host.locks import flocked
from worker.intake.intake import Intake
from worker.intake.observer import inotify_limit, observer_kind, start_observer, unwatched_folders, watched_path


log = logging.getLogger(__name__)


# how often the intake loop checks that the inbox is still the folder the observer watches
INBOX_CHECK_S = 1.0
# how often it counts the folders inotify does not watch (a walk of the inbox's folders)
COVERAGE_CHECK_S = 60.0


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


class LockedOutbox:
    """`outbox_lock` held while watching, and taken again when the outbox folder is replaced.

    An outbox deleted (a cleanup script, an operator) is made again by the next result written, as a new
    folder that the lock on the old one does not guard: a second watcher could then write into it.
    `check()` notices within INBOX_CHECK_S, says so in the log, makes the folder again where it is gone,
    and locks it; where another watcher has locked it meanwhile, the watcher stops (WorkerError)."""

    def __init__(self, outbox: Path, inbox: Path) -> None:
        self.outbox, self.inbox = outbox, inbox
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(outbox_lock(outbox, inbox))
        self._identity = folder_identity(outbox)
        self._next_check = time.monotonic() + INBOX_CHECK_S

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + INBOX_CHECK_S
        identity = folder_identity(self.outbox)
        if identity is not None and identity == self._identity:
            return
        log.error("%s: the outbox %s: the results written before are not in it; locking the folder there now",
                  self.outbox, "is gone (deleted, or its filesystem unmounted): made again" if identity is None
                  else "was replaced (deleted and made again, or mounted again)")
        self._lock.close()
        try:
            self._lock.enter_context(outbox_lock(self.outbox, self.inbox))
        except OSError as e:
            raise WorkerError(f"{self.outbox}: the outbox is gone and cannot be made again: {e.strerror or e}") from None
        self._identity = folder_identity(self.outbox)

    def __enter__(self) -> "LockedOutbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.close()


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
