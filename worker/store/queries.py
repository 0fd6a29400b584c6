"""What `query` reads (`stats` and `health`: worker/store/stats.py). Bound parameters only, portable SQL only.

The per-image skip check is in ledger.py."""

from __future__ import annotations

import posixpath
import socket
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, and_, exists, func, select

from worker.errors import StoreError
from worker.store.schema import ImageRow, LabelRow, ResultRow, Run, TimingRow


def glob_to_like(pattern: str) -> str:
    """Shell glob -> SQL LIKE with '\\' as escape (GLOB is SQLite-only)."""
    out = []
    for ch in pattern:
        if ch in "%_\\":
            out.append("\\" + ch)
        elif ch == "*":
            out.append("%")
        elif ch == "?":
            out.append("_")
        else:
            out.append(ch)
    return "".join(out)


@dataclass(frozen=True)
class Filters:
    status: str | None = None
    path: str | None = None  # glob on the relative path, or on the full path when absolute
    since: datetime | None = None
    until: datetime | None = None
    run_id: int | None = None
    min_score: float | None = None
    label: str | None = None
    model: str | None = None  # the model card's name
    limit: int = 1000  # the latest this many (by last update)


def other_roots(db: Engine, outbox: str, root: str) -> list[str]:
    """The folders other than `root` (inboxes, folders run or soaked) whose runs in this database wrote
    into `outbox`, first used first; a folder of another host as `host:folder` (the same path there
    may be another folder). Outputs are named by the path relative to the folder, so an image of
    `root` and one of such a folder with the same relative path overwrite each other's outputs."""
    here = socket.gethostname()
    # filtered in SQL (json_extract on SQLite, ->> on PostgreSQL): a database of years of hourly runs
    # need not send every run's config to each start
    stmt = (select(Run.host, Run.root).where(Run.root != root, Run.config["outbox"].as_string() == outbox)
            .group_by(Run.host, Run.root).order_by(func.min(Run.id)))
    with db.connect() as c:
        rows = c.execute(stmt).all()
    return [r.root if r.host == here else f"{r.host}:{r.root}" for r in rows]


def runs_over(db: Engine, root: str, exclude_mode: str | None = None) -> list[int]:
    """The ids of the runs over the folder `root` on this host (but those of `exclude_mode`), latest first."""
    stmt = select(Run.id).where(Run.root == root, Run.host == socket.gethostname())
    if exclude_mode is not None:
        stmt = stmt.where(Run.mode != exclude_mode)
    with db.connect() as c:
        return list(c.scalars(stmt.order_by(Run.id.desc())))


STAGES = ("queue_wait_ms", "decode_ms", "preprocess_ms", "infer_ms", "postprocess_ms", "write_ms", "total_ms")


def query_images(db: Engine, f: Filters) -> list[dict[str, Any]]:
    """One row per image: status, error, score, top label, when it was first and last seen, the folder
    of the run that last touched it (`root`) and the outbox it wrote into (`outbox`), each stage's latency (STAGES, and `batch_size`) and
    `result`, the document its outbox JSON holds but for the mask's path, which is `mask_path` (None for
    an image not done)."""
    top_label = (select(LabelRow.name).where(LabelRow.image_id == ImageRow.id)
                 .order_by(LabelRow.score.desc()).limit(1).scalar_subquery())
    matching = _matching_labels(f)  # with --label or --min-score: the best label that matched, and its score
    matched = [] if matching is None else [
        select(column).where(LabelRow.image_id == ImageRow.id, *matching).order_by(LabelRow.score.desc())
        .limit(1).scalar_subquery().label(name)
        for column, name in ((LabelRow.name, "matched_label"), (LabelRow.score, "matched_score"))]
    root = select(Run.root).where(Run.id == ImageRow.run_id).scalar_subquery()
    outbox = select(Run.config["outbox"].as_string()).where(Run.id == ImageRow.run_id).scalar_subquery()
    stmt = (select(ImageRow.id, ImageRow.run_id, ImageRow.rel_path, ImageRow.status, ImageRow.attempts,
                   ImageRow.error, ImageRow.model, ImageRow.sha256, ImageRow.created_at, ImageRow.updated_at,
                   root.label("root"), outbox.label("outbox"), ResultRow.task, ResultRow.score, ResultRow.json_path, ResultRow.mask_path,
                   top_label.label("top_label"), *(getattr(TimingRow, s) for s in STAGES), TimingRow.batch_size,
                   ResultRow.payload.label("result"), *matched)
            .outerjoin(ResultRow, ResultRow.image_id == ImageRow.id)
            .outerjoin(TimingRow, TimingRow.image_id == ImageRow.id))
    conds = []
    if f.status:
        conds.append(ImageRow.status == f.status)
    if f.path and posixpath.isabs(f.path):  # a file as the user sees it: the run's root joined to the path
        full = Run.root.concat("/").concat(ImageRow.rel_path)
        conds.append(exists().where(Run.id == ImageRow.run_id,
                                    full.like(glob_to_like(posixpath.normpath(f.path)), escape="\\")))
    elif f.path:
        conds.append(ImageRow.rel_path.like(glob_to_like(f.path), escape="\\"))
    if f.since:
        conds.append(ImageRow.updated_at >= f.since)
    if f.until:
        conds.append(ImageRow.updated_at < f.until)
    if f.run_id is not None:
        conds.append(ImageRow.run_id == f.run_id)
    if f.model is not None:
        conds.append(ImageRow.model == f.model)
    if matching is not None:
        conds.append(ImageRow.id.in_(select(LabelRow.image_id).where(*matching)))
    if conds:
        stmt = stmt.where(and_(*conds))
    # the latest `limit` (a database of months answered with its first thousand images hid today's),
    # listed oldest first
    stmt = stmt.order_by(ImageRow.updated_at.desc(), ImageRow.id.desc()).limit(f.limit)
    with db.connect() as c:
        require_run(c, f.run_id)
        rows = c.execute(stmt).mappings().all()
    out = []
    for r in reversed(rows):
        d = dict(r)
        for when in ("created_at", "updated_at"):
            d[when] = d[when].isoformat() if d[when] else None
        out.append(d)
    return out


def _matching_labels(f: Filters) -> list[Any] | None:
    """The conditions on a label row that --label (any case: `Cup` finds `cup`) and --min-score set."""
    if f.label is None and f.min_score is None:
        return None
    return [*([func.lower(LabelRow.name) == f.label.lower()] if f.label is not None else []),
            *([LabelRow.score >= f.min_score] if f.min_score is not None else [])]


def run_model(db: Engine, run_id: int) -> str:
    """The model card run `run_id` ran; StoreError when there is no such run."""
    with db.connect() as c:
        require_run(c, run_id)
        return str(c.execute(select(Run.model).where(Run.id == run_id)).scalar_one())


def require_run(c: Any, run_id: int | None) -> None:
    """A run asked for by id that is not in the database is a mistake to say (a typo, another database),
    not an empty answer: `query`, `stats`, `retry` and `export` said nothing, or wrote an empty file."""
    if run_id is not None and c.execute(select(Run.id).where(Run.id == run_id)).first() is None:
        raise StoreError(f"no run {run_id} on record (`worker stats` lists the latest runs)")
