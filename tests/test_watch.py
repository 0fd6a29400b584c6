"""The real watcher with real files: written in chunks, renamed into place, in subfolders,
present before start, temporary names; each processed exactly once, inputs archived."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import image_rows, read_only_view, wait_for
from tests.support.userns import own_inotify_watches, own_user_namespace
from tests.support.watching import Watching
from worker.intake.scan import is_candidate
from worker.intake import watch as watch_module
from worker.intake import intake as intake_module, observer as observer_module
from worker.intake.intake import Intake
from worker.intake.observer import MOVE_PAIRING_S, start_observer
from worker.intake.jobs import Job, JobStatus
from worker.service import watch
from worker.store.db import open_db


@pytest.mark.parametrize("observer", ["native", "polling"])
def test_watch_picks_up_each_file_once(cfg, samples: Path, observer: str) -> None:
    cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, observer=observer, poll_interval_s=0.2))
    cfg.inbox.mkdir(parents=True)
    shutil.copy(samples / "coffee.png", cfg.inbox / "before-start.png")  # left from before: start-up scan

    with Watching(cfg) as w:
        assert wait_for(lambda: len(w.finished) >= 1)
        # written slowly in chunks, with pauses longer than nothing but shorter than settle
        data = (samples / "page.png").read_bytes()
        with open(cfg.inbox / "slow.png", "wb") as f:
            for i in range(0, len(data), len(data) // 5 + 1):
                f.write(data[i:i + len(data) // 5 + 1])
                f.flush()
                time.sleep(0.1)
        # a copy tool: temporary name, then rename into place
        (cfg.inbox / "sub" / "deep").mkdir(parents=True)
        tmp = cfg.inbox / "sub" / "deep" / "renamed.jpg.part"
        shutil.copy(samples / "rocket.jpg", tmp)
        os.rename(tmp, cfg.inbox / "sub" / "deep" / "renamed.jpg")
        # hidden and temporary names are ignored
        shutil.copy(samples / "text.png", cfg.inbox / ".hidden.png")
        shutil.copy(samples / "text.png", cfg.inbox / "draft.png.tmp")
        assert wait_for(lambda: len(w.finished) >= 3)
        time.sleep(1.0)  # give any duplicate event the chance to show up

    rels = sorted(r for r, _ in w.finished)
    assert rels == ["before-start.png", "slow.png", "sub/deep/renamed.jpg"], rels
    assert all(s is JobStatus.DONE for _, s in w.finished)
    rows = image_rows(cfg)
    assert set(rows) == set(rels) and all(r.status == "done" and r.attempts == 1 for r in rows.values())
    assert rows["slow.png"].size == len(data)  # processed complete, not half-written
    for rel in rels:
        assert (cfg.archive / "done" / rel).exists() and not (cfg.inbox / rel).exists()
        assert (cfg.outbox / f"{rel}.json").exists()
    assert (cfg.inbox / ".hidden.png").exists() and (cfg.inbox / "draft.png.tmp").exists()


def test_a_file_renamed_into_place_is_taken_on_its_event(cfg, samples: Path) -> None:
    """With the settle check and the rescan out of reach, only the paired move event can submit the
    file: the shortened pairing wait (MOVE_PAIRING_S) still pairs a rename's two events."""
    grouper = pytest.importorskip("watchdog.observers.inotify_move_event_grouper").InotifyMoveEventGrouper
    cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, settle_s=600.0, rescan_interval_s=0.0))
    cfg.inbox.mkdir(parents=True)
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        for i in range(5):  # each written under a hidden name in the same folder, then renamed into place
            shutil.copy(samples / "coffee.png", cfg.inbox / f".coffee-{i}.png.part")
            os.rename(cfg.inbox / f".coffee-{i}.png.part", cfg.inbox / f"coffee-{i}.png")
        assert wait_for(lambda: len(w.finished) >= 5, timeout=60)
    assert sorted(r for r, _ in w.finished) == [f"coffee-{i}.png" for i in range(5)]
    assert grouper.delay == MOVE_PAIRING_S


@pytest.mark.parametrize("observer", ["native", "polling"])
def test_an_inbox_that_is_a_symbolic_link_is_watched_through_it(cfg, samples: Path, tmp_path: Path,
                                                                 observer: str) -> None:
    """`/srv/inbox -> /data/inbox`: with the rescan out of reach, only events can submit the files. Before,
    the native observer got none from such an inbox (inotify, as watchdog asks it, does not follow the
    link), and its files waited for the rescan. Paths, rows and the archive stay under the link's name."""
    real = tmp_path / "data-inbox"
    (real / "sub").mkdir(parents=True)
    cfg.inbox.parent.mkdir(parents=True, exist_ok=True)
    cfg.inbox.symlink_to(real)
    cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, observer=observer, rescan_interval_s=0.0,
                                                             settle_s=0.3))
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        shutil.copy(samples / "coffee.png", cfg.inbox / "coffee.png")
        shutil.copy(samples / "rocket.jpg", cfg.inbox / "sub" / "rocket.jpg")
        (cfg.inbox / "later").mkdir()  # a folder made after the start is watched too
        time.sleep(0.2)
        shutil.copy(samples / "chelsea.png", cfg.inbox / "later" / "chelsea.png")
        assert wait_for(lambda: len(w.finished) >= 3, timeout=60)
    assert sorted(w.finished) == [("coffee.png", JobStatus.DONE), ("later/chelsea.png", JobStatus.DONE),
                                  ("sub/rocket.jpg", JobStatus.DONE)]
    assert sorted(p.relative_to(cfg.archive).as_posix() for p in cfg.archive.rglob("*") if p.is_file()) == [
        "done/coffee.png", "done/later/chelsea.png", "done/sub/rocket.jpg"]
    assert cfg.inbox.is_symlink() and not [p for p in real.rglob("*") if p.is_file()]


def test_an_inbox_link_pointed_elsewhere_while_watched_is_followed(cfg, samples: Path, tmp_path: Path,
                                                                   caplog) -> None:
    """A deployment swaps the link to a new folder (a new link renamed over the old one): the watcher
    sees the folder replaced, watches the new one through the link and holds its lock."""
    from worker.host.locks import flocked

    first, second = tmp_path / "data-1", tmp_path / "data-2"
    first.mkdir()
    second.mkdir()
    cfg.inbox.parent.mkdir(parents=True, exist_ok=True)
    cfg.inbox.symlink_to(first)
    cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, rescan_interval_s=0.0, settle_s=0.3))
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        shutil.copy(samples / "coffee.png", cfg.inbox / "before.png")
        assert wait_for(lambda: len(w.finished) == 1, timeout=60)
        (tmp_path / "next-link").symlink_to(second)
        os.replace(tmp_path / "next-link", cfg.inbox)
        assert wait_for(lambda: "the inbox was replaced" in caplog.text, timeout=30)
        shutil.copy(samples / "coffee.png", cfg.inbox / "after.png")
        assert wait_for(lambda: len(w.finished) == 2, timeout=60)
        with flocked(second, wait=False) as held:
            assert held is False  # a second watcher on the new folder would refuse to start
    assert sorted(w.finished) == [("after.png", JobStatus.DONE), ("before.png", JobStatus.DONE)]
    assert list(second.iterdir()) == []  # its input moved to the archive


def test_a_second_watcher_on_the_same_inbox_or_outbox_refuses_to_start(cfg, tmp_path: Path) -> None:
    """On one inbox each would take files the other is processing and move them away from under it; into
    one outbox, same-named images from two inboxes would overwrite each other's results."""
    from worker.errors import WorkerError

    cfg.inbox.mkdir(parents=True)
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        with pytest.raises(WorkerError, match="another worker is watching this inbox"):
            watch(cfg, threading.Event(), burst=True)
        other = dataclasses.replace(cfg, inbox=tmp_path / "other-inbox")  # another inbox, the same outbox
        with pytest.raises(WorkerError, match="another worker watches into this outbox .* give the watcher of "
                                              ".*other-inbox its own --outbox"):
            watch(other, threading.Event(), burst=True)
        other = dataclasses.replace(other, outbox=tmp_path / "other-outbox")  # and its own outbox: no conflict
        assert watch(other, threading.Event(), burst=True).figures["images"] == 0
    assert watch(cfg, threading.Event(), burst=True).figures["images"] == 0  # released when the first stops


@pytest.mark.parametrize("observer", ["native", "polling"])
def test_an_inbox_deleted_and_made_again_is_watched_again(cfg, samples: Path, observer: str, caplog) -> None:
    """A cleanup script removes the inbox and makes it again: the observer on the old folder sees
    nothing more. The worker says so, watches the new folder (its events, not the rescan, which is
    off here) and holds the one-watcher lock on it."""
    from worker.host.locks import flocked

    cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, observer=observer, rescan_interval_s=0.0,
                                                             poll_interval_s=0.2))
    cfg.inbox.mkdir(parents=True)
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        shutil.copy(samples / "coffee.png", cfg.inbox / "before.png")
        assert wait_for(lambda: len(w.finished) == 1, timeout=60)
        shutil.rmtree(cfg.inbox)
        assert wait_for(lambda: "the inbox is gone" in caplog.text, timeout=30)
        cfg.inbox.mkdir()
        assert wait_for(lambda: "the inbox was replaced" in caplog.text, timeout=30)
        shutil.copy(samples / "coffee.png", cfg.inbox / "after.png")
        assert wait_for(lambda: len(w.finished) == 2, timeout=60)
        with flocked(cfg.inbox, wait=False) as held:
            assert held is False  # a second watcher on the new folder would refuse to start
    assert sorted(r for r, _ in w.finished) == ["after.png", "before.png"]
    assert (cfg.archive / "done" / "after.png").exists()


def test_an_outbox_deleted_while_watching_is_made_again_and_locked_again(cfg, samples: Path, tmp_path: Path,
                                                                        caplog) -> None:
    """A cleanup script removes the outbox: the next result would make it again as a new folder that the lock
    on the old one does not guard (a second watcher could write into it). The worker says so, makes it again
    and locks it; a second watcher into it still refuses to start."""
    from worker.errors import WorkerError

    cfg.inbox.mkdir(parents=True)
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        shutil.copy(samples / "coffee.png", cfg.inbox / "before.png")
        assert wait_for(lambda: len(w.finished) == 1, timeout=60)
        shutil.rmtree(cfg.outbox)
        assert wait_for(lambda: "the outbox is gone (deleted, or its filesystem unmounted): made again" in caplog.text,
                        timeout=30)
        assert cfg.outbox.is_dir()
        other = dataclasses.replace(cfg, inbox=tmp_path / "other-inbox")
        with pytest.raises(WorkerError, match="another worker watches into this outbox"):
            watch(other, threading.Event(), burst=True)
        shutil.copy(samples / "coffee.png", cfg.inbox / "after.png")
        assert wait_for(lambda: len(w.finished) == 2, timeout=60)
    assert (cfg.outbox / "after.png.json").is_file()


def test_an_outbox_that_cannot_be_made_is_one_line(cfg, tmp_path: Path) -> None:
    """An outbox to be made on a read-only filesystem: a traceback from the outbox lock before."""
    from worker.errors import ConfigError

    (tmp_path / "ro").mkdir()
    cfg.inbox.mkdir(parents=True)
    with read_only_view(tmp_path / "ro", tmp_path / "ro") as ro:
        with pytest.raises(ConfigError, match=f"'outbox' \\({ro / 'out'}\\) cannot be created: Read-only file system"):
            watch(dataclasses.replace(cfg, outbox=ro / "out"), threading.Event(), burst=True)


def test_a_read_only_inbox_gives_results_and_reads_each_file_once(cfg, samples: Path, caplog, request) -> None:
    """A read-only share as the inbox: inputs cannot be moved out. Each gets its result, the log says
    why it stays (once per file, not at every rescan), and rescans do not read it again."""
    if not own_user_namespace(request, mounts=True):
        return  # it ran, and passed, with mounts of its own
    src = cfg.inbox.parent / "share"
    src.mkdir()
    for name in ("coffee.png", "chelsea.png"):
        shutil.copy(samples / name, src / name)
    cfg.inbox.mkdir(parents=True)
    with read_only_view(src, cfg.inbox):
        cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, rescan_interval_s=0.2))
        with Watching(cfg) as w:
            assert w.ready.wait(120) and w.error is None
            assert wait_for(lambda: len(w.finished) >= 8, timeout=60)  # the two, then three rescans' worth
        first: dict[str, JobStatus] = {}
        for rel, status in w.finished:  # a rescan may pass over one file (kept, unread) before the other is done
            first.setdefault(rel, status)
        assert first == {"chelsea.png": JobStatus.DONE, "coffee.png": JobStatus.DONE}
        assert "is not writable" in caplog.text and caplog.text.count("cannot archive") == 2
        assert w.summary.figures["done"] == 2 and not [p for p in cfg.archive.rglob("*") if p.is_file()]


def test_an_archive_on_a_full_disk_is_said_once_and_tried_at_each_rescan(cfg, samples: Path, caplog, request) -> None:
    """The archive on another filesystem that is full (a small tmpfs): inputs get their results and
    stay in the inbox, the log says so once per file (not at every rescan, nor each input read and
    hashed again), and once there is room the next rescan moves them."""
    if not own_user_namespace(request, mounts=True):
        return  # it ran, and passed, with mounts of its own
    import subprocess

    from tests.support.disks import fill

    cfg.archive.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(cfg.archive)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        ballast = fill(cfg.archive, 0)
        cfg.inbox.mkdir(parents=True)
        for name in ("coffee.png", "chelsea.png"):
            shutil.copy(samples / name, cfg.inbox / name)
        cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, rescan_interval_s=0.2))
        with Watching(cfg) as w:
            assert w.ready.wait(120) and w.error is None
            assert wait_for(lambda: len(w.finished) >= 8, timeout=60)  # the two, then three rescans' worth
            assert caplog.text.count("cannot archive") == 2 and "No space left on device" in caplog.text
            assert sorted(p.name for p in cfg.inbox.iterdir()) == ["chelsea.png", "coffee.png"]
            ballast.unlink()
            assert wait_for(lambda: not list(cfg.inbox.iterdir()), timeout=30)
        assert sorted(p.name for p in (cfg.archive / "done").iterdir()) == ["chelsea.png", "coffee.png"]
        assert w.summary.figures["done"] == 2 and caplog.text.count("cannot archive") == 2
        assert {(r.status, r.attempts) for r in image_rows(cfg).values()} == {("done", 1)}
    finally:
        subprocess.run(["umount", "-l", str(cfg.archive)], check=True)


# this user namespace's own limit: a test that lowers it runs in a namespace of its own (tests.support.userns)
NAMESPACE_LIMIT = Path("/proc/sys/user/max_inotify_watches")


def test_folders_inotify_cannot_watch_are_said(cfg, caplog, request) -> None:
    """Past the inotify watch limit, watchdog silently leaves folders unwatched (their files come only
    with the rescan, or never with rescans off): the worker counts them and says so."""
    if not own_user_namespace(request):
        return  # it ran, and passed, in a user namespace of its own
    before = NAMESPACE_LIMIT.read_text()
    for i in range(40):
        (cfg.inbox / f"line{i:02d}").mkdir(parents=True)
    NAMESPACE_LIMIT.write_text(str(own_inotify_watches() + 10))
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
    said = re.search(r"inotify watches (\d+) of the 41 folders under the inbox \(its limit is (\d+), "
                     r"user.max_inotify_watches\)", caplog.text)
    # watchdog 7.0 takes up to 10 (the inbox and 9 of its folders); 7.1 refuses them all, then the inbox alone
    assert said and 1 <= int(said[1]) <= 10, caplog.text
    assert "found only by the rescan every 2 s" in caplog.text
    assert "(sysctl user.max_inotify_watches=...; the watcher notices within 60 s)" in caplog.text
    NAMESPACE_LIMIT.write_text(before)
    caplog.clear()
    with Watching(cfg) as w:  # the limit back: every folder watched, nothing said
        assert w.ready.wait(120) and w.error is None
    assert "inotify watches" not in caplog.text


def test_a_raised_inotify_limit_is_picked_up_without_a_restart(cfg, samples: Path, caplog, monkeypatch,
                                                                request) -> None:
    """watchdog never retries a folder it could not watch; once the limit is raised, the watcher starts
    its observer again (and rescans once), so every folder's files come by their events again. With
    rescans off, files in the folders left unwatched were never taken before."""
    if not own_user_namespace(request):
        return  # it ran, and passed, in a user namespace of its own
    before = NAMESPACE_LIMIT.read_text()
    monkeypatch.setattr(watch_module, "COVERAGE_CHECK_S", 0.3)
    cfg = dataclasses.replace(cfg, model="efficientnet-lite0", watch=dataclasses.replace(cfg.watch, rescan_interval_s=0))
    folders = [cfg.inbox / f"line{i:02d}" for i in range(40)]
    for folder in folders:
        folder.mkdir(parents=True)
    data = (samples / "coffee.png").read_bytes()
    NAMESPACE_LIMIT.write_text(str(own_inotify_watches() + 10))
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        assert wait_for(lambda: "inotify watches" in caplog.text)
        for folder in folders:  # most land in folders without a watch
            (folder / "before.png").write_bytes(data)
        NAMESPACE_LIMIT.write_text(before)
        assert wait_for(lambda: "inotify watches all 41 folders under the inbox again" in caplog.text), caplog.text
        assert "the inotify watch limit is now {} ({})".format(*observer_module.inotify_limit()) in caplog.text
        for folder in folders:  # only events can bring these
            (folder / "after.png").write_bytes(data)
        assert wait_for(lambda: len(w.finished) >= 80, timeout=60), len(w.finished)
    rows = image_rows(cfg)
    assert len(rows) == 80 and {(r.status, r.attempts) for r in rows.values()} == {("done", 1)}


def test_a_backlog_keeps_the_status_line_and_the_first_ctrl_c_ends_intake(cfg, samples: Path, caplog) -> None:
    """Hundreds of files waiting at start: the intake loop submits them one by one as the pipeline
    makes room. Before, that one pass lasted the whole backlog: no status line meanwhile, and the
    first Ctrl-C ("finish the jobs in flight") processed every file waiting (1,200 JPEGs, 10 s here).
    Now intake stops at once; the rest stay in the inbox for the next start."""
    caplog.set_level(logging.INFO, logger="worker.status")
    cfg = dataclasses.replace(cfg, model="efficientnet-lite0",
                              watch=dataclasses.replace(cfg.watch, status_log_s=0.2),
                              pipeline=dataclasses.replace(cfg.pipeline, queue_size=4))
    cfg.inbox.mkdir(parents=True)
    data = (samples / "coffee.png").read_bytes()
    for i in range(300):  # distinct content
        (cfg.inbox / f"b{i:03d}.png").write_bytes(data + i.to_bytes(2, "big"))
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        assert wait_for(lambda: "status: " in caplog.text and " done," in caplog.text, 60)  # during the backlog
        w.stop.set()
        w.thread.join(60)
        assert not w.thread.is_alive()
    left = len(list(cfg.inbox.iterdir()))
    assert left > 100, "the first Ctrl-C stopped intake, not processed the whole backlog"
    assert w.summary.figures["done"] + left == 300 and w.summary.figures["failed"] == 0
    assert watch(cfg, threading.Event(), burst=True).figures["done"] == left  # the next start does the rest
    assert not list(cfg.inbox.iterdir())


def test_the_observer_stop_race_is_not_logged_as_an_error(tmp_path: Path, caplog) -> None:
    observer = start_observer(Intake(tmp_path, (".jpg",), 1.0, 0.0, lambda job: None), "native", 1.0)
    observer.stop()
    observer.join()
    log = logging.getLogger("watchdog.observers.inotify")
    with caplog.at_level(logging.ERROR, logger="watchdog.observers.inotify"):
        log.error("InotifyEmitter.queue_events() called when the thread is inactive")
        log.error("Unable to rebuild recursive inotify watches below %r", "/x")
    assert [r.getMessage() for r in caplog.records] == ["Unable to rebuild recursive inotify watches below '/x'"]


def test_watchdogs_warning_for_a_folder_watched_twice_is_not_shown(tmp_path: Path) -> None:
    """The RuntimeWarning watchdog gives when a new folder's callback is added a second time (it came
    intermittently in a native watch test) is silenced; any other still shows. The real warning, from
    watchdog's own inotify code adding one callback twice."""
    import warnings

    from watchdog.observers.inotify_c import InotifyConstants, InotifyFD

    class Callback:
        def on_event(self, event) -> None: ...
        def on_watch_deleted(self, wd) -> None: ...
        def on_queue_overflow(self) -> None: ...

    fd = InotifyFD()  # not started: no thread
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.resetwarnings()  # without pytest's filters (-W default would show every warning)
            warnings.simplefilter("always")
            observer = observer_module.make_observer("native")  # installs the filter
            observer.start()
            observer.stop()
            observer.join()
            for _ in range(2):
                fd.add_callback(os.fsencode(tmp_path), InotifyConstants.IN_CREATE, Callback(), 1)
            warnings.warn("another warning", RuntimeWarning)
    finally:
        fd.close()
    assert [str(w.message) for w in seen] == ["another warning"]


def test_watch_moves_bad_files_to_failed_and_keeps_going(cfg, samples: Path) -> None:
    cfg.inbox.mkdir(parents=True)
    (cfg.inbox / "empty.jpg").write_bytes(b"")
    (cfg.inbox / "random.jpg").write_bytes(os.urandom(5000))
    shutil.copy(samples / "chelsea.png", cfg.inbox / "chelsea.png")
    summary = watch(cfg, threading.Event(), burst=True)
    assert (summary.figures["done"], summary.figures["failed"]) == (1, 2)
    assert (cfg.archive / "failed" / "empty.jpg").exists() and (cfg.archive / "failed" / "random.jpg").exists()
    assert (cfg.archive / "done" / "chelsea.png").exists()
    rows = image_rows(cfg)
    assert rows["empty.jpg"].error == "empty file"
    assert rows["random.jpg"].status == "failed" and rows["random.jpg"].error


def test_every_page_of_a_dropped_multi_page_file_is_one_outcome_then_archived(cfg, samples: Path) -> None:
    """pipeline.pages: all, watched: a 3-page TIFF renamed into the inbox gives one JSON of three pages and
    moves to archive/done once; one whose second page is over the pixel limit, to archive/failed, and
    neither leaves page outputs but the done one's."""
    import cv2
    import numpy as np

    every = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, pages="all", max_pixels=1_000_000))
    every.inbox.mkdir(parents=True)
    page, text = cv2.imread(str(samples / "page.png")), cv2.imread(str(samples / "text.png"))
    big = np.zeros((1000, 1001, 3), np.uint8)
    with Watching(every) as w:
        assert w.ready.wait(60)
        for name, pages in (("scan.tif", [page, text, page]), ("bad.tif", [text, big, page])):
            assert cv2.imwritemulti(str(every.inbox / f".{name}"), pages)
            os.rename(every.inbox / f".{name}", every.inbox / name)
        assert wait_for(lambda: len(w.finished) == 2)
    assert sorted(w.finished) == [("bad.tif", JobStatus.FAILED), ("scan.tif", JobStatus.DONE)]
    assert (every.archive / "done" / "scan.tif").exists() and (every.archive / "failed" / "bad.tif").exists()
    doc = json.loads((every.outbox / "scan.tif.json").read_text())
    assert [p["mask"] for p in doc["pages"]] == ["scan.tif.mask.png", "scan.tif.pages/2.mask.png",
                                                 "scan.tif.pages/3.mask.png"]
    assert all((every.outbox / p["mask"]).exists() for p in doc["pages"])
    assert image_rows(every)["bad.tif"].error.startswith("page 2 of 3: 1001x1000 pixels is over the limit")
    assert sorted(p.name for p in every.outbox.glob("bad.tif*")) == ["bad.tif.error.json"]


def test_a_file_left_alone_for_its_name_is_said_once(cfg, samples: Path, caplog) -> None:
    """photo.heic, notes.txt and a README in the inbox are never taken: intake says so once each, at the
    start-up scan or on its event, and not again for later events or rescans; hidden names are not said."""
    root = cfg.inbox
    (root / "sub").mkdir(parents=True)
    shutil.copy(samples / "coffee.png", root / "photo.heic")
    shutil.copy(samples / "coffee.png", root / "coffee.png")
    (root / "notes.txt").write_text("a")
    (root / "sub" / "README").write_text("b")
    (root / ".hidden.txt").write_text("c")
    submitted: list[Job] = []
    intake = Intake(root, cfg.extensions, settle_s=0.0, rescan_s=0.0, submit=submitted.append)
    with caplog.at_level(logging.WARNING, logger="worker.intake.watch"):
        assert intake.run(burst=True) == 1  # the start-up scan: coffee.png taken
        shutil.copy(samples / "coffee.png", root / "later.HEIC")
        intake.notify(root / "later.HEIC", ready=True)  # its event
        intake.notify(root / "notes.txt", ready=True)  # a change: not said again
        intake.rescan()
        intake.rescan()
    said = [r.getMessage() for r in caplog.records if "left in the inbox" in r.getMessage()]
    assert sorted(m.split(":")[0] for m in said) == ["later.HEIC", "notes.txt", "photo.heic", "sub/README"], said
    assert "photo.heic: left in the inbox: its name does not end in an image extension (.heic; `extensions` in the " \
           "config lists those taken)" in said
    assert any(m.startswith("sub/README: ") and "(no extension;" in m for m in said)
    assert [j.rel for j in submitted] == ["coffee.png"]


def test_a_file_cut_short_waits_for_its_writer_then_is_taken_whole(tmp_path: Path, samples: Path) -> None:
    """A close event on the first part of a JPEG does not take it: its writer may come back (a resumed
    upload). The rest appended and closed again, it is taken once, whole."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    data = (samples / "rocket.jpg").read_bytes()
    path = inbox / "upload.jpg"
    path.write_bytes(data[: len(data) // 3])
    submitted: list[Job] = []
    intake = Intake(inbox, (".jpg",), settle_s=0.0, rescan_s=0.0, submit=submitted.append, incomplete_s=600.0)
    intake.notify(path, ready=True)  # the first part's close-after-write
    assert intake.tick() == 0 and intake.tick() == 0  # held, however often it is looked at
    assert intake.held() == 1  # the status line says so
    with open(path, "ab") as f:  # the upload resumes
        f.write(data[len(data) // 3:])
    intake.notify(path, ready=True)
    assert intake.tick() == 1 and intake.held() == 0
    assert [(j.rel, j.size) for j in submitted] == [("upload.jpg", len(data))]


def test_a_file_still_cut_short_is_taken_once_unchanged_for_incomplete_s(tmp_path: Path, samples: Path,
                                                                         caplog) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    cut = (samples / "rocket.jpg").read_bytes()[:5000]
    (inbox / "new.jpg").write_bytes(cut)
    submitted: list[Job] = []
    intake = Intake(inbox, (".jpg",), settle_s=0.0, rescan_s=0.0, submit=submitted.append, incomplete_s=0.5)
    with caplog.at_level(logging.INFO, logger="worker.intake.watch"):
        intake.rescan()
        held_at = time.monotonic()
        assert intake.tick() == 0  # size noted, at or after held_at
        assert wait_for(lambda: intake.tick() == 1, timeout=10)
        assert time.monotonic() - held_at >= 0.5  # not before: the intake's clock decides
    assert [j.rel for j in submitted] == ["new.jpg"]
    said = [r.getMessage() for r in caplog.records if "looks cut short" in r.getMessage()]
    assert said == ["new.jpg looks cut short (no JPEG end-of-image marker after the last scan): waiting for its "
                    "writer to finish it (taken once it is complete, or as it is once unchanged for 0.5 s: "
                    "watch.incomplete_s)"]


def test_a_kept_input_is_not_read_to_judge_it(tmp_path: Path, samples: Path, monkeypatch) -> None:
    """inputs: keep: every rescan sees every kept file again; one known done (by its size and mtime)
    is passed over unread, cut short or not (200,000 kept files on a share must not be read each time)."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "kept.jpg").write_bytes((samples / "rocket.jpg").read_bytes()[:5000])
    judged: list[Path] = []
    real = intake_module.cut_short
    monkeypatch.setattr(intake_module, "cut_short", lambda path, size: judged.append(path) or real(path, size))
    submitted: list[Job] = []
    intake = Intake(inbox, (".jpg",), settle_s=0.0, rescan_s=0.0, submit=submitted.append,
                    done=lambda rel, sig: True, incomplete_s=600.0)
    intake.notify(inbox / "kept.jpg", ready=True)
    assert intake.tick() == 0
    assert judged == [] and submitted == []
    with intake._lock:
        assert not intake._pending  # let go, not held


def test_an_upload_resumed_after_its_first_part_was_closed_gives_one_result(cfg, samples: Path) -> None:
    """Real inotify events: the first part of a photo is written and closed, the writer pauses (a
    dropped connection) far longer than settle_s, then appends the rest. Before watch.incomplete_s the
    first part failed as a truncated JPEG and was archived, and the rest then failed as a headless
    file: two failures, no result."""
    cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, observer="native", incomplete_s=60.0))
    cfg.inbox.mkdir(parents=True)
    data = (samples / "rocket.jpg").read_bytes()
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        with open(cfg.inbox / "resumed.jpg", "wb") as f:
            f.write(data[:30000])
        time.sleep(1.5)  # the pause: five times settle_s
        assert w.finished == []
        with open(cfg.inbox / "resumed.jpg", "ab") as f:
            f.write(data[30000:])
        assert wait_for(lambda: len(w.finished) >= 1, timeout=60)
        time.sleep(0.5)  # room for a wrong second job to show up
    assert w.finished == [("resumed.jpg", JobStatus.DONE)]
    row = image_rows(cfg)["resumed.jpg"]
    assert (row.status, row.size, row.attempts) == ("done", len(data), 1)
    assert (cfg.archive / "done" / "resumed.jpg").read_bytes() == data
    assert not (cfg.archive / "failed").exists()


def test_a_file_held_at_shutdown_stays_in_the_inbox_and_the_log_says_so(cfg, samples: Path, caplog) -> None:
    cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, incomplete_s=600.0))
    cfg.inbox.mkdir(parents=True)
    cut = (samples / "rocket.jpg").read_bytes()[:20000]
    with caplog.at_level(logging.INFO, logger="worker"):
        with Watching(cfg) as w:
            assert w.ready.wait(120) and w.error is None
            (cfg.inbox / "stalled.jpg").write_bytes(cut)
            assert wait_for(lambda: any("stalled.jpg looks cut short" in r.getMessage() for r in caplog.records))
    assert w.finished == [] and (cfg.inbox / "stalled.jpg").read_bytes() == cut
    assert "1 file(s) held as cut short stay in the inbox for the next start" in [r.getMessage() for r in caplog.records]


def test_a_file_archived_while_a_rescan_looks_at_it_is_not_submitted_again(tmp_path: Path, monkeypatch) -> None:
    """The race: a rescan sees a file in flight; between its lstat and its in-flight check the pipeline
    finishes the job, moves the file to the archive and forgets it. A second job for the vanished file
    would record a phantom failure ("file disappeared") beside the real result."""
    inbox, archive = tmp_path / "inbox", tmp_path / "archive"
    inbox.mkdir()
    archive.mkdir()
    path = inbox / "a.jpg"
    path.write_bytes(b"jpeg bytes")
    submitted: list[Job] = []
    intake = Intake(inbox, (".jpg",), settle_s=0.0, rescan_s=0.0, submit=submitted.append)
    intake.notify(path, ready=True)
    assert intake.tick() == 1  # the job is in flight
    intake.rescan()  # a periodic rescan finds the file again while its job is in flight
    assert intake.tick() == 0  # first look: its size is noted (settle check)
    real_lstat = Path.lstat
    armed = [True]

    def lstat_then_finish(self: Path) -> os.stat_result:
        st = real_lstat(self)
        if self == path and armed[0]:  # right after this lstat: the job finishes, as on another thread
            armed[0] = False
            path.rename(archive / "a.jpg")
            intake.forget(submitted[0])
        return st

    monkeypatch.setattr(Path, "lstat", lstat_then_finish)
    assert intake.tick() == 0
    assert [j.rel for j in submitted] == ["a.jpg"]
    assert not armed[0]  # the race was really staged


def test_a_file_replaced_after_it_was_read_is_processed_not_archived_under_the_old_result(
        cfg, samples: Path, monkeypatch) -> None:
    """A producer rewrites a.png (rename over it) while the first a.png is between reading and
    archiving. The new file must get its own result and be archived itself; the first job must not
    archive it (its content would never be processed, and its own job would find nothing to read)."""
    from worker.tasks.segment import Segmenter

    # the new file is noticed a second later (polling), long after the first job was archived: with
    # the native observer its event usually beats the archive step and hides the race
    cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, observer="polling", poll_interval_s=1.0,
                                                             rescan_interval_s=0.0))
    cfg.inbox.mkdir(parents=True)
    first, second = (samples / "page.png").read_bytes(), (samples / "text.png").read_bytes()
    real_postprocess = Segmenter.postprocess
    replaced = threading.Event()

    def postprocess_then_replace(self, output, geometry):  # the first job's file is read by now
        if (cfg.inbox / "a.png").exists() and not replaced.is_set():
            replaced.set()
            (cfg.inbox / ".a.png.part").write_bytes(second)
            os.replace(cfg.inbox / ".a.png.part", cfg.inbox / "a.png")
        return real_postprocess(self, output, geometry)

    monkeypatch.setattr(Segmenter, "postprocess", postprocess_then_replace)
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        (cfg.inbox / ".a.png.part").write_bytes(first)
        os.replace(cfg.inbox / ".a.png.part", cfg.inbox / "a.png")
        assert wait_for(lambda: len(w.finished) >= 2 and not (cfg.inbox / "a.png").exists(), 120)
    assert replaced.is_set()
    assert w.finished == [("a.png", JobStatus.DONE), ("a.png", JobStatus.DONE)]
    db = open_db(cfg.db)
    with db.connect() as c:
        rows = c.exec_driver_sql("select sha256, status from images where rel_path = 'a.png'").fetchall()
    db.dispose()
    shas = {hashlib.sha256(first).hexdigest(), hashlib.sha256(second).hexdigest()}
    assert sorted(rows) == sorted((sha, "done") for sha in shas)  # both contents processed, no phantom
    assert (cfg.archive / "done" / "a.png").read_bytes() == second


def test_candidate_names() -> None:
    exts = (".jpg", ".png")
    assert is_candidate("a.JPG", exts) and is_candidate("-dash name ü.png", exts)
    for name in (".a.jpg", "a.jpg.part", "a.jpg.tmp", "a.jpg~", "a.txt", "a.jpg.crdownload"):
        assert not is_candidate(name, exts), name


def test_job_is_hashable(tmp_path: Path) -> None:
    p = tmp_path / "x.png"
    p.write_bytes(b"1")
    a, b = Job.from_path(tmp_path, p), Job.from_path(tmp_path, p)
    assert a == b and len({a, b}) == 1 and a.rel == "x.png"


def test_a_database_inside_the_watched_folder_does_not_block_its_own_start(cfg) -> None:
    """`watch` locks its inbox folder; the database's migration lock must not be that folder's."""
    cfg = dataclasses.replace(cfg, db=f"sqlite:///{cfg.inbox / 'worker.db'}")
    cfg.inbox.mkdir(parents=True)
    done: list = []
    t = threading.Thread(target=lambda: done.append(watch(cfg, threading.Event(), burst=True)), daemon=True)
    t.start()
    t.join(120)
    assert done and done[0].figures["images"] == 0
