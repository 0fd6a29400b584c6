"""`worker report`: gather, draw, write the file (atomically: a report is whole or not there)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Sequence

from worker.errors import CheckInputError, StoreError
from worker.outputs.files import write_atomic
from worker.report.data import gather, pick_runs
from worker.report.page import render
from worker.store.db import database
from worker.store.schema import utcnow


@dataclass(frozen=True)
class Written:
    path: Path
    runs: tuple[int, ...]
    size: int
    images: int


def write_report(db_url: str, output: Path, outbox: Path, *, run_ids: Sequence[int] = (), last: int = 1,
                 since: datetime | None = None, until: datetime | None = None, model: str | None = None,
                 warmup_s: float | None = None, max_slope_mb_per_h: float = 2.0,
                 verdict: str | None = None) -> Written:
    """Write the report of the runs asked for (default: the latest) to `output`; `verdict`: a soak's, shown first;
    `warmup_s` None: each run's own."""
    try:
        with database(db_url, create=False, read_only=True) as db:
            runs = pick_runs(db, run_ids, last, since, until, model)
            data = gather(db, runs, warmup_s, outbox)
    except StoreError as e:  # no database there, or one of another version: nothing to report from
        raise CheckInputError(str(e)) from None
    text = render(data, outbox, max_slope_mb_per_h, utcnow(), verdict).encode()
    try:
        write_atomic(output, text)
    except OSError as e:
        raise CheckInputError(f"{output}: cannot write the report there: {e.strerror or e}") from None
    return Written(output, tuple(r["id"] for r in runs), len(text), sum(data.counts.values()))
