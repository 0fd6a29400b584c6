"""What the database answers: query filters, per-run statistics (in a window, of a months-long run), what
the images held."""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from worker.errors import StoreError
from worker.service import run_folder
from worker.store.db import open_db
from worker.store.queries import Filters, glob_to_like, query_images
from worker.store.stats import run_stats
from worker.store.schema import ImageRow


def test_glob_to_like() -> None:
    assert glob_to_like("line3/*.png") == "line3/%.png"
    assert glob_to_like("a_b%?") == "a\\_b\\%_"


def test_query_filters_and_stats(cfg, tmp_path: Path, samples: Path) -> None:
    folder = tmp_path / "in"
    (folder / "line3").mkdir(parents=True)
    shutil.copy(samples / "page.png", folder / "line3" / "page.png")
    shutil.copy(samples / "astronaut.png", folder / "astronaut.png")
    (folder / "line3" / "bad.png").write_bytes(b"nope")
    for name in ("bad2.jpg", "bad3.jpg", "bad4.jpg"):  # more failures than successes: they must not skew timings
        (folder / "line3" / name).write_bytes(b"")
    summary = run_folder(cfg, folder)
    db = open_db(cfg.db)

    def rels(**kw) -> list[str]:
        return sorted(r["rel_path"] for r in query_images(db, Filters(**kw)))

    bad = ["line3/bad.png", "line3/bad2.jpg", "line3/bad3.jpg", "line3/bad4.jpg"]
    assert rels() == ["astronaut.png", *bad, "line3/page.png"]
    assert rels(status="failed") == bad
    assert rels(path="line3/*") == [*bad, "line3/page.png"]
    # a file as the user sees it (the folder run joined to the relative path), or a glob on that
    assert rels(path=str(folder / "line3" / "page.png")) == ["line3/page.png"]
    assert rels(path=f"{folder}/line3/../astronaut.png") == ["astronaut.png"]
    assert rels(path=f"{folder}/*/bad?.jpg") == bad[1:] and rels(path="/elsewhere/line3/page.png") == []
    assert rels(label="text", min_score=0.5) == ["line3/page.png"]
    assert rels(min_score=0.99999) == []
    assert rels(run_id=summary.run_id) == rels()
    with pytest.raises(StoreError, match=f"no run {summary.run_id + 1} on record"):  # a typo, not "nothing"
        rels(run_id=summary.run_id + 1)
    now = datetime.now(timezone.utc)
    assert rels(since=now - timedelta(hours=1)) == rels() and rels(since=now + timedelta(hours=1)) == []
    assert rels(until=now - timedelta(hours=1)) == []

    (stats,) = run_stats(db, run_id=summary.run_id, warmup_s=0)
    assert stats["counts"] == {"done": 2, "failed": 4}
    assert stats["images_per_s"] > 0 and stats["batch_size_mean"] == 1.0
    assert all(stats["latency_ms"][s]["p50"] > 0 for s in ("decode_ms", "preprocess_ms", "infer_ms", "write_ms"))
    assert stats["memory"]["samples"] >= 2 and stats["memory"]["rss_peak_mb"] > 50
    res = stats["results"]  # what the two done images held: PP-OCR's text, where it found some
    with_text = rels(label="text", status="done")
    assert res["task"] == "segment" and res["images"] == 2 and "line3/page.png" in with_text
    assert res["labels"] == [{"name": "text", "images": len(with_text)}] and res["none"] == 2 - len(with_text)
    assert 0.5 < res["score"]["p50"] <= 1.0  # the mean probability over the text's pixels
    db.dispose()


def test_memory_trend_judges_the_second_half_after_warm_up(tmp_path: Path) -> None:
    """Settling steps early in a run move the whole-window slope, not the second half's; a leak moves both."""
    from sqlalchemy.orm import Session

    from worker.store.schema import MemorySample, Run

    db = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    t0 = datetime(2026, 11, 30, tzinfo=timezone.utc)
    # 15 minutes sampled every 5 s, as a soak here measured it: settling = 200 MB, +1.2 MB at 4 min,
    # +0.8 MB at 5 min, then flat; leak = 200 MB growing 10 MB/h throughout
    shapes = {"settling": lambda s: 200 + 1.2 * (s >= 240) + 0.8 * (s >= 300), "leak": lambda s: 200 + 10 * s / 3600}
    with Session(db) as session:
        for name, rss_mb in shapes.items():
            run = Run(mode="soak", host="h", pid=1, root="/", model=name, model_sha256="", providers="cpu",
                      config={}, version="0", started_at=t0, finished_at=t0 + timedelta(minutes=15))
            session.add(run)
            session.flush()
            session.add_all(MemorySample(run_id=run.id, at=t0 + timedelta(seconds=s), rss_bytes=int(rss_mb(s) * 2**20),
                                         fds=10, threads=10, queue_depth=0, images_done=s) for s in range(0, 900, 5))
        session.commit()
    trend = {r["model"]: r["memory"] for r in run_stats(db, last=2, warmup_s=180)}
    db.dispose()
    assert trend["settling"]["slope_mb_per_h"] > 2 and trend["settling"]["late_slope_mb_per_h"] == 0
    assert abs(trend["leak"]["slope_mb_per_h"] - 10) < 0.01 and abs(trend["leak"]["late_slope_mb_per_h"] - 10) < 0.01
    assert trend["leak"]["late_samples"] == trend["leak"]["steady_samples"] // 2


def test_stats_of_a_months_long_run_reads_every_kth_row(tmp_path: Path, monkeypatch) -> None:
    """Beyond SAMPLE_CAP samples (TIMING_CAP timings) `stats` reads every k-th, and says so; the peak,
    the first and last sample, the mean batch and the processed count stay exact (before: every row
    read, 12 s and 800 MB of RSS for 58 days of samples)."""
    from sqlalchemy.orm import Session

    import worker.store.stats as stats_module
    from worker.store.schema import MemorySample, Run, TimingRow

    monkeypatch.setattr(stats_module, "SAMPLE_CAP", 100)
    monkeypatch.setattr(stats_module, "TIMING_CAP", 100)
    db = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    t0 = datetime(2026, 9, 1, tzinfo=timezone.utc)
    with Session(db) as session:
        run = Run(mode="watch", host="h", pid=1, root="/", model="m", model_sha256="", providers="cpu",
                  config={}, version="0", started_at=t0, finished_at=t0 + timedelta(hours=10))
        session.add(run)
        session.flush()
        # 1,000 samples over 10 h growing 1 MB/h, and one spike of 500 MB that the stride skips
        session.add_all(MemorySample(id=i, run_id=run.id, at=t0 + timedelta(seconds=36 * (i - 1)),
                                     rss_bytes=int((500 if i == 503 else 100 + (i - 1) * 36 / 3600) * 2**20),
                                     fds=10, threads=10, queue_depth=0, images_done=i) for i in range(1, 1001))
        for i in range(1, 1001):
            session.add(ImageRow(id=i, run_id=run.id, rel_path=f"{i}.png", sha256=f"{i:064d}", model="m", size=1,
                                 status="done", attempts=1, created_at=t0, updated_at=t0))
        session.flush()
        session.add_all(TimingRow(image_id=i, run_id=run.id, queue_wait_ms=0, decode_ms=0, preprocess_ms=0,
                                  infer_ms=0, postprocess_ms=0, write_ms=0, total_ms=float(i), batch_size=1 + (i == 7))
                        for i in range(1, 1001))
        session.commit()
    (st,) = run_stats(db, run_id=1, warmup_s=0)
    db.dispose()
    m = st["memory"]
    assert (m["samples"], m["sample_stride"], m["steady_samples"]) == (1000, 10, 101)  # every 10th, and the first
    assert m["rss_peak_mb"] == 500.0 and m["rss_start_mb"] == 100.0 and m["rss_end_mb"] == 110.0
    assert abs(m["slope_mb_per_h"] - 1.0) < 0.01
    assert st["latency_images"] == {"read": 100, "of": 1000, "stride": 10}
    assert abs(st["latency_ms"]["total_ms"]["p50"] - 500) < 10 and st["batch_size_mean"] == 1.0  # 1.001, rounded
    assert st["images_per_s"] == round(1000 / 36000, 2)


def test_stats_in_a_window_cover_only_what_happened_in_it(tmp_path: Path) -> None:
    """`stats --since/--until`: a watcher of ten days asked about its last day gets that day's counts,
    rate, latency and memory (the warm-up still counted from the run's start), and only runs active then."""
    from sqlalchemy.orm import Session

    from worker.store.schema import MemorySample, Run, TimingRow

    db = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    t0 = datetime(2026, 9, 1, tzinfo=timezone.utc)
    day = timedelta(days=1)
    with Session(db) as session:
        old = Run(mode="run", host="h", pid=1, root="/old", model="m", model_sha256="", providers="cpu", config={},
                  version="0", started_at=t0 - 2 * day, finished_at=t0 - day)
        watcher = Run(mode="watch", host="h", pid=2, root="/in", model="m", model_sha256="", providers="cpu",
                      config={}, version="0", started_at=t0)  # still running
        session.add_all([old, watcher])
        session.flush()
        old_id, watcher_id = old.id, watcher.id
        # a row an hour for ten days (the pipeline did 1 image/s, 2 on the last day, as a soak replaying
        # its images counts them); the last day's took twice as long, and RSS grew 1 MB an hour then
        for i in range(240):
            at = t0 + timedelta(hours=i, minutes=30)
            session.add(ImageRow(id=i + 1, run_id=watcher.id, rel_path=f"{i}.png", sha256=f"{i:064d}", model="m",
                                 size=1, status="failed" if i % 48 == 47 else "done", attempts=1, created_at=at,
                                 updated_at=at))
            session.flush()
            session.add(TimingRow(image_id=i + 1, run_id=watcher.id, queue_wait_ms=1, decode_ms=1, preprocess_ms=1,
                                  infer_ms=1, postprocess_ms=1, write_ms=1, total_ms=20.0 if i >= 216 else 10.0,
                                  batch_size=1))
        session.add_all(MemorySample(run_id=watcher.id, at=t0 + timedelta(hours=h), fds=10, threads=10, queue_depth=0,
                                     images_done=3600 * h + 3600 * max(0, h - 216),
                                     rss_bytes=int((100 + max(0, h - 216)) * 2**20))
                        for h in range(241))
        session.commit()
    last_day = t0 + 9 * day
    (st,) = run_stats(db, since=last_day, warmup_s=3600)
    assert st["run"] == watcher_id and st["window"] == {"since": last_day.isoformat(), "until": None}
    assert st["counts"] == {"done": 23, "failed": 1}  # hours 216-239; 239 failed
    assert st["latency_ms"]["total_ms"]["p50"] == 20.0 and st["latency_images"]["of"] == 23
    assert st["images_per_s"] == 2.0
    m = st["memory"]
    assert (m["rss_start_mb"], m["rss_end_mb"], m["samples"]) == (100.0, 124.0, 25)
    assert m["steady_samples"] == 25 and abs(m["slope_mb_per_h"] - 1.0) < 0.01  # its start is long past the warm-up
    # the whole run, for comparison: ten days, mostly flat and fast
    (whole,) = run_stats(db, run_id=watcher_id, warmup_s=3600)
    assert whole["counts"] == {"done": 235, "failed": 5} and whole["latency_ms"]["total_ms"]["p50"] == 10.0
    assert whole["memory"]["samples"] == 241 and whole["window"] == {"since": None, "until": None}
    # a window in the old run's time: only it; one before every run: none
    (st,) = run_stats(db, since=t0 - 1.5 * day, until=t0 - 1.2 * day)
    assert st["run"] == old_id and st["counts"] == {} and st["images_per_s"] == 0.0
    assert run_stats(db, since=t0 - 5 * day, until=t0 - 4 * day) == []
    (st,) = run_stats(db, since=t0 + 2 * day, until=t0 + 3 * day)  # a day in the middle of the watch
    assert st["counts"] == {"done": 24} and st["memory"]["rss_end_mb"] == 100.0
    assert 0.95 <= st["images_per_s"] <= 1.0  # its samples reach the window's last hour, not its end
    db.dispose()


def test_stats_say_what_the_images_held(tmp_path: Path) -> None:
    """Per run, what its done images held: a classifier's top labels (the best of each image's top-k,
    whatever order its rows came in), a detector's boxes by class with the images holding them and the
    images with none, and the score's percentiles (a detector's over the images with boxes); in a window,
    only the images last updated in it. `worker stats` prints it as one line."""
    from click.testing import CliRunner
    from sqlalchemy.orm import Session

    from worker.cli import cli
    from worker.store.schema import LabelRow, ResultRow, Run

    db = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    t0 = datetime(2026, 9, 1, tzinfo=timezone.utc)
    found = {  # run -> (image, task, score, [(label, score)], status): label rows in the order written
        "classify": [("a", 0.9, [("b", 0.05), ("a", 0.9)]), ("a", 0.8, [("a", 0.8), ("c", 0.1)]),
                     ("b", 0.7, [("b", 0.7), ("a", 0.2)]), ("c", 0.6, [("c", 0.6)]), ("x", 0.0, None)],
        "detect": [("1", 0.9, [("person", 0.9), ("car", 0.7), ("person", 0.5)]), ("2", 0.0, []),
                   ("3", 0.4, [("car", 0.4)])],
    }
    ids = {}
    with Session(db) as session:
        n = 0
        for task, images in found.items():
            run = Run(mode="run", host="h", pid=1, root=f"/{task}", model=task, model_sha256="", providers="cpu",
                      config={}, version="0", started_at=t0, finished_at=t0 + timedelta(hours=3))
            session.add(run)
            session.flush()
            ids[task] = run.id
            for i, (name, score, labels) in enumerate(images):
                n += 1
                at = t0 + timedelta(hours=i)
                session.add(ImageRow(id=n, run_id=run.id, rel_path=f"{name}.png", sha256=f"{n:064d}", model=task,
                                     size=1, status="failed" if labels is None else "done", attempts=1,
                                     created_at=at, updated_at=at))
                session.flush()
                if labels is not None:
                    session.add(ResultRow(image_id=n, task=task, score=score, payload={}))
                    session.add_all(LabelRow(image_id=n, class_id=0, name=label, score=s) for label, s in labels)
        session.commit()

    (classify,) = run_stats(db, run_id=ids["classify"])
    res = classify["results"]
    assert (res["task"], res["images"], res["none"]) == ("classify", 4, 0)
    assert res["labels"] == [{"name": "a", "images": 2}, {"name": "b", "images": 1}, {"name": "c", "images": 1}]
    assert res["score"]["p50"] == pytest.approx(0.75)
    (detect,) = run_stats(db, run_id=ids["detect"])
    res = detect["results"]
    assert (res["task"], res["images"], res["none"]) == ("detect", 3, 1)
    assert res["labels"] == [{"name": "car", "images": 2, "boxes": 2}, {"name": "person", "images": 1, "boxes": 2}]
    assert res["score"]["p50"] == pytest.approx(0.65)  # of the two images with boxes: 0.9 and 0.4
    (late,) = run_stats(db, run_id=ids["detect"], since=t0 + timedelta(hours=1.5))
    assert late["results"]["labels"] == [{"name": "car", "images": 1, "boxes": 1}] and late["results"]["none"] == 0
    assert run_stats(db, run_id=ids["detect"], since=t0 + timedelta(hours=2.5))[0]["results"] == {}
    db.dispose()

    text = CliRunner().invoke(cli, ["stats", "--db", f"sqlite:///{tmp_path / 'w.db'}"]).output
    assert "  results: 4 images done; top label a 2 (50.0%), b 1 (25.0%), c 1 (25.0%); top-1 probability p5 " in text
    assert ("  results: 3 images done; boxes of car 2 in 2 (66.7%), person 2 in 1 (33.3%); nothing in 1 (33.3%); "
            "best box's score p5 0.425, p50 0.65, p95 0.875") in text, text
