"""What becomes of an input once its outcome is committed: moved to <archive>/done|failed/<rel>, deleted
(a failed one moved to <archive>/failed/<rel>), or kept where it is. `InputArchive` is the one owner of
those moves, and of what the pipeline remembers about them: the inputs archived lately (a job queued
for content that an earlier job archived is not a failure), the inputs that could not be moved (a
read-only inbox: not read again at each rescan) and the inputs kept in place (not submitted again)."""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Literal

from worker.errors import WorkerError
from worker.intake.jobs import Job, JobStatus
from worker.outputs.files import move_verified

log = logging.getLogger(__name__)

Identity = tuple[int, int, int]  # (inode, size, mtime_ns) of a file as it was read
Signature = tuple[int, int]  # (size, mtime_ns)

ARCHIVED_REMEMBERED = 4096  # recent archive moves kept in memory (a few hundred KB)
STUCK_REMEMBERED = 100_000  # inputs that could not be moved out of the inbox (about 10 MB at most)
KEPT_REMEMBERED = 200_000  # inputs kept in the inbox by configuration (about 300 bytes each: 60 MB at most)
SWEEP_S = 10.0  # emptied folders are looked at this often at most
# a move that fails with one of these fails again at the next rescan: remembered, said once
_STUCK_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)
from worker.pipeline.items import STOP
from worker.store.events import LEASE_LOST
from worker.pipeline.state import StageState


def identity(path: Path) -> Identity | None:
    """(inode, size, mtime_ns) of what is at path now (a symlink itself, not followed), None if nothing."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _remember(memory: OrderedDict[str, Signature], rel: str, sig: Signature, bound: int) -> None:
    """Note rel's signature as the newest entry, dropping the oldest beyond `bound`."""
    memory[rel] = sig
    memory.move_to_end(rel)
    if len(memory) > bound:
        memory.popitem(last=False)


class EmptiedFolders:
    """The inbox's subfolders that moving (or deleting) inputs may have emptied, removed once empty and unchanged
    for `quiet_s` (a writer that made the folder may still be writing into it; a file put there keeps it), then
    their parents up to the inbox, likewise. Removing only an empty folder (rmdir) never takes a file with it."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self._folders: dict[Path, int] = {}  # folder -> how many of its parents are the inbox's subfolders too
        self._next = 0.0

    def note(self, job: Job) -> None:
        if self.quiet_s > 0 and (depth := job.rel.count("/")):
            self._folders[job.path.parent] = depth - 1

    def sweep(self) -> None:
        now = time.time()
        if not self._folders or now < self._next:
            return
        self._next = now + min(self.quiet_s, SWEEP_S)
        work = [(folder, above, False) for folder, above in self._folders.items()]
        while work:
            folder, above, quiet = work.pop()
            try:
                if any(folder.iterdir()):
                    self._folders.pop(folder, None)  # not empty: what is in it is someone's
                    continue
                if not quiet and now - folder.stat().st_mtime < self.quiet_s:
                    self._folders[folder] = above  # emptied (or written to) lately: asked again at a later sweep
                    continue
                # the parent's own quiet, before this removal changes its time
                parent_quiet = above > 0 and now - folder.parent.stat().st_mtime >= self.quiet_s
                folder.rmdir()
            except OSError:  # gone already, or not ours to remove
                self._folders.pop(folder, None)
                continue
            self._folders.pop(folder, None)
            log.info("removed the emptied folder %s", folder)
            if above:
                work.append((folder.parent, above - 1, parent_quiet))


class InputArchive:
    """Moves, deletes or keeps finished inputs (one thread calls `archive`; any thread may ask)."""

    def __init__(self, mode: Literal["move", "delete", "keep"], root: Path | None, remember_kept: bool = True,
                 empty_folders_s: float = 0.0) -> None:
        self.mode, self.root = mode, root  # root: needed by move and delete
        self._remember_kept = remember_kept
        self._emptied = EmptiedFolders(empty_folders_s)
        self._lock = threading.Lock()  # guards the three memories below
        self._archived: OrderedDict[str, Signature] = OrderedDict()
        # done or failed on record, only the move failed: each rescan leaves them unread, and unlogged,
        # until their content changes
        self._stuck: OrderedDict[str, Signature] = OrderedDict()
        self._kept: OrderedDict[str, Signature] = OrderedDict()

    def stuck(self, job: Job) -> bool:
        """Whether this job's content is on record and only its move out of the inbox failed."""
        if not self._stuck:  # empty but for a read-only inbox: no lock taken per image otherwise
            return False
        with self._lock:
            return self._stuck.get(job.rel) == (job.size, job.mtime_ns)

    def archived_already(self, job: Job) -> bool:
        """Whether the content this job was queued for (its size and mtime) was just archived by another."""
        with self._lock:
            return self._archived.get(job.rel) == (job.size, job.mtime_ns)

    def kept(self, rel: str, sig: Signature) -> bool:
        """Whether the input at `rel` with this (size, mtime_ns) was processed and, as configured, kept where
        it is: intake need not submit it again. (Bounded: beyond KEPT_REMEMBERED, and after a restart, such
        an input is submitted again and found done by its file's stamp, unread.)"""
        with self._lock:
            return self._kept.get(rel) == sig

    def archive(self, job: Job, status: JobStatus, read_as: Identity | None) -> None:
        """Move, delete or keep job's input; `read_as` is its identity when it was read (None: never read)."""
        if self.mode == "keep":
            if read_as is not None and self._remember_kept:
                with self._lock:
                    _remember(self._kept, job.rel, read_as[1:], KEPT_REMEMBERED)
            return
        if self.root is None:
            return
        try:
            if (current := identity(job.path)) is None:
                return  # nothing there (moved away, or never there)
            if read_as is not None:
                if current != read_as:
                    # replaced under the same name after it was read (a camera rewriting latest.jpg):
                    # the new file is not this result's; it stays for its own job (intake saw it change)
                    log.warning("%s was replaced after it was read: left in the inbox for its own job", job.key)
                    return
                with self._lock:  # before the move: a job reading after it finds the note
                    _remember(self._archived, job.rel, read_as[1:], ARCHIVED_REMEMBERED)
            if self.mode == "delete" and status is JobStatus.DONE:  # a failed input is kept, in the archive
                job.path.unlink()
            else:
                move_verified(job.path, self.root / ("done" if status is JobStatus.DONE else "failed") / job.rel)
        except (OSError, WorkerError) as e:
            self._not_moved(job, read_as, e)
        else:
            with self._lock:
                self._stuck.pop(job.rel, None)
            self._emptied.note(job)

    def sweep(self) -> None:
        """Remove the subfolders the moves emptied that have not changed since (EmptiedFolders)."""
        self._emptied.sweep()

    def _not_moved(self, job: Job, read_as: Identity | None, e: OSError | WorkerError) -> None:
        """A read-only or foreign inbox, or an archive on another disk that is full: remembered and said
        once (each rescan tries the move again without reading the input); anything else, each time."""
        if not (isinstance(e, OSError) and e.errno in _STUCK_ERRNOS):
            log.error("cannot archive %s: %s", job.key, e)
            return
        with self._lock:
            sig = read_as[1:] if read_as is not None else (job.size, job.mtime_ns)
            known = self._stuck.get(job.rel) == sig
            _remember(self._stuck, job.rel, sig, STUCK_REMEMBERED)  # beyond it, the oldest is said once more
        if not known:
            log.error("cannot archive %s: %s; it stays in the inbox, and is not read again unless it changes "
                      "(the move is tried again at each rescan)", job.key, e.strerror)


class ArchiveStage(StageState):
    """The archive thread."""

    def _archive_loop(self) -> None:
        inputs = self._inputs
        assert inputs is not None  # the thread runs only with settings.inputs
        every = min(SWEEP_S, self.settings.empty_folders_s or SWEEP_S)
        while True:
            try:
                entry = self._to_archive.get(timeout=every)
            except queue.Empty:
                inputs.sweep()
                continue
            if entry is STOP:
                break
            inputs.sweep()
            job, status, committed, identity = entry
            # only once its row is durable: a crash before never loses the image; an outcome the
            # database refused leaves the input in the inbox, where the next rescan offers it again
            if committed is not None and not committed.wait():
                if committed.taken_by != LEASE_LOST:  # else its new owner moves it (logged by the recorder)
                    log.error("%s: its outcome could not be recorded: left in the inbox", job.key)
                self._done(job, status)
                continue
            try:
                inputs.archive(job, status, identity)
            except Exception:  # never let one input stop the stage: it stays in the inbox, logged
                log.exception("archive %s", job.key)
            self._done(job, status)

    def kept(self, rel: str, sig: tuple[int, int]) -> bool:
        """Whether the input at `rel` with this (size, mtime_ns) was processed and kept where it is
        (`inputs: keep`): intake need not submit it again (InputArchive.kept)."""
        return self._inputs is not None and self._inputs.kept(rel, sig)
