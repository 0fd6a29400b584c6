"""The statistics: percentiles, slopes and their standard error, the bounded latency window."""

from __future__ import annotations


import numpy as np

from worker.measure.metrics import percentiles, slope_per_hour, slope_se_per_hour


def test_percentiles_and_slope() -> None:
    assert percentiles([1, 2, 3, 4, 100])["p50"] == 3
    t = [0, 600, 1200, 1800, 3600]
    assert abs(slope_per_hour(t, [100 + 2 * x / 3600 for x in t]) - 2.0) < 1e-9
    assert slope_per_hour([0, 1], [1, 2]) != slope_per_hour([0, 1], [1, 2])  # nan with too few points


def test_a_slopes_standard_error_counts_how_rss_wanders_not_only_its_scatter() -> None:
    """A 100-minute soak: RSS wandered by +-4 MB over minutes, and a second half with no leak
    in it fitted 3.8 MB/h, which the samples' own scatter (each taken as independent) called
    significant. The error read from block means is what a verdict can trust."""
    t = np.arange(0, 3000, 5.0)  # 50 minutes sampled every 5 s
    noise = np.random.default_rng(1).normal(0, 0.7, t.size)
    wander = 180 + 3 * np.sin(2 * np.pi * t / 1100)  # no trend: a slow swing of 3 MB
    slope, se = slope_per_hour(t, wander + noise), slope_se_per_hour(t, wander + noise)
    h = t / 3600
    residuals = wander + noise - np.polyval(np.polyfit(h, wander + noise, 1), h)
    naive = np.sqrt((residuals ** 2).sum() / (t.size - 2) / ((h - h.mean()) ** 2).sum())
    assert abs(slope) > 2 * naive  # "a trend", to the sample-by-sample error
    assert abs(slope) < 2 * se and se > 3 * naive  # within the noise, to the block means' error
    leak = 180 + 10 * h + noise  # a steady leak of 10 MB/h: its slope stands clear of its error
    assert abs(slope_per_hour(t, leak) - 10) < 1 and slope_se_per_hour(t, leak) < 1
    assert np.isnan(slope_se_per_hour(t[:15], leak[:15]))  # too few samples for 8 blocks of 2


def test_latency_window_is_bounded_and_ordered() -> None:
    from worker.measure.metrics import LatencyWindow

    w = LatencyWindow(head=3, tail=4)
    for v in range(10):
        w.add(float(v))
    assert w.first().tolist() == [0, 1, 2] and w.last().tolist() == [6, 7, 8, 9] and w.count == 10
    small = LatencyWindow(head=3, tail=4)
    small.add(5.0)
    assert small.last().tolist() == [5.0]
