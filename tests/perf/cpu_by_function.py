"""Where a `run_folder`'s CPU goes, by thread and by Python function (not a test).

    python3.13 -X perf tests/perf/cpu_by_function.py [--model efficientnet-lite0] [--width 640]
        [--images 3000] [--seconds 5] [--top 8]

py-spy (and `thread_cpu.py`'s /proc counters) cannot say which function a thread's CPU went to:
py-spy counts a thread waiting for the GIL, or preempted, at the line it stopped on. This samples
the CPU itself: Python 3.12+ started with `-X perf` names each Python function to `perf`, and
`perf record --call-graph dwarf` on this process, in the middle of an in-process `run_folder` over
a corpus of JPEGs built from the demo images, gives each sample a thread and an innermost Python
function. Prints milliseconds of a core per image, per kind of thread and per function (the
native code a function called counts to it; `<lib.so>`: a sample whose stack did not unwind to a
Python frame), and the kernel's share. Needs Linux, `perf`, and the right to profile this process
(root, or kernel.perf_event_paranoid <= 1). The outputs stay in a temporary folder, not deleted:
deleting thousands of files slows every file created in the next minutes on some filesystems.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from worker import config
from worker.measure.bench.corpus import make_corpus
from worker.measure.samples import fetch_samples
from worker.service import run_folder

_PY_FRAME = re.compile(r"py::([^:\s]+):")  # a Python function, as -X perf names it: py::qualname:file
_DSO = re.compile(r"\(([^()]*)\)\s*$")  # the sample's innermost frame's library, last on its line


def attribute(perf_script: str, names: dict[int, str]) -> dict[str, collections.Counter[str]]:
    """`perf script` output -> thread kind -> Counter of innermost Python function (or '<library>')
    per sample, with '(all)' and '(kernel)' totals. `names`: native thread id -> thread name."""
    per: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for block in perf_script.split("\n\n"):
        lines = [line for line in block.splitlines() if line.strip()]
        if len(lines) < 2:
            continue
        head = lines[0].split()  # comm tid time: period event:
        tid = next((int(f) for f in head[1:3] if f.isdigit()), -1)
        kind = re.sub(r"[-_]?\d+$", "", names.get(tid, "other"))
        py = next((m[1] for line in lines[1:] if (m := _PY_FRAME.search(line))), None)
        dso = m[1].rsplit("/", 1)[-1] if (m := _DSO.search(lines[1])) else "?"
        per[kind]["(all)"] += 1
        if "kernel" in dso:
            per[kind]["(kernel)"] += 1
        per[kind][py or f"<{dso}>"] += 1
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="efficientnet-lite0")
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=5.0, help="how long perf samples, mid-run")
    ap.add_argument("--top", type=int, default=8, help="functions shown per kind of thread")
    ap.add_argument("--models-dir", type=Path, help="another folder of cards (tests/perf/feed.py makes a stand-in's)")
    args = ap.parse_args()
    if not getattr(sys, "is_stack_trampoline_active", lambda: False)():
        sys.exit("start it with Python 3.12 or newer and -X perf (python3.13 -X perf tests/perf/cpu_by_function.py)")
    if shutil.which("perf") is None:
        sys.exit("perf is not installed")
    cfg = config.load(None)
    work = Path(tempfile.mkdtemp(prefix="worker-cpu-by-function-"))
    corpus = work / "corpus"
    make_corpus(fetch_samples(cfg.cache_dir), args.width, args.images, corpus)
    cfg = dataclasses.replace(cfg, model=args.model, outbox=work / "out", db=f"sqlite:///{work}/worker.db",
                              models_dir=args.models_dir or cfg.models_dir)

    finished: list[float] = []  # time.monotonic() of each image done: counted within perf's first and last sample
    started = threading.Event()
    names: dict[int, str] = {}

    def progress(n: int) -> None:
        finished.extend([time.monotonic()] * n)
        started.set()

    def profile(result: dict[str, object]) -> None:
        started.wait()
        time.sleep(1.0)  # past the first images' warm-up
        names.update({t.native_id: t.name for t in threading.enumerate() if t.native_id})
        data = work / "perf.data"
        command = ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-F", "499", "--call-graph", "dwarf,16384",
                   "-p", str(os.getpid()), "-o", str(data), "--", "sleep", str(args.seconds)]
        rec = subprocess.run(command, check=False, capture_output=True, text=True)
        result.update(rc=rec.returncode, err=rec.stderr, data=data, ended=time.monotonic())

    result: dict[str, object] = {}
    profiler = threading.Thread(target=profile, args=(result,), name="profiler")
    profiler.start()
    summary = run_folder(cfg, corpus, progress=progress)
    run_ended = time.monotonic()
    profiler.join()
    if result.get("rc") != 0:
        sys.exit(f"perf record failed: {result.get('err')}")
    if run_ended < float(str(result["ended"])):
        sys.exit(f"the run ({summary.figures['done']} images) ended before perf did: raise --images")
    script = subprocess.run(["perf", "script", "-i", str(result["data"])], check=True, capture_output=True,
                            text=True).stdout
    per = attribute(script, names)
    # the window perf sampled (its clock is CLOCK_MONOTONIC, as time.monotonic()): its start-up is not in it
    stamps = [float(m[1]) for m in re.finditer(r"^\S+\s+\d+\s+(\d+\.\d+):", script, re.MULTILINE)]
    first, last = min(stamps), max(stamps)
    images = sum(first <= t <= last for t in finished)
    ms = 1000.0 / 499  # one sample: 1/499 s of a core
    total = sum(c["(all)"] for c in per.values())
    print(f"{args.model}, {args.width} px, {images} images in the {last - first:.1f} s perf sampled "
          f"({images / (last - first):.1f} images/s, {total / 499 / (last - first):.2f} cores busy): "
          f"{total * ms / images:.2f} ms of CPU per image")
    for kind, c in sorted(per.items(), key=lambda kv: -kv[1]["(all)"]):
        print(f"  {kind:20s} {c['(all)'] * ms / images:6.2f} ms per image (kernel {c['(kernel)'] * ms / images:.2f})")
        for fn, k in [(f, k) for f, k in c.most_common() if not f.startswith("(")][:args.top]:
            print(f"      {k * ms / images:6.3f}  {fn}")
    print(f"(outputs left in {work})")


if __name__ == "__main__":
    main()
