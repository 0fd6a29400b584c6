"""`worker db prune`: forget what is older than a date, so months of running keep the database bounded.

Each done or failed image costs about 2 KB of database (its row, result, labels and timings; 3.2 MB
for 1,800 EfficientNet-Lite0 images here): a line at one image a second adds about 150 MB a day.
Pruning deletes the images last updated before the cutoff with their results, labels and timings, the
memory samples taken before it, the tallies of the minutes and hours before it, and the runs that ended
before it with nothing left that refers to them. In batches of a few thousand images, each its own short
transaction, so a worker writing meanwhile waits at most for one batch (well within its busy timeout).
Images in flight (`queued`, `processing`) are never pruned. What is pruned is forgotten: `worker run` on
a folder whose images were pruned processes them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, and_, delete, exists, func, not_, or_, select, text

from worker.intake.jobs import JobStatus
from worker.store.schema import BatchRow, ImageRow, LabelRow, MemorySample, ResultRow, Run, TallyRow, TimingRow
from worker.store.tallies import HOUR, MINUTE, MINUTE_TALLIES

BATCH = 2000  # images per transaction


@dataclass(frozen=True)
class Pruned:
    images: int
    samples: int
    runs: int


def _prunable(before: datetime) -> Any:
    """The images a prune forgets: done or failed, last updated before `before` (never those in flight)."""
    return and_(ImageRow.updated_at < before, ImageRow.status.in_((JobStatus.DONE.value, JobStatus.FAILED.value)))


def prune(db: Engine, before: datetime, batch: int = BATCH) -> Pruned:
    """Delete the done and failed images last updated before `before` (with their rows in the tables
    that refer to them), the memory samples taken before it, the tallies of the minutes and hours before
    it, and the runs that ended before it and are no longer referred to (with their tallies)."""
    # every statement writes (no read first): on SQLite a transaction that read, then writes after the
    # recorder committed, fails at once ("database is locked") instead of waiting its busy timeout
    chosen = select(ImageRow.id).where(_prunable(before)).order_by(ImageRow.id).limit(batch)
    images = 0
    while True:
        with db.begin() as c:
            for table in (LabelRow, ResultRow, TimingRow):
                c.execute(delete(table).where(table.image_id.in_(chosen)))
            n = c.execute(delete(ImageRow).where(ImageRow.id.in_(chosen))).rowcount
        images += n
        if n < batch:
            break
    with db.begin() as c:
        samples = c.execute(delete(MemorySample).where(MemorySample.at < before)).rowcount
        cutoff = int(before.timestamp())
        c.execute(delete(TallyRow).where(or_(TallyRow.at <= cutoff - HOUR, and_(
            TallyRow.kind.in_(MINUTE_TALLIES), TallyRow.at <= cutoff - MINUTE))))
        unreferenced = ~exists().where(ImageRow.run_id == Run.id) & ~exists().where(TimingRow.run_id == Run.id) \
            & ~exists().where(MemorySample.run_id == Run.id)
        gone = (Run.finished_at.is_not(None), Run.finished_at < before, unreferenced)
        c.execute(delete(TallyRow).where(TallyRow.run_id.in_(select(Run.id).where(*gone))))
        c.execute(delete(BatchRow).where(BatchRow.run_id.in_(select(Run.id).where(*gone))))
        runs = c.execute(delete(Run).where(*gone)).rowcount
    return Pruned(images, samples, runs)


def would_prune(db: Engine, before: datetime) -> Pruned:
    """What `prune(db, before)` would delete, counted without deleting (`db prune --dry-run`, and the
    question asked before a prune on a terminal). Reads only: no lock held over a worker's writes."""
    gone = _prunable(before)
    kept_image = exists().where(ImageRow.run_id == Run.id, not_(gone))
    kept_timing = exists().where(TimingRow.run_id == Run.id, TimingRow.image_id == ImageRow.id, not_(gone))
    kept_sample = exists().where(MemorySample.run_id == Run.id, MemorySample.at >= before)
    with db.connect() as c:
        images = c.execute(select(func.count()).select_from(ImageRow).where(gone)).scalar_one()
        samples = c.execute(select(func.count()).select_from(MemorySample).where(MemorySample.at < before)).scalar_one()
        runs = c.execute(select(func.count()).select_from(Run).where(
            Run.finished_at.is_not(None), Run.finished_at < before, ~kept_image, ~kept_timing, ~kept_sample)).scalar_one()
    return Pruned(images, samples, runs)


def vacuum(db: Engine) -> None:
    """Give the freed space back to the filesystem (SQLite: VACUUM, which rewrites the file and needs
    that much free space beside it; PostgreSQL: VACUUM, which marks it for reuse)."""
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text("VACUUM"))
        if db.dialect.name == "sqlite":  # in WAL mode the rewritten file is in the log until a checkpoint
            c.execute(text("PRAGMA wal_checkpoint(TRUNCATE)"))
