"""Whether onnxruntime's I/O binding pays on this machine's CPU (not a test).

    python tests/perf/io_binding.py [--rounds 8]

For each default model: `session.run` as the worker calls it (a fresh output array every call)
against `run_with_iobinding` with the input bound from numpy and the output bound to one reused
buffer, on a session with the worker's CPU settings (1 intra-op thread, no spinning). Alternates
the two in rounds, checks that both give the same output, and prints the median milliseconds per
call and the median of the rounds' ratios (above 1: binding is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from worker import config
from worker.models.lookup import find_card
from worker.models.pull import pull

CALLS_PER_ROUND = {"efficientnet-lite0": 40, "yolov3-tiny": 10, "ppocr-det": 3}


def ms_per_call(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def compare(session: ort.InferenceSession, iname: str, oname: str, x: np.ndarray, calls: int,
            rounds: int) -> tuple[tuple[int, ...], float, float, float]:
    """(output shape, ms per session.run, ms per bound run, median of the rounds' run/bound ratios)."""
    y = session.run([oname], {iname: x})[0]
    out = np.empty_like(y)
    binding = session.io_binding()
    binding.bind_cpu_input(iname, x)
    binding.bind_output(oname, "cpu", 0, out.dtype, out.shape, out.ctypes.data)
    session.run_with_iobinding(binding)
    if not np.array_equal(out, y):
        raise SystemExit(f"{oname}: the bound output differs from session.run's")
    plain, bound = [], []
    for _ in range(rounds):
        plain.append(ms_per_call(lambda: session.run([oname], {iname: x}), calls))
        bound.append(ms_per_call(lambda: session.run_with_iobinding(binding), calls))
    ratio = statistics.median(p / b for p, b in zip(plain, bound))
    return tuple(y.shape), statistics.median(plain), statistics.median(bound), ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    cfg = config.load(None)
    for name, calls in CALLS_PER_ROUND.items():
        card = find_card(cfg.models_dir, name)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = 1, 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(str(pull(card, cfg.cache_dir)), opts, providers=["CPUExecutionProvider"])
        iname, oname = session.get_inputs()[0].name, card.postprocess.output or session.get_outputs()[0].name
        x = np.random.default_rng(0).standard_normal((1, 3, *card.input.size[:2])).astype(np.float32)
        shape, plain, bound, ratio = compare(session, iname, oname, x, calls, args.rounds)
        print(f"{name:20s} output {shape}: session.run {plain:8.3f} ms, "
              f"I/O binding {bound:8.3f} ms per call; run/binding {ratio:.3f}")

if __name__ == "__main__":
    main()
