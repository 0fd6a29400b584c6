"""The report's charts: matplotlib (its Agg backend, no display) drawn to SVG text, embedded in the page as is."""

from __future__ import annotations

import io
import logging
import re
from datetime import datetime, timezone
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, whatever the environment says
logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font cache's INFO lines are not the worker's
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

from worker.report.data import SCORE_BINS, ReportData  # noqa: E402
from worker.store.tallies import PER_DECADE  # noqa: E402

SIZE = (9.0, 3.0)  # inches
STAGES = ("queue_wait_ms", "decode_ms", "preprocess_ms", "infer_ms", "postprocess_ms", "write_ms", "total_ms")


def _svg(fig: Any) -> str:
    out = io.StringIO()
    fig.savefig(out, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = out.getvalue()
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)  # matplotlib's Dublin Core block
    return text[text.index("<svg"):]  # without the XML prolog and doctype: inline in HTML


def _times(epochs: list[int]) -> list[float]:
    """Unix times as matplotlib's dates (UTC)."""
    return [float(mdates.date2num(datetime.fromtimestamp(t, timezone.utc))) for t in epochs]


def _time_axis(ax: Any, t: list[float] | None = None) -> None:
    """Dates on the x axis; a single point gets a minute either side (matplotlib would span years)."""
    ax.xaxis_date(timezone.utc)
    if t is not None and min(t) == max(t):
        ax.set_xlim(t[0] - 1 / 1440, t[0] + 1 / 1440)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax.xaxis.get_major_locator()))
    ax.grid(alpha=0.3)


def throughput(data: ReportData) -> str | None:
    if not data.throughput:
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    t = _times([b for b, _, _ in data.throughput])
    ax.plot(t, [d / data.bucket_s for _, d, _ in data.throughput], label="done", marker=".")
    ax.plot(t, [f / data.bucket_s for _, _, f in data.throughput], label="failed", marker=".", color="C3")
    ax.set_ylabel(f"images/s (per {data.bucket_s} s)")
    ax.legend(loc="upper right")
    _time_axis(ax, t)
    return _svg(fig)


def latency(data: ReportData) -> str | None:
    if not data.latency:
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    t = _times([b for b, *_ in data.latency])
    for i, name in enumerate(("p50", "p95", "p99")):
        ax.plot(t, [row[i + 1] for row in data.latency], label=name, marker=".")
    ax.set_yscale("log")
    ax.set_ylabel(f"total latency, ms (bins of {10 ** (1 / PER_DECADE):.3f}x)")
    ax.legend(loc="upper right")
    _time_axis(ax, t)
    return _svg(fig)


def stages(stats: dict[str, Any]) -> str | None:
    """One run's latency per stage: p50, p95 and p99 (worker stats' figures)."""
    lat = stats.get("latency_ms") or {}
    if not lat or not lat.get("total_ms"):
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    names = [s for s in STAGES if s in lat]
    for i, q in enumerate(("p50", "p95", "p99")):
        ax.bar([j + (i - 1) * 0.27 for j in range(len(names))], [lat[s].get(q, 0.0) for s in names], width=0.27,
               label=q)
    ax.set_xticks(range(len(names)), [s[:-3] for s in names])
    ax.set_ylabel("ms")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    return _svg(fig)


def memory(data: ReportData) -> str | None:
    if not data.memory:
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    t = _times([b for b, _, _ in data.memory])
    ax.plot(t, [m for _, m, _ in data.memory], label="RSS")
    if any(g is not None for _, _, g in data.memory):
        ax.plot(t, [float("nan") if g is None else g for _, _, g in data.memory], label="GPU memory", color="C2")
    if data.warmup_end is not None:
        ax.axvspan(t[0], min(_times([data.warmup_end])[0], t[-1]), color="0.85", label="warm-up")
    if data.trend is not None and data.warmup_end is not None:
        a, b = data.trend
        ends = [data.warmup_end, max(data.warmup_end, data.memory[-1][0] + data.bucket_s)]
        ax.plot(_times(ends), [a + b * (e - data.warmup_end) for e in ends], "--", color="C3",
                label=f"trend {b * 3600:+.2f} MB/h")
    ax.set_ylabel("MB")
    ax.legend(loc="lower right")
    _time_axis(ax, t)
    return _svg(fig)


def labels(data: ReportData) -> str | None:
    if not data.labels:
        return None
    fig, ax = plt.subplots(figsize=(SIZE[0], max(2.0, 0.25 * len(data.labels))))
    names = [n for n, _ in data.labels][::-1]
    ax.barh(names, [k for _, k in data.labels][::-1])
    ax.set_xlabel("images")
    ax.grid(alpha=0.3, axis="x")
    return _svg(fig)


def scores(data: ReportData) -> str | None:
    if not any(data.scores):
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    ax.bar([(i + 0.5) / SCORE_BINS for i in range(SCORE_BINS)], data.scores, width=1 / SCORE_BINS)
    ax.set_xlabel("score (top-1 probability, best box or mean mask probability)")
    ax.set_ylabel("images")
    ax.grid(alpha=0.3, axis="y")
    return _svg(fig)
