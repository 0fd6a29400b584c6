"""Hostile and odd inputs through `run` and `watch`: a clear outcome for each, nothing lost,
the worker keeps going; files that vanish or change while queued; a burst of 2,000 files."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import cv2
import pytest

from tests import hostile
from tests.conftest import image_rows, wait_for
from worker.jobs import Job
from worker.service import open_pipeline, run_folder, watch




def _check(rows: dict, expected: dict) -> None:
    assert sorted(rows) == sorted(expected), "one row per input, no more, no less"
    for rel, (status, why) in expected.items():
        assert rows[rel].status == status, (rel, rows[rel].status, rows[rel].error)
        if status == "failed":
            assert rows[rel].error and why in rows[rel].error, (rel, rows[rel].error)


@pytest.fixture
def effcfg(cfg, effnet_onnx):
    return dataclasses.replace(cfg, model="efficientnet-lite0")


def test_hostile_corpus_run(effcfg, tmp_path: Path, samples: Path) -> None:
    expected = hostile.build(tmp_path / "in", samples)
    summary = run_folder(effcfg, tmp_path / "in")
    assert summary.figures["images"] == len(expected)
    rows = image_rows(effcfg)
    _check(rows, expected)
    assert rows["dup_one.png"].sha256 == rows["dup_two.png"].sha256
    doc = json.loads((effcfg.outbox / "exif_rotated.jpg.json").read_text())
    h, w = cv2.imread(str(samples / "chelsea.png")).shape[:2]
    assert doc["size"] == [h, w], "EXIF orientation applied: the result is in upright coordinates"
    assert json.loads((effcfg.outbox / "--help.png.json").read_text())["task"] == "classify"
    assert (effcfg.outbox / "ünïcødé 画像.jpg.json").exists()
    assert not list(effcfg.outbox.rglob("link_outside*")), "nothing written for the symlink"


def test_hostile_corpus_watch(effcfg, samples: Path) -> None:
    expected = hostile.build(effcfg.inbox, samples)
    watch(effcfg, threading.Event(), burst=True)
    _check(image_rows(effcfg), expected)
    for rel, (status, _) in expected.items():
        target = effcfg.archive / ("done" if status == "done" else "failed") / rel
        assert target.exists() or target.is_symlink(), rel
    assert not [p for p in effcfg.inbox.rglob("*") if p.is_file() or p.is_symlink()], "inbox emptied"
    assert Path("/etc/hostname").exists(), "the symlink's target was not touched"


def test_file_deleted_or_replaced_while_queued(effcfg, tmp_path: Path, samples: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("gone.png", "replaced.png"):
        (folder / name).write_bytes((samples / "coffee.png").read_bytes())
    jobs = [Job.from_path(folder, folder / n) for n in ("gone.png", "replaced.png")]
    (folder / "gone.png").unlink()
    (folder / "replaced.png").write_bytes((samples / "page.png").read_bytes())
    with open_pipeline(effcfg, "run", folder) as pipeline:
        for job in jobs:
            pipeline.submit(job)
        pipeline.drain()
    rows = image_rows(effcfg)
    assert rows["gone.png"].status == "failed" and "disappeared" in rows["gone.png"].error
    assert rows["replaced.png"].status == "done"
    from worker.models.fetch import sha256_file

    assert rows["replaced.png"].sha256 == sha256_file(samples / "page.png"), "the content actually read"


@pytest.mark.timeout(300)
def test_burst_of_2000_files_into_a_watched_inbox(effcfg, samples: Path) -> None:
    cfg = dataclasses.replace(effcfg, pipeline=dataclasses.replace(effcfg.pipeline, queue_size=16))
    cfg.inbox.mkdir(parents=True)
    small = cv2.resize(cv2.imread(str(samples / "coffee.png")), (48, 32))
    n = 2000
    stop = threading.Event()
    done: list[str] = []
    t = threading.Thread(target=lambda: watch(cfg, stop, on_finished=lambda j, s: done.append(j.rel)))
    t.start()
    try:
        wait_for(lambda: cfg.inbox.exists(), 30)
        time.sleep(1.0)  # the observer is scheduled after the engine warms up
        for i in range(n):
            img = small.copy()
            img[0, 0] = (i % 256, i // 256, 7)  # distinct content
            sub = cfg.inbox / f"b{i // 500}"
            sub.mkdir(exist_ok=True)
            cv2.imwrite(str(sub / f"{i:04d}.png"), img)
        assert wait_for(lambda: len(done) >= n, 240), len(done)
    finally:
        stop.set()
        t.join(60)
    rows = image_rows(cfg)
    assert len(rows) == n and all(r.status == "done" and r.attempts == 1 for r in rows.values())
    assert len(done) == n and len(set(done)) == n, "each file processed exactly once"
    assert len([p for p in (cfg.archive / "done").rglob("*.png")]) == n
