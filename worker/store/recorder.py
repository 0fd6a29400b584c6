"""The only writer to the database: one thread, batched transactions.

Stages hand it frozen events; it writes them in order. An event can carry a `committed` flag that
is set once its transaction is durable, for the callers that must not act before (the archive move).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Union

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.orm import Session

from worker import __version__
from worker.jobs import JobStatus
from worker.store.schema import ImageRow, LabelRow, MemorySample, ResultRow, Run, TimingRow, utcnow

log = logging.getLogger(__name__)
MAX_BATCH = 256  # events per transaction


@dataclass(frozen=True)
class RunInfo:
    mode: str
    root: str
    model: str
    model_sha256: str
    providers: str
    config: dict[str, Any] = field(hash=False)


@dataclass(frozen=True, eq=False)
class Claimed:
    """An image is about to be processed: status processing, attempts + 1."""

    rel: str
    sha256: str
    size: int


@dataclass(frozen=True, eq=False)
class Finished:
    """An image ended done or failed, with its result rows and timings."""

    rel: str
    sha256: str
    size: int
    status: JobStatus
    error: str | None = None
    task: str | None = None
    score: float = 0.0
    payload: dict[str, Any] | None = None
    json_path: str | None = None
    mask_path: str | None = None
    labels: tuple[tuple[int, str, float], ...] = ()
    timings: dict[str, float] | None = None
    committed: threading.Event | None = None


@dataclass(frozen=True, eq=False)
class Sample:
    rss_bytes: int
    fds: int
    threads: int
    queue_depth: int
    images_done: int
    gpu_bytes: int | None
    at: datetime = field(default_factory=utcnow)


Event = Union[Claimed, Finished, Sample]
_STOP = object()


class Recorder:
    """Creates the run row, then writes events on its own thread until `close()`."""

    def __init__(self, engine: Engine, info: RunInfo) -> None:
        self.engine = engine
        self.model = info.model
        with Session(engine) as s, s.begin():
            run = Run(mode=info.mode, host=socket.gethostname(), pid=os.getpid(), root=info.root,
                      model=info.model, model_sha256=info.model_sha256, providers=info.providers,
                      config=info.config, version=__version__)
            s.add(run)
            s.flush()
            self.run_id: int = run.id
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="recorder", daemon=True)
        self._thread.start()

    def put(self, event: Event) -> None:
        self._queue.put(event)

    def depth(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        """Write everything queued, stamp the run's end, stop the thread."""
        self._queue.put(_STOP)
        self._thread.join()
        with Session(self.engine) as s, s.begin():
            s.execute(update(Run).where(Run.id == self.run_id).values(finished_at=utcnow()))

    def _loop(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if batch[-1] is _STOP or _STOP in batch:
                stop = True
                batch = [e for e in batch if e is not _STOP]
            try:
                self._write(batch)
            except Exception:  # one bad batch must not stop the recorder: retry events one by one
                log.exception("recorder: batch of %d failed, retrying one by one", len(batch))
                for e in batch:
                    try:
                        self._write([e])
                    except Exception:
                        log.exception("recorder: dropped event %r", e)
            for e in batch:
                if isinstance(e, Finished) and e.committed is not None:
                    e.committed.set()

    def _write(self, batch: list[Event]) -> None:
        with Session(self.engine) as s, s.begin():
            for e in batch:
                if isinstance(e, Sample):
                    s.add(MemorySample(run_id=self.run_id, at=e.at, rss_bytes=e.rss_bytes, fds=e.fds,
                                       threads=e.threads, queue_depth=e.queue_depth,
                                       images_done=e.images_done, gpu_bytes=e.gpu_bytes))
                elif isinstance(e, Claimed):
                    row = self._image(s, e.rel, e.sha256, e.size)
                    row.status = JobStatus.PROCESSING.value
                    row.attempts += 1
                    row.error = None
                    row.updated_at = utcnow()
                else:
                    self._finish(s, e)

    def _image(self, s: Session, rel: str, sha256: str, size: int) -> ImageRow:
        row = s.scalars(select(ImageRow).where(ImageRow.rel_path == rel, ImageRow.sha256 == sha256,
                                               ImageRow.model == self.model)).first()
        if row is None:
            row = ImageRow(run_id=self.run_id, rel_path=rel, sha256=sha256, model=self.model, size=size,
                           status=JobStatus.QUEUED.value, attempts=0)
            s.add(row)
            s.flush()
        row.run_id = self.run_id
        return row

    def _finish(self, s: Session, e: Finished) -> None:
        row = self._image(s, e.rel, e.sha256, e.size)
        if row.attempts == 0:  # failed before it could be claimed (unreadable, gone): still one attempt
            row.attempts = 1
        row.status = e.status.value
        row.error = e.error
        row.updated_at = utcnow()
        # a retried image replaces its earlier result rows: never two results for one image
        for table in (ResultRow, LabelRow, TimingRow):
            s.execute(delete(table).where(table.image_id == row.id))
        if e.status is JobStatus.DONE and e.task is not None:
            s.add(ResultRow(image_id=row.id, task=e.task, score=e.score, payload=e.payload or {},
                            json_path=e.json_path, mask_path=e.mask_path))
            s.add_all([LabelRow(image_id=row.id, class_id=c, name=n, score=sc) for c, n, sc in e.labels])
        if e.timings is not None:
            s.add(TimingRow(image_id=row.id, run_id=self.run_id, **e.timings))
