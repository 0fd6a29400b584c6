"""worker.store.health: a run's state from its row and its memory samples (the heartbeat); and
`worker health` / `worker stats` on a real watcher, alive and then killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tests.conftest import CACHE, ROOT, wait_for
from worker.store.health import Beat, RunState, assess, stalled_for

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def a_run(**changes) -> dict:
    run = {"id": 7, "mode": "watch", "finished_at": None, "started_at": NOW - timedelta(hours=1),
           "host": socket.gethostname(), "pid": os.getpid(), "config": {"metrics.memory_sample_s": 5.0}}
    return {**run, **changes}


def beats(*rows: tuple[float, int, int]) -> list[Beat]:
    """(seconds before NOW, in flight, processed), oldest first."""
    return [Beat(NOW - timedelta(seconds=ago), flight, done) for ago, flight, done in rows]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_finished_run() -> None:
    h = assess(a_run(finished_at=NOW - timedelta(minutes=3)), beats((200, 0, 10)), NOW)
    assert h.state is RunState.FINISHED and "finished at 2026-12-01T11:57:00" in h.detail


def test_running_with_recent_samples_says_how_much_it_did() -> None:
    h = assess(a_run(), beats((310, 0, 0), (200, 3, 40), (100, 2, 90), (3, 1, 130)), NOW)
    assert h.state is RunState.RUNNING and h.in_flight == 1 and h.last_sample_age_s == 3.0
    assert "last sample 3 s ago, 1 in flight, 90 processed in the last 3 min" in h.detail
    idle = assess(a_run(), beats((400, 0, 5), (2, 0, 5)), NOW)  # nothing to do is not a stall
    assert idle.state is RunState.RUNNING and idle.stalled_for_s == 0.0


def test_images_in_flight_and_none_finished_is_a_stall() -> None:
    rows = [(ago, 4, 12) for ago in range(700, 0, -5)]
    h = assess(a_run(), beats((705, 4, 11), *rows), NOW)
    assert h.state is RunState.STALLED and h.stalled_for_s == 695.0
    assert "4 image(s) in flight and none finished for 12 min" in h.detail
    assert assess(a_run(), beats(*rows), NOW, stall_s=1000).state is RunState.RUNNING  # under the threshold
    # progress restarts the count; so does an empty pipeline in between
    assert stalled_for(beats((30, 2, 5), (20, 0, 5), (10, 1, 5), (0, 1, 5))) == 10.0
    assert stalled_for(beats((30, 2, 4), (20, 2, 5), (0, 2, 5))) == 20.0


def test_a_run_whose_process_is_gone() -> None:
    h = assess(a_run(pid=dead_pid()), beats((7200, 2, 50)), NOW)
    assert h.state is RunState.GONE and "stopped without finishing" in h.detail and "2.0 h ago" in h.detail


def test_alive_pid_without_samples_and_another_hosts_silence() -> None:
    old = beats((900, 0, 50))
    assert assess(a_run(), old, NOW).state is RunState.STALLED  # our pid exists, but no heartbeat for 15 min
    other = assess(a_run(host="elsewhere", pid=1), old, NOW)
    assert other.state is RunState.SILENT and "cannot be checked" in other.detail
    fresh = assess(a_run(host="elsewhere", pid=1), beats((4, 0, 50)), NOW)
    assert fresh.state is RunState.RUNNING  # by its samples
    young = assess(a_run(started_at=NOW - timedelta(seconds=2)), [], NOW)
    assert young.state is RunState.RUNNING and "no sample yet" in young.detail
    # the silence threshold follows the run's own sample period
    slow = a_run(config={"metrics.memory_sample_s": 60.0})
    assert assess(slow, beats((200, 0, 50)), NOW).state is RunState.RUNNING


def worker(conf: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker", "--config", str(conf), *args],
                          capture_output=True, text=True, cwd=conf.parent, timeout=120)


@pytest.mark.timeout(300)
def test_health_of_a_real_watcher_alive_then_killed(tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    conf = tmp_path / "config.yaml"
    conf.write_text(f"inbox: inbox\noutbox: outbox\narchive: archive\ndb: sqlite:///worker.db\n"
                    f"model: efficientnet-lite0\nmodels_dir: {ROOT / 'models'}\ncache_dir: {CACHE}\n"
                    "metrics: {memory_sample_s: 0.2}\n")
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "coffee.png").write_bytes((samples / "coffee.png").read_bytes())
    assert worker(conf, "health").returncode == 1  # no database yet: an error, not a new database
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--config", str(conf), "watch"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert wait_for(lambda: (tmp_path / "archive" / "done" / "coffee.png").exists(), 120)
        seen: list = []  # the sample that counts the image may still be on its way to the database
        assert wait_for(lambda: "1 processed in the last" in (seen.append(worker(conf, "health")) or seen[-1]).stdout,
                        60), seen[-1]
        alive = seen[-1]
        assert alive.returncode == 0, alive
        assert f"(watch) running: pid {proc.pid} on {socket.gethostname()}" in alive.stdout
        as_json = json.loads(worker(conf, "health", "--format", "json").stdout)
        assert as_json["state"] == "running" and as_json["in_flight"] == 0
        # no watch there: the watchers it can see in the database are named
        elsewhere = worker(conf, "health", "--inbox", str(tmp_path / "elsewhere"))
        assert elsewhere.returncode == 1 and f"no watch run on {tmp_path / 'elsewhere'} on record: the watchers in " \
            f"this database are\n  run 1 on {socket.gethostname()} watching {tmp_path / 'inbox'}: running" in \
            elsewhere.stdout, elsewhere.stdout
        as_json = json.loads(worker(conf, "health", "--inbox", str(tmp_path / "elsewhere"), "--format", "json").stdout)
        assert [w["inbox"] for w in as_json["watchers"]] == [str(tmp_path / "inbox")]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stderr.close()  # type: ignore[union-attr]
    gone = worker(conf, "health")
    assert gone.returncode == 1 and "stopped without finishing" in gone.stdout, gone
    elsewhere = worker(conf, "health", "--inbox", str(tmp_path / "elsewhere"))  # a dead watcher is not named
    assert elsewhere.stdout == f"no watch run on {tmp_path / 'elsewhere'} on record\n", elsewhere.stdout
    stats = worker(conf, "stats")
    assert stats.returncode == 0 and "state: stopped without finishing" in stats.stdout, stats
    run = json.loads(worker(conf, "stats", "--format", "json").stdout)[-1]
    assert run["health"]["state"] == "gone" and run["images_per_s"] is not None  # up to its last sample
