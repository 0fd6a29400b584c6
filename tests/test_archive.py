"""InputArchive on real files in temporary folders (the pipeline's archive stage drives it: test_inputs,
test_watch)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from tests.conftest import read_only_view
from tests.support.userns import own_user_namespace
from worker.pipeline.archive import InputArchive, identity
from worker.intake.jobs import Job, JobStatus


def _input(inbox: Path, rel: str, data: bytes = b"pixels") -> tuple[Job, tuple[int, int, int]]:
    path = inbox / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    read_as = identity(path)
    assert read_as is not None
    return Job.from_path(inbox, path), read_as


def test_move_files_done_and_failed_inputs_apart_under_their_relative_paths(tmp_path: Path) -> None:
    inbox, archive = tmp_path / "inbox", tmp_path / "archive"
    moves = InputArchive("move", archive)
    good, good_id = _input(inbox, "line1/a.png")
    bad, bad_id = _input(inbox, "b.png", b"broken")
    moves.archive(good, JobStatus.DONE, good_id)
    moves.archive(bad, JobStatus.FAILED, bad_id)
    assert (archive / "done" / "line1" / "a.png").read_bytes() == b"pixels"
    assert (archive / "failed" / "b.png").read_bytes() == b"broken"
    assert not good.path.exists() and not bad.path.exists()
    # a job queued for the same content, finding the file gone, is told it was archived (not a failure)
    assert moves.archived_already(good) and not moves.archived_already(_input(inbox, "c.png")[0])


def test_delete_removes_done_inputs_and_keeps_failed_ones_to_look_at(tmp_path: Path) -> None:
    inbox, archive = tmp_path / "inbox", tmp_path / "archive"
    deletes = InputArchive("delete", archive)
    good, good_id = _input(inbox, "a.png")
    bad, bad_id = _input(inbox, "b.png")
    deletes.archive(good, JobStatus.DONE, good_id)
    deletes.archive(bad, JobStatus.FAILED, bad_id)
    assert not good.path.exists() and not (archive / "done").exists()
    assert (archive / "failed" / "b.png").exists() and not bad.path.exists()


def test_keep_leaves_inputs_and_remembers_exactly_the_content_it_processed(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    keeps = InputArchive("keep", None)
    job, read_as = _input(inbox, "a.png")
    keeps.archive(job, JobStatus.DONE, read_as)
    assert job.path.exists()
    assert keeps.kept("a.png", read_as[1:])
    assert not keeps.kept("a.png", (read_as[1] + 1, read_as[2])) and not keeps.kept("b.png", read_as[1:])
    never_read, _ = _input(inbox, "c.png")
    keeps.archive(never_read, JobStatus.FAILED, None)  # failed before it was read: nothing to remember
    assert not keeps.kept("c.png", (never_read.size, never_read.mtime_ns))


def test_an_input_replaced_after_it_was_read_stays_for_its_own_job(tmp_path: Path, caplog) -> None:
    inbox, archive = tmp_path / "inbox", tmp_path / "archive"
    moves = InputArchive("move", archive)
    job, read_as = _input(inbox, "latest.jpg", b"first frame")
    job.path.write_bytes(b"second frame, longer")  # a camera rewriting latest.jpg
    with caplog.at_level(logging.WARNING):
        moves.archive(job, JobStatus.DONE, read_as)
    assert job.path.read_bytes() == b"second frame, longer" and not archive.exists()
    assert "replaced after it was read" in caplog.text and not moves.archived_already(job)
    gone = InputArchive("move", archive)
    os.remove(job.path)
    gone.archive(job, JobStatus.DONE, read_as)  # nothing there any more: nothing to do, nothing said
    assert not archive.exists()


def test_an_inbox_that_cannot_be_written_is_said_once_per_content(tmp_path: Path, caplog, request) -> None:
    if not own_user_namespace(request, mounts=True):
        return  # it ran, and passed, with mounts of its own
    src, inbox, archive = tmp_path / "share", tmp_path / "inbox", tmp_path / "archive"
    job, read_as = _input(src, "a.png")
    inbox.mkdir()
    with read_only_view(src, inbox):
        job = Job.from_path(inbox, inbox / "a.png")
        moves = InputArchive("move", archive)
        assert not moves.stuck(job)
        for _ in range(3):  # each rescan tries again
            moves.archive(job, JobStatus.DONE, identity(job.path))
        assert moves.stuck(job) and job.path.exists()
        assert caplog.text.count("cannot archive a.png") == 1 and "not read again unless it changes" in caplog.text


def test_folders_emptied_by_moves_are_removed_once_quiet_and_nothing_else(tmp_path: Path) -> None:
    inbox, archive = tmp_path / "inbox", tmp_path / "archive"
    moves = InputArchive("move", archive, empty_folders_s=60)
    deep, deep_id = _input(inbox, "2026-12-08/line3/a.png")
    shared, shared_id = _input(inbox, "shared/b.png")
    _input(inbox, "shared/c.txt")  # not an input: keeps its folder
    top, top_id = _input(inbox, "d.png")
    for job, read_as in ((deep, deep_id), (shared, shared_id), (top, top_id)):
        moves.archive(job, JobStatus.DONE, read_as)
    moves.sweep()
    assert (inbox / "2026-12-08" / "line3").is_dir()  # emptied just now: a writer may still be writing there
    old = time.time() - 120
    for folder in (inbox / "2026-12-08" / "line3", inbox / "2026-12-08", inbox / "shared"):
        os.utime(folder, (old, old))
    moves._emptied._next = 0  # the next sweep now, not in SWEEP_S
    moves.sweep()
    assert not (inbox / "2026-12-08").exists(), "the emptied folder, then its emptied parent"
    assert (inbox / "shared" / "c.txt").is_file() and inbox.is_dir()  # a file in it, and the inbox itself, stay
    kept = InputArchive("move", archive, empty_folders_s=0)  # 0: folders are left in place
    again, again_id = _input(inbox, "later/e.png")
    kept.archive(again, JobStatus.DONE, again_id)
    os.utime(inbox / "later", (old, old))
    kept.sweep()
    assert (inbox / "later").is_dir()


def test_a_watcher_removes_the_folders_it_emptied(cfg, samples: Path) -> None:
    import dataclasses
    import shutil

    from tests.conftest import wait_for
    from tests.support.watching import Watching

    cfg = dataclasses.replace(cfg, inputs=dataclasses.replace(cfg.inputs, empty_folders_s=0.3))
    (cfg.inbox / "day" / "line3").mkdir(parents=True)
    shutil.copy(samples / "coffee.png", cfg.inbox / "day" / "line3" / "a.png")
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        assert wait_for(lambda: len(w.finished) == 1, timeout=60)
        assert wait_for(lambda: not (cfg.inbox / "day").exists(), timeout=30)
        assert cfg.inbox.is_dir() and (cfg.archive / "done" / "day" / "line3" / "a.png").is_file()
