"""One model's bench: A (bare inference) once, then for each corpus width the rounds of B, B' and C
side by side with the machine's limit, and D (the watcher fed at a steady rate); one CorpusResult each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from worker.config import Config
from worker.host.cores import usable_cores
from worker.images import decode, widen
from worker.measure.bench.corpus import SLOW_CREATE_US, _create_cost, copies_of_first, make_corpus
from worker.measure.bench.loops import (_best_rate, _default_session, _mean_rates, _naive_loop, _per_item, _worker_run,
                                        plain_preprocess)
from worker.measure.bench.results import CorpusResult, _Round, median
from worker.measure.bench.steady import Steady, _bench_heap_frozen, _copies_note, _steady, first_by_stage
from worker.measure.samples import fetch_samples
from worker.models.card import ModelCard
from worker.models.lookup import find_card
from worker.models.pull import pull, with_labels
from worker.runtime.engine import Engine, wanted_providers
from worker.runtime.model_output import ModelOutput
from worker.store.db import database
from worker.store.stats import run_stats
from worker.tasks import TaskAdapter, adapter_for
from worker.tasks.preprocess import Geometry


@dataclass(frozen=True)
class _Model:
    """What every corpus of one model is measured with."""

    cfg: Config
    name: str
    card: ModelCard
    adapter: TaskAdapter
    one: Engine  # 1 intra-op thread: A 1 thread and the limit, re-measured in every round
    naive_run: Callable[[np.ndarray], ModelOutput]  # B's session.run, onnxruntime's default threads
    cores: int


@dataclass(frozen=True)
class _Bare:
    """A: bare session.run on ready tensors, best of 1 and all threads, batch 1 to 8."""

    one_thread: float
    best: float
    best_at: str  # "2t b4"


def bench_model(cfg: Config, model: str, widths: tuple[int, ...], count: int, work: Path,
                say: Callable[[str], None], rounds: int = 3) -> list[CorpusResult]:
    card = with_labels(find_card(cfg.models_dir, model), cfg.cache_dir)
    onnx = pull(card, cfg.cache_dir)
    cores = usable_cores()
    # A and B on the device C runs on: CUDA when it is really active (onnxruntime-gpu falls back to CPU
    # without a GPU, saying so once, here). Every session is fed and read as `worker run` feeds and reads
    # the model (its layout, element type, fixed batch, sizes input and outputs: Engine.feeds / outputs)
    one = Engine.for_card(onnx, cfg.engine, 1, card)
    providers: list[Any] = [p for p in wanted_providers(cfg.engine) if one.on_gpu or p == "CPUExecutionProvider"]
    if one.on_gpu:
        say("  on CUDA: the model does not run on the cores, so the limit (cores over its 1-thread time plus the "
            "stages) does not bound C there; A best, B and C/B are the figures that count")
    bare = _bare_rates(cfg, card, onnx, one, cores)
    say(f"  A bare session.run: 1 thread batch 1 {bare.one_thread:.1f} img/s; best {bare.best:.1f} img/s "
        f"({bare.best_at.replace('t b', ' threads, batch ')})")
    session = _default_session(onnx, providers)  # what a user's naive loop gets

    def naive_run(x: np.ndarray) -> ModelOutput:
        return one.outputs(session.run(one.output_names, one.feeds(x)), len(x))

    m = _Model(cfg, model, card, adapter_for(card), one, naive_run, cores)
    samples = fetch_samples(cfg.cache_dir)
    return [_bench_corpus(m, bare, make_corpus(samples, width, count, work / f"{model}-{width}"), width, work, say,
                          rounds) for width in widths]


def _bare_rates(cfg: Config, card: ModelCard, onnx: Path, one: Engine, cores: int) -> _Bare:
    h, w = card.input.size[0], card.input.size[1]
    x1 = np.random.default_rng(0).standard_normal((8, card.preprocess.channels, h, w)).astype(np.float32)
    rates: dict[tuple[int, int], float] = {}
    for threads in sorted({1, cores}):
        eng = one if threads == 1 else Engine.for_card(onnx, cfg.engine, threads, card)
        for batch in ((1, 2, 4, 8) if card.input.dynamic_batch else (1,)):
            eng.run(x1[:batch])

            def one_call(eng: Engine = eng, b: int = batch) -> int:
                eng.run(x1[:b])
                return b
            rates[(threads, batch)] = _best_rate(one_call)
    (bt, bb), best = max(rates.items(), key=lambda kv: kv[1])
    return _Bare(rates[(1, 1)], best, f"{bt}t b{bb}")


def _bench_corpus(m: _Model, bare: _Bare, files: list[Path], width: int, work: Path, say: Callable[[str], None],
                  rounds: int) -> CorpusResult:
    """The rounds of B, B' and C on one corpus, the median round's figures, and D."""
    folder = files[0].parent
    machine = _machine_probe(m, files)
    # rounds: A's rates and the stage costs are measured right before and right after B and C, so
    # each round's limit holds for the minutes C ran in (this machine's speed drifts by +-20%);
    # every ratio is taken within a round, and the median round is reported
    rounds_seen = [_bench_round(m, machine, files, folder, width, k, work, say) for k in range(rounds)]
    med = sorted(rounds_seen, key=lambda r: r.ratio_limit)[len(rounds_seen) // 2]
    # D: watch mode fed at a steady half of C's rate: latency, not throughput
    rate = med.worker["images_per_s"] / 2
    fed = files[: max(20, min(len(files), int(rate * 20)))]
    # beside the last round's C: its outbox, a database of its own
    steady_cfg = dataclasses.replace(m.cfg, model=m.name, outbox=work / f"out-{m.name}-{width}-{len(rounds_seen) - 1}",
                                     db=f"sqlite:///{work / f'steady-{m.name}-{width}.db'}")
    with _bench_heap_frozen():
        steady = _steady(steady_cfg, fed, rate, work / f"steady-{m.name}-{width}")
    copies = copies_of_first(fed)
    r = _corpus_result(m.name, width, len(files), bare, med, rounds_seen, rate, steady, copies)
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
    return r


Probe = Callable[[], tuple[float, float, float, float, float, float]]


def _machine_probe(m: _Model, files: list[Path]) -> Probe:
    """What the limit is made of, measured now: (A 1 thread, A parallel, t_decode, t_preprocess,
    t_postprocess, B's t_preprocess), the stage costs on one thread, on the corpus's first 20 images."""
    card, cfg, adapter = m.card, m.cfg, m.adapter
    datas = [p.read_bytes() for p in files[:20]]
    imgs = [decode(d, "x", cfg.pipeline.max_pixels, card.preprocess.depth) for d in datas]
    pre = [adapter.preprocess(im) for im in imgs]
    outs = [m.naive_run(x[None])[0] for x, _ in pre[:5]]
    tensors = [x[None] for x, _ in pre]
    plain = _plain_preprocessing(card)

    def probe() -> tuple[float, float, float, float, float, float]:
        t_dec = _per_item(lambda d: decode(d, "x", cfg.pipeline.max_pixels, card.preprocess.depth), datas)
        t_pre = _per_item(adapter.preprocess, imgs)
        t_post = _per_item(lambda og: adapter.postprocess(og[0], og[1][1]), list(zip(outs * 4, pre)))
        t_plain = _per_item(plain, imgs)
        return (*_mean_rates(m.one.run, tensors, m.cores), t_dec, t_pre, t_post, t_plain)
    return probe


def _plain_preprocessing(card: ModelCard) -> Callable[[np.ndarray], tuple[np.ndarray, Geometry]]:
    """The card's preprocessing as a plain script writes it (B's)."""
    size_hw = (card.input.size[0], card.input.size[1])

    def plain(image: np.ndarray) -> tuple[np.ndarray, Geometry]:
        if card.preprocess.depth == 16 and image.dtype == np.uint8:  # the corpus is JPEGs: 8-bit
            image = widen(image)
        return plain_preprocess(image, card.preprocess, size_hw)
    return plain


def _bench_round(m: _Model, machine: Probe, files: list[Path], folder: Path, width: int, k: int, work: Path,
                 say: Callable[[str], None]) -> _Round:
    """One round: the machine measured, B and B' (in alternate order from round to round, so neither
    always runs on the warmer machine), C, the machine measured again."""
    before = machine()
    # C: `worker run` itself in a fresh process (its peak RSS is its own), default config, fresh database
    # and outbox each time
    c = dataclasses.replace(m.cfg, model=m.name, outbox=work / f"out-{m.name}-{width}-{k}",
                            db=f"sqlite:///{work / f'bench-{m.name}-{width}-{k}.db'}")
    create_us = _create_cost(c.outbox)  # where C's outputs will be created
    # each round's B writes new files, as C does: rewriting last round's files costs no inode
    # allocation, which is not free here (see SLOW_CREATE_US)
    plain = _plain_preprocessing(m.card)
    naive_rates: dict[str, float] = {}
    for which in (("plain", "worker") if k % 2 == 0 else ("worker", "plain")):
        naive_rates[which] = _naive_loop(files, plain if which == "plain" else m.adapter.preprocess, m.adapter,
                                         m.naive_run, work / f"naive-{which}-{m.name}-{width}-{k}")
    run_id, figures = _worker_run(c, folder)
    after = machine()
    with database(c.db) as db:
        (st,) = run_stats(db, run_id=run_id, warmup_s=0)
    one_t, par, t_dec, t_pre, t_post, t_plain = ((a + b) / 2 for a, b in zip(before, after))
    stages = t_dec + t_pre + t_post
    rnd = _Round(one_t=one_t, parallel=par, stages_ms=(t_dec * 1e3, t_pre * 1e3, t_post * 1e3),
                 plain_pre_ms=t_plain * 1e3, naive=naive_rates["plain"], naive_worker_pre=naive_rates["worker"],
                 worker=figures, rss_peak=st["memory"].get("rss_peak_mb", 0.0),
                 limit=m.cores / (1 / one_t + stages), limit_parallel=m.cores / (m.cores / par + stages),
                 create_file_us=create_us)
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
    return rnd


def _corpus_result(model: str, width: int, images: int, bare: _Bare, med: _Round, rounds_seen: list[_Round],
                   rate: float, steady: Steady, copies: list[int]) -> CorpusResult:
    """The median round's figures, the rounds' peak memory and median ratios, and D's latencies."""
    f, lat = med.worker, steady.pipeline_ms
    return CorpusResult(model=model, width=width, images=images, bare_1t=med.one_t, bare_best=bare.best,
                        bare_best_at=bare.best_at, bare_parallel=med.parallel, decode_ms=med.stages_ms[0],
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
