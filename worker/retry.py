"""`worker retry`: failed images get their attempts back, and their inputs go back where they came from.

An image that failed `pipeline.max_attempts` times is quarantined: every later sight of the same
content fails at once, so a cause that has since been fixed (a pixel limit raised, a share back, a
card corrected) never gets the image through. Retrying resets the attempts of the failed images that
match the filters, commits that, and only then moves each one's input from `<archive>/failed/<rel>`
(the archive that run was configured with, unless one is given) back to the inbox or folder of the
run that failed it (a watcher takes it from there; a folder is processed by running `worker run` on it
again). Inputs that are not in the archive (a `run` that keeps its inputs, or moved back already) are
left as they are.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine, select, update

from worker.errors import WorkerError
from worker.intake.jobs import JobStatus
from worker.host.names import on_disk
from worker.outputs.files import inside, move_verified
from worker.store.queries import Filters, query_images
from worker.store.schema import ImageRow, Run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retried:
    reset: int  # failed images whose attempts were reset
    moved: tuple[tuple[Path, Path], ...]  # (from the archive, back to the inbox or folder)
    left: int  # failed images whose input was not moved: not under <archive>/failed/, or its place taken


def retry_failed(db: Engine, filters: Filters, archive: Path | None = None) -> Retried:
    """Reset the attempts of the failed images matching `filters` (their status stays failed until they
    are processed again), then move their archived inputs back to where they came from. `archive`:
    where failed inputs were moved, if not where the run that failed each image recorded."""
    rows = query_images(db, dataclasses.replace(filters, status=JobStatus.FAILED.value, limit=1 << 62))
    if not rows:
        return Retried(0, (), 0)
    ids = [r["id"] for r in rows]
    with db.begin() as c:  # committed before any input moves: a watcher must not see one still quarantined
        for i in range(0, len(ids), 500):  # bound the statement's parameters
            c.execute(update(ImageRow).where(ImageRow.id.in_(ids[i:i + 500]),
                                             ImageRow.status == JobStatus.FAILED.value).values(attempts=0))
        runs = {run_id: (Path(root), archive or (Path(config["archive"]) if config.get("archive") else None))
                for run_id, root, config in c.execute(select(Run.id, Run.root, Run.config)
                                                      .where(Run.id.in_({r["run_id"] for r in rows})))}
    moved: list[tuple[Path, Path]] = []
    for r in rows:
        root, archived = runs[r["run_id"]]
        if archived is None:
            continue
        rel = on_disk(archived / "failed", r["rel_path"])  # a name that is not UTF-8 is recorded escaped
        if not (src := inside(archived / "failed", rel)).is_file():
            continue
        dst = inside(root, rel)
        if dst.exists():  # something is there already (the same image dropped again): leave both
            log.warning("%s: not moved back, %s exists", src, dst)
            continue
        try:
            moved.append((src, move_verified(src, dst)))
        except (OSError, WorkerError) as e:
            log.error("%s: cannot move it back to %s: %s", src, dst, e)
    return Retried(len(rows), tuple(moved), len(rows) - len(moved))
