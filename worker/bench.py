"""`worker bench`: how close `worker run` comes to this machine's limit, measured side by side.

For each corpus (the demo images resized to 640 and 1920 px wide, saved as JPEG) it measures:
  A  bare `session.run` on ready tensors: 1 intra-op thread and all cores, batch 1..8 (best of 3);
     and, on the corpus's own tensors, 1 thread alone and one 1-thread run per core at once
     ("parallel": what the pipeline's inference threads do; memory-heavy models do not scale to
     cores x the 1-thread rate);
  B  the naive sequential loop a user would write (read, decode, preprocess, run, postprocess, write JSON
     into a new folder, as C does), its preprocessing plain numpy as such a script would write it;
     B' the same loop with the worker's own preprocessing (faster): C/B' is the stricter ratio;
  C  `worker run` itself (a fresh process), default config, database and outbox writes on;
and the per-stage costs on one thread (20 images), from which the limit is
  limit          = cores / (1/bare_1_thread + t_decode + t_preprocess + t_postprocess)
  limit-parallel = cores / (cores/bare_parallel + t_decode + t_preprocess + t_postprocess).
This machine's speed drifts by +-20% over minutes, so B and C run in `rounds` rounds and A's two
rates and the stage costs are measured right before and right after each round's B and C (their mean
stands for that round); ratios are taken within a round and the median round is reported;
  D  `worker watch` itself, fed files at a steady half of C's rate (each written under a hidden name,
     then renamed into the inbox): per-image latency, first image included, as the pipeline records
     it (intake to result) and from the file's landing to its outcome committed and the input archived;
     the first image (the corpus's largest picture) also beside its own later copies in the feed.
     D runs in this process, with the bench's own objects frozen out of the garbage collector.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import cv2
import numpy as np
import onnxruntime as ort
from sqlalchemy import select

from worker.config import Config
from worker.engine import Engine, wanted_providers
from worker.images import decode, widen
from worker.model_output import ModelOutput
from worker.models.card import Preprocess, find_card
from worker.models.pull import pull, with_labels
from worker.samples import fetch_samples
from worker.store.db import database
from worker.store.queries import run_stats
from worker.store.schema import ImageRow, TimingRow
from worker.tasks import adapter_for
from worker.tasks.preprocess import Geometry, resize_for


@dataclass(frozen=True)
class CorpusResult:
    model: str
    width: int
    images: int
    bare_1t: float  # img/s, 1 intra-op thread, batch 1
    bare_best: float  # img/s, best of threads x batch
    bare_best_at: str
    bare_parallel: float  # img/s, one 1-thread run per core at once on one session (what the pipeline does)
    decode_ms: float
    preprocess_ms: float
    postprocess_ms: float
    plain_preprocess_ms: float  # B's plain preprocessing, on one thread
    limit: float  # cores / (1/bare_1t + stages)
    limit_parallel: float  # the same with inference at bare_parallel: cores / (cores/bare_parallel + stages)
    naive: float  # B: the loop with plain preprocessing
    naive_worker_pre: float  # B': the same loop with the worker's preprocessing
    worker: float
    ratio_naive: float  # C/B, median of the rounds' ratios
    ratio_naive_worker_pre: float  # C/B', median of the rounds' ratios
    worker_p50_ms: float
    worker_p99_ms: float
    worker_rss_peak_mb: float
    steady_rate: float  # D: images/s offered, half of C
    steady_first_ms: float
    steady_p50_ms: float
    steady_p99_ms: float
    steady_landed_p50_ms: float  # D, from the rename into the inbox to committed and archived
    steady_landed_p99_ms: float
    create_file_us: float  # creating one small file in C's outbox, highest of the rounds (see _create_cost)
    # D: the median and highest latency of the later images that are byte-for-byte copies of the first
    # (the corpus cycles through the sample photographs): the first image against itself, warm. None
    # without copies.
    steady_first_copies_ms: float | None = None
    steady_first_copies_max_ms: float | None = None

    @property
    def ratio_limit(self) -> float:
        return self.worker / self.limit

    @property
    def ratio_parallel(self) -> float:
        return self.worker / self.limit_parallel


@dataclass(frozen=True)
class _Round:
    """One round's figures: A's rates are the mean of the measurements just before and just after B and C."""

    one_t: float
    parallel: float
    stages_ms: tuple[float, float, float]  # decode, preprocess, postprocess on one thread
    plain_pre_ms: float  # B's plain preprocessing on one thread
    naive: float
    naive_worker_pre: float
    worker: dict[str, float]
    rss_peak: float
    limit: float
    limit_parallel: float
    create_file_us: float

    @property
    def ratio_limit(self) -> float:
        return self.worker["images_per_s"] / self.limit

    @property
    def ratio_naive(self) -> float:
        return self.worker["images_per_s"] / self.naive

    @property
    def ratio_naive_worker_pre(self) -> float:
        return self.worker["images_per_s"] / self.naive_worker_pre


# the targets `worker bench` holds its figures to (`--check`: exit 1 when one is missed)
LIMIT_TARGET = 0.85  # C/limit, every model and corpus
NAIVE_TARGETS = {640: 1.3, 1920: 1.5}  # C/B for efficientnet-lite0, where decoding weighs as much as the model
NAIVE_MODEL = "efficientnet-lite0"
TAIL_TARGET = 2.0  # D: p99 <= 2 x p50
RSS_TARGET_MB = 400.0  # efficientnet-lite0's peak RSS in `worker run`


@dataclass(frozen=True)
class Verdict:
    """One target on one corpus: `value` against `bound` (`at_least`: value >= bound, else <=)."""

    where: str  # "efficientnet-lite0 640 px"
    what: str  # what it measures, in words, e.g. "worker run / machine limit (C/limit)"
    value: float
    bound: float
    at_least: bool
    decimals: int = 2  # as printed: ratios to 2, megabytes to 0

    @property
    def met(self) -> bool:
        return self.value >= self.bound if self.at_least else self.value <= self.bound

    def __str__(self) -> str:
        value = f"{self.value:.{self.decimals}f}"
        return (f"{'met   ' if self.met else 'MISSED'}  {self.where:26s} {self.what} {value} "
                f"{'>=' if self.at_least else '<='} {self.bound:g}")


def verdicts(results: list[CorpusResult]) -> list[Verdict]:
    """Each corpus's median round against the targets (the watcher's first image: no spike over p99)."""
    out: list[Verdict] = []
    for r in results:
        where = f"{r.model} {r.width} px"
        out.append(Verdict(where, "worker run / machine limit (C/limit)", r.ratio_limit, LIMIT_TARGET, True))
        if r.model == NAIVE_MODEL and r.width in NAIVE_TARGETS:
            out.append(Verdict(where, "worker run / plain loop (C/B)", r.ratio_naive, NAIVE_TARGETS[r.width], True))
        out.append(Verdict(where, "watch latency p99 / p50 (D p99/p50)", r.steady_p99_ms / r.steady_p50_ms, TAIL_TARGET,
                           False))
        out.append(Verdict(where, "watch first image / p99 latency (D first/p99)", r.steady_first_ms / r.steady_p99_ms, 1.0,
                           False))
        if r.model == NAIVE_MODEL:
            out.append(Verdict(where, f"worker run peak memory over {r.images} images, MB (C peak RSS)", r.worker_rss_peak_mb,
                               RSS_TARGET_MB,
                               False, decimals=0))
    return out


def median(values: list[float]) -> float:
    return float(np.median(values))


def make_corpus(samples: Path, width: int, count: int, dest: Path) -> list[Path]:
    """`count` JPEGs `width` px wide, cycling through the sample photographs."""
    dest.mkdir(parents=True, exist_ok=True)
    # the worker's own decoder: OpenCV's imread would print libpng's colour-profile warnings
    sources = [decode(p.read_bytes(), p.name, 0) for p in sorted(samples.iterdir()) if p.suffix in (".png", ".jpg")]
    sources = [s for s in sources if s.shape[1] >= 300]
    out = []
    for i in range(count):
        img = sources[i % len(sources)]
        h = round(img.shape[0] * width / img.shape[1])
        big = cv2.resize(img, (width, h), interpolation=cv2.INTER_CUBIC)
        path = dest / f"img_{i:04d}.jpg"
        cv2.imwrite(str(path), big, [cv2.IMWRITE_JPEG_QUALITY, 90])
        out.append(path)
    return out


def _best_rate(fn: Callable[[], int], seconds: float = 1.5) -> float:
    """Items/s of fn() (which returns the items it did), best of 3 runs of about `seconds` each."""
    best = 0.0
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            n += fn()
        best = max(best, n / (time.perf_counter() - t0))
    return best


def _per_item(fn: Callable[[Any], Any], items: list[Any]) -> float:
    """Seconds per call of fn(item) over the items, each result dropped before the next call, as in
    a loop over images. (Keeping them all alive, as a list comprehension does, adds the page faults
    of fresh memory for every image: 20 decoded 1920 px photos are 200 MB, and that up to doubled the
    measured decode cost at 1920 px, which made the limit too low.)"""
    fn(items[0])  # first call: lazy initialisation in the libraries
    t0 = time.perf_counter()
    for item in items:
        fn(item)
    return (time.perf_counter() - t0) / len(items)


# Creating a file normally costs about 0.1 ms here. ext4 without a journal (this machine's) skips
# every inode freed in the last minute or so (five minutes more while its inode table block is not
# yet written back), one by one, on each create: after thousands of deletions nearby, each new file
# costs ~1 ms of kernel CPU (tests/perf/create_after_delete.py). B and C pay it (C for every output),
# the limit does not; the bench reports it so that such a round is seen for what it is.
SLOW_CREATE_US = 300.0


def _create_cost(folder: Path, n: int = 50) -> float:
    """Microseconds to create, write and close one small file in `folder` (made if missing), mean of `n`.

    The files are kept (deleting them would slow the creates that follow, see SLOW_CREATE_US)."""
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(n):
        (folder / f".create-probe-{i}").write_bytes(b"{}")
    return (time.perf_counter() - t0) / n * 1e6


def _mean_rates(run: Callable[[np.ndarray], ModelOutput], tensors: list[np.ndarray], cores: int,
                seconds: float = 1.5) -> tuple[float, float]:
    """(1-thread rate, rate of `cores` threads calling the same 1-thread engine's `run` at once), img/s,
    each the mean over `seconds` (a mean, not a best: it stands for the minutes around it)."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        run(tensors[n % len(tensors)])
        n += 1
    single = n / (time.perf_counter() - t0)
    counts = [0] * cores
    stop = threading.Event()

    def loop(i: int) -> None:
        while not stop.is_set():
            run(tensors[(i + cores * counts[i]) % len(tensors)])
            counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,), name=f"bench-parallel-{i}") for i in range(cores)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join()
    return single, sum(counts) / (time.perf_counter() - t0)


def _default_session(path: Path, providers: list[Any]) -> ort.InferenceSession:
    """A session with onnxruntime's default options, as a user's own loop makes it."""
    return ort.InferenceSession(str(path), sess_options=ort.SessionOptions(), providers=providers)


def bench_model(cfg: Config, model: str, widths: tuple[int, ...], count: int, work: Path,
                say: Callable[[str], None], rounds: int = 3) -> list[CorpusResult]:
    card = with_labels(find_card(cfg.models_dir, model), cfg.cache_dir)
    onnx = pull(card, cfg.cache_dir)
    adapter = adapter_for(card)
    h, w = card.input.size[0], card.input.size[1]
    cores = os.cpu_count() or 1

    # A and B on the device C runs on: CUDA when it is really active (onnxruntime-gpu falls back to CPU
    # without a GPU, saying so once, here). Every session is fed and read as `worker run` feeds and reads
    # the model (its layout, element type, fixed batch, sizes input and outputs: Engine.feeds / outputs)
    one = Engine.for_card(onnx, cfg.engine, 1, card)  # for the limit, re-measured in every round
    on_gpu = one.on_gpu
    providers: list[Any] = [p for p in wanted_providers(cfg.engine) if on_gpu or p == "CPUExecutionProvider"]
    if on_gpu:
        say("  on CUDA: the model does not run on the cores, so the limit (cores over its 1-thread time plus the "
            "stages) does not bound C there; A best, B and C/B are the figures that count")

    # A: bare session.run on ready tensors
    x1 = np.random.default_rng(0).standard_normal((8, card.preprocess.channels, h, w)).astype(np.float32)
    bare: dict[tuple[int, int], float] = {}
    for threads in sorted({1, cores}):
        eng = one if threads == 1 else Engine.for_card(onnx, cfg.engine, threads, card)
        for batch in ((1, 2, 4, 8) if card.input.dynamic_batch else (1,)):
            eng.run(x1[:batch])

            def one_call(eng: Engine = eng, b: int = batch) -> int:
                eng.run(x1[:b])
                return b
            bare[(threads, batch)] = _best_rate(one_call)
    bare_1t = bare[(1, 1)]
    (bt, bb), best = max(bare.items(), key=lambda kv: kv[1])
    say(f"  A bare session.run: 1 thread batch 1 {bare_1t:.1f} img/s; best {best:.1f} img/s "
        f"({bt} threads, batch {bb})")

    session = _default_session(onnx, providers)  # what a user's naive loop gets

    def naive_run(x: np.ndarray) -> ModelOutput:
        return one.outputs(session.run(one.output_names, one.feeds(x)), len(x))

    results = []
    samples = fetch_samples(cfg.cache_dir)
    for width in widths:
        folder = work / f"{model}-{width}"
        files = make_corpus(samples, width, count, folder)
        datas = [p.read_bytes() for p in files[:20]]
        imgs = [decode(d, "x", cfg.pipeline.max_pixels, card.preprocess.depth) for d in datas]
        pre = [adapter.preprocess(im) for im in imgs]
        outs = [naive_run(x[None])[0] for x, _ in pre[:5]]
        tensors = [x[None] for x, _ in pre]
        size_hw = (card.input.size[0], card.input.size[1])

        def plain(image: np.ndarray) -> tuple[np.ndarray, Geometry]:
            if card.preprocess.depth == 16 and image.dtype == np.uint8:  # the corpus is JPEGs: 8-bit
                image = widen(image)
            return plain_preprocess(image, card.preprocess, size_hw)

        def machine() -> tuple[float, float, float, float, float, float]:
            """(A 1 thread, A parallel, t_decode, t_preprocess, t_postprocess, B's t_preprocess) now; the
            stage costs on one thread."""
            t_dec = _per_item(lambda d: decode(d, "x", cfg.pipeline.max_pixels, card.preprocess.depth), datas)
            t_pre = _per_item(adapter.preprocess, imgs)
            t_post = _per_item(lambda og: adapter.postprocess(og[0], og[1][1]), list(zip(outs * 4, pre)))
            t_plain = _per_item(plain, imgs)
            return (*_mean_rates(one.run, tensors, cores), t_dec, t_pre, t_post, t_plain)

        # rounds: A's rates and the stage costs are measured right before and right after B and C, so
        # each round's limit holds for the minutes C ran in (this machine's speed drifts by +-20%);
        # every ratio is taken within a round, and the median round is reported
        rounds_seen: list[_Round] = []
        for k in range(rounds):
            before = machine()
            # C: `worker run` itself in a fresh process (its peak RSS is its own), default config,
            # fresh database and outbox each time
            c = dataclasses.replace(cfg, model=model, outbox=work / f"out-{model}-{width}-{k}",
                                    db=f"sqlite:///{work / f'bench-{model}-{width}-{k}.db'}")
            create_us = _create_cost(c.outbox)  # where C's outputs will be created
            # each round's B writes new files, as C does: rewriting last round's files costs no inode
            # allocation, which is not free here (see SLOW_CREATE_US)
            # B and B' in alternate order from round to round, so neither always runs on the warmer machine
            naive_rates: dict[str, float] = {}
            for which in (("plain", "worker") if k % 2 == 0 else ("worker", "plain")):
                naive_rates[which] = _naive_loop(files, plain if which == "plain" else adapter.preprocess, adapter,
                                                 naive_run, work / f"naive-{which}-{model}-{width}-{k}")
            run_id, figures = _worker_run(c, folder)
            after = machine()
            with database(c.db) as db:
                (st,) = run_stats(db, run_id=run_id, warmup_s=0)
            one_t, par, t_dec, t_pre, t_post, t_plain = ((a + b) / 2 for a, b in zip(before, after))
            stages = t_dec + t_pre + t_post
            rnd = _Round(one_t=one_t, parallel=par, stages_ms=(t_dec * 1e3, t_pre * 1e3, t_post * 1e3),
                         plain_pre_ms=t_plain * 1e3, naive=naive_rates["plain"], naive_worker_pre=naive_rates["worker"],
                         worker=figures, rss_peak=st["memory"].get("rss_peak_mb", 0.0),
                         limit=cores / (1 / one_t + stages), limit_parallel=cores / (cores / par + stages),
                         create_file_us=create_us)
            rounds_seen.append(rnd)
            say(f"    round {k + 1}: A 1 thread {one_t:.1f}, A parallel {par:.1f} img/s, stages {stages * 1e3:.1f} ms "
                f"-> limit {rnd.limit:.1f} | B {rnd.naive:.1f} (plain preprocessing {t_plain * 1e3:.2f} ms), B' "
                f"{rnd.naive_worker_pre:.1f} (the worker's, {t_pre * 1e3:.2f} ms) | C {figures['images_per_s']:.1f} "
                f"img/s (C/limit {rnd.ratio_limit:.2f}, C/B {rnd.ratio_naive:.2f}, "
                f"C/B' {rnd.ratio_naive_worker_pre:.2f}; C at the limit would make C/B {rnd.limit / rnd.naive:.2f}); "
                f"creating a file {create_us:.0f} us")
            if create_us > SLOW_CREATE_US:
                say(f"    (creating a file took {create_us:.0f} us, over {SLOW_CREATE_US:.0f}: if many files were "
                    f"deleted on this filesystem in the last minutes, ext4 without a journal skips their inodes "
                    f"one by one on every create; B and C pay it for every output, the limit does not)")
        med = sorted(rounds_seen, key=lambda r: r.ratio_limit)[len(rounds_seen) // 2]
        f = med.worker
        # D: watch mode fed at a steady half of C's rate: latency, not throughput
        rate = f["images_per_s"] / 2
        fed = files[: max(20, min(len(files), int(rate * 20)))]
        with _bench_heap_frozen():
            steady = _steady(dataclasses.replace(c, db=f"sqlite:///{work / f'steady-{model}-{width}.db'}"),
                             fed, rate, work / f"steady-{model}-{width}")
        lat = steady.pipeline_ms
        copies = copies_of_first(fed)
        r = CorpusResult(model=model, width=width, images=len(files), bare_1t=med.one_t, bare_best=best,
                         bare_best_at=f"{bt}t b{bb}", bare_parallel=med.parallel, decode_ms=med.stages_ms[0],
                         preprocess_ms=med.stages_ms[1], postprocess_ms=med.stages_ms[2],
                         plain_preprocess_ms=med.plain_pre_ms, limit=med.limit,
                         limit_parallel=med.limit_parallel, naive=med.naive,
                         naive_worker_pre=med.naive_worker_pre, worker=f["images_per_s"],
                         worker_p50_ms=f["p50"], worker_p99_ms=f["p99"],
                         worker_rss_peak_mb=max(x.rss_peak for x in rounds_seen),
                         ratio_naive=median([x.ratio_naive for x in rounds_seen]),
                         ratio_naive_worker_pre=median([x.ratio_naive_worker_pre for x in rounds_seen]),
                         steady_rate=rate, steady_first_ms=float(lat[0]), steady_p50_ms=float(np.percentile(lat, 50)),
                         steady_p99_ms=float(np.percentile(lat, 99)),
                         steady_landed_p50_ms=float(np.percentile(steady.landed_ms, 50)),
                         steady_landed_p99_ms=float(np.percentile(steady.landed_ms, 99)),
                         create_file_us=max(x.create_file_us for x in rounds_seen),
                         steady_first_copies_ms=float(np.median(lat[copies])) if copies else None,
                         steady_first_copies_max_ms=float(np.max(lat[copies])) if copies else None)
        say(f"  {width} px: decode {r.decode_ms:.1f} ms, preprocess {r.preprocess_ms:.1f} ms (plain "
            f"{r.plain_preprocess_ms:.1f} ms), postprocess {r.postprocess_ms:.1f} ms; median round: A 1 thread "
            f"{r.bare_1t:.1f} img/s -> limit {r.limit:.1f} img/s | B naive {r.naive:.1f}, B' "
            f"{r.naive_worker_pre:.1f} | C worker run {r.worker:.1f} img/s (C/limit {r.ratio_limit:.2f}, "
            f"C/limit-parallel {r.ratio_parallel:.2f}; C/B median {r.ratio_naive:.2f}, C/B' median "
            f"{r.ratio_naive_worker_pre:.2f}), p50 {r.worker_p50_ms:.0f} ms p99 {r.worker_p99_ms:.0f} ms, peak RSS "
            f"{r.worker_rss_peak_mb:.0f} MB | D watch mode, steady {rate:.1f} img/s: first {r.steady_first_ms:.0f} "
            f"ms{_copies_note(r, len(copies))}, p50 {r.steady_p50_ms:.0f} ms, p99 {r.steady_p99_ms:.0f} ms (p99/p50 "
            f"{r.steady_p99_ms / r.steady_p50_ms:.2f}); landed to archived p50 {r.steady_landed_p50_ms:.0f} ms, "
            f"p99 {r.steady_landed_p99_ms:.0f} ms")
        if copies:
            say(f"    D's first image by stage, against its copies' median: {first_by_stage(steady, copies)}")
        results.append(r)
    return results


def copies_of_first(files: list[Path]) -> list[int]:
    """Indexes of the later files with the same bytes as the first (the corpus repeats its pictures)."""
    first = files[0].read_bytes()
    return [i for i, p in enumerate(files) if i and p.stat().st_size == len(first) and p.read_bytes() == first]


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


def plain_preprocess(image: np.ndarray, spec: Preprocess, size_hw: tuple[int, int]) -> tuple[np.ndarray, Geometry]:
    """The card's preprocessing as a plain per-image script writes it: the resize, then the colour
    order and normalisation with numpy broadcasting and a transpose. The same tensor as the worker's
    `prepare`, which normalises one channel at a time, a few times faster on this CPU
    (`python tests/perf/hot_path.py`)."""
    resized, geo = resize_for(image, spec, size_hw)
    if spec.color == "rgb":
        resized = cv2.cvtColor(resized, cv2.COLOR_BGR2RGB)
    elif spec.color == "gray":
        resized = cv2.cvtColor(resized, cv2.COLOR_BGR2GRAY)[:, :, None]
    n = spec.channels
    x = (resized.astype(np.float32) - np.array(spec.mean[:n], np.float32)) / np.array(spec.std[:n], np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1)), geo


def _naive_loop(files: list[Path], preprocess: Callable[[np.ndarray], tuple[np.ndarray, Geometry]], adapter: Any,
                run: Callable[[np.ndarray], ModelOutput], out: Path) -> float:
    """Images/s of the sequential loop a user would write: read, preprocess, run, postprocess, write JSON
    (the worker's postprocess: a plain one would be slower still)."""
    out.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    for p in files:
        img = cv2.imread(str(p), cv2.IMREAD_COLOR)
        x, g = preprocess(img)
        y = run(x[None])[0]
        r = adapter.postprocess(y, g)
        (out / f"{p.name}.json").write_text(json.dumps(r.summary()))
    return len(files) / (time.perf_counter() - t0)


def _worker_run(cfg: Config, folder: Path) -> tuple[int, dict[str, float]]:
    """Run the `worker run` command in a subprocess; returns its run id and the figures it printed."""
    config = ["--config", str(cfg.source)] if cfg.source else []
    cmd = [sys.executable, "-m", "worker", *config, "run", str(folder), "--no-progress", "--model", cfg.model,
           "--outbox", str(cfg.outbox), "--db", cfg.db]
    out = subprocess.run(cmd, capture_output=True, text=True)
    run = re.search(r"^run (\d+) ", out.stdout, re.M)
    rate = re.search(r"([\d.]+) images/s over [\d.]+ s; latency ms p50 ([\d.]+) p95 [\d.]+ p99 ([\d.]+)", out.stdout)
    if out.returncode != 0 or run is None or rate is None:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout}\n{out.stderr[-2000:]}")
    return int(run[1]), {"images_per_s": float(rate[1]), "p50": float(rate[2]), "p99": float(rate[3])}


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
    from worker.jobs import Job, JobStatus
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


def run_bench(cfg: Config, models: tuple[str, ...], widths: tuple[int, ...], count: int,
              say: Callable[[str], None], rounds: int = 3) -> list[CorpusResult]:
    say(f"worker bench: {os.cpu_count()} cores, onnxruntime {ort.__version__}, {count} images per corpus, "
        f"{rounds} rounds of A, B, B' and C side by side, median round reported")
    results: list[CorpusResult] = []
    with tempfile.TemporaryDirectory(prefix="worker-bench-") as tmp:
        for m in models:
            say(f"model {m}")
            results += bench_model(cfg, m, widths, count, Path(tmp), say, rounds)
    say("")
    say("| model | corpus | A bare 1 thread | A best | A parallel | limit | limit-parallel | B naive | B' | "
        "C worker run | C/limit | C/limit-parallel | C/B | C/B' | C peak RSS MB | D rate | D first ms | D p50 ms | "
        "D p99 ms | D landed p50 ms | D landed p99 ms |")
    say("|---" * 21 + "|")
    for r in results:
        say(f"| {r.model} | {r.width} px | {r.bare_1t:.1f} | {r.bare_best:.1f} ({r.bare_best_at}) | "
            f"{r.bare_parallel:.1f} | {r.limit:.1f} | {r.limit_parallel:.1f} | {r.naive:.1f} | "
            f"{r.naive_worker_pre:.1f} | {r.worker:.1f} | {r.ratio_limit:.2f} | {r.ratio_parallel:.2f} | "
            f"{r.ratio_naive:.2f} | {r.ratio_naive_worker_pre:.2f} | {r.worker_rss_peak_mb:.0f} | "
            f"{r.steady_rate:.1f} | {r.steady_first_ms:.0f} | {r.steady_p50_ms:.0f} | {r.steady_p99_ms:.0f} | "
            f"{r.steady_landed_p50_ms:.0f} | {r.steady_landed_p99_ms:.0f} |")
    checked = verdicts(results)
    say("")
    say("Targets, median round (a miss by a few percent can be this machine's drift: compare C/limit-parallel, "
        "and rerun):")
    for v in checked:
        say(f"  {v}")
    missed = [v for v in checked if not v.met]
    say(f"  {len(checked) - len(missed)} of {len(checked)} targets met" + (f"; missed: {len(missed)}" if missed else ""))
    return results


def as_dicts(results: list[CorpusResult]) -> list[dict[str, Any]]:
    """`--json`: one dict per corpus, its figures, ratios and targets (what each measured, against what, met)."""
    return [{**dataclasses.asdict(r), "ratio_limit": r.ratio_limit, "ratio_parallel": r.ratio_parallel,
             "targets": [{"where": v.where, "what": v.what, "value": v.value, "bound": v.bound,
                          "at_least": v.at_least, "met": v.met} for v in verdicts([r])]}
            for r in results]
