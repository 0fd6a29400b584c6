"""What the pipeline around the model costs, with a stand-in model that costs nothing (not a test).

    python tests/perf/feed.py [--images 2000] [--width 640] [--processes N] [--gil SECONDS] [--pin] [--repeat 1]
                              [--cores 1,2,4,8,16] [--json OUT]
                              [-- worker run options]

Builds a classify card whose ONNX is GlobalAveragePool + Flatten + MatMul to 1,000 logits (224x224,
EfficientNet-Lite0's preprocessing) and a corpus of JPEGs from the sample images, then runs
`worker run DIR --inputs keep` in a fresh process and prints images/s and the CPU per image of
every process of the run together, and of its main process alone (the one holding the session: an
upper bound of the time it holds the GIL, as far as it runs no native code), each with the wall time
and CPU of a run over an empty folder (start-up) taken off. `--gil SECONDS` attaches `py-spy record --gil` (py-spy installed) to
the main process for that long once 200 images are done, and prints the time it held the GIL per
image done in that window. `--cores 1,2,4,8,16` runs it on that many CPUs each (their affinity, as `taskset`
does; the worker sizes its defaults by them) and prints each run's share of the ceiling `cores / CPU per
image` (1.0: no core ever idle). Extra arguments after `--` go to `worker run`.
The outputs stay in a temporary folder that is not deleted (see tests/perf/create_after_delete.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: its tests/support helpers

from tests.support.stand_in import stand_in
from worker.config import default_cache_dir
from worker.measure.bench.corpus import make_corpus
from worker.measure.samples import fetch_samples

RATE = 250  # py-spy samples per second

def run(root: Path, inbox: Path, tag: str, extra: list[str], gil_s: int = 0, pin: bool = False,
        cores: set[int] | None = None) -> dict[str, float]:
    """One `worker run` (with `cores`: on those CPUs only, as `taskset` starts it; the worker sizes its
    defaults by them)."""
    outbox = root / f"out-{tag}"
    cmd = [sys.executable, "-m", "worker", "--config", str(root / "config.yaml"), "run", str(inbox),
           "--outbox", str(outbox), "--db", f"sqlite:///{root}/{tag}.db", "--inputs", "keep", *extra]
    t0 = time.perf_counter()
    ru0 = os.times()
    err = open(root / f"{tag}.log", "w+")
    pinned = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=pinned)
    gil: dict[str, float] = {}
    # until it ends, not reaped yet: its /proc entry then holds its whole CPU time
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        if pin:
            pin_apart(proc.pid)
        if gil_s and not gil and outputs(outbox) >= 200:  # past start-up: sample a window of the steady run
            gil = gil_held(proc.pid, outbox, gil_s, root / f"{tag}.gil.txt")
        time.sleep(0.02)
    main_cpu = process_cpu_s(proc.pid)
    proc.wait()
    ru1 = os.times()
    if proc.returncode != 0:
        err.seek(0)
        sys.exit(f"worker run failed:\n{err.read()[-3000:]}")
    return {"wall_s": time.perf_counter() - t0, "main_cpu_s": main_cpu, **gil,
            "cpu_s": (ru1.children_user - ru0.children_user) + (ru1.children_system - ru0.children_system)}


def outputs(outbox: Path) -> int:
    try:
        return sum(1 for e in os.scandir(outbox) if e.name.endswith(".json"))
    except OSError:
        return 0


def gil_held(pid: int, outbox: Path, seconds: int, out: Path) -> dict[str, float]:
    """py-spy attached to the main process for `seconds` of its steady run: the GIL-held samples per
    image done meanwhile (the images counted by their outputs)."""
    before = outputs(outbox)
    subprocess.run(["py-spy", "record", "--pid", str(pid), "--gil", "--format", "raw", "-r", str(RATE),
                    "--duration", str(seconds), "-o", str(out)], capture_output=True, check=True)
    done = outputs(outbox) - before
    samples = sum(int(line.rpartition(" ")[2]) for line in out.read_text().splitlines() if line)
    return {"gil_ms_per_image": samples / RATE / max(1, done) * 1000, "gil_window_images": done}


def pin_apart(pid: int) -> None:
    """The main process (all its threads) on CPU 0, its prepare processes on the others: what the main
    process holds is then measured as on a host with cores to spare, not stretched by its threads being
    preempted while they hold the GIL."""
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus[:1])
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            for tid in os.listdir(f"/proc/{child}/task"):
                os.sched_setaffinity(int(tid), cpus[1:])
    except OSError:  # a thread or process that ended meanwhile
        pass


def process_cpu_s(pid: int) -> float:
    """A process's CPU seconds (all its threads) from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--gil", type=int, default=0, metavar="SECONDS",
                    help="attach py-spy --gil to the main process for this long once 200 images are done")
    ap.add_argument("--pin", action="store_true",
                    help="main process on CPU 0, prepare processes on the other CPUs (with --processes > 1)")
    ap.add_argument("--cores", default="",
                    help="comma-separated core counts (1,2,4,8,16): one run on each many CPUs, with the defaults "
                         "those cores give, and its share of the ceiling cores / CPU per image")
    ap.add_argument("--json")
    ap.add_argument("--processes", type=int, default=0, help="pipeline.processes (0: chosen from the cores)")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    root = Path(tempfile.mkdtemp(prefix="worker-feed-"))
    stand_in(root / "models")
    (root / "config.yaml").write_text(f"models_dir: {root / 'models'}\nmodel: stand-in\n"
                                      f"cache_dir: {default_cache_dir()}\n"
                                      f"pipeline: {{processes: {args.processes}}}\n")
    inbox, empty = root / "inbox", root / "empty"
    empty.mkdir()
    make_corpus(fetch_samples(default_cache_dir()), args.width, args.images, inbox)
    rows = []
    available = sorted(os.sched_getaffinity(0))
    counts = [int(n) for n in args.cores.split(",") if n and int(n) <= len(available)] if args.cores else [0]
    for i in range(args.repeat):
        for n in counts:
            cores = set(available[:n]) if n else None
            tag = f"{i}-{n}" if n else f"{i}"
            base = run(root, empty, f"empty{tag}", extra, cores=cores)
            full = run(root, inbox, f"full{tag}", extra, args.gil, args.pin, cores)
            row = {"images": args.images, "width": args.width, "processes": args.processes, "pinned": args.pin,
                   "cores": n or len(available), "images_per_s": args.images / (full["wall_s"] - base["wall_s"]),
                   "cpu_ms_per_image": (full["cpu_s"] - base["cpu_s"]) / args.images * 1000,
                   "main_cpu_ms_per_image": (full["main_cpu_s"] - base["main_cpu_s"]) / args.images * 1000,
                   "startup_cpu_s": base["cpu_s"], "startup_wall_s": base["wall_s"]}
            # of what the cores could do at this CPU per image: 1.0 when no core ever waits
            row["of_ceiling"] = row["images_per_s"] * row["cpu_ms_per_image"] / 1000 / row["cores"]
            row.update({k: full[k] for k in ("gil_ms_per_image", "gil_window_images") if k in full})
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:  # after each run: what was measured survives a run cut off by a time box
                Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"outputs under {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
