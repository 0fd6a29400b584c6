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
     D runs in this process, with the bench's own objects frozen out of the garbage collector."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnxruntime as ort

from worker.config import Config
from worker.runtime.engine import Engine, wanted_providers
from worker.images import decode, widen
from worker.runtime.model_output import ModelOutput
from worker.models.card import find_card
from worker.models.pull import pull, with_labels
from worker.measure.samples import fetch_samples
from worker.store.db import database
from worker.store.queries import run_stats
from worker.tasks import adapter_for
from worker.tasks.preprocess import Geometry
from worker.measure.bench.corpus import SLOW_CREATE_US, _create_cost, copies_of_first, make_corpus
from worker.measure.bench.loops import _best_rate, _default_session, _mean_rates, _naive_loop, _per_item, _worker_run, plain_preprocess
from worker.measure.bench.results import CorpusResult, _Round, median, verdicts
from worker.measure.bench.steady import _bench_heap_frozen, _copies_note, _steady, first_by_stage


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
