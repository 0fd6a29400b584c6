"""Tallies (worker.store.tallies): what the recorder adds up per minute and hour, and `stats` and `report`
read from it for a long run, against the same run read row by row."""

from __future__ import annotations

import dataclasses
import json
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import delete, exists, func, select

from tests.conftest import CACHE, ROOT
from worker.config import load
from worker.intake.jobs import JobStatus
from worker.report.data import gather, pick_runs
from worker.service import run_folder
from worker.store import tallies
from worker.store.db import open_db
from worker.store.events import Finished
from worker.store.prune import prune
from worker.store.queries import STAGES
from worker.store.stats import run_stats
from worker.store.schema import ImageRow, LabelRow, ResultRow, TallyRow, TimingRow
from worker.store.tallies import Tally, bin_ms, latency_bin, score_bin, tally

AT = datetime(2026, 11, 1, 10, 30, 15, tzinfo=timezone.utc)
TIMED = dict(queue_wait_ms=1.0, decode_ms=2.0, preprocess_ms=0.5, infer_ms=8.0, postprocess_ms=0.0, write_ms=0.3,
             total_ms=12.0, batch_size=4)


def test_an_outcome_adds_to_its_minute_and_hour() -> None:
    classified = Finished("a.jpg", "s", 1, JobStatus.DONE, task="classify", score=0.93, timings=TIMED,
                          labels=((3, "cup", 0.93), (7, "mug", 0.05)))
    boxes = Finished("b.jpg", "s", 1, JobStatus.DONE, task="detect", score=0.8, timings=TIMED,
                     labels=((0, "person", 0.8), (0, "person", 0.6), (2, "car", 0.7)))
    empty = Finished("c.jpg", "s", 1, JobStatus.DONE, task="detect", score=0.0, timings=TIMED)
    failed = Finished("d.jpg", "s", 1, JobStatus.FAILED, error="not an image", timings={**TIMED, "total_ms": 1e4})
    deferred = Finished("e.jpg", "s", 1, JobStatus.QUEUED, error="waiting for room in the outbox", undo_attempt=True)
    # a soak's replay: the same image twice is two outcomes; an image queued again is none yet
    cells = tally([classified, classified, boxes, empty, failed, deferred], AT)
    minute = int(AT.timestamp()) // 60 * 60
    hour = int(AT.timestamp()) // 3600 * 3600
    assert cells[(minute, "outcome", "done")] == [4, 0.0] and cells[(minute, "outcome", "failed")] == [1, 0.0]
    # the failure's latency is not counted: it stopped part-way
    assert cells[(minute, "total", str(latency_bin(12.0)))] == [4, 16.0]
    assert cells[(hour, "stage", f"infer_ms {latency_bin(8.0)}")] == [4, 0.0]
    assert cells[(hour, "stage", "postprocess_ms 0")] == [4, 0.0]
    # a classifier's top label only; a detector's images and boxes per class
    assert cells[(hour, "label", "cup")] == [2, 0.0] and (hour, "label", "mug") not in cells
    assert cells[(hour, "label", "person")] == [1, 2.0] and cells[(hour, "label", "car")] == [1, 1.0]
    # scores of a classifier's every image, a detector's where it found something
    assert cells[(hour, "score", "93")] == [2, 0.0] and cells[(hour, "score", "80")] == [1, 0.0]
    assert sum(n for (_, kind, _), (n, _) in cells.items() if kind == "score") == 3
    assert cells[(hour, "result", "classify")] == [2, 0.0] and cells[(hour, "result", "detect")] == [2, 1.0]
    assert {kind for _, kind, _ in cells} == {t.value for t in Tally} and (minute, "outcome", "queued") not in cells


def test_a_window_holds_the_minutes_and_hours_that_overlap_it() -> None:
    from worker.store.tallies import Span
    from sqlalchemy.dialects import sqlite

    def bounds(span: Span, kind: Tally) -> list[str]:
        return [str(w.compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True}))
                for w in span.where(kind)]

    span = Span.of(AT, AT + timedelta(hours=2))
    t = int(AT.timestamp())
    # the minute that began 15 s before the window is in it; so is the hour that began 30 min 15 s before
    assert bounds(span, Tally.OUTCOME) == [f"tallies.at > {t - 60}", f"tallies.at < {t + 7200}"]
    assert bounds(span, Tally.LABEL) == [f"tallies.at > {t - 3600}", f"tallies.at < {t + 7200}"]
    assert bounds(Span(), Tally.TOTAL) == []


def test_bins_hold_a_value_within_four_percent() -> None:
    for ms in (0.011, 0.3, 1.0, 7.77, 12.5, 99.0, 4321.0, 999_000.0):
        assert abs(bin_ms(latency_bin(ms)) / ms - 1) < 0.037, ms
    assert bin_ms(latency_bin(0.0)) == 0.0 and bin_ms(latency_bin(1e9)) == 1e6
    assert [score_bin(s) for s in (0.0, 0.005, 0.5, 0.999, 1.0, -1.0, float("nan"))] == [0, 0, 50, 99, 99, 0, 0]


def _rank(values: list[float], q: float) -> float:
    """The value at which the q-th percentile is reached, counting images (as the bins are read)."""
    values = sorted(values)
    return next(v for k, v in enumerate(values, 1) if k >= q / 100 * len(values))


@pytest.fixture(params=["efficientnet-lite0", "yolov3-tiny"])
def recorded(request, tmp_path: Path, samples: Path):
    """A real `run` of a model over the samples, each three times under another name, and two broken files."""
    request.getfixturevalue({"efficientnet-lite0": "effnet_onnx", "yolov3-tiny": "yolo_onnx"}[request.param])
    folder = tmp_path / "images"
    folder.mkdir()
    for path in sorted(samples.iterdir()):
        if path.suffix in (".png", ".jpg"):
            for copy in range(3):
                shutil.copy(path, folder / f"{copy}-{path.name}")
    (folder / "broken.jpg").write_bytes(b"\xff\xd8 not much of a JPEG")
    (folder / "empty.png").write_bytes(b"")
    base = load(ROOT / "config.yaml")
    cfg = dataclasses.replace(base, outbox=tmp_path / "outbox", db=f"sqlite:///{tmp_path / 'w.db'}",
                              cache_dir=CACHE, models_dir=ROOT / "models", model=request.param)
    summary = run_folder(cfg, folder)
    db = open_db(cfg.db)
    yield db, summary.run_id, cfg
    db.dispose()


def test_stats_from_the_tallies_agree_with_the_rows(recorded) -> None:
    db, run_id, _ = recorded
    (rows,) = run_stats(db, run_id=run_id, warmup_s=0)
    (tallied,) = run_stats(db, run_id=run_id, warmup_s=0, tallied_above=0)
    assert (rows["read_from"], tallied["read_from"]) == ("rows", "tallies")
    assert tallied["counts"] == rows["counts"] and rows["counts"]["failed"] == 2 and rows["counts"]["done"] >= 20
    assert tallied["batch_size_mean"] == rows["batch_size_mean"]
    assert tallied["latency_images"]["of"] == rows["latency_images"]["of"]
    assert json.dumps(tallied["memory"]) == json.dumps(rows["memory"])  # nan is not nan: compared as JSON
    assert tallied["images_per_s"] == rows["images_per_s"]
    with db.connect() as c:
        timed = c.execute(select(*(getattr(TimingRow, s) for s in STAGES)).join(
            ImageRow, ImageRow.id == TimingRow.image_id).where(ImageRow.status == "done")).all()
        found = exists().where(LabelRow.image_id == ResultRow.image_id)  # a detector's images with a box
        scores = c.execute(select(ResultRow.score).where(found) if rows["results"]["task"] == "detect"
                           else select(ResultRow.score)).scalars().all()
    for i, stage in enumerate(STAGES):
        for q in (50, 95, 99):
            expected = round(bin_ms(latency_bin(_rank([t[i] for t in timed], q))), 2)
            assert tallied["latency_ms"][stage][f"p{q}"] == expected, (stage, q)
            # and within the bins' width of what the rows say (where the rows' interpolation agrees)
            assert expected <= 1.04 * max(t[i] for t in timed) + 0.01
    # a window (`stats --since`) from the tallies too: here, the whole run
    (windowed,) = run_stats(db, run_id=run_id, warmup_s=0, since=datetime.now(timezone.utc) - timedelta(hours=1),
                            tallied_above=0)
    assert windowed["read_from"] == "tallies" and windowed["counts"] == rows["counts"]
    assert windowed["latency_ms"] == tallied["latency_ms"] and windowed["results"] == tallied["results"]
    res_rows, res_tallied = rows["results"], tallied["results"]
    for key in ("task", "images", "labels", "none"):
        assert res_tallied[key] == res_rows[key], key
    assert res_rows["labels"], "the samples name nothing: the test would check nothing"
    for q in (5, 50, 95):
        assert res_tallied["score"][f"p{q}"] == round((score_bin(_rank(scores, q)) + 0.5) / 100, 4), q


def test_the_report_reads_the_same_from_the_tallies_and_the_rows(recorded) -> None:
    db, run_id, cfg = recorded
    runs = pick_runs(db, [run_id], 1, None, None, None)
    from_tallies = gather(db, runs, 0, cfg.outbox)
    with db.connect() as c:
        minutes = {int(at.timestamp()) // 60 * 60 for at in c.execute(
            select(ImageRow.updated_at).where(ImageRow.status.in_(("done", "failed")))).scalars()}
        done = c.execute(select(func.count()).where(ImageRow.status == "done")).scalar_one()
        per_minute, hist = tallies.series(c, [run_id], 60)
    assert {at for at, _, _ in per_minute} == minutes and sum(d for _, d, _ in per_minute) == done
    assert sum(f for _, _, f in per_minute) == 2 and sum(sum(h.values()) for h in hist.values()) == done
    with db.begin() as c:  # as a run recorded before tallies were
        c.execute(delete(TallyRow))
    from_rows = gather(db, runs, 0, cfg.outbox)
    def timeless(stats: list[dict]) -> str:  # the run's health says how long ago it ended
        return json.dumps([{k: v for k, v in st.items() if k != "health"} for st in stats])

    assert timeless(from_rows.stats) == timeless(from_tallies.stats) and from_rows.counts == from_tallies.counts
    assert from_rows.scores == from_tallies.scores and sum(from_rows.scores) > 0
    assert from_rows.throughput == from_tallies.throughput and from_rows.latency == from_tallies.latency


def test_prune_forgets_the_tallies_before_its_cutoff(recorded) -> None:
    db, run_id, _ = recorded
    with db.connect() as c:
        assert c.execute(select(func.count()).select_from(TallyRow)).scalar_one() > 0
    prune(db, datetime.now(timezone.utc) - timedelta(days=1))
    with db.connect() as c:
        assert c.execute(select(func.count()).select_from(TallyRow)).scalar_one() > 0
    prune(db, datetime.now(timezone.utc) + timedelta(hours=2))
    with db.connect() as c:
        assert c.execute(select(func.count()).select_from(TallyRow)).scalar_one() == 0
