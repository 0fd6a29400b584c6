"""D: `worker watch` itself fed at a steady rate, each image's latency as the pipeline records it and
from its landing to its input archived."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from sqlalchemy import select

from worker.config import Config
from worker.store.db import database
from worker.store.schema import ImageRow, TimingRow
from worker.measure.bench.results import CorpusResult


def first_by_stage(steady: Steady, copies: list[int]) -> str:
    """"queue_wait 3.8 / 1.8 ms, decode ..." for D's first image against the median of its copies: where
    a first image over p99 spent its time (a cold start shows in the stage it hit)."""
    theirs = np.median(steady.stage_ms[copies], axis=0)
    return ", ".join(f"{s} {a:.1f} / {b:.1f}" for s, a, b in zip(STAGES, steady.stage_ms[0], theirs)) + " ms"


def _copies_note(r: CorpusResult, n: int) -> str:
    """D's first image beside its own later copies: a cold start shows as the first over them, a
    picture that is simply the corpus's slowest does not."""
    if r.steady_first_copies_ms is None:
        return ""
    return (f" (the same picture {n} times later: median {r.steady_first_copies_ms:.0f} ms, highest "
            f"{r.steady_first_copies_max_ms:.0f} ms)")


# the stages each image's timings row records, in the order of Steady.stage_ms's columns
STAGES = ("queue_wait", "decode", "preprocess", "infer", "postprocess", "write")


@dataclass(frozen=True)
class Steady:
    """D's latencies, ms, one per image in landing order."""

    pipeline_ms: np.ndarray  # (N,) intake to result, as recorded in `timings.total_ms` (what `worker stats` reports)
    landed_ms: np.ndarray  # (N,) from the rename into the inbox to the outcome committed and the input archived
    stage_ms: np.ndarray  # (N, len(STAGES)) each image's recorded stages

    def __post_init__(self) -> None:
        n = self.pipeline_ms.shape
        if self.landed_ms.shape != n or self.pipeline_ms.ndim != 1 or not len(self.pipeline_ms) or \
                self.stage_ms.shape != (*n, len(STAGES)):
            raise ValueError(f"latency arrays of shapes {n}, {self.landed_ms.shape} and {self.stage_ms.shape}")


@contextlib.contextmanager
def _bench_heap_frozen() -> Iterator[None]:
    """Keep the bench's own objects out of Python's garbage collector while D runs `worker watch` in
    this process. Its full collections scan every object: one of 45-65 ms over the bench's ~100,000
    came due as D's watcher started and fell on its first image (PP-OCR at 640 px, three runs:
    176-186 ms, where its own copies later in the feed took 136-144 in the median, 155-158 at most).
    A `worker watch` process has no such heap (in a small one feeding D alone, its collections took
    at most 2.2 ms)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _steady(cfg: Config, files: list[Path], rate: float, work: Path) -> Steady:
    """`worker watch` itself (observer, intake, pipeline, archive) on a fresh inbox, fed one file every
    1/rate s the way a well-behaved producer delivers: written under a hidden name, then renamed
    into place. Starts feeding once the watcher says it is ready (model warm, observer live)."""
    from worker.intake.jobs import Job, JobStatus
    from worker.service import watch
    from worker.store.queries import Filters, query_images

    inbox = work / "inbox"
    inbox.mkdir(parents=True)
    cfg = dataclasses.replace(cfg, inbox=inbox, archive=work / "archive", outbox=work / "out")
    datas = [(p.name, p.read_bytes()) for p in files]
    landed: dict[str, float] = {}
    finished: dict[str, float] = {}
    all_done, ready, stop = threading.Event(), threading.Event(), threading.Event()
    failure: list[Exception] = []
    summary: list[Any] = []

    def on_finished(job: Job, status: JobStatus) -> None:
        finished[job.rel] = time.perf_counter()
        if status is not JobStatus.DONE:
            failure.append(RuntimeError(f"bench image {job.rel} failed in watch mode"))
        if len(finished) == len(datas):
            all_done.set()

    def serve() -> None:
        try:
            summary.append(watch(cfg, stop, on_finished=on_finished, ready=ready))
        except Exception as e:  # surfaced below, never a hang
            failure.append(e)
            ready.set()
            all_done.set()

    server = threading.Thread(target=serve, name="bench-watch")
    server.start()
    try:
        ready.wait()
        t0 = time.perf_counter()
        for i, (name, data) in enumerate(datas):
            if failure:
                break
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            (inbox / f".{name}.part").write_bytes(data)
            # timed before the rename: the file is invisible until then, and a feeder preempted right
            # after it would otherwise time its landing after the watcher had already taken the file
            landed[name] = time.perf_counter()
            os.rename(inbox / f".{name}.part", inbox / name)
        all_done.wait(timeout=600)
    finally:
        stop.set()
        server.join()
    if failure or not summary or len(finished) != len(datas):
        raise RuntimeError(f"watch-mode latency run incomplete ({len(finished)} of {len(datas)} images)") from (
            failure[0] if failure else None)
    with database(cfg.db) as db, db.connect() as c:  # the latencies as `worker query` reports them
        rows = query_images(db, Filters(run_id=summary[0].run_id, limit=len(datas)))
        stages = {rel: list(ms) for rel, *ms in c.execute(
            select(ImageRow.rel_path, *(getattr(TimingRow, f"{s}_ms") for s in STAGES))
            .join(TimingRow, TimingRow.image_id == ImageRow.id).where(ImageRow.run_id == summary[0].run_id))}
    recorded = {r["rel_path"]: r["total_ms"] for r in rows}
    names = [name for name, _ in datas]
    return Steady(pipeline_ms=np.array([recorded[n] for n in names]),
                  landed_ms=np.array([(finished[n] - landed[n]) * 1000 for n in names]),
                  stage_ms=np.array([stages[n] for n in names]))
