"""The stages, wired by bounded queues:

    submit(job) -> [jobs] -> prepare x N -> [prepared] -> batch + infer x M -> [inferred] -> finish x 1
                                                   (watch; run with inputs: move|delete) -> [archive] -> archive x 1

prepare: read, hash, skip/quarantine check, claim, decode, preprocess.
infer:   micro-batch up to max_batch or max_delay_ms, one shared session.
finish:  postprocess, outbox write, hand the outcome to the recorder.
archive: wait until the outcome is committed, then move, delete or keep the input, as configured
         (worker/pipeline/archive.py owns those moves).
A full queue makes the stage before it wait, never drop; a full outbox disk pauses intake, the images
that found no room waiting for it (worker/pipeline/pause.py). Every per-image error becomes a failed
result that flows on to the recorder. `close()` pushes sentinels through so jobs in flight finish.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import Engine as DbEngine

from worker.fleet.leases import Leases
from worker.pipeline.archive import InputArchive
from worker.runtime.engine import Engine
from worker.runtime.gpu import GpuMemory
from worker.images import decode
from worker.intake.jobs import Job, JobStatus
from worker.host.memory import MemorySampler
from worker.measure.prometheus import StageObserver
from worker.models.card import ModelCard, accepted_digests
from worker.host.names import as_text, on_disk
from worker.outputs.outbox import Outbox
from worker.pipeline.pause import FullOutboxPause
from worker.store.ledger import Ledger, WhatDone
from worker.store.events import Sample
from worker.store.recorder import Recorder
from worker.store.shared import SharedConnection
from worker.tasks import TaskAdapter
from worker.tasks.preprocess import needed_size
from worker.pipeline.archive import ArchiveStage
from worker.pipeline.finish import FinishStage
from worker.pipeline.infer import InferStage
from worker.pipeline.items import STOP, Counts, Settings, summarize
from worker.pipeline.pages import PagesStage
from worker.pipeline.prepare import MAX_BYTES_PER_PIXEL, PrepareStage
from worker.pipeline.warmup import WARM_UP_WAIT_S, synthetic_jpeg, warm_up_stages

__all__ = ["Counts", "Pipeline", "Settings", "recover_in_flight", "summarize", "warm_up_stages"]

log = logging.getLogger(__name__)


def recover_in_flight(ledger: Ledger, root: Path, submit: Callable[[Job], object],
                      drain: Callable[[], object], stop: threading.Event | None = None) -> set[str]:
    """Submit the images a dead worker left in flight, one at a time, and wait for each.

    Each crash counts an attempt against every image in flight; alone, a file that crashes the
    worker again is the only one charged, so it reaches quarantine without taking its neighbours
    with it. Returns the relative paths it submitted."""
    done: set[str] = set()
    left = [(text, on_disk(root, text)) for text in ledger.in_flight()]
    left = [(text, rel) for text, rel in left if (root / rel).is_file() or (root / rel).is_symlink()]
    if left:  # a symlink is refused by the claim step, on record
        names = ", ".join(text for text, _ in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        log.warning("%d image(s) were in flight when a worker was killed: processing each on its own first (%s)",
                    len(left), names)
    for text, rel in left:
        if stop is not None and stop.is_set():  # stopped meanwhile: the rest stay in flight for the next start
            break
        log.debug("%s: in flight when a worker was killed: processing it on its own", text)
        submit(dataclasses.replace(Job.from_path(root, root / rel), take_over=True))
        drain()
        done.add(rel)
    return done


def _ignore(_sample: object) -> None:
    """A memory sample not recorded: the sampler still gives malloc's free pages back before each."""


class Pipeline(PrepareStage, InferStage, FinishStage, PagesStage, ArchiveStage):
    """Starts its threads on construction; use as a context manager or call close()."""

    def __init__(self, *, card: ModelCard, engine: Engine, adapter: TaskAdapter, recorder: Recorder,
                 outbox: Outbox, db: DbEngine, settings: Settings,
                 on_finished: Callable[[Job, JobStatus], None] | None = None,
                 leases: Leases | None = None, shared: SharedConnection | None = None,
                 metrics: StageObserver | None = None) -> None:
        """Fleet mode: `leases` fences each claimed file's outputs; `shared`, the connection its skip checks use.
        `metrics`: Prometheus's stage histograms, observed as each image finishes."""
        self.card, self.engine, self.adapter = card, engine, adapter
        self.leases, self.metrics = leases, metrics
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
        # what counts as done (the one-page digests: a file of one page, whatever pipeline.pages says)
        done = WhatDone(recorder.model_sha256, accepted_digests(card, settings.all_pages),
                        accepted_digests(card, False) | accepted_digests(card, True), as_text(str(outbox.root)))
        self._ledger = Ledger(db, card.name, recorder.root, done, shared)
        # moves, deletes or keeps each input once its outcome is committed (None: run leaves inputs alone)
        self._inputs = InputArchive(settings.inputs, settings.archive, settings.remember_kept,
                                    settings.empty_folders_s) \
            if settings.inputs is not None else None
        self._pending = 0
        self._idle = threading.Condition()
        self._giving_back = threading.Event()
        # the outbox's disk is full: intake pauses, and the images that could not be written wait
        # there (still pending) until there is room again; see _defer
        self._outbox_pause = FullOutboxPause(outbox.has_room, outbox.root)
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
        self._sampler = MemorySampler(settings.memory_sample_s, recorder.put if settings.record_memory else _ignore,
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
                if stop is not None and stop.is_set() and (self._outbox_pause.full or self.recorder.down):
                    self._done(job, JobStatus.QUEUED)
                    return False

    def wait_for_room(self, max_pending: int) -> None:
        """Block until fewer than `max_pending` jobs are in flight (steady-load callers: soak, bench)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending < max_pending)

    def recover(self, root: Path, stop: threading.Event | None = None) -> set[str]:
        """The images a dead worker left in flight, one at a time (`recover_in_flight`), until `stop`."""
        return recover_in_flight(self._ledger, root, self.submit, self.drain, stop)

    @property
    def outbox_full(self) -> bool:
        """Intake is paused: the outbox's disk is full."""
        return self._outbox_pause.full

    def last_sample(self) -> Sample | None:
        """The memory sampler's latest sample (RSS, GPU memory): what the Prometheus gauges show."""
        return self._sampler.last

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
                q.put(STOP)
            for t in threads:
                t.join()
        self._sampler.stop()
        self._ledger.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def abandon_waiting(self) -> int:
        """Stop waiting for room in the outbox (shutdown): the images deferred so far stay queued in the
        database, their inputs where they are, for the next start. Returns how many."""
        waiting = self._outbox_pause.stop_waiting()
        for job in waiting:
            self._done(job, JobStatus.QUEUED)
        return len(waiting)

    def give_back(self) -> None:
        """Stop taking work on (the run was stopped): the images that have not reached inference are given
        back, queued again with no attempt counted; those past it finish."""
        self._giving_back.set()

    def finish_or_abandon(self, stop: threading.Event | None) -> None:
        """`drain()`, but once `stop` is set, only what inference has started is finished (`give_back`), and
        images waiting for room in the outbox, or for a database that refuses writes, are not waited for."""
        if stop is not None and stop.is_set():
            self.give_back()
        while not self.drain(timeout=0.2):
            if stop is not None and stop.is_set():
                self.give_back()
                self.abandon_waiting()  # no more waiting for room: what waits stays for the next start
                self.recorder.abandon()
