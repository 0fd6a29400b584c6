"""FullOutboxPause's pause: jobs that found no room wait in order, decode threads wait until a check finds
room, and shutdown releases both (the pipeline drives it on a real full disk: test_hostile)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import worker.pipeline.pause as room_mod
from worker.errors import OutboxFull
from worker.intake.jobs import Job
from worker.pipeline.pause import FullOutboxPause


def _jobs(tmp_path: Path, n: int) -> list[Job]:
    return [Job(path=tmp_path / f"{i}.png", rel=f"{i}.png", size=i, mtime_ns=0) for i in range(n)]


def test_waiting_jobs_go_first_in_order_once_a_check_finds_room(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(room_mod, "ROOM_CHECK_S", 0.01)
    checks: list[bool] = []
    room_now = threading.Event()

    def has_room() -> bool:
        checks.append(room_now.is_set())
        return room_now.is_set()

    room = FullOutboxPause(has_room, tmp_path)
    assert not room.full and room.next_waiting() is None
    jobs = _jobs(tmp_path, 3)
    with caplog.at_level(logging.WARNING):
        for job in jobs:
            room.defer(job, OutboxFull(f"{tmp_path}: no space left on device"))
        assert room.full and caplog.text.count("pausing until there is room") == 1  # once per pause
        waiter = threading.Thread(target=room.wait)
        waiter.start()
        while len(checks) < 3:  # it looks, finds none, and keeps waiting
            waiter.join(0.01)
        assert waiter.is_alive()
        room_now.set()
        waiter.join(10)
    assert not waiter.is_alive() and not room.full and checks[-1] is True
    assert "room in the outbox again" in caplog.text and "(3 images waited)" in caplog.text
    assert [room.next_waiting() for _ in range(4)] == [*jobs, None]


def test_stop_waiting_releases_the_waiting_thread_and_hands_back_every_waiting_job(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    monkeypatch.setattr(room_mod, "ROOM_CHECK_S", 0.01)
    room = FullOutboxPause(lambda: False, tmp_path)
    jobs = _jobs(tmp_path, 2)
    for job in jobs:
        room.defer(job, OutboxFull("full"))
    waiter = threading.Thread(target=room.wait)
    waiter.start()
    assert room.stop_waiting() == jobs
    waiter.join(10)
    assert not waiter.is_alive() and room.stopped and room.full  # still full: nothing more is taken
    assert room.stop_waiting() == [] and room.next_waiting() is None


def test_a_long_pause_is_said_again_with_how_long_and_how_many(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(room_mod, "ROOM_CHECK_S", 0.01)
    monkeypatch.setattr(room_mod, "FULL_REMINDER_S", 0.0)
    looks = 0

    def has_room() -> bool:
        nonlocal looks
        looks += 1
        return looks > 2

    room = FullOutboxPause(has_room, tmp_path / "out")
    room.defer(_jobs(tmp_path, 1)[0], OutboxFull("full"))
    with caplog.at_level(logging.ERROR):
        room.wait()
    assert caplog.text.count("still no room after") == 2 and "1 images wait" in caplog.text
    assert str(tmp_path / "out") in caplog.text
