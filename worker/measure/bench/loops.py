"""What the bench sets `worker run` beside: bare inference, rates per core, the per-stage costs of the
machine's limit, and the plain per-image loop a user would write."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np
import onnxruntime as ort

from worker.config import Config
from worker.runtime.model_output import ModelOutput
from worker.models.card import Preprocess
from worker.tasks.preprocess import Geometry, resize_for


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
