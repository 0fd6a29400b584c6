"""The time and size of `worker report` over a long run (not a test).

    python tests/perf/report_scale.py [--days 7] [--rate 50] [--sample-s 1] [--db PATH]

Writes a SQLite database through the worker's own schema (its migrations) holding one run of `--days` at
`--rate` images per second (each image done, with its timings, one label and a result row; one failed in a
thousand) and a memory sample every `--sample-s` s, then times `worker report` on it and prints the time,
the file's size and its peak RSS, and where Chromium is installed the time headless Chromium takes to open
the file and render it to a screenshot (its start included)."""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import shutil
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

CHUNK = 200_000


def _uniform(i: int, salt: int) -> float:
    """A number in (0, 1) drawn from the image's index: the same for its rows and its tallies."""
    return (((i + 1) * 2654435761 + salt * 40503) % 2**32 + 0.5) / 2**32


def _total_ms(i: int) -> float:
    return 14 - 5 * math.log(_uniform(i, 1))  # 14 ms and an exponential tail of mean 5


def _score(i: int) -> float:
    return _uniform(i, 2)


def build(path: Path, days: float, rate: float, sample_s: float) -> int:
    from worker.intake.jobs import JobStatus
    from worker.store.db import open_db
    from worker.store.events import Finished
    from worker.store.tallies import as_rows, tally

    open_db(f"sqlite:///{path}").dispose()  # the schema, as a worker makes it
    n = int(days * 86400 * rate)
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    rng = random.Random(0)
    c = sqlite3.connect(path)
    c.execute("PRAGMA synchronous=OFF")
    c.execute("PRAGMA journal_mode=OFF")
    c.execute("INSERT INTO runs (id, started_at, finished_at, mode, host, pid, root, model, model_sha256, providers, "
              "config, version) VALUES (1, ?, ?, 'soak', 'vm', 1, '/in', 'm', ?, 'CPUExecutionProvider', ?, '0.1.0')",
              (start.isoformat(" ")[:26], (start + timedelta(days=days)).isoformat(" ")[:26], "0" * 64,
               json.dumps({"outbox": "/out"})))
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        at = [(start + timedelta(seconds=i / rate)).isoformat(" ")[:26] for i in range(lo, hi)]
        c.executemany("INSERT INTO images (id, run_id, rel_path, sha256, model, size, status, attempts, error, "
                      "created_at, updated_at) VALUES (?, 1, ?, '', 'm', 1000, ?, 1, ?, ?, ?)",
                      [(i + 1, f"d/{i}.jpg", "failed" if i % 1000 == 999 else "done",
                        "not an image" if i % 1000 == 999 else None, t, t) for i, t in zip(range(lo, hi), at)])
        c.executemany("INSERT INTO timings (image_id, run_id, queue_wait_ms, decode_ms, preprocess_ms, infer_ms, "
                      "postprocess_ms, write_ms, total_ms, batch_size) VALUES (?, 1, 1, 3, 1, 8, 0.2, 0.3, ?, 1)",
                      [(i + 1, _total_ms(i)) for i in range(lo, hi)])
        c.executemany("INSERT INTO results (image_id, task, score, payload) VALUES (?, 'classify', ?, '{}')",
                      [(i + 1, _score(i)) for i in range(lo, hi) if i % 1000 != 999])
        c.executemany("INSERT INTO labels (image_id, class_id, name, score) VALUES (?, ?, ?, 0.5)",
                      [(i + 1, i % 50, f"class {i % 50}") for i in range(lo, hi) if i % 1000 != 999])
        c.commit()
    # the tallies, as the recorder adds them up: one batch of outcomes per minute
    cells: dict = {}
    per_minute = int(60 * rate)
    for lo in range(0, n, per_minute):
        outcomes = []
        for i in range(lo, min(n, lo + per_minute)):
            total, score = _total_ms(i), _score(i)
            failed = i % 1000 == 999
            outcomes.append(Finished(
                f"d/{i}.jpg", "", 1000, JobStatus.FAILED if failed else JobStatus.DONE,
                error="not an image" if failed else None, task=None if failed else "classify", score=score,
                labels=() if failed else ((i % 50, f"class {i % 50}", 0.5),),
                timings=dict(queue_wait_ms=1, decode_ms=3, preprocess_ms=1, infer_ms=8, postprocess_ms=0.2,
                             write_ms=0.3, total_ms=total, batch_size=1)))
        for key, (k, amount) in tally(outcomes, start + timedelta(seconds=lo / rate)).items():
            cell = cells.setdefault(key, [0, 0.0])
            cell[0] += k
            cell[1] += amount
    c.executemany("INSERT INTO tallies (run_id, at, kind, key, images, amount) VALUES (1, ?, ?, ?, ?, ?)",
                  [(r["at"], r["kind"], r["key"], r["images"], r["amount"]) for r in as_rows(1, cells)])
    c.commit()
    samples = int(days * 86400 / sample_s)
    c.executemany("INSERT INTO memory_samples (run_id, at, rss_bytes, fds, threads, queue_depth, images_done) "
                  "VALUES (1, ?, ?, 20, 12, 3, ?)",
                  [((start + timedelta(seconds=i * sample_s)).isoformat(" ")[:26],
                    int((300 + 5 * rng.random()) * 2**20), int(i * sample_s * rate)) for i in range(samples)])
    c.commit()
    c.close()
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--days", type=float, default=7)
    ap.add_argument("--rate", type=float, default=50)
    ap.add_argument("--sample-s", type=float, default=1.0)
    ap.add_argument("--db", type=Path, default=Path("/tmp/report-scale.db"))
    args = ap.parse_args()
    if not args.db.exists():
        t0 = time.perf_counter()
        n = build(args.db, args.days, args.rate, args.sample_s)
        print(f"built {args.db}: {n} images in {time.perf_counter() - t0:.0f} s, {args.db.stat().st_size >> 20} MB")
    out = args.db.with_suffix(".html")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "worker", "report", "--db", f"sqlite:///{args.db}", "-o", str(out)],
                          capture_output=True, text=True)
    took = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(proc.stdout.strip() or proc.stderr[-2000:])
    figures = {"report_s": round(took, 1), "size_kb": out.stat().st_size >> 10 if out.exists() else None,
               "peak_rss_mb": round(peak, 1)}
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser and out.exists():  # opened from the file, offline, and rendered to a screenshot
        t0 = time.perf_counter()
        subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--window-size=1200,1600", f"--screenshot={out.with_suffix('.png')}", out.as_uri()],
                       capture_output=True, timeout=120, check=True)
        figures["screenshot_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
