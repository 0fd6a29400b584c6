"""The time and size of `worker report` over a long run (not a test).

    python tests/perf/report_scale.py [--days 7] [--rate 50] [--sample-s 1] [--db PATH]

Writes a SQLite database through the worker's own schema (its migrations) holding one run of `--days` at
`--rate` images per second (each image done, with its timings, one label and a result row; one failed in a
thousand) and a memory sample every `--sample-s` s, then times `worker report` on it and prints the time,
the file's size and its peak RSS."""

from __future__ import annotations

import argparse
import json
import random
import resource
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

CHUNK = 200_000


def build(path: Path, days: float, rate: float, sample_s: float) -> int:
    from worker.store.db import open_db

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
                      [(i + 1, 14 + rng.expovariate(0.2)) for i in range(lo, hi)])
        c.executemany("INSERT INTO results (image_id, task, score, payload) VALUES (?, 'classify', ?, '{}')",
                      [(i + 1, rng.random()) for i in range(lo, hi) if i % 1000 != 999])
        c.executemany("INSERT INTO labels (image_id, class_id, name, score) VALUES (?, ?, ?, 0.5)",
                      [(i + 1, i % 50, f"class {i % 50}") for i in range(lo, hi) if i % 1000 != 999])
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
    print(json.dumps({"report_s": round(took, 1), "size_kb": out.stat().st_size >> 10 if out.exists() else None,
                      "peak_rss_mb": round(peak, 1)}))


if __name__ == "__main__":
    main()
