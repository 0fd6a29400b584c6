"""Workers killed and started again as real processes, and the checks that every input then has exactly one
outcome."""

from __future__ import annotations

import contextlib
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np

from tests.conftest import CACHE, ROOT, wait_for

N_IMAGES = 240
N_BAD = 6


def make_corpus(folder: Path, samples: Path, n: int = N_IMAGES, bad: int = N_BAD) -> list[str]:
    """Distinct small real images (crops of the samples, numbered so no two are equal) and bad files."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = [cv2.imread(str(samples / s)) for s in ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg")]
    rels = []
    for i in range(n):
        img = sources[i % len(sources)]
        y, x = (i * 7) % 100, (i * 13) % 100
        crop = img[y:y + 200, x:x + 240].copy()
        cv2.putText(crop, str(i), (10, 30), cv2.FONT_HERSHEY_SIMPLEX, 1, (0, 0, 255), 2)
        rel = f"d{i % 5}/img_{i:04d}.jpg"
        (folder / rel).parent.mkdir(exist_ok=True)
        cv2.imwrite(str(folder / rel), crop)
        rels.append(rel)
    for i in range(bad):
        (folder / f"bad_{i}.jpg").write_bytes(np.random.default_rng(i).bytes(3000))
        rels.append(f"bad_{i}.jpg")
    return rels


def write_config(tmp: Path, processes: int = 0) -> Path:
    """`processes`: pipeline.processes (0: chosen from the cores)."""
    conf = tmp / "config.yaml"
    conf.write_text(f"inbox: inbox\noutbox: outbox\narchive: archive\ndb: sqlite:///worker.db\n"
                    f"model: efficientnet-lite0\nmodels_dir: {ROOT / 'models'}\ncache_dir: {CACHE}\n"
                    f"pipeline: {{max_attempts: 10, processes: {processes}}}\n"
                    "watch: {settle_s: 0.2, rescan_interval_s: 1.0, create_inbox: true}\n"
                    "metrics: {memory_sample_s: 1.0}\n")
    return conf


def finished_rows(db: Path) -> int:
    return count_rows(db, "select count(*) from images where status in ('done','failed')")


def runs(db: Path) -> int:
    """Starts on record: a start's row is written once its signal handlers are in place and it is live."""
    return count_rows(db, "select count(*) from runs")


def count_rows(db: Path, sql: str) -> int:
    if not db.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=30)) as c:  # `with` alone would not close it
            return c.execute(sql).fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def start(conf: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "worker", "--config", str(conf), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=conf.parent)


def kill_rounds(conf: Path, args: list[str], rounds: int, rng: random.Random) -> int:
    db = conf.parent / "worker.db"
    killed = 0
    for _ in range(rounds):
        before = finished_rows(db)
        proc = start(conf, *args)
        # let it get going, then kill it at a random point mid-flight
        wait_for(lambda: finished_rows(db) >= before + rng.randint(5, 40) or proc.poll() is not None, 60)
        time.sleep(rng.uniform(0, 0.3))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed += 1
        proc.wait(30)
        proc.stderr.close()  # type: ignore[union-attr]
    return killed


def check_outcome(tmp: Path, rels: list[str]) -> None:
    with contextlib.closing(sqlite3.connect(tmp / "worker.db")) as c:
        rows = c.execute("select rel_path, status, attempts, error from images").fetchall()
        tallied = c.execute("select coalesce(sum(images), 0) from tallies where kind = 'outcome' and key = 'done'"
                            ).fetchone()[0]
    by_rel: dict[str, list] = {}
    for r in rows:
        by_rel.setdefault(r[0], []).append(r)
    assert sorted(by_rel) == sorted(rels), "every input has a row, and no row without an input"
    assert all(len(v) == 1 for v in by_rel.values()), "exactly one row per input"
    for rel, ((_, status, attempts, error),) in by_rel.items():
        if rel.startswith("bad_"):
            assert status == "failed" and error, rel
        else:
            assert status == "done", (rel, status, error)
            doc = tmp / "outbox" / f"{rel}.json"
            assert doc.exists() and doc.read_text().rstrip().endswith("}"), rel
    outs = sorted(p.relative_to(tmp / "outbox").as_posix() for p in (tmp / "outbox").rglob("*") if p.is_file())
    expected = sorted(f"{rel}.error.json" if rel.startswith("bad_") else f"{rel}.json" for rel in rels)
    assert outs == expected, ("exactly one complete outcome per input: results when done, the reason when failed; "
                              f"extra {sorted(set(outs) - set(expected))}, missing {sorted(set(expected) - set(outs))}")
    assert not [p for p in tmp.rglob(".tmp-*")], "no temporary files remain"
    # each image's outcome was committed once, with its tally in the same transaction, whatever was killed
    assert tallied == sum(1 for (_, status, _, _), in by_rel.values() if status == "done"), tallied
