"""A prepare process: the whole pipeline but the session (read, hash, claim, decode, preprocess; then
postprocess, outputs and database rows), its batches run by the inference process that started it.

    python -m worker.pipeline.shards CONTROL_FD INFER_FD TENSORS_FD

It takes its orders on the control connection (a `ShardSpec` first, then jobs, `give_back`, `abandon`
and `close`) and answers there: `ready`, then the finished jobs in small groups with its counts, and
`closed` with its final counts. It ends at once when the inference process goes away (its
connections close), and ignores the signals that stop a worker: the inference process decides when
it stops."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from worker.config import Config
from worker.intake.jobs import Job, JobStatus
from worker.measure.prometheus import TimingsRelay
from worker.models.card import ModelCard
from worker.outputs.outbox import Outbox
from worker.pipeline import Pipeline
from worker.pipeline.items import Counts, Settings
from worker.pipeline.shards.tensors import EXIT_PARENT_GONE, RemoteEngine, SharedTensors
from worker.store.db import database
from worker.store.events import RunInfo
from worker.store.recorder import Recorder
from worker.tasks import adapter_for

log = logging.getLogger("worker.pipeline")

NOTICE_S = 0.02  # finished jobs are told in groups gathered this long


@dataclass(frozen=True)
class ShardSpec:
    """What a prepare process needs to build its part of the pipeline, sent once at its start."""

    index: int
    count: int  # regions in the shared tensors
    shape: tuple[int, int, int, int]
    cfg: Config
    card: ModelCard
    settings: Settings
    info: RunInfo
    run_id: int
    providers: tuple[str, ...]
    log_level: int
    relay_timings: bool = False  # Prometheus's histograms are wanted: send each image's timings with the notices


@dataclass(frozen=True)
class Snapshot:
    """A prepare process's counts and state as of its last notice (its latencies come with `closed`)."""

    done: int = 0
    failed: int = 0
    skipped: int = 0
    unread: int = 0
    pages: int = 0
    taken: int = 0
    given_back: int = 0
    outbox_full: bool = False
    db_down: bool = False

    @classmethod
    def of(cls, c: Counts, outbox_full: bool = False, db_down: bool = False) -> "Snapshot":
        return cls(c.done, c.failed, c.skipped, c.unread, c.pages, c.taken, c.given_back, outbox_full, db_down)


class Notices:
    """Gathers (sequence number, status) of finished jobs and sends them every NOTICE_S with the counts (and,
    for Prometheus, the images' stage timings)."""

    def __init__(self, conn: Connection, lock: threading.Lock, pipeline: Pipeline,
                 timings: TimingsRelay | None) -> None:
        self._conn, self._lock, self._pipeline, self._timings = conn, lock, pipeline, timings
        self._finished: deque[tuple[int, str]] = deque()  # appended by the finish thread, taken by this one
        self._last: Snapshot | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="notices", daemon=True)
        self._thread.start()

    def add(self, seq: int, status: JobStatus) -> None:
        self._finished.append((seq, status.value))

    def _loop(self) -> None:
        while not self._stop.wait(NOTICE_S):
            self.flush()

    def flush(self) -> None:
        finished = [self._finished.popleft() for _ in range(len(self._finished))]
        timings = self._timings.take() if self._timings is not None else []
        p = self._pipeline
        snap = Snapshot.of(p.counts, p.outbox_full, p.recorder.down)
        if finished or timings or snap != self._last:
            with self._lock:
                self._conn.send(("finished", finished, snap, timings))
            self._last = snap

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.flush()


def parent_gone() -> NoReturn:
    """The inference process is gone (killed, crashed): end at once, as a crash of the whole worker would.
    Its images in flight stay claimed, for the next start to recover; none is recorded as failed for it."""
    os._exit(EXIT_PARENT_GONE)


def run(control: Connection, infer: socket.socket, tensors_fd: int) -> None:
    """Build this process's part of the pipeline from the spec sent first, then take orders until `close`."""
    spec: ShardSpec = control.recv()
    logging.getLogger().setLevel(spec.log_level)
    tensors = SharedTensors(tensors_fd, spec.count, spec.shape)
    engine = RemoteEngine(tensors, spec.index, infer, spec.providers)
    lock = threading.Lock()
    seqs: dict[int, int] = {}  # id(job) -> its sequence number, while in flight
    notices: Notices | None = None

    def finished(job: Job, status: JobStatus) -> None:
        if notices is not None and (seq := seqs.pop(id(job), None)) is not None:
            notices.add(seq, status)

    cfg = spec.cfg
    timings = TimingsRelay() if spec.relay_timings else None
    with database(cfg.db) as db:
        recorder = Recorder(db, spec.info, run_id=spec.run_id)
        try:
            o = cfg.outputs
            outbox = Outbox(cfg.outbox, o.json, o.masks, o.yolo_txt, o.overlays, o.errors, pages=spec.settings.all_pages)
            with Pipeline(card=spec.card, engine=engine, adapter=adapter_for(spec.card),  # type: ignore[arg-type]
                          recorder=recorder, outbox=outbox, db=db, settings=spec.settings,
                          on_finished=finished, metrics=timings) as pipeline:
                notices = Notices(control, lock, pipeline, timings)
                with lock:
                    control.send(("ready",))
                _take_orders(control, lock, pipeline, recorder, seqs)
                notices.stop()
            counts = pipeline.counts
        finally:
            recorder.close()
    with lock:
        control.send(("closed", counts))


def _take_orders(control: Connection, lock: threading.Lock, pipeline: Pipeline, recorder: Recorder,
                 seqs: dict[int, int]) -> None:
    while True:
        try:
            order: Any = control.recv()
        except (EOFError, OSError):
            parent_gone()
        if order[0] == "jobs":
            for seq, values in order[1]:
                job = Job.from_tuple(values)
                seqs[id(job)] = seq
                pipeline.submit(job)  # never blocks long: the inference process sends no more than the queue holds
        elif order[0] == "give_back":  # the run was stopped
            pipeline.give_back()
        elif order[0] == "abandon":
            pipeline.abandon_waiting()
            recorder.abandon()
        elif order[0] == "report":  # its latencies, for the run's summary
            with lock:
                control.send(("report", pipeline.counts))
        elif order[0] == "close":
            return


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("alembic").setLevel(logging.WARNING)
    control_fd, infer_fd, tensors_fd = (int(a) for a in argv)
    run(Connection(control_fd), socket.socket(fileno=infer_fd), tensors_fd)

