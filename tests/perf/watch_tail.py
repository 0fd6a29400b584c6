"""Watch-mode latency and what its slowest images waited for (not a test).

    python tests/perf/watch_tail.py [--model efficientnet-lite0] [--width 640] [--images 400] [--rate 100]
                                    [--runs 3] [--switch-interval S] [--infer-workers N --intra-op N]

Runs `worker bench`'s D (`worker watch` itself on a fresh inbox, fed one JPEG every 1/rate s, written
under a hidden name and renamed into place) `--runs` times, and prints for each: p50 and p99 of the
pipeline latency (intake to result, as `worker stats` reports it), their ratio, and the mean of each
recorded stage for the slowest 2% of images against the 40 around the median, and the first image's
against the median (*) of the same picture's copies later in the feed. `queue` is intake to
decode start (reading, hashing, the claim and its commit); `between` is the rest of the latency that
no stage accounts for: waiting in the queues between stages, mostly for a free inference thread.
Use a rate of about half what `worker bench` measured for C on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np

from worker import config
from worker.measure.bench.corpus import copies_of_first, make_corpus
from worker.measure.bench.steady import _steady
from worker.measure.samples import fetch_samples

def one_run(cfg: config.Config, files: list[Path], rate: float, work: Path) -> None:
    steady = _steady(cfg, files, rate, work)
    p50, p99 = np.percentile(steady.pipeline_ms, [50, 99])
    total = steady.pipeline_ms
    between = total - steady.stage_ms.sum(axis=1)
    table = np.column_stack([steady.stage_ms, between, total])  # in landing order: the first image is row 0
    slowest = table[np.argsort(-total, kind="stable")]
    k, mid = max(3, len(table) // 50), len(table) // 2
    copies = copies_of_first(files)
    print(f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, p99/p50 {p99 / p50:.2f}; landed to archived p50 "
          f"{np.percentile(steady.landed_ms, 50):.0f} ms, p99 {np.percentile(steady.landed_ms, 99):.0f} ms")
    names = ("queue", "decode", "pre", "infer", "post", "write", "between", "total")
    print("  ms, mean of      " + " ".join(f"{n:>7s}" for n in names))
    for label, part in (("slowest 2%", slowest[:k]), ("median 40", slowest[max(0, mid - 20):mid + 20])):
        print(f"  {label:16s}" + " ".join(f"{v:7.1f}" for v in part.mean(axis=0)))
    # the first image against the same picture later in the feed: what a cold start would cost
    print(f"  {'first image':16s}" + " ".join(f"{v:7.1f}" for v in table[0]))
    if copies:
        print(f"  {f'its {len(copies)} copies*':16s}" + " ".join(f"{v:7.1f}" for v in np.median(table[copies], axis=0)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="efficientnet-lite0")
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--rate", type=float, default=100.0, help="images/s fed")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval, s (Python's default 0.005)")
    ap.add_argument("--infer-workers", type=int, default=0)
    ap.add_argument("--intra-op", type=int, default=0)
    args = ap.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    cfg = config.load(None)
    work = Path(tempfile.mkdtemp(prefix="worker-watch-tail-"))  # left in place (see thread_cpu.py)
    files = make_corpus(fetch_samples(cfg.cache_dir), args.width, args.images, work / "corpus")
    cfg = dataclasses.replace(cfg, model=args.model,
                              pipeline=dataclasses.replace(cfg.pipeline, infer_workers=args.infer_workers),
                              engine=dataclasses.replace(cfg.engine, intra_op_threads=args.intra_op))
    for i in range(args.runs):
        run = work / f"run{i}"
        one_run(dataclasses.replace(cfg, db=f"sqlite:///{run}/worker.db"), files, args.rate, run / "d")


if __name__ == "__main__":
    main()
