"""InputArchive on real files in temporary folders (the pipeline's archive stage drives it: test_inputs,
test_watch)."""

from __future__ import annotations

import logging
import os
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
