"""Hostile and odd inputs through `run` and `watch`: a clear outcome for each, nothing lost,
the worker keeps going; files that vanish or change while queued; a burst of 2,000 files."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import cv2
import pytest

from tests.support import hostile
from tests.conftest import image_rows, wait_for
from tests.support.userns import own_user_namespace
from tests.support.disks import fill
from worker.intake.jobs import Job
from worker.host.names import as_text
from worker.outputs.outbox import output_rel
from worker.service import open_pipeline, run_folder, watch
from worker.store.db import open_db
from worker.store.health import Health, RunState
from worker.store.stats import run_health


def _check(rows: dict, expected: dict) -> None:
    # a name that is not UTF-8 is recorded with its undecodable bytes as \xNN (worker.host.names)
    assert sorted(rows) == sorted(as_text(rel) for rel in expected), "one row per input, no more, no less"
    for rel, (status, why) in expected.items():
        row = rows[as_text(rel)]
        assert row.status == status, (rel, row.status, row.error)
        if status == "failed":
            assert row.error and why in row.error, (rel, row.error)


@pytest.fixture
def effcfg(cfg, effnet_onnx):
    return dataclasses.replace(cfg, model="efficientnet-lite0")


def _payload(cfg, image_id: int) -> dict:
    """The result document the database holds for an image."""
    from sqlalchemy import select

    from worker.store.db import open_db
    from worker.store.schema import ResultRow

    db = open_db(cfg.db)
    with db.connect() as c:
        payload = c.execute(select(ResultRow.payload).where(ResultRow.image_id == image_id)).scalar_one()
    db.dispose()
    return payload


def test_hostile_corpus_run(effcfg, tmp_path: Path, samples: Path) -> None:
    expected = hostile.build(tmp_path / "in", samples)
    summary = run_folder(effcfg, tmp_path / "in")
    assert summary.figures["images"] == len(expected)
    rows = image_rows(effcfg)
    _check(rows, expected)
    assert rows["dup_one.png"].sha256 == rows["dup_two.png"].sha256
    doc = json.loads((effcfg.outbox / "exif_rotated.jpg.json").read_text())
    h, w = cv2.imread(str(samples / "chelsea.png")).shape[:2]
    assert doc["image"] == {"width": h, "height": w}, "EXIF orientation applied: the result is in upright coordinates"
    assert json.loads((effcfg.outbox / "--help.png.json").read_text())["task"] == "classify"
    # the first page or frame is processed, and the result says how many there were (the database's too)
    for rel in ("multipage.tif", "animated.gif"):
        assert json.loads((effcfg.outbox / f"{rel}.json").read_text())["image"]["pages"] == 2, rel
        assert _payload(effcfg, rows[rel].id)["image"]["pages"] == 2, rel
    assert "pages" not in json.loads((effcfg.outbox / "palette.png.json").read_text())["image"]
    assert (effcfg.outbox / "ünïcødé 画像.jpg.json").exists()
    long_name = "長" * 82 + ".jpg"  # 250 bytes: "<name>.json" would be 255, its temporary name longer
    assert output_rel(long_name) != long_name
    assert json.loads((effcfg.outbox / f"{output_rel(long_name)}.json").read_text())["input"] == long_name
    # outputs keep a name's real bytes; the JSON, valid UTF-8, says it as the database does
    latin1 = json.loads((effcfg.outbox / "d\udce4ta" / "n\udcfcmero.png.json").read_bytes().decode("utf-8"))
    assert latin1["input"] == "d\\xe4ta/n\\xfcmero.png" and latin1["status"] == "done"
    broken = json.loads((effcfg.outbox / "br\udcf6ken.jpg.error.json").read_bytes().decode("utf-8"))
    assert broken["input"] == "br\\xf6ken.jpg" and "not an image" in broken["error"]
    # for the symlink only the reason it was refused, and every failed input has its reason in the outbox
    assert [p.name for p in effcfg.outbox.rglob("link_outside*")] == ["link_outside.jpg.error.json"]
    for rel, (status, reason) in expected.items():
        error = effcfg.outbox / f"{output_rel(rel)}.error.json"
        assert error.exists() == (status == "failed"), rel
        assert status != "failed" or reason in json.loads(error.read_text())["error"], rel


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


def test_file_replaced_while_queued_in_watch_mode_is_no_failure(effcfg, samples: Path) -> None:
    """Watch mode: a.png is queued, then replaced under the same name, and intake queues the new
    content too. The first job reads the new content and archives it; the second then finds nothing
    to read, which is no failure (no phantom "disappeared" row). A file deleted while queued still is."""
    inbox = effcfg.inbox
    inbox.mkdir(parents=True)
    old, new = (samples / "coffee.png").read_bytes(), (samples / "page.png").read_bytes()
    (inbox / "a.png").write_bytes(old)
    (inbox / "gone.png").write_bytes(old)
    queued_old, gone = Job.from_path(inbox, inbox / "a.png"), Job.from_path(inbox, inbox / "gone.png")
    (inbox / ".a.png.part").write_bytes(new)
    os.replace(inbox / ".a.png.part", inbox / "a.png")  # a producer rewriting a.png
    queued_new = Job.from_path(inbox, inbox / "a.png")
    (inbox / "gone.png").unlink()
    with open_pipeline(effcfg, "watch", inbox, "move") as pipeline:
        for job in (queued_old, gone):
            pipeline.submit(job)
        pipeline.drain()  # the first job read the new content and archived it
        pipeline.submit(queued_new)
        pipeline.drain()
        assert pipeline.counts.skipped == 1
    db = open_db(effcfg.db)
    with db.connect() as c:
        rows = sorted(c.exec_driver_sql("select rel_path, sha256, status, error from images").fetchall())
    db.dispose()
    assert [r[:3] for r in rows] == [("a.png", hashlib.sha256(new).hexdigest(), "done"), ("gone.png", "", "failed")]
    assert "disappeared" in rows[1][3]
    assert (effcfg.archive / "done" / "a.png").read_bytes() == new


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


def test_a_multi_page_file_whose_page_finds_the_outbox_full_waits_whole(cfg, tmp_path: Path, samples: Path,
                                                                         monkeypatch, request) -> None:
    """pipeline.pages: all, the outbox on a small tmpfs with room for about one page's mask: the file is
    not failed, it waits whole (queued, its attempt not counted) and, once room is made, is done once
    with every page's mask and one JSON."""
    if not own_user_namespace(request, mounts=True):
        return  # it ran, and passed, with mounts of its own
    import subprocess

    import cv2

    import worker.pipeline.pause as room_mod

    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    monkeypatch.setattr(room_mod, "ROOM_CHECK_S", 0.1)
    try:
        every = dataclasses.replace(cfg, outbox=small / "out", pipeline=dataclasses.replace(cfg.pipeline, pages="all"))
        (small / "out").mkdir()
        folder = tmp_path / "in"
        folder.mkdir()
        page = cv2.imread(str(samples / "page.png"))
        assert cv2.imwritemulti(str(folder / "scan.tif"), [page, cv2.resize(page, (1536, 764)), page, page])
        ballast = fill(small, 6 << 10)  # the 1536 px page's mask alone is bigger than this
        out: list = []
        t = threading.Thread(target=lambda: out.append(run_folder(every, folder)))
        t.start()
        assert wait_for(lambda: Path(every.db[10:]).exists() and
                        image_rows(every).get("scan.tif") is not None and
                        image_rows(every)["scan.tif"].status == "queued", 60)
        assert "waiting for room in the outbox" in image_rows(every)["scan.tif"].error
        ballast.unlink()
        t.join(120)
        assert not t.is_alive() and (out[0].figures["done"], out[0].figures["failed"]) == (1, 0)
        row = image_rows(every)["scan.tif"]
        assert (row.status, row.attempts) == ("done", 1)
        doc = json.loads((small / "out" / "scan.tif.json").read_text())
        assert [p["page"] for p in doc["pages"]] == [1, 2, 3, 4]
        assert all((small / "out" / p["mask"]).exists() for p in doc["pages"])
        assert not list((small / "out").rglob(".tmp-*"))
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_a_full_outbox_disk_pauses_the_images_until_there_is_room(effcfg, tmp_path: Path, samples: Path,
                                                                   monkeypatch, caplog, request) -> None:
    """A real full filesystem (a small tmpfs) under the outbox: no image is failed for it. The images
    that cannot be written wait (queued, the attempt not counted) with intake paused, and go on once
    room is made; stopped while waiting, the run leaves them queued for the next one."""
    if not own_user_namespace(request, mounts=True):
        return  # it ran, and passed, with mounts of its own
    import subprocess

    import worker.pipeline.pause as room_mod

    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    monkeypatch.setattr(room_mod, "ROOM_CHECK_S", 0.1)
    monkeypatch.setattr(room_mod, "FULL_REMINDER_S", 0.3)
    try:
        cfg = dataclasses.replace(effcfg, outbox=small / "out",  # samples often: `health` sees the stall
                                  metrics=dataclasses.replace(effcfg.metrics, memory_sample_s=0.05))
        (small / "out").mkdir()
        data = (samples / "coffee.png").read_bytes()

        def folder(name: str, n: int) -> Path:
            d = tmp_path / name
            d.mkdir()
            for i in range(n):  # distinct content, so none is skipped as a duplicate
                (d / f"{name}{i:02d}.png").write_bytes(data + name.encode() + bytes([i]))
            return d

        def start(d: Path, stop: threading.Event) -> tuple[threading.Thread, list]:
            out: list = []
            t = threading.Thread(target=lambda: out.append(run_folder(cfg, d, stop=stop)))
            t.start()
            return t, out

        def waiting() -> bool:
            return any(r.status == "queued" for r in image_rows(cfg).values()) if Path(cfg.db[10:]).exists() else False

        # room made while the run waits: every image done, each with one attempt
        ballast = fill(small, 12 << 10)
        t, out = start(folder("a", 30), threading.Event())
        assert wait_for(waiting, 60)
        queued = [r for r in image_rows(cfg).values() if r.status == "queued"]
        assert "waiting for room in the outbox" in queued[0].error and "No space left on device" in queued[0].error
        assert wait_for(lambda: "still no room after" in caplog.text, 30)  # said again while it lasts
        # what a monitor sees meanwhile (`worker health`): images in flight, none finished
        def health(stall_s: float = 0.5) -> Health:
            db = open_db(cfg.db)
            try:
                h = run_health(db, stall_s=stall_s)
            finally:
                db.dispose()
            assert h is not None
            return h

        assert wait_for(lambda: health().state is RunState.STALLED, 30)
        assert "in flight and none finished for" in health().detail
        ballast.unlink()
        t.join(120)
        assert not t.is_alive() and out[0].figures["done"] == 30 and out[0].figures["failed"] == 0
        assert health().state is RunState.FINISHED
        rows = image_rows(cfg)
        assert {(r.status, r.attempts) for r in rows.values()} == {("done", 1)} and len(rows) == 30
        assert all((small / "out" / f"{rel}.json").exists() for rel in rows)

        # stopped while waiting, with more images than the job queue holds (so the run's own thread
        # waits to submit): nothing failed, what waits is left for the next run, which does it
        ballast = fill(small, 8 << 10)
        b = folder("b", 20)
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, queue_size=2))
        stop = threading.Event()
        t, out = start(b, stop)
        assert wait_for(waiting, 60)
        stop.set()
        t.join(60)
        assert not t.is_alive() and out[0].figures["failed"] == 0 and out[0].figures["done"] < 20
        assert not [r for r in image_rows(cfg).values() if r.status not in ("done", "queued")]
        ballast.unlink()
        assert run_folder(cfg, b).figures["failed"] == 0
        rows = image_rows(cfg)
        assert len(rows) == 50 and {(r.status, r.attempts) for r in rows.values()} == {("done", 1)}
        assert not [p for p in (small / "out").iterdir() if p.name.startswith(".tmp-")]
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)
