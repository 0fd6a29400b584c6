"""The report's charts: matplotlib (its Agg backend, no display) drawn to SVG text, embedded in the page as is."""

from __future__ import annotations

import io
import logging
import re
from datetime import datetime, timezone
from typing import Any, Sequence

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


def _broken(rows: Sequence[Sequence[float]], bucket_s: int) -> list[list[float]]:
    """`rows` (bucket start, values...) as columns to plot, the first as matplotlib's dates, with a row of
    NaN where buckets were skipped: the lines break there (between runs, or while nothing finished)
    instead of drawing one slope across the gap."""
    out: list[list[float]] = []
    for k, row in enumerate(rows):
        if k and row[0] - rows[k - 1][0] > bucket_s:
            out.append([float("nan")] * len(row))
        out.append([_times([int(row[0])])[0], *map(float, row[1:])])
    return [list(column) for column in zip(*out)]


def throughput(data: ReportData) -> str | None:
    if not data.throughput:
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    rated = [(b, data.rate(b, d), data.rate(b, f)) for b, d, f in data.throughput]
    t, done, failed = _broken(rated, data.bucket_s)
    ax.plot(t, done, label="done", marker=".")
    ax.plot(t, failed, label="failed", marker=".", color="C3")
    ax.set_ylabel(f"images/s (per {data.bucket_s} s)")
    ax.legend(loc="upper right")
    _time_axis(ax, _times([b for b, _, _ in data.throughput]))
    return _svg(fig)


def latency(data: ReportData) -> str | None:
    if not data.latency:
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    t, *columns = _broken(data.latency, data.bucket_s)
    for name, values in zip(("p50", "p95", "p99"), columns):
        ax.plot(t, values, label=name, marker=".")
    ax.set_yscale("log")
    ax.set_ylabel(f"total latency, ms (bins of {10 ** (1 / PER_DECADE):.3f}x)")
    ax.legend(loc="upper right")
    _time_axis(ax, _times([b for b, *_ in data.latency]))
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


def memory(data: ReportData, judged: set[int]) -> str | None:
    """Each run's RSS (and GPU memory) as a line of its own, its warm-up shaded, and its trend after the
    warm-up where the page judges one (`judged`): runs are separate processes, never one series."""
    if not data.memory:
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    alone = len(data.memory) == 1
    every: list[float] = []
    for k, run in enumerate(data.memory):
        name = "" if alone else f"run {run.run} "
        t = _times([b for b, _, _ in run.series])
        every += t
        (line,) = ax.plot(t, [m for _, m, _ in run.series], label=f"{name}RSS",
                          marker="." if len(run.series) == 1 else None)  # one sample: a point, not nothing
        if any(g is not None for _, _, g in run.series):
            ax.plot(t, [float("nan") if g is None else g for _, _, g in run.series], label=f"{name}GPU memory")
        ax.axvspan(t[0], min(_times([run.warmup_end])[0], t[-1]), color="0.85", label="warm-up" if k == 0 else None)
        if run.trend is not None and run.run in judged:  # over the window the verdict judges, as it fits it
            a, b = run.trend
            ends = [run.judged_from, max(run.judged_from, run.series[-1][0] + run.bucket_s)]
            ax.plot(_times(ends), [a + b * (e - run.judged_from) for e in ends], "--", color=line.get_color(),
                    label=f"{name}trend {b * 3600:+.2f} MB/h (judged half)")
    ax.set_ylabel("MB")
    ax.legend(loc="lower right")
    _time_axis(ax, every)
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
