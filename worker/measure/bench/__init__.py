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

import tempfile
from pathlib import Path
from typing import Callable

import onnxruntime as ort

from worker.config import Config
from worker.host.cores import usable_cores
from worker.measure.bench.results import CorpusResult, verdicts
from worker.measure.bench.model import bench_model


def run_bench(cfg: Config, models: tuple[str, ...], widths: tuple[int, ...], count: int,
              say: Callable[[str], None], rounds: int = 3) -> list[CorpusResult]:
    say(f"worker bench: {usable_cores()} cores, onnxruntime {ort.__version__}, {count} images per corpus, "
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
