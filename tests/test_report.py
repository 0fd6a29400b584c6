"""`worker report` on real runs (a `worker run` of a few images, one of them broken): the file parsed (its
figures held to the database, every section there, the gallery's pictures decodable), rendered by a real
headless browser from the file, offline; and the one-line refusals."""

from __future__ import annotations

import base64
import json
import re
import shutil
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import cv2
import numpy as np
import pytest
from click.testing import CliRunner

from tests.support.cli import config_file, main_as_command
from worker.cli import cli

SECTIONS = ("Throughput", "Latency", "Latency by stage", "Memory", "Failures by reason", "Labels", "Scores", "Gallery")


@pytest.fixture(scope="module")
def ran(tmp_path_factory, samples: Path, effnet_onnx: Path) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    folder = tmp / "in"
    folder.mkdir()
    for name in ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg"):
        shutil.copy(samples / name, folder / name)
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    conf = config_file(tmp)
    out = CliRunner().invoke(cli, ["--config", str(conf), "run", str(folder), "--model", "efficientnet-lite0",
                                   "--no-progress"])
    assert out.exit_code == 0, out.output
    return tmp


def _report(tmp: Path, *args: str) -> tuple[int, str]:
    out = CliRunner().invoke(main_as_command, ["--config", str(tmp / "config.yaml"), "report", *args])
    return out.exit_code, out.output


def test_the_report_holds_what_the_database_says(ran: Path) -> None:
    code, said = _report(ran, "-o", str(ran / "r.html"))
    assert code == 0 and said.startswith(f"wrote {ran / 'r.html'}") and "5 images" in said, said
    page = (ran / "r.html").read_text()
    assert all(f"<h2>{s}</h2>" in page for s in SECTIONS)
    assert not re.search(r'(src|href)="(https?:)?//', page) and "<script src" not in page  # nothing fetched
    assert "<link" not in page and "@import" not in page
    data = json.loads(re.search(r'id="report-data">(.*?)</script>', page, re.S)[1])
    with closing(sqlite3.connect(ran / "worker.db")) as c:
        recorded = dict(c.execute("SELECT status, count(*) FROM images GROUP BY status"))
        tops = dict(c.execute("SELECT name, count(*) FROM labels l WHERE score = (SELECT max(score) FROM labels "
                              "WHERE image_id = l.image_id) GROUP BY name"))
    assert data["images"] == recorded == {"done": 4, "failed": 1}
    assert sum(d for _, d, _ in data["throughput"]) == 4 and sum(f for _, _, f in data["throughput"]) == 1
    assert all(0 < p50 <= p95 <= p99 for _, p50, p95, p99 in data["latency_ms"])
    assert data["memory_mb"] and all(50 < m < 2000 for _, m, _ in data["memory_mb"])
    assert dict(data["labels"]) == tops and sum(tops.values()) == 4 and sum(data["scores"]) == 4  # each top label
    (reason, n, rel) = data["failures"][0]
    assert n == 1 and rel == "broken.jpg" and "broken.jpg.error.json" in page
    assert data["gallery"]["failed"] == ["broken.jpg"] and len(data["gallery"]["slowest"]) == 4
    pictures = re.findall(r'src="data:image/jpeg;base64,([^"]+)"', page)
    assert len(pictures) == 8  # 4 slowest + 4 done; the broken file has none
    for b64 in pictures:
        image = cv2.imdecode(np.frombuffer(base64.b64decode(b64), np.uint8), cv2.IMREAD_COLOR)
        assert image is not None and max(image.shape[:2]) <= 180
    assert page.count("<svg") == 6  # throughput, latency, stages, memory, labels, scores


def test_a_browser_renders_it_offline(ran: Path, tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium here (.ci/run installs Debian's)")
    assert _report(ran, "-o", str(tmp_path / "r.html"))[0] == 0
    shot = tmp_path / "shot.png"
    proc = subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--window-size=1200,1600", f"--screenshot={shot}", "--enable-logging=stderr", "--v=0",
                           (tmp_path / "r.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    assert "Uncaught" not in proc.stderr and "CONSOLE" not in proc.stderr
    image = cv2.imread(str(shot))
    assert image.shape[:2] == (1600, 1200)
    assert image.std() > 20  # not blank: text, tables and charts


@pytest.mark.parametrize("args, says", [
    (["--run", "99"], "no run 99 on record"),
    (["--model", "nothing-such"], "no run of model nothing-such on record"),
    (["-o", "/proc/nope/r.html"], "/proc/nope/r.html: cannot write the report there"),
])
def test_what_cannot_be_reported_is_one_line_and_exit_2(ran: Path, args: list[str], says: str) -> None:
    code, said = _report(ran, *args)
    assert code == 2 and says in said and said.count("\n") == 1, said


def test_a_database_without_runs_is_refused(tmp_path: Path) -> None:
    conf = config_file(tmp_path)
    out = CliRunner().invoke(main_as_command, ["--config", str(conf), "report", "-o", str(tmp_path / "r.html")])
    assert out.exit_code == 2 and out.output.startswith("error: ") and not (tmp_path / "r.html").exists(), out.output
