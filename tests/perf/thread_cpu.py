"""Where a `run_folder`'s CPU goes, thread by thread (not a test).

    python tests/perf/thread_cpu.py [--model efficientnet-lite0] [--width 640] [--images 1200] [--processes 1]
                                    [--max-batch 0] [--decode-workers 0] [--claim-ahead N] [--models-dir DIR]

Builds a corpus of JPEGs from the demo images (as `worker bench` does), runs an in-process
`run_folder` over it with the default config, and prints milliseconds of CPU per image for each kind
of thread (prepare = read, hash, claim, decode and preprocess; infer; finish = postprocess and write
the outputs; recorder; main), read from /proc/self/task while the run goes, and the seconds the
decode threads waited for their claims' commits. `--claim-ahead N` runs with that many claims ahead
per decode thread instead of worker.pipeline.prepare.CLAIM_AHEAD. Compare with the stage
costs `worker bench` prints (one image at a time, alone): the difference is what the pipeline adds.
Linux only. The outputs stay in a temporary folder that is not deleted: deleting thousands of files
slows every file created in the next minutes on some filesystems (README, Performance).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from worker import config
from worker.pipeline import prepare
from worker.store import events
from worker.measure.bench.corpus import make_corpus
from worker.measure.samples import fetch_samples
from worker.runtime.engine import default_threads
from worker.service import run_folder

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(tid: int) -> tuple[float, int, int] | None:
    """A thread's CPU seconds, and how often it slept (a wait: the GIL, a queue, I/O) and was preempted."""
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/self/task/{tid}/status").read_text()
    except OSError:
        return None
    switches = dict(re.findall(r"^(\w+)_ctxt_switches:\s+(\d+)$", status, re.M))
    # utime + stime
    return (int(fields[11]) + int(fields[12])) / TICK, int(switches["voluntary"]), int(switches["nonvoluntary"])


def count_commit_waits() -> list[float]:
    """Time the decode threads' waits for a commit (Commit.wait); returns the running total."""
    total = [0.0]
    wait = events.Commit.wait

    def timed(self: events.Commit, timeout: float | None = None) -> bool:
        t0 = time.perf_counter()
        try:
            return wait(self, timeout)
        finally:
            if threading.current_thread().name.startswith("prepare"):
                total[0] += time.perf_counter() - t0

    events.Commit.wait = timed  # type: ignore[method-assign]
    return total


def decode_threads(cfg: config.Config) -> int:
    return cfg.pipeline.decode_workers or default_threads()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="efficientnet-lite0")
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--processes", type=int, default=1, help="pipeline.processes: the threads counted are this process's")
    ap.add_argument("--max-batch", type=int, default=0, help="pipeline.max_batch (0: the default)")
    ap.add_argument("--decode-workers", type=int, default=0, help="pipeline.decode_workers (0: the default)")
    ap.add_argument("--claim-ahead", type=int, default=0, help="claims ahead per decode thread (0: the worker's)")
    ap.add_argument("--models-dir", type=Path, help="another folder of cards (tests/perf/feed.py makes a stand-in's)")
    args = ap.parse_args()
    if args.claim_ahead:
        prepare.CLAIM_AHEAD = args.claim_ahead
    commit_waits = count_commit_waits()
    cfg = config.load(None)
    work = Path(tempfile.mkdtemp(prefix="worker-thread-cpu-"))
    corpus = work / "corpus"
    make_corpus(fetch_samples(cfg.cache_dir), args.width, args.images, corpus)
    cfg = dataclasses.replace(cfg, model=args.model, outbox=work / "out", db=f"sqlite:///{work}/worker.db",
                              models_dir=args.models_dir or cfg.models_dir,
                              pipeline=dataclasses.replace(cfg.pipeline, processes=args.processes,
                                                           max_batch=args.max_batch,
                                                           decode_workers=args.decode_workers))

    last: dict[int, tuple[str, tuple[float, int, int]]] = {}  # native thread id -> (name, thread_cpu_s so far)
    main_cpu = time.thread_time()
    stop = threading.Event()

    def sample() -> None:  # threads end before run_folder returns: keep each one's last reading
        while not stop.wait(0.2):
            for t in threading.enumerate():
                if t.native_id and t is not threading.current_thread() and t is not threading.main_thread():
                    if (cpu := thread_cpu_s(t.native_id)) is not None:
                        last[t.native_id] = (t.name, cpu)

    sampler = threading.Thread(target=sample, name="sampler", daemon=True)  # a failed run must not hang here
    sampler.start()
    t0, p0 = time.perf_counter(), time.process_time()
    summary = run_folder(cfg, corpus)
    wall, process = time.perf_counter() - t0, time.process_time() - p0
    stop.set()
    sampler.join()
    n = summary.figures["done"]
    main = thread_cpu_s(threading.get_native_id()) or (0.0, 0, 0)
    # the main thread's includes the model's load and warm-up
    per_kind: dict[str, list[float]] = {"main": [time.thread_time() - main_cpu, main[1], main[2]]}
    for name, (cpu, sleeps, preempted) in last.values():
        kind = per_kind.setdefault(re.sub(r"[-_]?\d+$", "", name), [0.0, 0, 0])
        kind[0] += cpu
        kind[1] += sleeps
        kind[2] += preempted
    print(f"{args.model}, {n} JPEGs {args.width} px: {summary.figures['images_per_s']} images/s, "
          f"{process / n * 1000:.2f} ms of process CPU per image over {wall:.1f} s ({process / wall:.2f} cores busy)")
    print(f"  {'thread':20s} {'CPU ms':>6s}  sleeps  preempted  (per image; the main thread's switches since start)")
    for kind, (cpu, sleeps, preempted) in sorted(per_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"  {kind:20s} {cpu / n * 1000:6.2f} {sleeps / n:7.1f} {preempted / n:10.1f}")
    print(f"  the decode threads waited {commit_waits[0]:.2f} s for their claims' commits, "
          f"{commit_waits[0] / (wall * decode_threads(cfg)):.0%} of their time "
          f"({prepare.CLAIM_AHEAD} claims ahead each)")
    print(f"(outputs left in {work})")


if __name__ == "__main__":
    main()
