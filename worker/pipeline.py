"""The stages, wired by bounded queues:

    submit(job) -> [jobs] -> prepare x N -> [prepared] -> batch + infer x M -> [inferred] -> finish x 1
                                                   (watch; run with inputs: move|delete) -> [archive] -> archive x 1

prepare: read, hash, skip/quarantine check, claim, decode, preprocess.
infer:   micro-batch up to max_batch or max_delay_ms, one shared session.
finish:  postprocess, outbox write, hand the outcome to the recorder.
archive: wait until the outcome is committed, then move, delete or keep the input, as configured
         (worker/archive.py owns those moves).
A full queue makes the stage before it wait, never drop; a full outbox disk pauses intake, the images
that found no room waiting for it (worker/outbox_room.py). Every per-image error becomes a failed
result that flows on to the recorder. `close()` pushes sentinels through so jobs in flight finish.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import queue
import stat
import threading
import time
from collections import Counter, deque
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Literal

import cv2
import numpy as np
from sqlalchemy import Engine as DbEngine

from worker.archive import InputArchive
from worker.batcher import Batcher
from worker.engine import Engine
from worker.errors import ImageError, ImageTooLarge, InputGone, OutboxFull, WorkerError
from worker.gpu import GpuMemory
from worker.images import (decode, decode_reduced, file_pages, frames, later_pages, reopenable,
                           tiff_pages)
from worker.jobs import Job, JobStatus
from worker.metrics import LatencyWindow, MemorySampler, percentiles
from worker.model_output import ModelOutput
from worker.models.card import ModelCard, accepted_digests
from worker.names import as_text, on_disk
from worker.outbox import Outbox
from worker.outbox_room import OutboxRoom
from worker.results import Result, labels_of, top_score
from worker.store.ledger import Known, Ledger, stamp_of
from worker.store.recorder import Claimed, Commit, Finished, Recorder, Restamped
from worker.tasks import TaskAdapter
from worker.tasks.preprocess import Geometry, needed_size

log = logging.getLogger(__name__)
_STOP: Any = object()
_WAKE: Any = object()  # wakes a decode thread waiting for a job: images wait to be retried (outbox full)
# a decode thread claims up to this many waiting jobs (and bytes) ahead of decoding: enough that a
# busy pipeline's claims share transactions (see recorder.GROUP_S) and no thread waits for a commit
CLAIM_AHEAD = 4
CLAIM_AHEAD_BYTES = 64 << 20
# a file bigger than this many bytes per allowed pixel (16-bit RGBA, uncompressed; twice that for a card
# of depth 32, whose files may hold 32-bit samples) is refused unread: reading it whole would cost its
# size in memory on each decode thread. A TIFF of several pages is not read whole but page by page.
MAX_BYTES_PER_PIXEL = 8
# a TIFF of several pages over this size is read page by page as well: not held whole on its decode thread
# (under pipeline.pages: all while every page is decoded; under `first`, for its first page alone)
PAGES_FROM_DISK_BYTES = 64 << 20
# why a file read page by page fails when another program writes to it between its claim and its decode
_CHANGED = "changed while its pages were being read; its new content is read anew"
# the constructor waits at most this long for its threads' warm-ups, all together (a slow GPU's first
# call on a thread can take seconds); past it intake starts anyway
WARM_UP_WAIT_S = 60.0


@dataclass(frozen=True)
class Settings:
    """What the stages need from the config, resolved once (no config lookups inside loops)."""

    decode_workers: int
    infer_workers: int
    max_batch: int
    max_delay_ms: float
    queue_size: int
    max_pixels: int
    max_attempts: int
    memory_sample_s: float
    # once an outcome is committed: "move" the input to <archive>/done|failed/<rel>; "delete" it (a failed
    # one is moved to <archive>/failed/<rel>); "keep" it where it is, remembered so that a rescan does
    # not read it again (`kept`); None: the pipeline never touches inputs nor waits for commits (`run`)
    inputs: Literal["move", "delete", "keep"] | None = None
    archive: Path | None = None  # needed by move and delete
    keep_image: bool = False  # carry the decoded image to the finish stage (overlays need it)
    replay: bool = False  # soak: process images again even when the ledger says done
    jpeg_reduce: bool = False  # decode big JPEGs at a reduced scale (never with keep_image)
    all_pages: bool = False  # every page of a multi-page file (pipeline.pages: all), not only its first


@dataclass
class Counts:
    done: int = 0
    failed: int = 0
    skipped: int = 0
    unread: int = 0  # of the skipped: known done by the file's size and stamp, not read again
    pages: int = 0  # pages of the done images (more than `done` only with pipeline.pages: all)
    taken: int = 0  # left to another live worker that claimed them first
    # done images that an earlier run had done with this model into another outbox, by that outbox
    earlier_outboxes: Counter[str] = field(default_factory=Counter)
    latencies_ms: LatencyWindow = field(default_factory=LatencyWindow)  # done images, total ms

    @property
    def processed(self) -> int:
        return self.done + self.failed


@dataclass
class _Item:
    """One image on its way through the stages (mutable, private to the pipeline)."""

    job: Job
    sha256: str = ""
    size: int = 0
    tensor: np.ndarray | None = None
    image: np.ndarray | None = None
    geometry: Geometry | None = None
    output: ModelOutput | None = None
    data: bytes | None = None  # the file's bytes, from reading to decoding
    earlier_outbox: str | None = None  # done before into another outbox: being done again into this one
    # a multi-page TIFF read page by page (over the byte limit, or over PAGES_FROM_DISK_BYTES): the file,
    # open from its claim until its pages are decoded (release() closes it), and its pages as they are
    # decoded from disk
    source: BinaryIO | None = None
    rest: Generator[np.ndarray, None, None] | None = None
    identity: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) of the file as it was read
    committed: Commit | None = None  # set once the claim's transaction has ended
    error: str | None = None
    skipped: bool = False  # already done with the same content and model
    unread: bool = False  # skipped by its file's size and stamp, without reading it
    taken: bool = False  # in another live worker's hands (its claim came first): left to it
    timings: dict[str, float] = field(default_factory=dict)
    batch_size: int = 0
    pages: int = 1  # pages or frames in the file (a multi-page TIFF, an animated GIF)
    page: int = 0  # which of them this item is (0: the first; with all_pages the others follow it as items)
    book: "_Book | None" = None  # with all_pages, a multi-page file's: shared by its pages' items

    @property
    def held(self) -> int:
        """Bytes of the file held in memory between claim and decode."""
        return len(self.data) if self.data is not None else 0

    def release(self) -> None:
        """Close what a file read page by page keeps open (a no-op for any other)."""
        if self.rest is not None:
            self.rest.close()
            self.rest = None
        if self.source is not None:
            self.source.close()
            self.source = None


@dataclass
class _Book:
    """A multi-page file's pages on their way to its one outcome (pipeline.pages: all). The prepare thread
    sends every page after the first as an item of its own; the finish thread postprocesses and writes
    each as it comes, in any order, and records the file once all have come (or, after a page failed,
    those before it: the rest are not sent)."""

    pages: int
    data: bytes | None  # the file's bytes, until every page is decoded
    expected: int  # items the finish thread waits for: `pages`, fewer once a page has failed
    source: BinaryIO | None = None  # or, for a file read page by page (_Item.source), the file
    rest: Generator[np.ndarray, None, None] | None = None  # and its pages after the first
    arrived: int = 0
    first: _Item | None = None  # page 0's item: the job, its claim, its first page's result
    first_result: Result | None = None
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)  # page -> its part of the JSON
    labels: dict[int, tuple[int, str, float]] = field(default_factory=dict)  # class id -> best of any page
    score: float = 0.0  # the best page's
    timings: dict[str, float] = field(default_factory=dict)  # summed over the pages after the first
    error: str | None = None  # why the first page that failed did (the lowest page number)
    error_page: int = 0
    full: OutboxFull | None = None  # a page's outputs found no room: the whole file waits for room


class Pipeline:
    """Starts its threads on construction; use as a context manager or call close()."""

    def __init__(self, *, card: ModelCard, engine: Engine, adapter: TaskAdapter, recorder: Recorder,
                 outbox: Outbox, db: DbEngine, settings: Settings,
                 on_finished: Callable[[Job, JobStatus], None] | None = None) -> None:
        self.card, self.engine, self.adapter = card, engine, adapter
        self.recorder, self.outbox, self.settings = recorder, outbox, settings
        self.on_finished = on_finished
        self.counts = Counts()
        # jobs are only paths: a deep queue is cheap. Prepared tensors and raw outputs are megabytes
        # each (4.9 MB per image at 640x640), so those queues hold just enough to keep every
        # inference thread busy: more only adds memory and latency, not throughput.
        in_flight = 2 * settings.max_batch * settings.infer_workers
        self._jobs: queue.Queue[Any] = queue.Queue(settings.queue_size)
        self._prepared: queue.Queue[Any] = queue.Queue(min(settings.queue_size, in_flight))
        self._inferred: queue.Queue[Any] = queue.Queue(min(settings.queue_size, in_flight))
        self._to_archive: queue.Queue[Any] = queue.Queue(settings.queue_size)
        self._ledger = Ledger(db, card.name, recorder.root)
        self._outbox_recorded = as_text(str(outbox.root))  # as runs' configs record it
        # a run recorded under one of these: the same settings
        self._card_digests = accepted_digests(card, settings.all_pages)
        # the same for a file of one page, whose result does not depend on pipeline.pages
        self._one_page_digests = accepted_digests(card, False) | accepted_digests(card, True)
        # moves, deletes or keeps each input once its outcome is committed (None: run leaves inputs alone)
        self._inputs = InputArchive(settings.inputs, settings.archive) if settings.inputs is not None else None
        self._pending = 0
        self._idle = threading.Condition()
        # the outbox's disk is full: intake pauses, and the images that could not be written wait
        # there (still pending) until there is room again; see _defer
        self._room = OutboxRoom(outbox.has_room, outbox.root)
        size = (card.input.size[0], card.input.size[1])
        self._size_hw = size
        self._channels = card.preprocess.channels
        self._depth = card.preprocess.depth
        self._bytes_per_pixel = MAX_BYTES_PER_PIXEL * (2 if self._depth == 32 else 1)
        self._needed = lambda orig_hw: needed_size(card.preprocess, size, orig_hw)
        gpu = GpuMemory(engine.device_id) if engine.on_gpu else None  # before any thread starts
        # each decode thread (and on CUDA each inference thread) warms itself up before intake starts
        self._warm_jpeg: bytes | None = synthetic_jpeg(settings.max_pixels)  # dropped once they have
        self._warmed: list[threading.Event] = []
        self._stages = [
            [self._thread(f"prepare-{i}", self._prepare_loop, self._warm_up_prepare)
             for i in range(settings.decode_workers)],
            # on CUDA only: onnxruntime's CUDA provider sets up each thread's cuBLAS and cuDNN handles at its
            # first run; on the CPU a thread's first run costs what later ones do (docs/performance.md)
            [self._thread(f"infer-{i}", self._infer_loop, self._warm_up_infer if engine.on_gpu else None)
             for i in range(settings.infer_workers)],
            [self._thread("finish", self._finish_loop)],
            # moving inputs waits for the database commit: on its own thread, so finish never waits
            [self._thread("archive", self._archive_loop)] if settings.inputs is not None else [],
        ]
        self._sampler = MemorySampler(settings.memory_sample_s, recorder.put,
                                      lambda: (self.depth(), self.counts.processed), gpu=gpu)
        deadline = time.monotonic() + WARM_UP_WAIT_S  # for all of them together: they warm up side by side
        for warmed in self._warmed:
            warmed.wait(max(0.0, deadline - time.monotonic()))
        self._warm_jpeg = None  # 2.4 MB, not to be kept for the months a watcher runs
        synthetic_jpeg.cache_clear()

    def _thread(self, name: str, target: Callable[[], None],
                warm_up: Callable[[], object] | None = None) -> threading.Thread:
        body = target
        if warm_up is not None:
            warmed = threading.Event()
            self._warmed.append(warmed)

            def body() -> None:
                self._warm_up_thread(warm_up, warmed)
                target()
        t = threading.Thread(target=body, name=name, daemon=True)
        t.start()
        return t

    @staticmethod
    def _warm_up_thread(step: Callable[[], object], warmed: threading.Event) -> None:
        """A new thread's first image pays for what is set up per thread: a decode thread's database
        connection and its first decode and preprocessing (about 1-3 ms more than later images' on
        YOLOv3-tiny at 640 px: `python tests/perf/watch_tail.py`), an inference thread's CUDA
        handles. Each such thread pays it here, before intake starts: the constructor waits for them."""
        try:
            step()
        except Exception as e:  # only a warm-up: real images will say what is wrong, one by one
            log.debug("warm-up of %s: %s", threading.current_thread().name, e)
        finally:
            warmed.set()

    def _warm_up_prepare(self) -> None:
        self._ledger.connect()
        if (jpeg := self._warm_jpeg) is not None:  # None: intake has started without waiting any longer
            self.adapter.preprocess(decode(jpeg, "warm-up", self.settings.max_pixels, self._depth))

    def _warm_up_infer(self) -> None:
        self.engine.warm_up(self.settings.max_batch, self._size_hw)

    # -- the public surface ------------------------------------------------------------------
    def submit(self, job: Job, stop: threading.Event | None = None,
               waiting: Callable[[], object] | None = None) -> bool:
        """Queue a job; blocks while the pipeline is full (intake waits, nothing is dropped).

        Once `stop` is set while nothing moves (the outbox full, the database refusing writes), it
        gives up instead: the job is not taken (False), and stays where it is for the next start.
        `waiting` is called every 0.2 s while it blocks (the watcher's status line and inbox guard)."""
        with self._idle:
            self._pending += 1
        while True:
            try:
                self._jobs.put(job, timeout=None if stop is None and waiting is None else 0.2)
                return True
            except queue.Full:
                if waiting is not None:
                    waiting()
                if stop is not None and stop.is_set() and (self._room.full or self.recorder.down):
                    self._done(job, JobStatus.QUEUED)
                    return False

    def wait_for_room(self, max_pending: int) -> None:
        """Block until fewer than `max_pending` jobs are in flight (steady-load callers: soak, bench)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending < max_pending)

    def recover(self, root: Path) -> set[str]:
        """Submit the images a dead worker left in flight, one at a time, and wait for each.

        Each crash counts an attempt against every image in flight; alone, a file that crashes the
        worker again is the only one charged, so it reaches quarantine without taking its neighbours
        with it. Returns the relative paths it submitted."""
        done: set[str] = set()
        for text in self._ledger.in_flight():
            rel = on_disk(root, text)
            path = root / rel
            if path.is_file() or path.is_symlink():  # a symlink is refused by the claim step, on record
                log.warning("%s was in flight when a worker stopped: processing it on its own first", text)
                self.submit(dataclasses.replace(Job.from_path(root, path), take_over=True))
                self.drain()
                done.add(rel)
        return done

    def depth(self) -> int:
        """Images in the pipeline: submitted and not yet finished (queued, in progress, or waiting for
        room in the outbox). Each memory sample records it: with a count that stops moving, a stall."""
        return self._pending

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Finish the jobs in flight, then stop every thread (sentinels flow stage by stage)."""
        self.abandon_waiting()  # a decode thread waiting for room in the outbox gives up
        queues = [self._jobs, self._prepared, self._inferred, self._to_archive]
        for q, threads in zip(queues, self._stages):
            for _ in threads:
                q.put(_STOP)
            for t in threads:
                t.join()
        self._sampler.stop()
        self._ledger.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- stage 1: read, check, claim, decode, preprocess ------------------------------------
    def _prepare_loop(self) -> None:
        ahead: deque[_Item] = deque()  # claimed, waiting for the claim's commit, then decoding
        stopping = False
        while ahead or not stopping:
            # claim the jobs that are waiting (up to CLAIM_AHEAD, and 64 MiB) before decoding the oldest:
            # their claims then share one transaction; block for a job only when nothing is claimed
            while not stopping and len(ahead) < CLAIM_AHEAD and sum(i.held for i in ahead) < CLAIM_AHEAD_BYTES:
                if self._room.full:
                    if ahead:
                        break  # decode what is claimed first
                    self._room.wait()
                try:
                    job = self._room.next_waiting() or self._jobs.get(block=not ahead)
                except queue.Empty:
                    break
                if job is _WAKE:
                    continue
                if job is not _STOP and self._room.stopped and self._room.full:
                    self._done(job, JobStatus.QUEUED)  # not taken: stopping while the outbox is full
                    continue
                if job is _STOP:
                    stopping = True
                elif (item := self._guarded(_Item(job), self._claim)) is not None:
                    ahead.append(item)
            if ahead:
                if (item := self._guarded(ahead.popleft(), self._decode)) is not None:
                    self._prepared.put(item)
                    if item.book is not None:
                        self._send_pages(item)

    def _guarded(self, item: _Item, step: Callable[[_Item], bool]) -> _Item | None:
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

    def _claim(self, item: _Item) -> bool:
        """Read, hash, check the ledger and claim; False when already done (skipped)."""
        job = item.job
        if self._inputs is not None and self._inputs.stuck(job):
            item.skipped = True  # its outcome is on record; only its move failed (logged once)
            return False
        if job.path.is_symlink():  # never followed: it could point anywhere on the machine
            raise ImageError(job.key, "symbolic link: not followed (copy the file into the folder instead)")
        try:
            # O_NONBLOCK: a named pipe (or device) with an image's name must not block this thread on open;
            # O_NOFOLLOW: a symbolic link put there since the check above is refused too
            fd = os.open(job.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise ImageError(job.key, f"not a regular file ({_file_kind(st.st_mode)}): left unread")
                over = bool(self.settings.max_pixels) and st.st_size > self._bytes_per_pixel * self.settings.max_pixels
                big = over or st.st_size > PAGES_FROM_DISK_BYTES
                pages = tiff_pages(f) if big else 0  # a TIFF of several pages that size is read page by page
                if over and pages < 2:
                    raise ImageTooLarge(job.key, f"{st.st_size} bytes is more than any image within the pixel "
                                                 f"limit takes ({self._bytes_per_pixel} bytes x pipeline.max_pixels)")
                item.identity = (st.st_ino, st.st_size, st.st_mtime_ns)
                stamp = stamp_of(st)
                if stamp is not None and not self.settings.replay and self._done_as_read(job.key, st.st_size, stamp):
                    item.skipped = item.unread = True
                    return False
                if pages > 1:
                    f.seek(0)
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
        known = None if self.settings.replay else self._ledger.check(job.key, item.sha256)
        redo = self.settings.replay
        if known is not None and known.status == JobStatus.DONE.value and not self._same_outbox(known):
            item.earlier_outbox = self._outbox_of(known)  # its outputs are there: done again, into this outbox
            known, redo = None, True
        if known is not None and known.status == JobStatus.DONE.value:
            # done under the other pipeline.pages setting: the same result for a file of one page
            if self._same_model(known) or (self._same_model(known, self._one_page_digests) and item.source is None
                                           and frames(item.data or b"") == 1):
                item.skipped, item.data = True, None
                if stamp is not None:  # read under a new stamp (touched, or done before stamps): note it
                    self.recorder.put(Restamped(job.key, item.sha256, stamp))
                return False
            known, redo = None, True  # done with another model file (retrained) or card settings: processed again
        if known is not None and known.attempts >= self.settings.max_attempts:
            raise ImageError(job.key, f"quarantined after {known.attempts} attempts"
                                      f" (last error: {known.error or 'worker stopped while processing it'})")
        item.committed = Commit()
        self.recorder.put(Claimed(job.key, item.sha256, item.size, item.committed, stamp=stamp,
                                  take_over=job.take_over, redo=redo))
        return True

    def _done_as_read(self, rel: str, size: int, stamp: str) -> bool:
        """Whether this file, unchanged since the read whose content was processed, is done with this
        model's file: then it need not be read (a rerun over a big folder, a restart with inputs kept)."""
        known = self._ledger.check_stamp(rel, size, stamp)
        return known is not None and known.status == JobStatus.DONE.value and self._same_model(known) \
            and self._same_outbox(known)

    def _same_outbox(self, known: Known) -> bool:
        """Whether an image's last processing wrote its outputs into this outbox: done into another one
        (`run DIR --outbox NEW`), it is done again, so that the outbox asked for gets the outputs."""
        return self._outbox_of(known) in (None, self._outbox_recorded)

    def _outbox_of(self, known: Known) -> str | None:
        return None if known.run_id is None else self._ledger.run_outbox(known.run_id)

    def _same_model(self, known: Known, digests: frozenset[str] | None = None) -> bool:
        """Whether an image's last processing used this ONNX file and these card settings (a run recorded
        before card digests counts as these settings: an upgrade alone does not process everything again),
        or settings of `digests`."""
        return known.model_sha256 == self.recorder.model_sha256 and \
            (known.card_sha256 is None or known.card_sha256 in (digests or self._card_digests))

    def _decode(self, item: _Item) -> bool:
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
                image, orig_hw = decode_reduced(data, job.key, self.settings.max_pixels, self._needed, self._depth)
            else:
                image = decode(data, job.key, self.settings.max_pixels, self._depth)
                orig_hw = (image.shape[0], image.shape[1])
            pages = frames(data)
        if pages > 1:
            item.pages = pages
            if self.settings.all_pages:
                item.book = _Book(pages=pages, data=data, expected=pages, source=item.source, rest=item.rest)
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

    def _first_page_from_disk(self, item: _Item) -> np.ndarray:
        """The first page of a multi-page TIFF read page by page; its others follow in item.rest."""
        assert item.source is not None
        item.rest = file_pages(item.source, reopenable(item.source, item.job.path), item.job.key,
                               self.settings.max_pixels, self._depth)
        image = next(item.rest, None)
        if image is None:  # counted two pages or more at its claim: changed since
            raise ImageError(item.job.key, _CHANGED)
        self._unchanged(item.job, item.source, item.identity)
        return image

    @staticmethod
    def _unchanged(job: Job, source: BinaryIO, identity: tuple[int, int, int] | None) -> None:
        """A file read page by page was hashed at its claim: if it has changed since, its pages are not
        that content's (a new content under the name comes as a job of its own)."""
        st = os.fstat(source.fileno())
        if identity is not None and (st.st_size, st.st_mtime_ns) != identity[1:]:
            raise ImageError(job.key, _CHANGED)

    def _send_pages(self, first: _Item) -> None:
        """Decode and preprocess a multi-page file's other pages in order, each into the queue after its
        first (a full queue holds this thread: a file of a thousand pages is never all in memory). After a
        page that fails, the rest are not sent: the file fails naming that page."""
        book = first.book
        assert book is not None and (book.data is not None or book.rest is not None)
        pages = book.rest or later_pages(book.data or b"", first.job.key, self.settings.max_pixels, self._depth)
        try:
            for page in range(1, book.pages):
                part = _Item(first.job, sha256=first.sha256, size=first.size, pages=book.pages, page=page, book=book)
                t0 = time.perf_counter()
                try:
                    image = next(pages, None)
                    if image is None:
                        raise ImageError(first.job.key, "not in the file (it ended early)")
                    if book.source is not None:
                        self._unchanged(first.job, book.source, first.identity)
                    t1 = time.perf_counter()
                    part.tensor, part.geometry = self.adapter.preprocess(image)
                    if self.settings.keep_image:
                        part.image = image
                    part.timings.update(decode_ms=(t1 - t0) * 1000, preprocess_ms=(time.perf_counter() - t1) * 1000)
                except Exception as e:
                    if not isinstance(e, ImageError):
                        log.exception("prepare %s, page %d", first.job.key, page + 1)
                    part.error = e.reason if isinstance(e, ImageError) else f"{type(e).__name__}: {e}"
                    book.expected = page + 1  # before the item is queued: the finish thread counts up to it
                    self._inferred.put(part)
                    return
                self._prepared.put(part)
        finally:
            pages.close()
            if book.source is not None:
                book.source.close()
            book.data, book.rest, book.source = None, None, None

    # -- stage 2: micro-batch and run the one shared session --------------------------------
    def _infer_loop(self) -> None:
        s = self.settings
        buf = np.empty((s.max_batch, self._channels, *self._size_hw), dtype=np.float32)  # reused every batch
        batcher: Batcher[_Item] = Batcher(self._prepared, s.max_batch, s.max_delay_ms / 1000, _STOP)
        stopping = False
        while not stopping:
            batch, stopping = batcher.next_batch()
            if batch:
                self._infer(batch, buf)

    def _infer(self, batch: list[_Item], buf: np.ndarray) -> None:
        n = len(batch)
        if n == 1 and batch[0].tensor is not None:  # a batch of one runs on its own tensor: no copy
            x = batch[0].tensor[None]
        else:
            for i, item in enumerate(batch):
                buf[i] = item.tensor
            x = buf[:n]
        for item in batch:
            item.tensor = None  # release the per-image input early
        t0 = time.perf_counter()
        try:
            out = self.engine.run(x)
        except Exception as e:
            log.exception("inference failed for a batch of %d", n)
            for item in batch:
                item.error = f"inference failed: {e}"
        else:
            ms = (time.perf_counter() - t0) * 1000
            for i, item in enumerate(batch):
                item.output = out[i]
                item.batch_size = n
                item.timings["infer_ms"] = ms
        for item in batch:
            self._inferred.put(item)

    # -- stage 3: postprocess, write, record ------------------------------------------------
    def _finish_loop(self) -> None:
        while (item := self._inferred.get()) is not _STOP:
            if item.book is not None and (item := self._bind(item)) is None:
                continue  # a page of a file whose other pages are still on their way
            if item.taken:  # nothing recorded, nothing archived: the other worker does both
                self.counts.taken += 1
                self._done(item.job, JobStatus.PROCESSING)
                continue
            try:
                status, committed = self._finish(item)
            except Exception:
                log.exception("finish %s", item.job.key)
                status, committed = JobStatus.FAILED, None
            if status is JobStatus.QUEUED:
                continue  # waits for room in the outbox: still pending, its input where it is
            if self.settings.inputs is None:
                self._done(item.job, status)
            else:
                self._to_archive.put((item.job, status, committed, item.identity))

    def _bind(self, item: _Item) -> _Item | None:
        """Take one page of a multi-page file: postprocess it and write its outputs (the first page's wait
        for the file's JSON). Returns the file's first item once every expected page has come, else None."""
        book = item.book
        assert book is not None
        if item.page == 0:
            book.first = item
        if item.error is None and item.output is not None and item.geometry is not None and book.error is None:
            try:
                self._page_done(item, book)
            except OutboxFull as e:
                book.full = e
            except Exception as e:
                if not isinstance(e, OSError):
                    log.exception("postprocess/write %s, page %d", item.job.key, item.page + 1)
                item.error = (f"cannot write its outputs under {self.outbox.root}: {e.strerror or e}"
                              if isinstance(e, OSError) else f"{type(e).__name__}: {e}")
        if item.error is not None and (book.error is None or item.page < book.error_page):
            book.error, book.error_page = item.error, item.page
        item.output = None
        if item.page:
            item.image = None  # the first page's is drawn on with the file's JSON
        book.arrived += 1
        if book.arrived < book.expected:
            return None
        first = book.first
        assert first is not None
        if book.error is not None and first.error is None:
            first.error = book.error if book.error_page == 0 else \
                f"page {book.error_page + 1} of {book.pages}: {book.error}"
        return first

    def _page_done(self, item: _Item, book: _Book) -> None:
        """Postprocess one page; write its outputs now unless it is the first (written with the JSON)."""
        t0 = time.perf_counter()
        result = self.adapter.postprocess(item.output, item.geometry)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        h, w = item.geometry.orig_hw  # type: ignore[union-attr]
        entry: dict[str, Any] = {"page": item.page + 1, "image": {"width": w, "height": h}, **result.summary()}
        if item.page == 0:
            book.first_result = result
            item.timings["postprocess_ms"] = (t1 - t0) * 1000
        else:
            entry.update(self.outbox.write_page(item.job.rel, item.page, result, item.image).named())
            for k in ("decode_ms", "preprocess_ms", "infer_ms"):
                book.timings[k] = book.timings.get(k, 0.0) + item.timings.get(k, 0.0)
            book.timings["postprocess_ms"] = book.timings.get("postprocess_ms", 0.0) + (t1 - t0) * 1000
            book.timings["write_ms"] = book.timings.get("write_ms", 0.0) + (time.perf_counter() - t1) * 1000
        book.entries[item.page] = entry
        book.score = max(book.score, top_score(result))
        for cid, name, score in labels_of(result):
            if cid not in book.labels or score > book.labels[cid][2]:
                book.labels[cid] = (cid, name, score)

    def _done(self, job: Job, status: JobStatus) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()
        if self.on_finished is not None:
            self.on_finished(job, status)

    def _finish(self, item: _Item) -> tuple[JobStatus, Commit | None]:
        """Returns the outcome and, in watch mode, the event set once the recorder has committed it."""
        job = item.job
        if item.skipped:
            self.counts.skipped += 1
            self.counts.unread += item.unread
            return JobStatus.DONE, None
        event: Finished
        t0 = time.perf_counter()
        if item.error is None and (item.book is not None or (item.output is not None and item.geometry is not None)):
            try:
                event = self._succeed(item, t0) if item.book is None else self._succeed_pages(item, item.book)
            except OutboxFull as e:
                self._defer(item, e)
                return JobStatus.QUEUED, None
            except OSError as e:  # the outbox's disk, not the image (disk full, read-only): no traceback
                item.error = f"cannot write its outputs under {self.outbox.root}: {e.strerror or e}"
            except Exception as e:
                log.exception("postprocess/write %s", job.key)
                item.error = f"{type(e).__name__}: {e}"
        if item.error is not None:
            log.warning("failed: %s: %s", job.key, item.error)
            self._write_error(item)
            event = Finished(job.key, item.sha256, item.size, JobStatus.FAILED, error=item.error,
                             timings=self._timings(item), committed=self._committed())
        self.recorder.put(event)
        status = event.status
        if status is JobStatus.DONE:
            self.counts.done += 1
            if item.earlier_outbox is not None:
                self.counts.earlier_outboxes[item.earlier_outbox] += 1
            self.counts.pages += item.book.pages if item.book is not None else 1
            self.counts.latencies_ms.add(event.timings["total_ms"] if event.timings else 0.0)
        else:
            self.counts.failed += 1
        return status, event.committed

    def _head(self, item: _Item, status: JobStatus) -> dict[str, Any]:
        """The keys every outbox JSON starts with, result or error file (docs/outputs.md)."""
        return {"input": item.job.key, "sha256": item.sha256 or None, "model": self.card.name,
                "task": self.card.task, "status": status.value}

    def _write_error(self, item: _Item) -> None:
        """The outbox's word on a failed image, for whoever collects results from it (not the database's)."""
        document = {**self._head(item, JobStatus.FAILED), "error": item.error}
        try:
            self.outbox.write_error(item.job.rel, document, item.pages)
        except (OSError, WorkerError) as e:  # a full or read-only outbox: the failure is on record all the same
            log.debug("no error file for %s: %s", item.job.key, e)

    def _succeed(self, item: _Item, t0: float) -> Finished:
        job = item.job
        result = self.adapter.postprocess(item.output, item.geometry)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        h, w = item.geometry.orig_hw  # type: ignore[union-attr]
        item.timings["postprocess_ms"] = (t1 - t0) * 1000
        image = {"width": w, "height": h, **({"pages": item.pages} if item.pages > 1 else {})}
        document = {**self._head(item, JobStatus.DONE), "image": image, **result.summary(),
                    # up to the write (which is timed, with the total, in the database)
                    "timings_ms": {k[:-3]: round(item.timings.get(k, 0.0), 3) for k in _JSON_TIMINGS}}
        json_path, outputs = self.outbox.write(job.rel, result, document, item.image, item.pages)
        item.image = None
        t2 = time.perf_counter()
        item.timings["write_ms"] = (t2 - t1) * 1000
        if outputs.overlay is not None:  # recorded with the result, as the JSON names it
            document = {**document, "overlay": outputs.overlay}
        return Finished(job.key, item.sha256, item.size, JobStatus.DONE, task=self.card.task,
                        score=top_score(result), payload=document, json_path=json_path, mask_path=outputs.mask,
                        labels=tuple(labels_of(result)), timings=self._timings(item),
                        committed=self._committed())

    def _succeed_pages(self, item: _Item, book: _Book) -> Finished:
        """A multi-page file whose pages are all postprocessed and but the first written: the first page's
        outputs, then the JSON listing every page."""
        if book.full is not None:
            raise book.full
        assert book.first_result is not None and item.geometry is not None
        job = item.job
        t0 = time.perf_counter()
        first = self.outbox.write_page(job.rel, 0, book.first_result, item.image)
        book.entries[0].update(first.named())
        item.image = None
        for k, v in book.timings.items():
            item.timings[k] = item.timings.get(k, 0.0) + v
        h, w = item.geometry.orig_hw
        document = {**self._head(item, JobStatus.DONE), "image": {"width": w, "height": h, "pages": book.pages},
                    "pages": [book.entries[k] for k in sorted(book.entries)],
                    "timings_ms": {k[:-3]: round(item.timings.get(k, 0.0), 3) for k in _JSON_TIMINGS}}
        json_path = self.outbox.write_document(job.rel, document, book.pages)
        item.timings["write_ms"] = item.timings.get("write_ms", 0.0) + (time.perf_counter() - t0) * 1000
        return Finished(job.key, item.sha256, item.size, JobStatus.DONE, task=self.card.task, score=book.score,
                        payload=document, json_path=json_path, mask_path=first.mask, labels=tuple(book.labels.values()),
                        timings=self._timings(item), committed=self._committed())

    def _defer(self, item: _Item, reason: OutboxFull) -> None:
        """The outbox's disk is full: no fault of the image's. It is recorded as queued (the attempt not
        counted), its input stays where it is, and it waits with intake paused until there is room."""
        job = item.job
        self.recorder.put(Finished(job.key, item.sha256, item.size, JobStatus.QUEUED,
                                   error=f"waiting for room in the outbox ({reason})", undo_attempt=True))
        self._room.defer(job, reason)
        for _ in range(self.settings.decode_workers):  # a decode thread blocked on an empty queue
            try:
                self._jobs.put_nowait(_WAKE)
            except queue.Full:
                break

    def abandon_waiting(self) -> int:
        """Stop waiting for room in the outbox (shutdown): the images deferred so far stay queued in the
        database, their inputs where they are, for the next start. Returns how many."""
        waiting = self._room.stop_waiting()
        for job in waiting:
            self._done(job, JobStatus.QUEUED)
        return len(waiting)

    def finish_or_abandon(self, stop: threading.Event | None) -> None:
        """`drain()`, but once `stop` is set, images waiting for room in the outbox, or for a database
        that refuses writes, are not waited for."""
        while not self.drain(timeout=0.2):
            if stop is not None and stop.is_set():
                self.abandon_waiting()  # no more waiting for room: what waits stays for the next start
                self.recorder.abandon()

    def _timings(self, item: _Item) -> dict[str, float] | None:
        if item.sha256 == "":
            return None  # never read: nothing to time
        t = item.timings
        keys = ("queue_wait_ms", "decode_ms", "preprocess_ms", "infer_ms", "postprocess_ms", "write_ms")
        out: dict[str, float] = {k: round(t.get(k, 0.0), 3) for k in keys}
        out["total_ms"] = round((time.perf_counter() - item.job.enqueued_at) * 1000, 3)
        out["batch_size"] = item.batch_size
        return out

    def _committed(self) -> Commit | None:
        return Commit() if self.settings.inputs is not None else None

    # -- stage 4 (watch mode, or run with inputs: move|delete): move, delete or keep each input ---
    def _archive_loop(self) -> None:
        inputs = self._inputs
        assert inputs is not None  # the thread runs only with settings.inputs
        while (entry := self._to_archive.get()) is not _STOP:
            job, status, committed, identity = entry
            # only once its row is durable: a crash before never loses the image; an outcome the
            # database refused leaves the input in the inbox, where the next rescan offers it again
            if committed is not None and not committed.wait():
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


_JSON_TIMINGS = ("queue_wait_ms", "decode_ms", "preprocess_ms", "infer_ms", "postprocess_ms")


@functools.lru_cache(maxsize=1)
def synthetic_jpeg(max_pixels: int) -> bytes:
    """A photo-sized (1920x1080, or less within `max_pixels`) JPEG of noise, for warm-ups. Encoding it
    takes about 50 ms: made once per start (warm_up_stages, then the Pipeline's threads), and let go
    by the Pipeline once its threads have warmed up."""
    scale = min(1.0, (max_pixels / (1920 * 1080)) ** 0.5) if max_pixels else 1.0
    h, w = max(1, int(1080 * scale)), max(1, int(1920 * scale))
    image = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return cv2.imencode(".jpg", image)[1].tobytes()


def warm_up_stages(adapter: TaskAdapter, engine: Engine, max_pixels: int, depth: int = 8) -> None:
    """Decode, preprocess, infer and postprocess one synthetic photo-sized JPEG before intake starts.

    The first calls into OpenCV's codecs and resizers and into numpy's kernels cost tens of
    milliseconds (more on big images); without this the first real image would pay them."""
    try:
        x, geometry = adapter.preprocess(decode(synthetic_jpeg(max_pixels), "warm-up", max_pixels, depth))
        output = engine.run(x[None])[0]
    except Exception as e:  # only a warm-up: real images will say what is wrong, one by one
        log.warning("warm-up of the image stages failed: %s", e)
        return
    # a card that contradicts its model (a labels file for another model, a multi-class segmenter)
    # stops the worker here, instead of failing or mislabelling every image
    adapter.check_output(output, engine.other_outputs)
    try:
        adapter.postprocess(output, geometry)
    except Exception as e:
        log.warning("warm-up of the image stages failed: %s", e)


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
    return next((name for test, name in kinds if test(mode)), "not a plain file")


def summarize(counts: Counts, seconds: float) -> dict[str, Any]:
    return {"images": counts.processed + counts.skipped + counts.taken, "done": counts.done, "failed": counts.failed,
            "skipped": counts.skipped, "skipped_unread": counts.unread, "taken": counts.taken, "pages": counts.pages,
            "earlier_outboxes": dict(counts.earlier_outboxes.most_common()),
            "seconds": round(seconds, 3),
            "images_per_s": round(counts.processed / seconds, 2) if seconds > 0 else 0.0,
            **{k: round(v, 1) for k, v in percentiles(counts.latencies_ms.last()).items()}}
