"""worker.status: the watcher's periodic status line, with a controlled clock and on a real watcher."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path

from tests.conftest import wait_for
from tests.support.watching import Watching
from worker.pipeline import Counts
from worker.status import StatusLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_period_saying_what_happened_since_the_last(caplog) -> None:
    caplog.set_level(logging.INFO, logger="worker.status")
    counts, clock, flight = Counts(), Clock(), [0]
    status = StatusLog(300, counts, lambda: flight[0], clock)
    clock.now += 299
    status.tick()
    assert not caplog.records  # not yet
    clock.now += 1
    status.tick()
    assert re.fullmatch(r"status: idle for the last 5 min; 0 in flight; RSS \d+ MB", caplog.records[-1].message)
    for ms in range(1, 101):
        counts.done += 1
        counts.latencies_ms.add(float(ms))
    counts.failed, counts.skipped, flight[0] = 2, 3, 4
    clock.now += 300
    status.tick()
    line = caplog.records[-1].message
    assert line.startswith("status: 100 done, 2 failed, 3 skipped (already done) in the last 5 min (0.3 images/s)")
    assert "latency p50 50 ms, p99 99 ms; 4 in flight; RSS" in line
    counts.done += 1  # the next line counts only what is new, its latency included
    counts.latencies_ms.add(7.0)
    clock.now += 600
    status.tick()
    assert "status: 1 done, 0 failed in the last 10 min" in caplog.records[-1].message
    assert "latency p50 7 ms, p99 7 ms" in caplog.records[-1].message
    clock.now += 300  # images in flight and none finished: not idle
    status.tick()
    assert caplog.records[-1].message.startswith("status: nothing finished in the last 5 min; 4 in flight; RSS")
    off = StatusLog(0, counts, lambda: 0, clock)  # 0 disables
    clock.now += 10_000
    n = len(caplog.records)
    off.tick()
    assert len(caplog.records) == n


def test_files_held_as_cut_short_are_counted_so_that_idle_does_not_mislead(caplog) -> None:
    caplog.set_level(logging.INFO, logger="worker.status")
    counts, clock, held = Counts(), Clock(), [2]
    status = StatusLog(60, counts, lambda: 0, clock, held=lambda: held[0])
    clock.now += 60
    status.tick()
    assert re.fullmatch(r"status: idle for the last 60 s; 0 in flight, 2 held as cut short \(watch.incomplete_s\); "
                        r"RSS \d+ MB", caplog.records[-1].message)
    held[0] = 0
    clock.now += 60
    status.tick()
    assert "held" not in caplog.records[-1].message


def test_a_real_watcher_logs_its_status(cfg, samples: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="worker.status")
    cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, status_log_s=0.3))
    cfg.inbox.mkdir(parents=True)
    with Watching(cfg) as w:
        assert w.ready.wait(120)
        for name in ("coffee.png", "chelsea.png"):
            shutil.copy(samples / name, cfg.inbox / name)
        assert wait_for(lambda: len(w.finished) == 2, 60)
        assert wait_for(lambda: any(re.match(r"status: [12] done, 0 failed", r.message) for r in caplog.records), 10)
        assert wait_for(lambda: any("idle for the last" in r.message for r in caplog.records), 10)


def test_a_disk_low_on_room_is_said_with_how_soon_it_fills(tmp_path: Path, caplog) -> None:
    """The status line says when a filesystem the watcher writes to runs low (here every one is, by a
    threshold of the whole disk), how much is free and how soon it fills at the rate since the last
    line; as a WARNING. Folders on one filesystem are named together; one not made yet by its parent."""
    from worker.host.disks import LowDisk, filesystems

    (tmp_path / "out").mkdir()
    disks = filesystems([("outbox", tmp_path / "out"), ("archive", tmp_path / "archive" / "done"),
                         ("database", tmp_path)])
    assert [(d.path, d.holds) for d in disks] == [(tmp_path / "out", "outbox, archive and database")]
    clock = Clock()
    low = LowDisk(disks, clock, low_bytes=0, low_fraction=1.0)
    first = low.check()
    assert first is not None and re.fullmatch(
        rf"low on disk: [\d.]+ [GM]B free \(\d+%\) on the filesystem of the outbox, archive and database "
        rf"\({re.escape(str(tmp_path / 'out'))}\)", first), first
    with open(tmp_path / "out" / "big.bin", "wb") as f:  # 256 MB in 60 s: about 15 GB an hour
        f.write(bytes(256 * 2**20))
        f.flush()
        os.fsync(f.fileno())
    clock.now += 60
    second = low.check()
    assert second is not None and re.search(r", filling at [\d.]+ GB/h: full in about [\d.]+ (min|h|days)$", second)
    assert LowDisk(disks, clock, low_bytes=0, low_fraction=0.0).check() is None  # nothing is under 0%

    caplog.set_level(logging.INFO, logger="worker.status")
    counts = Counts()
    status = StatusLog(300, counts, lambda: 0, clock, disks=LowDisk(disks, clock, low_bytes=0, low_fraction=1.0))
    clock.now += 300
    status.tick()
    record = caplog.records[-1]
    assert record.levelno == logging.WARNING and re.fullmatch(
        r"status: idle for the last 5 min; 0 in flight; RSS \d+ MB; low on disk: .* \(\d+%\) on the filesystem of "
        r"the outbox, archive and database \(.*\)", record.message), record.message
    quiet = StatusLog(300, counts, lambda: 0, clock, disks=LowDisk(disks, clock, low_bytes=0, low_fraction=0.0))
    clock.now += 300
    quiet.tick()
    assert caplog.records[-1].levelno == logging.INFO and "low on disk" not in caplog.records[-1].message


def test_a_run_without_a_status_line_is_told_of_a_low_disk_at_once_then_every_period(tmp_path: Path,
                                                                                     caplog) -> None:
    from worker.host.disks import DiskAlarm, LowDisk, filesystems

    caplog.set_level(logging.WARNING, logger="worker.host.disks")
    clock = Clock()
    disks = filesystems([("outbox", tmp_path)])
    alarm = DiskAlarm(LowDisk(disks, clock, low_bytes=0, low_fraction=1.0), 300, clock)
    said = []
    for step in (0, 1, 298, 1, 300):  # checks at 0 s (at once), 300 s and 600 s; not between
        clock.now += step
        alarm.tick()
        said.append(len(caplog.records))
    assert said == [1, 1, 1, 2, 3]
    assert all(r.levelno == logging.WARNING and r.message.startswith("low on disk: ") for r in caplog.records)
    quiet = DiskAlarm(LowDisk(disks, clock, low_bytes=0, low_fraction=0.0), 300, clock)
    quiet.tick()
    assert len(caplog.records) == 3
