"""`worker report` on real runs (a `worker run` of a few images, one of them broken): the file parsed (its
figures held to the database, every section there, the gallery's pictures decodable), rendered by a real
headless browser from the file, offline; and the one-line refusals."""

from __future__ import annotations

import base64
import json
import re
import shutil
import sqlite3
import signal
import subprocess
import sys
import time
from contextlib import closing
from datetime import datetime, timezone
from pathlib import Path

import cv2
import numpy as np
import pytest
from click.testing import CliRunner

from tests.conftest import wait_for
from tests.support.cli import config_file, main_as_command
from tests.support.crash import finished_rows, make_corpus, start
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
    assert list(data["memory_mb"]) == ["1"] and all(50 < m < 2000 for _, m, _ in data["memory_mb"]["1"])
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


def _rendered(page: Path) -> np.ndarray:
    """A screenshot of the page by a real headless browser, from the file, offline (skips where none is)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium here (.ci/run installs Debian's)")
    shot = page.with_suffix(".png")
    proc = subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--window-size=1200,1600", f"--screenshot={shot}", "--enable-logging=stderr", "--v=0",
                           page.as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    assert "Uncaught" not in proc.stderr and "CONSOLE" not in proc.stderr
    image = cv2.imread(str(shot))
    assert image.shape[:2] == (1600, 1200)
    return image


def test_a_browser_renders_it_offline(ran: Path, tmp_path: Path) -> None:
    assert _report(ran, "-o", str(tmp_path / "r.html"))[0] == 0
    assert _rendered(tmp_path / "r.html").std() > 20  # not blank: text, tables and charts


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory, samples: Path, effnet_onnx: Path) -> tuple[Path, float]:
    """Three `worker run`s, each its own process, one after the other: the first killed with -9 mid-run (at
    the time returned, epoch s), the other two over folders of their own, finished."""
    tmp = tmp_path_factory.mktemp("three")
    conf = config_file(tmp)
    make_corpus(tmp / "many", samples, n=400, bad=0)
    proc = start(conf, "run", str(tmp / "many"), "--model", "efficientnet-lite0", "--no-progress")
    assert wait_for(lambda: finished_rows(tmp / "worker.db") >= 40 or proc.poll() is not None, 120)
    proc.send_signal(signal.SIGKILL)
    killed_at = time.time()
    assert proc.wait(30) == -signal.SIGKILL
    proc.stderr.close()  # type: ignore[union-attr]
    for k, names in enumerate((("chelsea.png", "coffee.png"), ("astronaut.png", "rocket.jpg", "text.png"))):
        folder = tmp / f"few{k}"
        folder.mkdir()
        for name in names:
            shutil.copy(samples / name, folder / name)
        done = subprocess.run([sys.executable, "-m", "worker", "--config", str(conf), "run", str(folder), "--model",
                               "efficientnet-lite0", "--no-progress"], capture_output=True, text=True, cwd=tmp)
        assert done.returncode == 0, done.stderr[-2000:]
    return tmp, killed_at


def _rate_of(images: int, wall_s: float, rate: float) -> bool:
    """Whether `rate` is `images` over `wall_s` as the report rounds it (to 0.1 s)."""
    return images / (wall_s + 0.051) <= rate <= images / (wall_s - 0.051)


def test_runs_of_separate_processes_are_reported_each_on_its_own(three_runs: tuple[Path, float]) -> None:
    tmp, killed_at = three_runs
    code, said = _report(tmp, "--run", "1", "--run", "2", "--run", "3", "-o", str(tmp / "r.html"))
    assert code == 0 and "run(s) 1, 2, 3" in said, said
    page = (tmp / "r.html").read_text()
    data = json.loads(re.search(r'id="report-data">(.*?)</script>', page, re.S)[1])
    with closing(sqlite3.connect(tmp / "worker.db")) as c:
        started = {rid: datetime.fromisoformat(at).replace(tzinfo=timezone.utc).timestamp()
                   for rid, at in c.execute("SELECT id, started_at FROM runs")}
        outcomes = dict(c.execute("SELECT run_id, count(*) FROM images WHERE status IN ('done', 'failed') "
                                  "GROUP BY run_id"))
    assert data["runs"] == [1, 2, 3] and sum(outcomes.values()) == 40 + (outcomes[1] - 40) + 5
    per_run = data["per_run"]
    assert {rid: r["images"] for rid, r in per_run.items()} == {str(k): n for k, n in outcomes.items()}
    # the killed run ended when it was killed (its last heartbeat, sample or outcome), not when the report is made
    assert killed_at - started[1] - 2.5 < per_run["1"]["wall_s"] <= killed_at - started[1] + 0.5, per_run["1"]
    # each rate from its own images and wall time; the headline's from all of them over the time any ran
    for r in per_run.values():
        assert _rate_of(r["images"], r["wall_s"], r["images_per_s"]), r
    assert data["wall_s"] == pytest.approx(sum(r["wall_s"] for r in per_run.values()), abs=0.3)
    assert _rate_of(sum(outcomes.values()), data["wall_s"], data["images_per_s"]), data
    # memory by process: one series and at most one trend each, never one line across them
    assert set(data["memory_mb"]) == set(data["trend_mb_per_h"]) == {"1", "2", "3"}
    for rid, series in data["memory_mb"].items():
        assert series and min(b for b, _, _ in series) >= started[int(rid)] - data["bucket_s"]
    verdicts = re.findall(r'<p class="verdict (\w+)">run (\d): ([^<]*)</p>', page)
    assert [v[1] for v in verdicts] == ["1", "2", "3"]
    assert all(css == "unsure" and "too few memory samples" in text for css, _, text in verdicts), verdicts
    # --last 3 says the same
    assert _report(tmp, "--last", "3", "-o", str(tmp / "last.html"))[0] == 0
    same = json.loads(re.search(r'id="report-data">(.*?)</script>', (tmp / "last.html").read_text(), re.S)[1])
    assert same["per_run"] == per_run and same["images_per_s"] == data["images_per_s"]
    assert _rendered(tmp / "r.html").std() > 20


@pytest.mark.parametrize("args, says", [
    (["--run", "99"], "no run 99 on record"),
    (["--run", "1", "--run", "98", "--run", "99"], "no run 98, 99 on record"),
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
