"""`worker soak`: replay images through the full pipeline for hours, then judge memory and latency."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable


from worker.config import Config, without_password
from worker.errors import ConfigError
from worker.intake.scan import walk
from worker.intake.jobs import Job, JobStatus
from worker.measure.metrics import judge_memory, percentiles
from worker.host.names import as_text
from worker.service import open_pipeline
from worker.store.db import database, sqlite_file
from worker.store.queries import runs_over
from worker.store.stats import memory_so_far, run_stats


@dataclass(frozen=True)
class SoakVerdict:
    run_id: int
    images: int
    seconds: float
    rss_slope_mb_per_h: float  # least squares over every sample after warm-up
    rss_late_slope_mb_per_h: float  # ... over the second half of those: what the verdict judges
    rss_late_slope_se_mb_per_h: float  # its standard error (nan: too few samples to tell)
    rss_start_mb: float  # first sample after warm-up
    rss_end_mb: float
    rss_peak_mb: float
    samples: int
    p50_start_ms: float
    p99_start_ms: float
    p50_end_ms: float
    p99_end_ms: float
    failures: tuple[str, ...]
    inconclusive: tuple[str, ...] = ()  # over a limit, but by less than this run can resolve
    notes: tuple[str, ...] = ()  # what the verdict cannot tell (a run too short to resolve the limit)

    @property
    def passed(self) -> bool:
        return not self.failures and not self.inconclusive

    @property
    def verdict(self) -> str:
        return "FAIL" if self.failures else "INCONCLUSIVE" if self.inconclusive else "PASS"


@dataclass(frozen=True)
class SoakProgress:
    """How a soak is going, said every few seconds while it runs."""

    elapsed_s: float
    duration_s: float
    images: int
    rss_mb: float
    slope_mb_per_h: float  # least squares over the RSS samples after warm-up so far; nan: too few yet

    @property
    def images_per_s(self) -> float:
        return self.images / self.elapsed_s if self.elapsed_s > 0 else 0.0


MARKER = ".worker-soak"  # in a soak's outbox: a later soak may overwrite it


def soak_workspace(cfg: Config, outbox_given: bool, db_given: bool, now: datetime | None = None) -> Config:
    """The outbox and database a soak writes: its own, in a new folder beside the config's outbox
    (`soak-YYYYmmdd-HHMMSS/outbox`, `.../soak.db`), unless given. A soak replays images and overwrites
    their outputs and rows: in a watcher's outbox or database it would replace that watcher's results."""
    if outbox_given and db_given:
        return cfg
    home = cfg.outbox.parent / f"soak-{(now or datetime.now()).strftime('%Y%m%d-%H%M%S')}"
    return dataclasses.replace(cfg, outbox=cfg.outbox if outbox_given else home / "outbox",
                               db=cfg.db if db_given else f"sqlite:///{home / 'soak.db'}")


def _refuse_others(cfg: Config, folder: Path) -> None:
    """A soak never touches another run's outputs or history: an outbox with files of something else, or
    a database that holds a `run` or `watch` over the same folder, is refused with the way out."""
    if cfg.outbox.is_dir() and not (cfg.outbox / MARKER).exists() and any(cfg.outbox.iterdir()):
        raise ConfigError(f"soak: the outbox {cfg.outbox} holds other outputs, which a soak would overwrite: give "
                          f"it a new or empty --outbox (or leave --outbox out for a folder of its own)")
    if (file := sqlite_file(cfg.db)) is not None and not file.exists():  # a new database: its own
        return
    with database(cfg.db) as db:
        others = runs_over(db, as_text(str(folder)), exclude_mode="soak")
    if others:
        raise ConfigError(f"soak: the database {without_password(cfg.db)} holds the results of runs over {folder} "
                          f"(run {', '.join(map(str, others[:3]))}), which a soak would replace: give it its own "
                          f"--db (or leave --db out for a database of its own)")


PROGRESS_S = 30.0  # a soak says how it goes this often


def soak(cfg: Config, folder: Path, duration_s: float, stop: threading.Event | None = None,
         on_finished: Callable[[Job, JobStatus], None] | None = None, warmup_s: float | None = None,
         progress: Callable[[SoakProgress], None] | None = None, progress_s: float = PROGRESS_S) -> SoakVerdict:
    """Replay the images under `folder` through the full pipeline for `duration_s` into cfg's outbox
    and database (see `soak_workspace`; outputs are overwritten, not accumulated), saying how it goes
    every `progress_s`, then judge the memory and latency trend against cfg.soak."""
    folder = folder.absolute()
    paths = list(walk(folder, cfg.extensions, skip=(cfg.outbox,)))
    if not paths:
        raise ConfigError(f"{folder}: no images to soak with")
    _refuse_others(cfg, folder)
    warm = cfg.metrics.warmup_s if warmup_s is None else warmup_s
    cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, warmup_s=warm))  # on record: stats, report
    with open_pipeline(cfg, "soak", folder, on_finished=on_finished, replay=True) as pipeline:
        (cfg.outbox / MARKER).touch()
        t0 = time.monotonic()
        n = 0
        next_said = t0 + progress_s
        # a constant number in flight: steady memory and latencies that measure processing, not queueing
        in_flight = 2 * (pipeline.settings.decode_workers + pipeline.settings.infer_workers)
        while (now := time.monotonic()) - t0 < duration_s and not (stop is not None and stop.is_set()):
            if progress is not None and now >= next_said:  # from the samples the pipeline's sampler records
                next_said = now + progress_s
                rss_mb, slope = memory_so_far(pipeline.recorder.engine, pipeline.recorder.run_id, warm)
                progress(SoakProgress(now - t0, duration_s, n, rss_mb, slope))
            pipeline.wait_for_room(in_flight)
            pipeline.submit(Job.from_path(folder, paths[n % len(paths)]))
            n += 1
        pipeline.finish_or_abandon(stop)
        seconds = time.monotonic() - t0
        run_id, lat = pipeline.recorder.run_id, pipeline.counts.latencies_ms
    with database(cfg.db) as db:
        (stats,) = run_stats(db, run_id=run_id, warmup_s=warm)
    mem = stats["memory"]
    slope = mem.get("slope_mb_per_h", float("nan"))
    late = mem.get("late_slope_mb_per_h", float("nan"))
    start, end = percentiles(lat.first()), percentiles(lat.last())
    failures, inconclusive, notes = judge_memory(mem, cfg.soak.max_rss_slope_mb_per_h, warm)
    if "gpu_peak_mb" in mem:
        notes.append(f"GPU memory {mem['gpu_start_mb']} -> {mem['gpu_end_mb']} MB (peak {mem['gpu_peak_mb']} MB), "
                     f"slope {mem['gpu_slope_mb_per_h']:.2f} MB/h after warm-up (reported, not judged)")
    ratio = cfg.soak.max_p99_ratio
    if ratio and end["p99"] > ratio * start["p99"]:
        failures.append(f"p99 latency grew from {start['p99']:.1f} to {end['p99']:.1f} ms (limit x{ratio})")
    return SoakVerdict(run_id=run_id, images=n, seconds=round(seconds, 1), rss_slope_mb_per_h=slope,
                       rss_late_slope_mb_per_h=late,
                       rss_late_slope_se_mb_per_h=mem.get("late_slope_se_mb_per_h", float("nan")),
                       rss_start_mb=mem.get("steady_start_mb", float("nan")),
                       rss_end_mb=mem.get("steady_end_mb", float("nan")),
                       rss_peak_mb=mem.get("rss_peak_mb", float("nan")), samples=mem.get("steady_samples", 0),
                       p50_start_ms=start["p50"], p99_start_ms=start["p99"], p50_end_ms=end["p50"],
                       p99_end_ms=end["p99"], failures=tuple(failures),
                       inconclusive=tuple(inconclusive), notes=tuple(notes))


