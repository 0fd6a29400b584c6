"""What `stats` and `health` read: per run counts, throughput, latency percentiles, results, the RSS
trend and the latest heartbeat. Bound parameters only, portable SQL only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine, and_, exists, func, or_, select

from worker.intake.jobs import JobStatus
from worker.measure.metrics import percentiles, slope_per_hour, slope_se_per_hour
from worker.store import tallies
from worker.store.health import STALL_S, Beat, Health, RunState, assess, sample_period_s
from worker.store.queries import STAGES, require_run
from worker.store.schema import ImageRow, LabelRow, MemorySample, ResultRow, Run, TimingRow, utcnow


# a run of months holds millions of memory samples and timing rows: beyond these, every k-th is
# read (exact aggregates, first and last sample included), so `stats` stays quick and small
SAMPLE_CAP = 20_000
TIMING_CAP = 100_000
# beyond this many outcomes, a run asked about as a whole is read from its tallies
TALLIED_ABOVE = 100_000


def run_stats(db: Engine, run_id: int | None = None, last: int = 10, warmup_s: float | None = None,
              since: datetime | None = None, until: datetime | None = None,
              tallied_above: int = TALLIED_ABOVE) -> list[dict[str, Any]]:
    """Per run: counts, throughput, per-stage latency percentiles and the RSS trend after `warmup_s` (None: the
    warm-up the run itself was given, metrics.warmup_s or a soak's --warmup, as its recorded config says).

    `since` / `until`: only what happened in that window (images by their last update, memory samples
    by their time), of the runs that were active in it: a watcher of months asked about its last day.
    The warm-up still counts from the run's start.

    A run of more than `tallied_above` outcomes (in the window), and a soak, are read from their tallies
    (worker.store.tallies; `read_from` says which): counts are outcomes as recorded, latencies to 3.7%, a
    window to the minute (counts, total latency) and the hour (the other stages, labels, scores)."""
    window, span = _Window(since, until), tallies.Span.of(since, until)
    with db.connect() as c:
        q = select(Run).order_by(Run.id.desc()).limit(last)
        if run_id is not None:
            require_run(c, run_id)
            q = select(Run).where(Run.id == run_id)
        if since is not None:  # active at or after it: finished then, or still running (a sample since)
            sampled = exists().where(MemorySample.run_id == Run.id, MemorySample.at >= since)
            q = q.where(or_(Run.finished_at >= since, Run.started_at >= since,
                            and_(Run.finished_at.is_(None), sampled)))
        if until is not None:
            q = q.where(Run.started_at < until)
        runs = c.execute(q).mappings().all()
        out = []
        for run in reversed(runs):
            rid = run["id"]
            outcomes = tallies.tallied(c, [rid], span)
            facts: dict[str, Any] = {**run, "ended_at": _last_seen(c, run)}
            warm = run_warmup(run) if warmup_s is None else warmup_s
            if outcomes > tallied_above or (outcomes and replays(run)):
                counts = {**tallies.outcomes(c, [rid], span), **_in_flight(c, rid, window)}
                stats = _one_run(facts, counts, _tallied_latency(c, rid, span), _samples(c, rid, window),
                                 warm, window)
                stats["results"] = tallies.results(c, [rid], span)
                stats["read_from"] = "tallies"
            else:
                counts = dict(c.execute(select(ImageRow.status, func.count())
                                        .where(ImageRow.run_id == rid, *window.of(ImageRow.updated_at))
                                        .group_by(ImageRow.status)).all())
                stats = _one_run(facts, counts, _latency(_timings(c, rid, window)), _samples(c, rid, window),
                                 warm, window)
                stats["results"] = _results(c, rid, window)
                stats["read_from"] = "rows"
            stats["health"] = assess(dict(run), _latest_beats(c, dict(run), STALL_S), utcnow()).as_dict()
            out.append(stats)
    return out


def run_warmup(run: Any) -> float:
    """The warm-up a run was given (its recorded config's metrics.warmup_s: a soak records its --warmup there)."""
    value = (run["config"] or {}).get("metrics.warmup_s")
    return float(value) if isinstance(value, (int, float)) and value >= 0 else 60.0


def _last_seen(c: Any, run: Any) -> datetime:
    """When a run ended: when it finished, else (killed, or still running) the last sign of it: its heartbeat,
    its last memory sample or its last outcome (read within the last minute its tallies have, where it has them:
    by the index on time, not by every row of a long run)."""
    if run["finished_at"] is not None:
        return run["finished_at"]
    rid = run["id"]
    last_sample = c.execute(select(func.max(MemorySample.at)).where(MemorySample.run_id == rid)).scalar()
    q = select(func.max(ImageRow.updated_at)).where(ImageRow.run_id == rid)
    if (minute_end := tallies.last_at(c, [rid])) is not None:
        q = q.where(ImageRow.updated_at >= datetime.fromtimestamp(minute_end - tallies.MINUTE, timezone.utc))
    signs = (run["started_at"], run["heartbeat_at"], last_sample, c.execute(q).scalar())
    return max(x for x in signs if x is not None)


def replays(run: Any) -> bool:
    """A soak replays its images: each image's row holds its last replay, its tallies every outcome."""
    return run["mode"] == "soak"


@dataclass(frozen=True)
class _Window:
    """A span of time `stats` is asked about; either end open."""
    since: datetime | None = None
    until: datetime | None = None

    def of(self, column: Any) -> list[Any]:
        """SQL conditions: `column` inside the window."""
        return [*([column >= self.since] if self.since else []), *([column < self.until] if self.until else [])]

    def clip(self, start: datetime, end: datetime | None) -> tuple[datetime, datetime | None]:
        """[start, end] cut to the window."""
        start = max(start, self.since) if self.since else start
        return start, (min(end, self.until) if end and self.until else end)


@dataclass(frozen=True)
class _Timings:
    rows: list[Any]  # (stage..., batch_size) of done images: all, or every `stride`-th image's
    total: int
    stride: int
    batch_mean: float | None  # over all of them


@dataclass(frozen=True)
class _Latency:
    """What `stats` says of a run's latencies: percentiles by stage, how many images they are of."""
    by_stage: dict[str, dict[str, float]]
    images: dict[str, Any]  # read, of, stride (and from tallies: bins_per_decade)
    batch_mean: float | None


def _latency(timings: _Timings) -> _Latency:
    return _Latency({s: percentiles([r[i] for r in timings.rows]) for i, s in enumerate(STAGES)},
                    {"read": len(timings.rows), "of": timings.total, "stride": timings.stride}, timings.batch_mean)


def _tallied_latency(c: Any, rid: int, span: tallies.Span) -> _Latency:
    lat = tallies.latency(c, [rid], span)
    return _Latency(lat.by_stage, {"read": lat.images, "of": lat.images, "stride": 1,
                                   "bins_per_decade": tallies.PER_DECADE}, lat.batch_mean)


def _in_flight(c: Any, rid: int, window: _Window) -> dict[str, int]:
    """A run's images queued or in progress (by the index on status and run: not its every image)."""
    return dict(c.execute(select(ImageRow.status, func.count())
                          .where(ImageRow.status.in_((JobStatus.QUEUED.value, JobStatus.PROCESSING.value)),
                                 ImageRow.run_id == rid, *window.of(ImageRow.updated_at))
                          .group_by(ImageRow.status)).all())


def _timings(c: Any, rid: int, window: _Window) -> _Timings:
    # done images only: a failed image times the stages it reached and 0 for the rest, which would
    # pull every percentile (and the mean batch) towards 0
    where = (TimingRow.run_id == rid, ImageRow.status == JobStatus.DONE.value, *window.of(ImageRow.updated_at))
    total, batch_mean = c.execute(select(func.count(), func.avg(TimingRow.batch_size))
                                  .join(ImageRow, ImageRow.id == TimingRow.image_id).where(*where)).one()
    stride = max(1, -(-total // TIMING_CAP))
    q = select(*[getattr(TimingRow, s) for s in STAGES], TimingRow.batch_size).join(
        ImageRow, ImageRow.id == TimingRow.image_id).where(*where)
    if stride > 1:
        q = q.where(TimingRow.image_id % stride == 0)
    return _Timings(c.execute(q).all(), total, stride, float(batch_mean) if batch_mean is not None else None)


# the results whose score says something: a classifier's every one, a detector's or segmenter's where it
# found something (the others' 0 says nothing); the tallies count the same (worker.store.tallies.tally)
SCORED = or_(ResultRow.task == "classify", exists().where(LabelRow.image_id == ResultRow.image_id))


def _results(c: Any, rid: int, window: _Window) -> dict[str, Any]:
    """What the run's done images held: the task; per label, most first, the images naming it (a
    classifier's top label; a detector's boxes' classes, with the boxes; a segmenter's classes present);
    the images naming none; and p5/p50/p95 of the score `query` lists (a classifier's top-1 probability,
    a detector's best box's score or a segmenter's mean mask probability over the images where something
    was found). Label counts are exact; the percentiles read every k-th score beyond TIMING_CAP images.
    Empty when no image is done."""
    done = (ImageRow.run_id == rid, ImageRow.status == JobStatus.DONE.value, *window.of(ImageRow.updated_at))
    task, total = c.execute(select(func.max(ResultRow.task), func.count())
                            .join(ImageRow, ImageRow.id == ResultRow.image_id).where(*done)).one()
    if not total:
        return {}
    stride = max(1, -(-total // TIMING_CAP))
    q = select(ResultRow.score).join(ImageRow, ImageRow.id == ResultRow.image_id).where(*done, SCORED)
    scores = c.execute(q.where(ResultRow.image_id % stride == 0) if stride > 1 else q).scalars().all()
    if task == "classify":  # its top label, as `query` gives it: the top-k's best; one each, when any
        top = (select(LabelRow.name).where(LabelRow.image_id == ImageRow.id)
               .order_by(LabelRow.score.desc()).limit(1).scalar_subquery())
        tops = select(top.label("name")).where(*done).subquery()
        rows = c.execute(select(tops.c.name, func.count(), func.count()).group_by(tops.c.name)).all()
        named = sum(images for name, images, _ in rows if name is not None)
    else:
        rows = c.execute(select(LabelRow.name, func.count(LabelRow.image_id.distinct()), func.count())
                         .join(ImageRow, ImageRow.id == LabelRow.image_id).where(*done).group_by(LabelRow.name)).all()
        named = c.execute(select(func.count(LabelRow.image_id.distinct()))
                          .join(ImageRow, ImageRow.id == LabelRow.image_id).where(*done)).scalar() or 0
    labels = [{"name": name, "images": images, **({"boxes": n} if task == "detect" else {})}
              for name, images, n in sorted(rows, key=lambda r: (-r[1], str(r[0]))) if name is not None]
    score = {k: round(v, 4) for k, v in percentiles(scores, (5, 50, 95)).items()}
    return {"task": task, "images": total, "score": score,
            "scores_read": {"read": len(scores), "stride": stride}, "labels": labels, "none": total - named}


@dataclass(frozen=True)
class _Samples:
    rows: list[Any]  # (at, rss_bytes, gpu_bytes, images_done), by time: all, or every `stride`-th and the last
    total: int
    stride: int
    peak_rss: int | None  # over all of them
    peak_gpu: int | None
    most_done: int | None  # images the pipeline processed by the last of them, less those before them
    first_at: datetime | None  # the run's first sample, in the window or not: where its warm-up starts
    last_at: datetime | None  # the run's last sample, in the window or not: where an unfinished run is


def _samples(c: Any, rid: int, window: _Window) -> _Samples:
    where = (MemorySample.run_id == rid, *window.of(MemorySample.at))
    total, peak_rss, peak_gpu, most_done = c.execute(
        select(func.count(), func.max(MemorySample.rss_bytes), func.max(MemorySample.gpu_bytes),
               func.max(MemorySample.images_done)).where(*where)).one()
    first_at, last_at = c.execute(select(func.min(MemorySample.at), func.max(MemorySample.at))
                                  .where(MemorySample.run_id == rid)).one()
    if window.since is not None and most_done is not None:  # the count is the run's: less what was before
        # done by the window's start: the last sample at or before it
        before = c.execute(select(MemorySample.images_done)
                           .where(MemorySample.run_id == rid, MemorySample.at <= window.since)
                           .order_by(MemorySample.at.desc()).limit(1)).scalar()
        most_done -= before or 0
    stride = max(1, -(-total // SAMPLE_CAP))
    cols = (MemorySample.at, MemorySample.rss_bytes, MemorySample.gpu_bytes, MemorySample.images_done)
    q = select(*cols).where(*where).order_by(MemorySample.at)
    rows = list(c.execute(q.where(MemorySample.id % stride == 0) if stride > 1 else q).all())
    if stride > 1:  # the first and the last sample always: where the run started and where it is
        first = c.execute(q.limit(1)).first()
        final = c.execute(select(*cols).where(*where).order_by(MemorySample.at.desc()).limit(1)).first()
        rows = [first, *[r for r in rows if r.at not in (first.at, final.at)], final]
    return _Samples(rows, total, stride, peak_rss, peak_gpu, most_done, first_at, last_at)


def memory_so_far(db: Engine, run_id: int, warmup_s: float) -> tuple[float, float]:
    """(RSS of the run's latest memory sample, the least-squares slope of its samples after the warm-up so
    far), in MB and MB/h, as `run_stats` reads them; nan for what there are too few samples for yet."""
    with db.connect() as c:
        sampled = _samples(c, run_id, _Window())
    if not sampled.rows:
        return math.nan, math.nan
    t0 = sampled.first_at or sampled.rows[0].at
    steady = [((r.at - t0).total_seconds(), r.rss_bytes / 2**20) for r in sampled.rows
              if (r.at - t0).total_seconds() >= warmup_s]
    return sampled.rows[-1].rss_bytes / 2**20, slope_per_hour([t for t, _ in steady], [m for _, m in steady])


def _latest_beats(c: Any, run: dict[str, Any], stall_s: float) -> list[Beat]:
    """Enough of the latest samples to see a stall of stall_s, and the rate over it, oldest first."""
    keep = int(stall_s / sample_period_s(run["config"])) + 20
    rows = c.execute(select(MemorySample.at, MemorySample.queue_depth, MemorySample.images_done)
                     .where(MemorySample.run_id == run["id"]).order_by(MemorySample.at.desc()).limit(keep)).all()
    return [Beat(r.at, r.queue_depth, r.images_done) for r in reversed(rows)]


def run_health(db: Engine, run_id: int | None = None, root: str | None = None,
               stall_s: float = STALL_S) -> Health | None:
    """The state of one run (see worker.store.health): `run_id`'s, else the latest `watch` run on
    `root` (an inbox), else the latest run. None when there is no such run."""
    q = select(Run).order_by(Run.id.desc()).limit(1)
    if run_id is not None:
        q = select(Run).where(Run.id == run_id)
    elif root is not None:
        q = q.where(Run.mode == "watch", Run.root == root)
    with db.connect() as c:
        run = c.execute(q).mappings().first()
        if run is None:
            return None
        beats = _latest_beats(c, dict(run), stall_s)
    return assess(dict(run), beats, utcnow(), stall_s)


def other_watchers(db: Engine, stall_s: float = STALL_S, limit: int = 20) -> list[tuple[Health, str, str]]:
    """The `watch` runs on record that are not finished and not gone (running, stalled, or another host's
    and silent), latest first, as (health, inbox, host): what `health` names when asked about an inbox
    that no watcher watches."""
    q = select(Run).where(Run.mode == "watch", Run.finished_at.is_(None)).order_by(Run.id.desc()).limit(limit)
    found = []
    with db.connect() as c:
        for run in c.execute(q).mappings().all():
            h = assess(dict(run), _latest_beats(c, dict(run), stall_s), utcnow(), stall_s)
            if h.state is not RunState.GONE:
                found.append((h, str(run["root"]), str(run["host"])))
    return found


def _one_run(run: dict[str, Any], counts: dict[str, int], latency: _Latency, sampled: _Samples,
             warmup_s: float, window: _Window = _Window()) -> dict[str, Any]:
    start, end = run["started_at"], run["finished_at"]
    samples = sampled.rows
    processed = counts.get("done", 0) + counts.get("failed", 0)
    # an unfinished run (running, or killed): up to the last sign of it
    span_start, until = window.clip(start, run.get("ended_at") or end or sampled.last_at)
    span = (until - span_start).total_seconds() if until and until > span_start else None
    memory: dict[str, Any] = {"samples": sampled.total, "sample_stride": sampled.stride, "warmup_s": warmup_s}
    if samples:
        # the sampler counts what the pipeline processed: a soak replays its images, one row each
        processed = max(processed, sampled.most_done or 0)
        t0 = sampled.first_at or samples[0].at  # the run's first sample: the warm-up counts from there
        secs = [(s.at - t0).total_seconds() for s in samples]
        mb = [s.rss_bytes / 2**20 for s in samples]
        steady = [(t, m) for t, m in zip(secs, mb) if t >= warmup_s]
        # the second half of the steady state: a leak still grows there, while the allocator's and
        # onnxruntime's settling steps (a few MB, in the first minutes) are behind it (docs/operations.md)
        late = [(t, m) for t, m in steady if t >= (steady[0][0] + steady[-1][0]) / 2] if steady else []
        late_t, late_mb = [t for t, _ in late], [m for _, m in late]
        memory.update(rss_start_mb=round(mb[0], 1), rss_end_mb=round(mb[-1], 1),
                      rss_peak_mb=round((sampled.peak_rss or 0) / 2**20, 1),
                      slope_mb_per_h=round(slope_per_hour([t for t, _ in steady], [m for _, m in steady]), 3),
                      steady_samples=len(steady),
                      late_slope_mb_per_h=round(slope_per_hour(late_t, late_mb), 3),
                      # how far that slope can be trusted: judged against it (worker.measure.metrics.judge_memory)
                      late_slope_se_mb_per_h=round(slope_se_per_hour(late_t, late_mb), 3),
                      late_samples=len(late), late_span_s=round(late[-1][0] - late[0][0], 1) if late else 0.0)
        if steady:  # the first and last sample after the warm-up: what a soak compares
            memory.update(steady_start_mb=round(steady[0][1], 1), steady_end_mb=round(steady[-1][1], 1))
        gpu = [(t, s.gpu_bytes / 2**20) for t, s in zip(secs, samples) if s.gpu_bytes is not None]
        if gpu:  # CUDA runs with NVML: reported, not judged (docs/gpu.md)
            gpu_steady = [(t, m) for t, m in gpu if t >= warmup_s]
            memory.update(gpu_start_mb=round(gpu[0][1], 1), gpu_end_mb=round(gpu[-1][1], 1),
                          gpu_peak_mb=round((sampled.peak_gpu or 0) / 2**20, 1),
                          gpu_slope_mb_per_h=round(slope_per_hour([t for t, _ in gpu_steady],
                                                                  [m for _, m in gpu_steady]), 3))
    return {"run": run["id"], "mode": run["mode"], "model": run["model"], "providers": run["providers"],
            "started_at": start.isoformat(), "finished_at": end.isoformat() if end else None,
            # when it ended: finished, else (killed, or still running) its last sign of life (`_last_seen`)
            "ended_at": run["ended_at"].isoformat() if run.get("ended_at") else None,
            "window": {"since": window.since.isoformat() if window.since else None,
                       "until": window.until.isoformat() if window.until else None},
            "counts": counts, "images_per_s": round(processed / span, 2) if span else None,
            "batch_size_mean": round(latency.batch_mean, 2) if latency.batch_mean is not None else None,
            "latency_ms": {s: {k: round(v, 2) for k, v in p.items()} for s, p in latency.by_stage.items()},
            "latency_images": latency.images,
            "memory": memory}
