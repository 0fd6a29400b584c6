"""What the stages share, owned by the assembler (`Pipeline.__init__` sets every field): the queues
between them, the pipeline's collaborators, and the calls one stage makes into another."""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from worker.fleet.leases import Leases
    from worker.measure.prometheus import StageObserver
    from worker.pipeline.archive import InputArchive
    from worker.runtime.engine import Engine
    from worker.intake.jobs import Job, JobStatus
    from worker.models.card import ModelCard
    from worker.outputs.outbox import Outbox
    from worker.pipeline.pause import FullOutboxPause
    from worker.pipeline.items import Counts, Item, PageSet, Settings
    from worker.store.ledger import Ledger
    from worker.store.events import Commit, Finished
    from worker.store.recorder import Recorder
    from worker.tasks import TaskAdapter


class StageState:
    card: ModelCard
    engine: Engine
    adapter: TaskAdapter
    recorder: Recorder
    outbox: Outbox
    settings: Settings
    on_finished: Callable[[Job, JobStatus], None] | None
    counts: Counts
    leases: Leases | None  # fleet mode: this worker's claims, asked before a claimed file's outputs are written
    metrics: StageObserver | None  # Prometheus's stage histograms (metrics.port)
    _jobs: queue.Queue[Any]  # submit -> prepare
    _prepared: queue.Queue[Any]  # prepare -> infer
    _inferred: queue.Queue[Any]  # infer (and failures of prepare) -> finish
    _to_archive: queue.Queue[Any]  # finish -> archive
    _ledger: Ledger
    _inputs: InputArchive | None
    _pending: int
    _idle: threading.Condition
    _giving_back: threading.Event  # the run was stopped: what has not reached inference is given back
    _outbox_pause: FullOutboxPause
    _size_hw: tuple[int, int]
    _channels: int
    _depth: int
    _bytes_per_pixel: int
    _needed: Callable[[tuple[int, int]], tuple[int, int]]  # the decoded size the preprocessing needs

    # one stage's calls into another (the assembler's class has them all)
    def _done(self, job: Job, status: JobStatus) -> None:
        raise NotImplementedError

    def _finish(self, item: Item) -> tuple[JobStatus, Commit | None]:
        raise NotImplementedError

    def _give_back(self, item: Item) -> None:
        raise NotImplementedError

    def _send_pages(self, first: Item) -> None:
        raise NotImplementedError

    def _gather_page(self, item: Item) -> Item | None:
        raise NotImplementedError

    def _page_done(self, item: Item, book: PageSet) -> None:
        raise NotImplementedError

    def _succeed_pages(self, item: Item, book: PageSet) -> Finished:
        raise NotImplementedError

    def _write_error(self, item: Item) -> None:
        raise NotImplementedError

    def _document_head(self, item: Item, status: JobStatus) -> dict[str, Any]:
        raise NotImplementedError

    def _timings(self, item: Item) -> dict[str, float] | None:
        raise NotImplementedError

    def _committed(self) -> Commit | None:
        raise NotImplementedError

    def _defer(self, item: Item, reason: Any) -> None:
        raise NotImplementedError

    def _guarded(self, item: Item, step: Callable[[Item], bool]) -> Item | None:
        raise NotImplementedError

    def _decode(self, item: Item) -> bool:
        raise NotImplementedError
