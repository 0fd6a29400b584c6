"""kill -9 at random points, several times, then restart: every input ends with exactly one done or
failed row and one complete set of outputs, and no temporary files remain."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.support.crash import check_outcome, kill_rounds, make_corpus, runs, start, write_config


@pytest.mark.timeout(400)
def test_run_survives_kill_9(tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    rels = make_corpus(tmp_path / "in", samples)
    conf = write_config(tmp_path)
    killed = kill_rounds(conf, ["run", str(tmp_path / "in"), "--no-progress"], 4, random.Random(1))
    assert killed >= 3
    proc = start(conf, "run", str(tmp_path / "in"), "--no-progress")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    check_outcome(tmp_path, rels)


@pytest.mark.timeout(400)
def test_watch_survives_kill_9_and_stops_on_sigterm(tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    rels = make_corpus(tmp_path / "inbox", samples)
    conf = write_config(tmp_path)
    killed = kill_rounds(conf, ["watch"], 4, random.Random(2))
    assert killed >= 3
    started = runs(tmp_path / "worker.db")
    proc = start(conf, "watch")
    try:
        # live first: the inbox may be empty already, and a SIGTERM before the worker has set its handler
        # ends it the default way (exit status -15), which says nothing about its two-stage stop
        assert wait_for(lambda: runs(tmp_path / "worker.db") > started, 120)
        assert wait_for(lambda: not [p for p in (tmp_path / "inbox").rglob("*") if p.is_file()], 300)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    check_outcome(tmp_path, rels)
    archived = sorted(p.relative_to(tmp_path / "archive").as_posix() for p in (tmp_path / "archive").rglob("*")
                      if p.is_file())
    expected = sorted(("failed/" if r.startswith("bad_") else "done/") + r for r in rels)
    assert archived == expected, "each input archived exactly once, in done/ or failed/"
