"""What the bench finds for one corpus, and the targets it holds the figures to."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CorpusResult:
    model: str
    width: int
    images: int
    bare_1t: float  # img/s, 1 intra-op thread, batch 1
    bare_best: float  # img/s, best of threads x batch
    bare_best_at: str
    bare_parallel: float  # img/s, one 1-thread run per core at once on one session (what the pipeline does)
    decode_ms: float
    preprocess_ms: float
    postprocess_ms: float
    plain_preprocess_ms: float  # B's plain preprocessing, on one thread
    limit: float  # cores / (1/bare_1t + stages)
    limit_parallel: float  # the same with inference at bare_parallel: cores / (cores/bare_parallel + stages)
    naive: float  # B: the loop with plain preprocessing
    naive_worker_pre: float  # B': the same loop with the worker's preprocessing
    worker: float
    ratio_naive: float  # C/B, median of the rounds' ratios
    ratio_naive_worker_pre: float  # C/B', median of the rounds' ratios
    worker_p50_ms: float
    worker_p99_ms: float
    worker_rss_peak_mb: float
    steady_rate: float  # D: images/s offered, half of C
    steady_first_ms: float
    steady_p50_ms: float
    steady_p99_ms: float
    steady_landed_p50_ms: float  # D, from the rename into the inbox to committed and archived
    steady_landed_p99_ms: float
    create_file_us: float  # creating one small file in C's outbox, highest of the rounds (see _create_cost)
    # D: the median and highest latency of the later images that are byte-for-byte copies of the first
    # (the corpus cycles through the sample photographs): the first image against itself, warm. None
    # without copies.
    steady_first_copies_ms: float | None = None
    steady_first_copies_max_ms: float | None = None

    @property
    def ratio_limit(self) -> float:
        return self.worker / self.limit

    @property
    def ratio_parallel(self) -> float:
        return self.worker / self.limit_parallel


@dataclass(frozen=True)
class _Round:
    """One round's figures: A's rates are the mean of the measurements just before and just after B and C."""

    one_t: float
    parallel: float
    stages_ms: tuple[float, float, float]  # decode, preprocess, postprocess on one thread
    plain_pre_ms: float  # B's plain preprocessing on one thread
    naive: float
    naive_worker_pre: float
    worker: dict[str, float]
    rss_peak: float
    limit: float
    limit_parallel: float
    create_file_us: float

    @property
    def ratio_limit(self) -> float:
        return self.worker["images_per_s"] / self.limit

    @property
    def ratio_naive(self) -> float:
        return self.worker["images_per_s"] / self.naive

    @property
    def ratio_naive_worker_pre(self) -> float:
        return self.worker["images_per_s"] / self.naive_worker_pre


# the targets `worker bench` holds its figures to (`--check`: exit 1 when one is missed)
LIMIT_TARGET = 0.85  # C/limit, every model and corpus
NAIVE_TARGETS = {640: 1.3, 1920: 1.5}  # C/B for efficientnet-lite0, where decoding weighs as much as the model
NAIVE_MODEL = "efficientnet-lite0"
TAIL_TARGET = 2.0  # D: p99 <= 2 x p50
RSS_TARGET_MB = 400.0  # efficientnet-lite0's peak RSS in `worker run`


@dataclass(frozen=True)
class Verdict:
    """One target on one corpus: `value` against `bound` (`at_least`: value >= bound, else <=)."""

    where: str  # "efficientnet-lite0 640 px"
    what: str  # what it measures, in words, e.g. "worker run / machine limit (C/limit)"
    value: float
    bound: float
    at_least: bool
    decimals: int = 2  # as printed: ratios to 2, megabytes to 0

    @property
    def met(self) -> bool:
        return self.value >= self.bound if self.at_least else self.value <= self.bound

    def __str__(self) -> str:
        value = f"{self.value:.{self.decimals}f}"
        return (f"{'met   ' if self.met else 'MISSED'}  {self.where:26s} {self.what} {value} "
                f"{'>=' if self.at_least else '<='} {self.bound:g}")


def verdicts(results: list[CorpusResult]) -> list[Verdict]:
    """Each corpus's median round against the targets (the watcher's first image: no spike over p99)."""
    out: list[Verdict] = []
    for r in results:
        where = f"{r.model} {r.width} px"
        out.append(Verdict(where, "worker run / machine limit (C/limit)", r.ratio_limit, LIMIT_TARGET, True))
        if r.model == NAIVE_MODEL and r.width in NAIVE_TARGETS:
            out.append(Verdict(where, "worker run / plain loop (C/B)", r.ratio_naive, NAIVE_TARGETS[r.width], True))
        out.append(Verdict(where, "watch latency p99 / p50 (D p99/p50)", r.steady_p99_ms / r.steady_p50_ms, TAIL_TARGET,
                           False))
        out.append(Verdict(where, "watch first image / p99 latency (D first/p99)", r.steady_first_ms / r.steady_p99_ms, 1.0,
                           False))
        if r.model == NAIVE_MODEL:
            out.append(Verdict(where, f"worker run peak memory over {r.images} images, MB (C peak RSS)", r.worker_rss_peak_mb,
                               RSS_TARGET_MB,
                               False, decimals=0))
    return out


def median(values: list[float]) -> float:
    return float(np.median(values))


def as_dicts(results: list[CorpusResult]) -> list[dict[str, Any]]:
    """`--json`: one dict per corpus, its figures, ratios and targets (what each measured, against what, met)."""
    return [{**dataclasses.asdict(r), "ratio_limit": r.ratio_limit, "ratio_parallel": r.ratio_parallel,
             "targets": [{"where": v.where, "what": v.what, "value": v.value, "bound": v.bound,
                          "at_least": v.at_least, "met": v.met} for v in verdicts([r])]}
            for r in results]
