"""The GPU session's one prepared script (not a test): run on a machine with an NVIDIA GPU, it proves CUDA and
measures the worker there, writing everything to --out (the device tool's $OUT) as a few files.

    python tests/perf/gpu_check.py --out $OUT [--budget-s 480] [--cpu]

Steps, each time-boxed within --budget-s: `nvidia-smi` before and after; onnxruntime's providers with CUDA
first; `worker models check` of every bundled model with `engine.require_gpu: true`; `worker bench` of the
bundled models at 640 and 1920 px (A, B, C, D); the pipeline around a stand-in model on 1, 2, 4, 8 and 16
cores (tests/perf/feed.py --cores); a sweep of pipeline.max_batch x infer_workers x
decode_workers with `worker run` on EfficientNet-Lite0's 640 px corpus; a `worker soak` on CUDA with GPU memory
samples, and its report. --cpu runs the same on the CPU (with require_gpu off), to try the script here.
The packages it needs there travel as wheels: tests/perf/gpu_wheels.sh (docs/development.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("efficientnet-lite0", "yolov3-tiny", "ppocr-det")
RESERVE_S = 15.0


class Steps:
    def __init__(self, work: Path, budget_s: float) -> None:
        self.work, self.deadline, self.logs = work, time.monotonic() + budget_s, work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.summary: dict[str, object] = {}

    def left(self) -> float:
        """Seconds left, less RESERVE_S kept for the last step (nvidia-smi after)."""
        return self.deadline - RESERVE_S - time.monotonic()

    def run(self, name: str, cmd: list[str], share: float) -> int | None:
        """Run `cmd` for at most `share` of the time left; its output to logs/NAME.txt; its exit status (None:
        not run, or cut off)."""
        limit = max(0.0, self.left() * share)
        if limit < 5:
            self.summary[name] = "not run: out of time"
            return None
        t0 = time.monotonic()
        with (self.logs / f"{name}.txt").open("w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=self.work,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
            except subprocess.TimeoutExpired:
                rc = None
            except OSError as e:  # not there (nvidia-smi on a machine without the driver)
                log.write(f"cannot run {cmd[0]}: {e}\n")
                rc = None
        self.summary[name] = {"exit": rc, "seconds": round(time.monotonic() - t0, 1)}
        return rc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True, help="where the few result files go")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-check"), help="everything else")
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--cpu", action="store_true", help="try the script on a machine without a GPU")
    args = ap.parse_args()
    out, work = args.out.absolute(), args.work.absolute()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    s = Steps(work, args.budget_s)
    py = sys.executable
    providers = "cpu" if args.cpu else "cuda"

    def config(name: str, pipeline: str = "") -> list[str]:
        path = work / f"{name}.yaml"
        path.write_text(f"outbox: {name}-outbox\ndb: sqlite:///{name}.db\nmodels_dir: {ROOT / 'models'}\n"
                        f"engine: {{providers: {providers}, require_gpu: {str(not args.cpu).lower()}}}\n"
                        f"metrics: {{memory_sample_s: 1.0, warmup_s: 30}}\n" + (f"pipeline: {{{pipeline}}}\n" if pipeline else ""))
        return [py, "-m", "worker", "--config", str(path)]

    worker = config("main")
    s.run("nvidia-smi-before", ["nvidia-smi"], 0.05)
    s.run("providers", [py, "-c", "import json, onnxruntime as o; print(json.dumps({'version': o.__version__, "
                        "'available': o.get_available_providers(), 'device': o.get_device()}))"], 0.05)
    for m in MODELS:
        s.run(f"check-{m}", [*worker, "models", "check", m], 0.1)
    for i, m in enumerate(MODELS):  # one model at a time: what is measured survives a step cut off
        s.run(f"bench-{m}", [*worker, "bench", "--model", m, "--rounds", "1", "--images", "300",
                             "--json", str(out / f"bench-{m}.json")], 0.5 / (len(MODELS) - i))
    corpus = work / "corpus"
    s.run("corpus", [py, "-c", f"from worker.measure.bench.corpus import make_corpus; from worker.measure.samples "
                     f"import fetch_samples; from worker.config import default_cache_dir; "
                     f"make_corpus(fetch_samples(default_cache_dir()), 640, 1000, __import__('pathlib').Path({str(corpus)!r}))"],
          0.1)
    s.run("scaling", [py, str(ROOT / "tests" / "perf" / "feed.py"), "--images", "3000", "--cores", "1,2,4,8,16",
                      "--json", str(out / "scaling.json")], 0.2)  # the pipeline on 1-16 cores, a stand-in model
    sweep = []
    grid = list(itertools.product((4, 16), (1, 2), (8, 15)))
    for i, (batch, infer, decode) in enumerate(grid):
        name = f"sweep-b{batch}-i{infer}-d{decode}"
        t0 = time.monotonic()
        rc = s.run(name, [*config(name, f"max_batch: {batch}, infer_workers: {infer}, decode_workers: {decode}"),
                          "run", str(corpus), "--model", "efficientnet-lite0", "--no-progress"],
                   1 / (len(grid) - i + 2))
        log = s.logs / f"{name}.txt"
        text = log.read_text() if log.exists() else ""  # not run: out of time
        rate = next((line.split()[0] for line in text.splitlines() if "images/s over" in line), None)
        sweep.append({"max_batch": batch, "infer_workers": infer, "decode_workers": decode, "exit": rc,
                      "images_per_s": float(rate) if rate else None, "wall_s": round(time.monotonic() - t0, 1)})
    s.summary["sweep"] = sweep
    s.run("soak", [*worker, "soak", "--duration", f"{int(max(60, s.left() * 0.6))}s", "--images", str(corpus),
                   "--model", "efficientnet-lite0", "--report", str(out / "soak-report.html")], 0.8)
    s.deadline += RESERVE_S
    s.run("nvidia-smi-after", ["nvidia-smi"], 1.0)
    (out / "summary.json").write_text(json.dumps(s.summary, indent=1))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:  # the device tool brings back a few files only
        tar.add(s.logs, arcname="logs")
    print(json.dumps(s.summary, indent=1))


if __name__ == "__main__":
    main()
