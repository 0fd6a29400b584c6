"""What a report shows, gathered with SQL aggregates (portable: SQLite and PostgreSQL): the runs and their
`worker stats` (worker.store.stats.run_stats: one owner for the statistics), then time series by bucket,
failures by reason, labels and scores, and the images of the gallery."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from sqlalchemy import BigInteger, Engine, Integer, and_, case, cast, extract, func, select

from worker.errors import CheckInputError
from worker.store import tallies
from worker.store.stats import SCORED, replays, run_stats
from worker.store.schema import ImageRow, MemorySample, ResultRow, Run, TimingRow

BUCKETS = 120  # points of a time series at most
NICE_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
SCORE_BINS = 20
# runs recorded before tallies: their latency bins and scores are read from every k-th image where they have
# more than this many (a uniform sample: its shape holds, its counts are scaled back)
SAMPLED = 300_000
GALLERY = 6  # images per gallery row


@dataclass(frozen=True)
class Pictured:
    rel: str
    caption: str
    picture: Path | None  # its overlay, or the input where it still is; None: nothing to show


@dataclass(frozen=True)
class RunMemory:
    """One run's memory (one process's): RSS and GPU memory by bucket, and the least-squares line through its
    samples after its warm-up. Never joined to another run's: each process has its own."""
    run: int
    bucket_s: int
    series: list[tuple[int, float, float | None]]  # (bucket start, RSS MB, GPU MB)
    warmup_end: int  # epoch s
    # over the second half of the samples after the warm-up, as `worker stats` and `worker soak` judge it:
    # RSS MB = a + b * (t - judged_from), b per s; None: too few samples
    judged_from: int
    trend: tuple[float, float] | None


@dataclass
class ReportData:
    runs: list[dict[str, Any]]
    stats: list[dict[str, Any]]
    counts: dict[str, int]
    bucket_s: int
    ends: dict[int, datetime] = field(default_factory=dict)  # each run's end: finished, else last seen alive
    stride: int = 1  # the distributions' sample: every stride-th image
    throughput: list[tuple[int, int, int]] = field(default_factory=list)  # (bucket start, done, failed)
    latency: list[tuple[int, float, float, float]] = field(default_factory=list)  # (bucket, p50, p95, p99) ms
    memory: list[RunMemory] = field(default_factory=list)
    failures: list[tuple[str, int, str]] = field(default_factory=list)  # (reason, images, one of them)
    labels: list[tuple[str, int]] = field(default_factory=list)
    scores: list[int] = field(default_factory=list)
    gallery: dict[str, list[Pictured]] = field(default_factory=dict)


    def busy_s(self, lo: datetime | None = None, hi: datetime | None = None) -> float:
        """Seconds (within [lo, hi) where given) in which at least one of the runs was running: their spans'
        union, so that neither an overlap nor a gap between runs counts."""
        total, reached = 0.0, lo
        for start, end in sorted((r["started_at"], self.ends[r["id"]]) for r in self.runs):
            start = max(start, reached) if reached is not None else start
            end = min(end, hi) if hi is not None else end
            if end > start:
                total += (end - start).total_seconds()
            reached = max(end, reached) if reached is not None else end
        return total

    def rate(self, bucket_start: int, images: int) -> float:
        """Images per second in the bucket starting at `bucket_start` (epoch s): over the part of it in
        which a run was running (a run's first and last minute are partly idle)."""
        lo = datetime.fromtimestamp(bucket_start, timezone.utc)
        busy = self.busy_s(lo, datetime.fromtimestamp(bucket_start + self.bucket_s, timezone.utc))
        return images / (busy if busy > 0 else self.bucket_s)

    @property
    def images_per_s(self) -> float | None:
        """Outcomes (done and failed) per second of the runs' busy time."""
        busy = self.busy_s()
        return (self.counts.get("done", 0) + self.counts.get("failed", 0)) / busy if busy > 0 else None


def pick_runs(db: Engine, run_ids: Sequence[int], last: int, since: datetime | None, until: datetime | None,
              model: str | None) -> list[dict[str, Any]]:
    """The runs asked for: some by id, the last K, or those started in a window; for a model. Refused when
    one asked for by id, or every one, is not on record."""
    q = select(Run).order_by(Run.id.desc())
    if run_ids:
        q = q.where(Run.id.in_(run_ids))
    if model is not None:
        q = q.where(Run.model == model)
    if since is not None:
        q = q.where(func.coalesce(Run.finished_at, Run.heartbeat_at, func.now()) >= since)
    if until is not None:
        q = q.where(Run.started_at < until)
    if not run_ids and since is None and until is None:
        q = q.limit(last)
    with db.connect() as c:
        runs = [dict(r) for r in c.execute(q).mappings()]
    missing = sorted(set(run_ids) - {r["id"] for r in runs})
    if missing or not runs:
        said = ("run " + ", ".join(map(str, missing or run_ids)) if run_ids else
                "run" + (f" of model {model}" if model else ""))
        raise CheckInputError(f"no {said} on record in this database")
    return runs[::-1]


def _bucket(span_s: float) -> int:
    return next((b for b in NICE_S if span_s / b <= BUCKETS), NICE_S[-1])


def gather(db: Engine, runs: list[dict[str, Any]], warmup_s: float | None, outbox: Path,
           gallery: int = GALLERY) -> ReportData:
    """`warmup_s`: None, each run's own (see run_stats)."""
    ids = [r["id"] for r in runs]
    stats = [s for rid in ids for s in run_stats(db, run_id=rid, warmup_s=warmup_s)]
    warm = {s["run"]: float(s["memory"]["warmup_s"]) for s in stats}
    start = min(r["started_at"] for r in runs)
    with db.connect() as c:
        tallied = all(_tallied(c, rid) for rid in ids)
        ends = {s["run"]: datetime.fromisoformat(s["ended_at"]) for s in stats}  # `worker stats`' own
        sampled = _bucket(max((max(ends.values()) - start).total_seconds(), 1.0))  # memory's buckets
        bucket = sampled  # the outcomes': only the tallies count every replay of a soak, by the minute
        if tallied and any(replays(r) for r in runs):
            bucket = max(bucket, tallies.MINUTE)
        data = ReportData(runs, stats, {}, bucket, ends)
        for run in stats:  # `worker stats`' own counts, summed over the runs
            for status, n in run["counts"].items():
                data.counts[status] = data.counts.get(status, 0) + int(n)
        if tallied and bucket >= tallies.MINUTE:
            data.throughput, hist = tallies.series(c, ids, bucket)
        else:
            data.throughput, hist, data.stride = _series(c, ids, bucket, sum(data.counts.values()))
        for b, h in sorted(hist.items()):
            p = tallies.bin_percentiles(h)
            data.latency.append((b, p["p50"], p["p95"], p["p99"]))
        data.memory = [m for rid in ids if (m := _memory(c, rid, sampled, warm[rid])) is not None]
        mine = ImageRow.run_id.in_(ids)
        data.failures = [(reason or "(no reason recorded)", int(n), rel) for reason, n, rel in c.execute(
            select(ImageRow.error, func.count(), func.min(ImageRow.rel_path))
            .where(ImageRow.status == "failed", mine).group_by(ImageRow.error)
            .order_by(func.count().desc()).limit(20))]
        data.labels = _labels(stats)
        data.scores = _score_bins(c, ids, data.stride) if not tallied else [
            sum(n) for n in _chunks(tallies.score_counts(c, ids), tallies.SCORE_BINS // SCORE_BINS)]
        data.gallery = _gallery(c, ids, runs, outbox, gallery)
    return data


def _tallied(c: Any, rid: int) -> bool:
    """A run whose outcomes are tallied: it has tallies, or no image (tallies came with migration 0005)."""
    return bool(tallies.tallied(c, [rid])) or c.execute(select(ImageRow.id).where(ImageRow.run_id == rid)
                                                        .limit(1)).first() is None


def _epoch(at: int | None) -> datetime | None:
    return None if at is None else datetime.fromtimestamp(at, timezone.utc)


def _chunks(values: list[int], size: int) -> list[list[int]]:
    return [values[i:i + size] for i in range(0, len(values), size)]


def _series(c: Any, ids: list[int], bucket: int, images: int) -> tuple[list[tuple[int, int, int]],
                                                                       dict[int, dict[int, int]], int]:
    """Throughput and latency bins by bucket, read from the images' rows (a span too short for the
    tallies' minutes, or runs recorded before them): the latency bins from every stride-th image."""
    mine = ImageRow.run_id.in_(ids)
    stride = max(1, images // SAMPLED)
    sampled = mine if stride == 1 else and_(mine, ImageRow.id % stride == 0)
    epoch = cast(extract("epoch", ImageRow.updated_at), BigInteger) // bucket
    throughput = [(int(b) * bucket, int(d or 0), int(f or 0)) for b, d, f in c.execute(
        select(epoch, func.sum(case((ImageRow.status == "done", 1), else_=0)),
               func.sum(case((ImageRow.status == "failed", 1), else_=0)))
        .where(mine, ImageRow.status.in_(("done", "failed"))).group_by(epoch).order_by(epoch))]
    hist: dict[int, dict[int, int]] = {}
    for b, ms in c.execute(select(epoch, TimingRow.total_ms).join(TimingRow, TimingRow.image_id == ImageRow.id)
                           .where(sampled, ImageRow.status == "done")):
        cell = hist.setdefault(int(b) * bucket, {})
        index = tallies.latency_bin(ms)
        cell[index] = cell.get(index, 0) + stride
    return throughput, hist, stride


def _score_bins(c: Any, ids: list[int], stride: int) -> list[int]:
    sampled = ImageRow.run_id.in_(ids) if stride == 1 else and_(ImageRow.run_id.in_(ids), ImageRow.id % stride == 0)
    score_bin = cast(ResultRow.score * SCORE_BINS, Integer)
    scores = dict(c.execute(select(score_bin, func.count()).join(ImageRow, ImageRow.id == ResultRow.image_id)
                            .where(sampled, ImageRow.status == "done", SCORED).group_by(score_bin)).all())
    return [stride * (int(scores.get(i, 0)) + (int(scores.get(SCORE_BINS, 0)) if i == SCORE_BINS - 1 else 0))
            for i in range(SCORE_BINS)]


def _labels(stats: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The images naming each label, most first (twenty), over the runs: `worker stats`' own counts (a
    classifier's top label, a detector's or segmenter's classes found)."""
    images: dict[str, int] = {}
    for run in stats:
        for label in run.get("results", {}).get("labels", []):
            images[label["name"]] = images.get(label["name"], 0) + int(label["images"])
    return sorted(images.items(), key=lambda kv: (-kv[1], kv[0]))[:20]


def _memory(c: Any, rid: int, bucket: int, warmup_s: float) -> RunMemory | None:
    """One run's RSS (and GPU memory) by bucket, and the least-squares line through the second half of its samples
    after the warm-up, the window its verdict judges (its sums in SQL: no sample is fetched); None when it has no
    sample."""
    mine = MemorySample.run_id == rid
    at = cast(extract("epoch", MemorySample.at), BigInteger)
    by = at // bucket  # one expression (one parameter) in SELECT and GROUP BY: PostgreSQL matches them so
    series = [(int(b) * bucket, float(rss) / 2**20, None if gpu is None else float(gpu) / 2**20)
              for b, rss, gpu in c.execute(select(by, func.avg(MemorySample.rss_bytes), func.avg(MemorySample.gpu_bytes))
                                           .where(mine).group_by(by).order_by(by))]
    first = c.execute(select(func.min(at)).where(mine)).scalar()
    if first is None:
        return None
    warmup_end = int(first + warmup_s)
    steady_first, last = c.execute(select(func.min(at), func.max(at)).where(mine, at >= warmup_end)).one()
    judged_from = warmup_end if steady_first is None else (int(steady_first) + int(last)) // 2
    x = at - judged_from
    y = MemorySample.rss_bytes / 2**20
    n, sx, sy, sxx, sxy = c.execute(select(func.count(), func.sum(x), func.sum(y), func.sum(x * x), func.sum(x * y))
                                    .where(mine, and_(at >= judged_from))).one()
    trend = None
    if n and n > 2 and (den := n * float(sxx) - float(sx) ** 2) > 0:
        slope = (n * float(sxy) - float(sx) * float(sy)) / den
        trend = ((float(sy) - slope * float(sx)) / n, slope)
    return RunMemory(rid, bucket, series, warmup_end, judged_from, trend)


def _slowest(c: Any, rid: int, n: int) -> list[Any]:
    """A run's n slowest done images: its slowest timings first (by the index on run and total), then
    those of them done (a failure is timed to where it stopped)."""
    top = (select(TimingRow.image_id, TimingRow.total_ms).where(TimingRow.run_id == rid)
           .order_by(TimingRow.total_ms.desc()).limit(4 * n).subquery())
    return list(c.execute(select(ImageRow.rel_path, ImageRow.run_id, top.c.total_ms)
                          .join(top, top.c.image_id == ImageRow.id).where(ImageRow.status == "done")
                          .order_by(top.c.total_ms.desc()).limit(n)).all())


def _gallery(c: Any, ids: list[int], runs: list[dict[str, Any]], outbox: Path, n: int) -> dict[str, list[Pictured]]:
    roots = {r["id"]: Path(r["root"]) for r in runs}
    archives = {r["id"]: Path(str((r["config"] or {}).get("archive", ""))) for r in runs}
    outboxes = {r["id"]: Path(str((r["config"] or {}).get("outbox", outbox))) for r in runs}

    def pictured(rel: str, rid: int, caption: str) -> Pictured:
        found = next((p for p in (outboxes[rid] / f"{rel}.overlay.jpg", roots[rid] / rel,
                                  archives[rid] / "done" / rel, archives[rid] / "failed" / rel) if p.is_file()), None)
        return Pictured(rel, caption, found)

    mine = ImageRow.run_id.in_(ids)
    slowest = sorted((row for rid in ids for row in _slowest(c, rid, n)), key=lambda r: -r[2])[:n]
    failed = c.execute(select(ImageRow.rel_path, ImageRow.run_id, ImageRow.error)
                       .where(mine, ImageRow.status == "failed").order_by(ImageRow.updated_at.desc()).limit(n)).all()
    done = c.execute(select(ImageRow.rel_path, ImageRow.run_id, ResultRow.score)
                     .join(ResultRow, ResultRow.image_id == ImageRow.id).where(mine, ImageRow.status == "done")
                     .order_by(ImageRow.id).limit(n)).all()
    return {"slowest": [pictured(r, rid, f"{ms:.0f} ms") for r, rid, ms in slowest],
            "failed": [pictured(r, rid, err or "") for r, rid, err in failed],
            "done": [pictured(r, rid, f"score {s:.2f}") for r, rid, s in done]}
