"""Tallies: what a run's outcomes add up to per minute or per hour, written by the recorder in the
transaction that records the outcomes, so that `worker stats` and `worker report` read a run of
millions of images from a few hundred thousand rows instead of its every row.

A tally counts outcomes as they were recorded: an image done twice (a soak's replay) counts twice, and a
failure that a later run retried stays the failing run's. Latencies are counted in bins of 32 to a
decade (a percentile read from them is within 3.7% of the value), scores in bins of 0.01."""

from __future__ import annotations

import enum
import math
from bisect import bisect_left
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterable, Sequence

from sqlalchemy import Connection, bindparam, func, select

from worker.intake.jobs import JobStatus
from worker.store.events import Finished
from worker.store.schema import TallyRow

MINUTE, HOUR = 60, 3600
PER_DECADE = 32
# a latency bin's upper edge in ms: bin 0 is up to 0.01 ms, the last beyond 1,000 s
LATENCY_EDGES_MS = tuple(10 ** (i / PER_DECADE - 2) for i in range(8 * PER_DECADE + 1))
SCORE_BINS = 100
STAGES = ("queue_wait_ms", "decode_ms", "preprocess_ms", "infer_ms", "postprocess_ms", "write_ms", "total_ms")


class Tally(str, enum.Enum):
    OUTCOME = "outcome"  # per minute; key: the status
    TOTAL = "total"  # per minute; key: the bin of a done image's total_ms; amount: batch sizes summed
    STAGE = "stage"  # per hour; key: "<stage> <bin>" of a done image's other stages
    LABEL = "label"  # per hour; key: a label; images naming it (a classifier's top label); amount: boxes
    SCORE = "score"  # per hour; key: the score's bin (a classifier's every image; others' naming a label)
    RESULT = "result"  # per hour; key: the task; done images with a result; amount: those naming no label


MINUTE_TALLIES = (Tally.OUTCOME.value, Tally.TOTAL.value)  # the others are per hour


def latency_bin(ms: float) -> int:
    return bisect_left(LATENCY_EDGES_MS, ms)


def bin_ms(index: int) -> float:
    """The value a latency bin stands for: the geometric middle of its edges (0 for the first, the last
    edge for the one beyond it)."""
    if index <= 0:
        return 0.0
    if index >= len(LATENCY_EDGES_MS):
        return LATENCY_EDGES_MS[-1]
    return 10 ** ((index - 0.5) / PER_DECADE - 2)


def score_bin(score: float) -> int:
    return min(SCORE_BINS - 1, max(0, int(score * SCORE_BINS))) if math.isfinite(score) else 0


Cells = dict[tuple[int, str, str], list[float]]  # (period's start, kind, key) -> [images, amount]


def tally(outcomes: Iterable[Finished], at: datetime) -> Cells:
    """What `outcomes`, recorded at `at`, add to their run's tallies."""
    t = int(at.timestamp())
    minute, hour = t - t % MINUTE, t - t % HOUR
    cells: Cells = {}

    def add(period: int, kind: Tally, key: str, amount: float = 0.0) -> None:
        cell = cells.setdefault((period, kind.value, key), [0, 0.0])
        cell[0] += 1
        cell[1] += amount

    for e in outcomes:
        if e.status not in (JobStatus.DONE, JobStatus.FAILED):
            continue  # queued again (the outbox full): not an outcome yet
        add(minute, Tally.OUTCOME, e.status.value)
        if e.status is not JobStatus.DONE:
            continue
        if e.timings is not None:
            total_ms, batch = e.timings.get("total_ms", 0.0), e.timings.get("batch_size", 1)
            add(minute, Tally.TOTAL, str(latency_bin(total_ms)), batch)
            for stage in STAGES[:-1]:
                add(hour, Tally.STAGE, f"{stage} {latency_bin(e.timings.get(stage, 0.0))}")
        if e.task is None:
            continue
        if e.task == "classify":
            if e.labels:
                add(hour, Tally.LABEL, max(e.labels, key=lambda label: label[2])[1])
        else:
            boxes: dict[str, int] = {}
            for _, name, _ in e.labels:
                boxes[name] = boxes.get(name, 0) + 1
            for name, n in boxes.items():
                add(hour, Tally.LABEL, name, n)
        if e.task == "classify" or e.labels:
            add(hour, Tally.SCORE, str(score_bin(e.score)))
        add(hour, Tally.RESULT, e.task, 0.0 if e.labels else 1.0)
    return cells


def as_rows(run_id: int, cells: Cells) -> list[dict[str, Any]]:
    """The upserts' parameters, in key order (two recorders of one run then never wait for each other in a cycle)."""
    return [dict(run_id=run_id, at=at, kind=kind, key=key, images=int(n), amount=amount)
            for (at, kind, key), (n, amount) in sorted(cells.items())]


def upsert(insert: Any) -> Any:
    """The statement adding a tally's images and amount to its row (made when missing); `insert`:
    the dialect's (SQLite and PostgreSQL both have ON CONFLICT DO UPDATE)."""
    table = TallyRow.__table__
    ins = insert(table).values({c.key: bindparam(c.key) for c in table.columns})
    return ins.on_conflict_do_update(
        index_elements=[table.c.run_id, table.c.at, table.c.kind, table.c.key],
        set_=dict(images=table.c.images + ins.excluded.images, amount=table.c.amount + ins.excluded.amount))


# reading

@dataclass(frozen=True)
class Span:
    """A window of time asked about (`stats --since/--until`), in epoch s; either end open. A tally is in
    it when its minute or hour overlaps it: the window is read to the minute (outcomes, total latency)
    and to the hour (the other stages, labels, scores)."""

    since: int | None = None
    until: int | None = None

    @classmethod
    def of(cls, since: datetime | None, until: datetime | None) -> Span:
        return cls(None if since is None else int(since.timestamp()), None if until is None else int(until.timestamp()))

    def where(self, kind: Tally) -> list[Any]:
        period = MINUTE if kind.value in MINUTE_TALLIES else HOUR
        return [*([TallyRow.at > self.since - period] if self.since is not None else []),
                *([TallyRow.at < self.until] if self.until is not None else [])]


WHOLE = Span()


def tallied(c: Connection, run_ids: Sequence[int], span: Span = WHOLE) -> int:
    """The outcomes tallied for the runs (0 for runs recorded before tallies were: read row by row)."""
    return int(c.execute(select(func.coalesce(func.sum(TallyRow.images), 0))
                         .where(TallyRow.run_id.in_(run_ids), TallyRow.kind == Tally.OUTCOME.value,
                                *span.where(Tally.OUTCOME))).scalar_one())


def _sums(c: Connection, run_ids: Sequence[int], kind: Tally, span: Span = WHOLE) -> list[Any]:
    return list(c.execute(select(TallyRow.key, func.sum(TallyRow.images), func.sum(TallyRow.amount))
                          .where(TallyRow.run_id.in_(run_ids), TallyRow.kind == kind.value, *span.where(kind))
                          .group_by(TallyRow.key)).all())


def outcomes(c: Connection, run_ids: Sequence[int], span: Span = WHOLE) -> dict[str, int]:
    return {key: int(n) for key, n, _ in _sums(c, run_ids, Tally.OUTCOME, span)}


def last_at(c: Connection, run_ids: Sequence[int]) -> int | None:
    """Epoch s at the end of the last minute with an outcome."""
    at = c.execute(select(func.max(TallyRow.at)).where(TallyRow.run_id.in_(run_ids),
                                                       TallyRow.kind == Tally.OUTCOME.value)).scalar()
    return None if at is None else int(at) + MINUTE


def _reached(counts: dict[int, int], qs: Sequence[float], value: Callable[[int], float]) -> dict[str, float]:
    """Percentiles of binned values: `value` of the bin where each is reached (nan with no count)."""
    total = sum(counts.values())
    out = {f"p{int(q)}": float("nan") for q in qs}
    for q in qs:
        running = 0
        for index in sorted(i for i, n in counts.items() if n):
            running += counts[index]
            if running >= q / 100 * total:
                out[f"p{int(q)}"] = value(index)
                break
    return out


def bin_percentiles(counts: dict[int, int], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    """Percentiles of binned latencies: the value of the bin where each is reached."""
    return _reached(counts, qs, bin_ms)


@dataclass(frozen=True)
class Latency:
    by_stage: dict[str, dict[str, float]]  # STAGES -> p50, p95, p99 in ms
    images: int  # done images timed
    batch_mean: float | None


def latency(c: Connection, run_ids: Sequence[int], span: Span = WHOLE) -> Latency:
    bins: dict[str, dict[int, int]] = {s: {} for s in STAGES}
    images, batches = 0, 0.0
    for key, n, amount in _sums(c, run_ids, Tally.TOTAL, span):
        bins["total_ms"][int(key)] = int(n)
        images += int(n)
        batches += float(amount)
    for key, n, _ in _sums(c, run_ids, Tally.STAGE, span):
        stage, index = key.split(" ")
        bins[stage][int(index)] = int(n)
    return Latency({s: bin_percentiles(b) for s, b in bins.items()}, images, batches / images if images else None)


def results(c: Connection, run_ids: Sequence[int], span: Span = WHOLE) -> dict[str, Any]:
    """As `worker stats` gives a run's results (worker.store.stats), from the tallies."""
    tasks = _sums(c, run_ids, Tally.RESULT, span)
    if not tasks:
        return {}
    task = max(key for key, _, _ in tasks)
    total = sum(int(n) for _, n, _ in tasks)
    labels = sorted(((key, int(n), int(boxes)) for key, n, boxes in _sums(c, run_ids, Tally.LABEL, span)),
                    key=lambda r: (-r[1], r[0]))
    scores = score_counts(c, run_ids, span)
    score = _reached(dict(enumerate(scores)), (5, 50, 95), lambda index: round((index + 0.5) / SCORE_BINS, 4))
    return {"task": task, "images": total, "score": score,
            "scores_read": {"read": sum(scores), "bins": SCORE_BINS},
            "labels": [{"name": name, "images": n, **({"boxes": boxes} if task == "detect" else {})}
                       for name, n, boxes in labels],
            "none": int(sum(float(none) for _, _, none in tasks))}


def score_counts(c: Connection, run_ids: Sequence[int], span: Span = WHOLE) -> list[int]:
    counts = [0] * SCORE_BINS
    for key, n, _ in _sums(c, run_ids, Tally.SCORE, span):
        counts[int(key)] += int(n)
    return counts


def series(c: Connection, run_ids: Sequence[int], bucket_s: int) -> tuple[list[tuple[int, int, int]],
                                                                           dict[int, dict[int, int]]]:
    """By bucket of `bucket_s` (a multiple of a minute, or under one): (start, done, failed), and the
    latency bins of the done images."""
    bucket = TallyRow.at // max(bucket_s, MINUTE) * max(bucket_s, MINUTE)
    mine = TallyRow.run_id.in_(run_ids)
    counts: dict[int, list[int]] = {}
    for at, key, n in c.execute(select(bucket, TallyRow.key, func.sum(TallyRow.images))
                                .where(mine, TallyRow.kind == Tally.OUTCOME.value).group_by(bucket, TallyRow.key)):
        row = counts.setdefault(int(at), [0, 0])
        if key in (JobStatus.DONE.value, JobStatus.FAILED.value):
            row[key == JobStatus.FAILED.value] += int(n)
    hist: dict[int, dict[int, int]] = {}
    for at, key, n in c.execute(select(bucket, TallyRow.key, func.sum(TallyRow.images))
                                .where(mine, TallyRow.kind == Tally.TOTAL.value).group_by(bucket, TallyRow.key)):
        hist.setdefault(int(at), {})[int(key)] = int(n)
    return [(at, d, f) for at, (d, f) in sorted(counts.items())], hist
