"""Stage 1: read, hash, the skip or quarantine check and the claim, then decode and preprocess."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import stat
import time
from collections import deque
from typing import BinaryIO, Callable

import numpy as np

from worker.errors import ImageError, ImageTooLarge, InputGone
from worker.images import decode, decode_reduced, file_pages, frames, reopenable, tiff_pages
from worker.intake.jobs import Job, JobStatus
from worker.store.ledger import Decision, stamp_of
from worker.store.events import Claimed, Commit, StampRenewed
from worker.pipeline.items import Item, PageSet, STOP, WAKE
from worker.pipeline.state import StageState

log = logging.getLogger("worker.pipeline")


# a decode thread claims up to this many waiting jobs (and bytes) ahead of decoding: enough that the
# oldest one's claim was committed by the recorder's own gathering (recorder.GROUP_S) before the thread
# reaches it (with 4 they waited on commits a fifth of their time and hurried the recorder
# into small transactions: docs/performance.md, Claims ahead)
CLAIM_AHEAD = 32
CLAIM_AHEAD_BYTES = 8 << 20  # about 13 JPEGs of 1920 px, which take long enough to decode
# a file bigger than this many bytes per allowed pixel (16-bit RGBA, uncompressed; twice that for a card
# of depth 32, whose files may hold 32-bit samples) is refused unread: reading it whole would cost its
# size in memory on each decode thread. A TIFF of several pages is not read whole but page by page.
MAX_BYTES_PER_PIXEL = 8
# a TIFF of several pages over this size is read page by page as well: not held whole on its decode thread
# (under pipeline.pages: all while every page is decoded; under `first`, for its first page alone)
PAGES_FROM_DISK_BYTES = 64 << 20
# why a file read page by page fails when another program writes to it between its claim and its decode
CHANGED = "changed while its pages were being read; its new content is read anew"


def file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
    return next((name for test, name in kinds if test(mode)), "not a plain file")


def unchanged_since_claim(job: Job, source: BinaryIO, identity: tuple[int, int, int] | None) -> None:
    """A file read page by page was hashed at its claim: if it has changed since, its pages are not
    that content's (a new content under the name comes as a job of its own)."""
    st = os.fstat(source.fileno())
    if identity is not None and (st.st_size, st.st_mtime_ns) != identity[1:]:
        raise ImageError(job.key, CHANGED)


class PrepareStage(StageState):
    """The decode threads: claim the waiting jobs ahead of decoding, skip what is done, decode and preprocess."""

    def _prepare_loop(self) -> None:
        ahead: deque[Item] = deque()  # claimed, waiting for the claim's commit, then decoding
        held = 0  # bytes of their files that those hold
        stopping = False
        while ahead or not stopping:
            # claim the jobs that are waiting (up to CLAIM_AHEAD, and 8 MiB) before decoding the oldest:
            # their claims then share one transaction; block for a job only when nothing is claimed
            while not stopping and len(ahead) < CLAIM_AHEAD and held < CLAIM_AHEAD_BYTES:
                if self._outbox_pause.full:
                    if ahead:
                        break  # decode what is claimed first
                    self._outbox_pause.wait()
                try:
                    job = self._outbox_pause.next_waiting() or self._jobs.get(block=not ahead)
                except queue.Empty:
                    break
                if job is WAKE:
                    continue
                if job is not STOP and self._giving_back.is_set():
                    self._done(job, JobStatus.QUEUED)  # not taken: the run was stopped; never claimed
                    continue
                if job is not STOP and self._outbox_pause.stopped and self._outbox_pause.full:
                    self._done(job, JobStatus.QUEUED)  # not taken: stopping while the outbox is full
                    continue
                if job is STOP:
                    stopping = True
                elif (item := self._guarded(Item(job), self._claim)) is not None:
                    ahead.append(item)
                    held += item.held
            if ahead:
                held -= ahead[0].held
                if self._giving_back.is_set():  # claimed, not started: given back
                    self._give_back(ahead.popleft())
                elif (item := self._guarded(ahead.popleft(), self._decode)) is not None:
                    self._prepared.put(item)
                    if item.book is not None:
                        self._send_pages(item)

    def _guarded(self, item: Item, step: Callable[[Item], bool]) -> Item | None:
        """Run one step; an item that fails or needs no more work goes straight to finish (returns None)."""
        try:
            if step(item):
                return item
        except ImageError as e:
            item.error = e.reason
        except Exception as e:  # a bug or an OS error on one image: record it, keep going
            log.exception("prepare %s", item.job.key)
            item.error = f"{type(e).__name__}: {e}"
        item.release()
        self._inferred.put(item)
        return None

    def _claim(self, item: Item) -> bool:
        """Read, hash, check the ledger and claim; False when already done (skipped)."""
        job = item.job
        if job.ticket is not None and self.leases is not None and not self.leases.holds(job.ticket):
            item.taken = True  # its claim passed to another worker meanwhile (this one was paused): not read
            return False
        if self._inputs is not None and self._inputs.stuck(job):
            item.skipped = True  # its outcome is on record; only its move failed (logged once)
            return False
        if job.path.is_symlink():  # never followed: it could point anywhere on the machine
            raise ImageError(job.key, "symbolic link: not followed (copy the file into the folder instead)")
        on_record = None if self.settings.replay else self._ledger.on_record(job.key)  # both checks, one query
        try:
            # O_NONBLOCK: a named pipe (or device) with an image's name must not block this thread on open;
            # O_NOFOLLOW: a symbolic link put there since the check above is refused too
            fd = os.open(job.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise ImageError(job.key, f"not a regular file ({file_kind(st.st_mode)}): left unread")
                over = bool(self.settings.max_pixels) and st.st_size > self._bytes_per_pixel * self.settings.max_pixels
                big = over or st.st_size > PAGES_FROM_DISK_BYTES
                pages = tiff_pages(f) if big else 0  # a TIFF of several pages that size is read page by page
                if over and pages < 2:
                    raise ImageTooLarge(job.key, f"{st.st_size} bytes is more than any image within the pixel "
                                                 f"limit takes ({self._bytes_per_pixel} bytes x pipeline.max_pixels)")
                item.identity = (st.st_ino, st.st_size, st.st_mtime_ns)
                stamp = stamp_of(st)
                if stamp is not None and not self.settings.replay and \
                        self._ledger.done_as_read(job.key, st.st_size, stamp, on_record):
                    item.skipped = item.unread = True
                    return False
                f.seek(0)  # tiff_pages read its directories: the hash and the data start at the first byte
                if pages > 1:
                    item.sha256, item.size, item.pages = hashlib.file_digest(f, "sha256").hexdigest(), st.st_size, pages
                    item.source = os.fdopen(os.dup(f.fileno()), "rb")  # open until its pages are decoded
                else:
                    item.data = f.read()
        except FileNotFoundError:
            if self._inputs is not None and self._inputs.archived_already(job):
                item.skipped = True  # replaced while queued: the job before it read and archived this content
                return False
            raise InputGone(job.key, "file disappeared before it could be read") from None
        except (PermissionError, IsADirectoryError, OSError) as e:
            raise InputGone(job.key, f"cannot read file: {e.strerror or e}") from None
        if item.data is not None:
            item.sha256, item.size = hashlib.sha256(item.data).hexdigest(), len(item.data)
        decision = Decision(skip=False, redo=True) if self.settings.replay else \
            self._ledger.decide(job.key, item.sha256, lambda: item.source is None and frames(item.data or b"") == 1,
                                on_record)
        if decision.skip:
            item.skipped, item.data = True, None
            if stamp is not None:  # read under a new stamp (touched, or done before stamps): note it
                self.recorder.put(StampRenewed(job.key, item.sha256, stamp))
            return False
        item.earlier_outbox, known, redo = decision.earlier_outbox, decision.known, decision.redo
        if known is not None and known.attempts >= self.settings.max_attempts:
            raise ImageError(job.key, f"quarantined after {known.attempts} attempts"
                                      f" (last error: {known.error or 'worker stopped while processing it'})")
        item.committed = Commit()
        self.recorder.put(Claimed(job.key, item.sha256, item.size, item.committed, stamp=stamp,
                                  take_over=job.take_over, redo=redo))
        return True

    def _decode(self, item: Item) -> bool:
        job, data = item.job, item.data
        assert (data is not None or item.source is not None) and item.committed is not None
        item.data = None
        if not item.committed.is_set():
            self.recorder.hurry()  # nothing else to do here: no point in the recorder gathering more
        # the attempt is on record before decoding: a crash in the decoder counts
        if not item.committed.wait():
            item.error = "not processed: the database refused its claim (see the log)"
            return False
        if item.committed.taken_by is not None:  # another live worker (a second `run` of this folder) has it
            item.taken = True
            return False
        t0 = time.perf_counter()
        item.timings["queue_wait_ms"] = (t0 - job.enqueued_at) * 1000
        if item.source is not None:
            image, pages = self._first_page_from_disk(item), item.pages
            orig_hw = (image.shape[0], image.shape[1])
        else:
            assert data is not None
            if self.settings.jpeg_reduce and not self.settings.keep_image:
                image, orig_hw = decode_reduced(data, job.key, self.settings.max_pixels, self._needed, self._depth,
                                                item.warnings)
            else:
                image = decode(data, job.key, self.settings.max_pixels, self._depth, item.warnings)
                orig_hw = (image.shape[0], image.shape[1])
            pages = frames(data)
        if pages > 1:
            item.pages = pages
            if self.settings.all_pages:
                item.book = PageSet(pages=pages, data=data, expected=pages, source=item.source, rest=item.rest)
                item.source = item.rest = None  # the book's now: _send_pages closes them
            else:
                log.warning("%s: %d pages (or frames); only the first is processed", job.key, pages)
        item.release()
        t1 = time.perf_counter()
        item.tensor, item.geometry = self.adapter.preprocess(image)
        if orig_hw != image.shape[:2]:
            item.geometry = item.geometry.rescaled(orig_hw)
        if self.settings.keep_image:
            item.image = image
        t2 = time.perf_counter()
        item.timings.update(decode_ms=(t1 - t0) * 1000, preprocess_ms=(t2 - t1) * 1000)
        return True

    def _first_page_from_disk(self, item: Item) -> np.ndarray:
        """The first page of a multi-page TIFF read page by page; its others follow in item.rest."""
        assert item.source is not None
        item.rest = file_pages(item.source, reopenable(item.source, item.job.path), item.job.key,
                               self.settings.max_pixels, self._depth)
        image = next(item.rest, None)
        if image is None:  # counted two pages or more at its claim: changed since
            raise ImageError(item.job.key, CHANGED)
        unchanged_since_claim(item.job, item.source, item.identity)
        return image

