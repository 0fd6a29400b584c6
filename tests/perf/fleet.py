"""One worker against a fleet of workers on one folder and one PostgreSQL database (not a test).

    python tests/perf/fleet.py [--hosts 8] [--images 1500] [--width 640] [--model stand-in] [--repeat 1] [--json OUT]

Each worker is a host of its own (a UTS namespace with its own hostname: tests/support/fleet.py), runs
`worker run DIR` on the same folder, against a fresh database on the server at $WORKER_TEST_POSTGRES
(default 127.0.0.1:5432). For one worker, then `--hosts` workers side by side, it prints: images/s
(the images over the span from the first claim to the last outcome, from the database), wall seconds from
the starts to the last exit, file reads per image (claims: each claim reads its file once), database
transactions per image (pg_stat_database's commits and rollbacks of the run's database), the most
connections any one worker held and all of them together (pg_stat_activity, sampled every 20 ms), and
the lost races retried (deadlocks, serialization failures: counted in the workers' logs). `--model`:
the stand-in (GlobalAveragePool + MatMul: the pipeline's own cost) or a bundled card.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: its tests/support helpers

from tests.support.fleet import ADMIN, fresh_database, rows, start_host, write_config
from tests.support.stand_in import stand_in
from worker.config import default_cache_dir, shipped
from worker.measure.bench.corpus import make_corpus
from worker.measure.samples import fetch_samples
from worker.store.db import open_db


def round_of(root: Path, hosts: int, model: str, models: Path, n: int) -> dict[str, float]:
    with fresh_database() as url:
        open_db(url).dispose()
        name = url.rsplit("/", 1)[1]
        tmp = Path(tempfile.mkdtemp(dir=root))
        (tmp / "in").symlink_to(root / "in")
        conf = write_config(tmp, url, models, lease_s=60.0)
        conf.write_text(conf.read_text().replace("model: stand-in", f"model: {model}"))
        xacts = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s"
        before = rows(ADMIN, xacts, name)[0][0]
        t0 = time.monotonic()
        started = [start_host(conf, f"host{i}", "run", "in/") for i in range(hosts)]
        most: dict[str, int] = {}
        total = 0
        while any(h.proc.poll() is None for h in started):
            now = rows(ADMIN, "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = %s "
                              "AND application_name LIKE 'worker@%%' GROUP BY 1", name)
            for app, k in now:
                most[app] = max(most.get(app, 0), k)
            total = max(total, sum(k for _, k in now))
            time.sleep(0.02)
        wall = time.monotonic() - t0
        codes = [h.proc.returncode for h in started]
        time.sleep(0.6)  # pg_stat_database is updated at most every 500 ms
        after = rows(ADMIN, xacts, name)[0][0]
        (first, last), = rows(url, "SELECT min(created_at), max(updated_at) FROM images")
        reads, done = rows(url, "SELECT sum(attempts), count(*) FILTER (WHERE state = 'done') FROM queue")[0]
        logs = "".join(h.said() for h in started)
        return {"hosts": hosts, "exit_codes_ok": all(c == 0 for c in codes), "done": done,
                "images_per_s": round(n / (last - first).total_seconds(), 1), "wall_s": round(wall, 1),
                "reads_per_image": round(reads / n, 3), "transactions_per_image": round((after - before) / n, 2),
                "max_connections_per_worker": max(most.values(), default=0), "max_connections": total,
                "lost_races_retried": logs.count("writing the batch again") + logs.count("lost a race"),
                "errors": logs.count(" ERROR ")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--model", default="stand-in")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="worker-fleet-"))
    models = root / "models"
    if args.model == "stand-in":
        stand_in(models)
    else:
        models = shipped("models")
    make_corpus(fetch_samples(default_cache_dir()), args.width, args.images, root / "in")
    out = []
    for _ in range(args.repeat):
        for hosts in (1, args.hosts):
            row = round_of(root, hosts, args.model, models, args.images)
            out.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"outputs under {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
