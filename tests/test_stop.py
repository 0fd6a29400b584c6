"""The first Ctrl-C (SIGINT) of `worker run` and `worker watch`, as real processes: the images inference has
started finish, the others are given back (queued, no attempt counted, inputs where they are), and the next
start processes them as any other, with no warning and no second attempt."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.support.slow import slow_outbox_site
from tests.support.crash import check_outcome, finished_rows, make_corpus, write_config

N = 400


def _rows(db: Path) -> list[tuple[str, str, int]]:
    with contextlib.closing(sqlite3.connect(db)) as c:
        return c.execute("select rel_path, status, attempts from images").fetchall()


def _start(conf: Path, *args: str, slow: bool = False) -> subprocess.Popen:
    """`worker ARGS` as a process of its own (`slow`: its outbox on a slow share, 0.5 s per result)."""
    env = {**os.environ, "PYTHONPATH": str(slow_outbox_site(conf.parent))} if slow else None
    # SIGINT's default disposition: a test run started in the background (`pytest &`) ignores it, and the
    # worker rightly keeps an ignored signal ignored
    return subprocess.Popen([sys.executable, "-m", "worker", "--config", str(conf), *args], cwd=conf.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("command, processes", [("run", 1), ("run", 2), ("watch", 1)])
def test_the_first_ctrl_c_gives_back_what_has_not_started(tmp_path: Path, samples: Path, effnet_onnx: Path,
                                                          command: str, processes: int) -> None:
    conf = write_config(tmp_path, processes=processes)
    folder = tmp_path / ("inbox" if command == "watch" else "in")
    rels = make_corpus(folder, samples, n=N, bad=0)
    args = ["watch"] if command == "watch" else ["run", str(folder), "--no-progress"]
    db = tmp_path / "worker.db"
    proc = _start(conf, *args)
    assert wait_for(lambda: finished_rows(db) >= 30 or proc.poll() is not None, 120), "it never got going"
    proc.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - signalled
    assert proc.returncode == 0, err[-3000:]
    rows = _rows(db)
    given = [r for r in rows if r[1] == "queued"]
    done = [r for r in rows if r[1] == "done"]
    print(f"{command}, {processes} process(es): exited {took:.2f} s after SIGINT; done {len(done)}, "
          f"given back {len(given)}")
    assert len(done) + len(given) == len(rows), "nothing left in progress, nothing failed"
    assert given and all(attempts == 0 for _, _, attempts in given), "given back, with no attempt counted"
    assert all(attempts == 1 for _, _, attempts in done)
    assert len(done) < N - len(given), "it stopped: not every image was taken"
    assert f"given back: {len(given)} claimed but not started" in out, out
    if command == "watch":  # the given-back inputs are still in the inbox; the done ones archived
        assert all((folder / rel).is_file() for rel, _, _ in given)
        assert all((tmp_path / "archive" / "done" / rel).is_file() for rel, _, _ in done)
    # the next start processes the rest as any other image: no recovery one by one, no second attempt
    again = _start(conf, "run", str(folder), "--no-progress")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0 and "in flight when a worker was killed" not in err, err[-3000:]
    if command == "run":
        check_outcome(tmp_path, rels)
    assert all(status == "done" and attempts == 1 for _, status, attempts in _rows(db))


def test_two_ctrl_c_in_quick_succession_still_give_back(tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    """A second Ctrl-C a tenth of a second after the first (a habit at a terminal) exited at once, leaving every
    image claimed ahead `processing`, charged an attempt, to be recovered one by one: it now lets the giving back
    finish (up to a second after the first) and exits 130; only what inference had started may be left in
    flight (here each result takes 0.5 s to write, an outbox on a slow share)."""
    conf = write_config(tmp_path, processes=1)
    folder = tmp_path / "in"
    make_corpus(folder, samples, n=N, bad=0)
    db = tmp_path / "worker.db"
    proc = _start(conf, "run", str(folder), "--no-progress", slow=True)
    assert wait_for(lambda: finished_rows(db) >= 3 or proc.poll() is not None, 120), "it never got going"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)  # the second press, as a person's
    proc.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT and time.monotonic() - signalled < 5
    rows = _rows(db)
    in_flight = [r for r in rows if r[1] == "processing"]
    given = [r for r in rows if r[1] == "queued"]
    assert len(in_flight) <= 6, f"{len(in_flight)} left in flight, charged: more than inference had started"
    assert given and all(attempts == 0 for _, _, attempts in given)


def test_a_ctrl_c_while_recovering_from_a_kill_stops_without_recovering_everything(tmp_path: Path, samples: Path,
                                                                                  effnet_onnx: Path) -> None:
    """After a kill -9, a start first processes the images the dead worker had in flight, one at a time; a Ctrl-C
    then went on through all of them (10 s for 70 here with PP-OCR; longer than `docker stop` waits). It stops
    after the one it is on; the rest stay in flight for the next start, which does them all."""
    conf = write_config(tmp_path, processes=1)
    folder = tmp_path / "in"
    rels = make_corpus(folder, samples, n=N, bad=0)
    db = tmp_path / "worker.db"
    proc = _start(conf, "run", str(folder), "--no-progress")
    assert wait_for(lambda: finished_rows(db) >= 30 or proc.poll() is not None, 120), "it never got going"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    left = len([r for r in _rows(db) if r[1] == "processing"])
    assert left > 3, left
    proc = _start(conf, "run", str(folder), "--no-progress", slow=True)  # the recovery then takes a while
    assert proc.stderr is not None
    while (line := proc.stderr.readline()) and "were in flight when a worker was killed" not in line:
        pass
    proc.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    proc.communicate(timeout=60)
    assert proc.returncode == 0 and time.monotonic() - signalled < 5
    assert len([r for r in _rows(db) if r[1] == "processing"]) >= left - 3  # not recovered: still in flight
    again = _start(conf, "run", str(folder), "--no-progress")
    again.communicate(timeout=300)
    assert again.returncode == 0
    check_outcome(tmp_path, rels)

