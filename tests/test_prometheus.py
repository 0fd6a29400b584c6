"""Prometheus metrics (`metrics.port`, `--metrics-port`): scraped over HTTP from a real `worker watch` and parsed with
prometheus-client's own parser; its counters held to what the database recorded."""

from __future__ import annotations

import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import urllib.request
from contextlib import closing
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for
from tests.support.cli import config_file


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(samples: list, name: str, **labels: str) -> float:
    (found,) = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return float(found)


def _finished(db: Path) -> dict[str, int]:
    if not db.exists():
        return {}
    with closing(sqlite3.connect(db, timeout=30)) as c:
        return dict(c.execute("SELECT status, count(*) FROM images WHERE status IN ('done', 'failed') GROUP BY 1"))


@pytest.mark.parametrize("processes", [1, 3])
def test_a_watcher_s_metrics_match_its_database(tmp_path: Path, samples: Path, effnet_onnx: Path,
                                                processes: int) -> None:
    """In one process, and with prepare processes (which send their images' timings to the one serving)."""
    conf = config_file(tmp_path)
    conf.write_text(conf.read_text() + f"pipeline: {{processes: {processes}}}\n")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--config", str(conf), "watch", "--model",
                             "efficientnet-lite0", "--metrics-port", str(port)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: (tmp_path / "inbox").is_dir(), 60)

        def up() -> bool:
            try:
                return "worker_info" in _scrape(port)
            except OSError:
                return proc.poll() is not None
        assert wait_for(up, 60) and proc.poll() is None
        before = _scrape(port)
        assert _value(before["worker_images"], "worker_images_total", outcome="done") == 0
        for name in ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg"):
            shutil.copy(samples / name, tmp_path / "inbox" / name)
        (tmp_path / "inbox" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
        assert wait_for(lambda: sum(_finished(tmp_path / "worker.db").values()) == 5, 60)

        def settled() -> bool:  # the serving process learns of an image once its outcome is committed (a notice)
            m = _scrape(port)
            told = sum(_value(m["worker_images"], "worker_images_total", outcome=o) for o in ("done", "failed"))
            return told == 5 and _value(m["worker_queue_depth"], "worker_queue_depth") == 0
        assert wait_for(settled, 10)
        m = _scrape(port)
        recorded = _finished(tmp_path / "worker.db")
        for outcome in ("done", "failed"):
            assert _value(m["worker_images"], "worker_images_total", model="efficientnet-lite0",
                          outcome=outcome) == recorded[outcome]
        assert _value(m["worker_stage_seconds"], "worker_stage_seconds_count", stage="total") == 5
        assert _value(m["worker_stage_seconds"], "worker_stage_seconds_count", stage="infer") == 5
        assert 0 < _value(m["worker_stage_seconds"], "worker_stage_seconds_sum", stage="infer") < 5
        assert _value(m["worker_queue_depth"], "worker_queue_depth") == 0
        assert _value(m["worker_rss_bytes"], "worker_rss_bytes") > 50e6
        assert _value(m["worker_disk_free_bytes"], "worker_disk_free_bytes", folder="outbox") > 0
        assert _value(m["worker_last_image_timestamp_seconds"], "worker_last_image_timestamp_seconds") > 1.7e9
        (info,) = m["worker_info"]
        assert info.labels["model"] == "efficientnet-lite0" and info.labels["providers"] == "CPUExecutionProvider"
        assert len(info.labels["model_sha256"]) == 64
        if processes == 1:
            # a second worker asking for the same port is refused in one line, exit 2
            second = subprocess.run([sys.executable, "-m", "worker", "--config", str(conf), "run", str(samples),
                                     "--model", "efficientnet-lite0", "--metrics-port", str(port), "--no-progress",
                                     "--outbox", str(tmp_path / "out2"), "--db", f"sqlite:///{tmp_path / 'other.db'}"],
                                    cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert second.returncode == 2 and f"metrics.port {port} on 127.0.0.1: cannot listen there (in use" in \
                second.stderr, second.stderr[-2000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    assert f"Prometheus metrics on http://127.0.0.1:{port}/metrics" in out
