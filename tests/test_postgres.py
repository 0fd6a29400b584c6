"""The database layer on a real PostgreSQL server: migrations, the recorder's compiled statements (named
parameters there, positional on SQLite), the ledger's skip check and the queries.

A throwaway server is started in a temporary folder (Unix socket only) when PostgreSQL's binaries and
psycopg are on the machine; otherwise the tests are skipped, saying why.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from tests.conftest import wait_for
from worker.service import run_folder
from worker.store.db import open_db
from worker.store.health import RunState
from worker.report.make import write_report
from worker.store import tallies
from worker.store.queries import Filters, other_roots, query_images
from worker.store.stats import run_health, run_stats
from worker.store.schema import ImageRow, LabelRow, ResultRow, TimingRow, utcnow


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


@dataclasses.dataclass(frozen=True)
class Server:
    """A throwaway PostgreSQL server: its URL, and stop/start for the tests of a server going away."""
    url: str
    ctl: list[str]  # pg_ctl -D DATA, as the server's user
    log: Path
    options: str

    def stop(self) -> None:
        subprocess.run([*self.ctl, "-m", "immediate", "stop"], check=True, capture_output=True)

    def start(self) -> None:
        subprocess.run([*self.ctl, "-l", str(self.log), "-w", "start", "-o", self.options], check=True,
                       capture_output=True)


@pytest.fixture(scope="module")
def pg_server() -> Iterator[Server]:
    pytest.importorskip("psycopg", reason="psycopg not installed (pip install -e '.[postgres]')")
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL's initdb/pg_ctl not found")
    # directly under /tmp: the server's user must be able to reach it (pytest's own folders are 0700)
    base = Path(tempfile.mkdtemp(prefix="worker-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # the server refuses to run as root: run it as the postgres user
        import pwd

        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(base)
            pytest.skip("running as root and there is no postgres user to run the server")
        os.chown(base, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = base / "data", 54000 + os.getpid() % 1000
    server = Server(f"postgresql+psycopg://worker@/postgres?host={base}&port={port}",
                    [*as_user, pg_ctl, "-D", str(data)], base / "log", f"-k {base} -p {port} -c listen_addresses=''")
    try:
        subprocess.run([*as_user, initdb, "-D", str(data), "-A", "trust", "-U", "worker"], check=True,
                       capture_output=True)
        server.start()
        yield server
    finally:
        subprocess.run([*server.ctl, "-m", "immediate", "stop"], capture_output=True, check=False)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_url(pg_server: Server) -> str:
    return pg_server.url


def test_run_records_and_resumes_on_postgresql(cfg, tmp_path: Path, samples: Path, pg_url: str,
                                                monkeypatch) -> None:
    from worker.store import ledger

    monkeypatch.setattr(ledger, "SETTLED_S", 0.0)  # the files copied in count as settled: stamped when read
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("rocket.jpg", "coffee.png", "chelsea.png"):
        shutil.copy(samples / name, folder / name)
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    # one host's behaviour on PostgreSQL (the fleet's claim queue: tests/test_fleet.py)
    c = dataclasses.replace(cfg, model="efficientnet-lite0", db=pg_url, fleet=dataclasses.replace(cfg.fleet, mode="local"))

    first = run_folder(c, folder)
    assert (first.figures["done"], first.figures["failed"]) == (3, 1)
    second = run_folder(c, folder)  # the ledger's check on PostgreSQL: done images skipped, the failed one retried
    assert (second.figures["done"], second.figures["failed"], second.figures["skipped"]) == (0, 1, 3)
    assert second.figures["skipped_unread"] == 3  # known by their file stamps (that statement ran here too)

    db = open_db(pg_url)
    try:
        with db.connect() as conn:
            rows = {r.rel_path: r for r in conn.execute(select(ImageRow))}
            assert rows["broken.jpg"].status == "failed" and rows["broken.jpg"].attempts == 2
            assert rows["rocket.jpg"].status == "done" and rows["rocket.jpg"].attempts == 1
            assert conn.scalar(select(func.count()).select_from(ResultRow)) == 3
            assert conn.scalar(select(func.count()).select_from(LabelRow)) == 3 * 5  # top-5 per image
            # a retried image's rows replace its earlier ones (the statements that delete them ran here too)
            assert conn.scalar(select(func.count()).select_from(TimingRow)) == 4
            # the payload is JSONB: PostgreSQL can reach into it
            tasks = conn.scalars(text("SELECT DISTINCT payload->>'task' FROM results")).all()
            assert tasks == ["classify"]
            top = conn.scalar(select(LabelRow.name).join(ImageRow, ImageRow.id == LabelRow.image_id)
                              .where(ImageRow.rel_path == "chelsea.png").order_by(LabelRow.score.desc()).limit(1))
            outbox_top = json.loads((c.outbox / "chelsea.png.json").read_text())["labels"][0]["name"]
            assert top == outbox_top
        (stats,) = run_stats(db, run_id=first.run_id, warmup_s=0)  # an image counts in the run that last had it
        assert stats["counts"] == {"done": 3} and stats["latency_ms"]["total_ms"]["p50"] > 0
        # what the images held: each one's top label, counted (that grouping ran here too)
        res = stats["results"]
        assert (res["task"], res["images"], res["none"]) == ("classify", 3, 0)
        assert sum(lb["images"] for lb in res["labels"]) == 3 and outbox_top in [lb["name"] for lb in res["labels"]]
        # the same run read from its tallies (as a run of millions is): its outcomes, the failure that the
        # second run retried included; the upserts that add them up and the reads ran here too
        (tallied,) = run_stats(db, run_id=first.run_id, warmup_s=0, tallied_above=0)
        assert tallied["read_from"] == "tallies" and tallied["counts"] == {"done": 3, "failed": 1}
        assert tallied["results"]["labels"] == res["labels"] and tallied["batch_size_mean"] == stats["batch_size_mean"]
        with db.connect() as conn:
            per_minute, latency_bins = tallies.series(conn, [first.run_id], 60)
        assert sum(d for _, d, _ in per_minute) == 3 and sum(sum(b.values()) for b in latency_bins.values()) == 3
        (stats,) = run_stats(db, run_id=second.run_id, warmup_s=0)
        assert stats["counts"] == {"failed": 1} and stats["health"]["state"] == "finished"
        # `worker report`'s SQL (epoch buckets, the tallies, the gallery's slowest by run and total) there too
        written = write_report(pg_url, tmp_path / "report.html", c.outbox, last=2)
        page = (tmp_path / "report.html").read_text()
        assert written.runs == (first.run_id, second.run_id) and written.images == 4 and "chelsea.png" in page
        # a window (`stats --since`) and `query`'s rows, their documents from JSONB, there too
        assert [st["run"] for st in run_stats(db, since=utcnow() - timedelta(hours=1))] == [first.run_id,
                                                                                           second.run_id]
        assert run_stats(db, until=utcnow() - timedelta(hours=1)) == []
        found = {r["rel_path"]: r for r in query_images(db, Filters())}
        assert found["chelsea.png"]["result"]["labels"][0]["name"] == outbox_top
        assert found["chelsea.png"]["root"] == str(folder) and found["broken.jpg"]["result"] is None
        assert [r["rel_path"] for r in query_images(db, Filters(limit=1))] == [max(
            found.values(), key=lambda r: (r["updated_at"], r["id"]))["rel_path"]]
        # `worker health`'s reads: a run by id, and the latest watch run on an inbox (none here)
        assert run_health(db, run_id=first.run_id).state is RunState.FINISHED
        assert run_health(db, root=str(folder)) is None
        (folder / "coffee.png").touch()  # read again, known by its content, its new stamp recorded (and that one)
        assert [run_folder(c, folder).figures["skipped_unread"] for _ in range(2)] == [2, 3]
        # the folders that shared the outbox, found by reaching into the runs' JSONB configs (->>)
        outbox = str(c.outbox.absolute())
        assert other_roots(db, outbox, "/elsewhere") == [str(folder)] and other_roots(db, outbox, str(folder)) == []
        assert other_roots(db, outbox + "-not", "/elsewhere") == []

        # the conditional claim (ON CONFLICT ... DO UPDATE ... WHERE) on PostgreSQL: a live worker's image
        # is left to it, a recovery takes it over
        from worker.store.recorder import Claimed, Commit, Recorder, RunInfo

        first_rec, second_rec = (Recorder(db, RunInfo("run", "/in", "m", "", "cpu", {})) for _ in range(2))
        try:
            for rec, take_over, expected in ((first_rec, False, None), (second_rec, False, first_rec.run_id),
                                             (second_rec, True, None)):
                committed = Commit()
                rec.put(Claimed("held.png", "s" * 64, 10, committed, take_over=take_over))
                assert committed.wait(10) and committed.taken_by == expected
        finally:
            first_rec.close()
            second_rec.close()

        # `worker db prune` on PostgreSQL: everything ended goes; the image left processing, and its run, stay
        from datetime import datetime, timezone

        from worker.store.prune import prune, vacuum
        pruned = prune(db, datetime.now(timezone.utc) + timedelta(days=1))
        vacuum(db)
        with db.connect() as conn:
            assert pruned.images == 4 and conn.scalars(select(ImageRow.rel_path)).all() == ["held.png"]
            assert conn.scalar(select(func.count()).select_from(ResultRow)) == 0

        # migrations both ways on PostgreSQL, with rows in place (they keep them)
        from worker.store.db import downgrade, upgrade

        downgrade(db, "0002")
        upgrade(db)
        with db.connect() as conn:
            assert conn.scalars(select(ImageRow.rel_path)).all() == ["held.png"]
    finally:
        db.dispose()


def test_a_path_too_long_for_the_index_is_refused_alone(pg_url: str) -> None:
    """PostgreSQL refuses an index entry over about 2.7 kB with "program limit exceeded", an OperationalError
    like a server going away: that one image is refused and logged, and the recorder goes on with the
    others instead of holding every event as if the server were down (as it did)."""
    import secrets

    from worker.store.recorder import Claimed, Commit, Recorder, RunInfo

    db = open_db(pg_url)
    rec = Recorder(db, RunInfo("run", "/in", "m", "", "cpu", {}))
    try:
        too_long = "/".join(secrets.token_hex(100) for _ in range(15)) + "/x.png"  # 3,000 bytes, no compressing them
        refused, fine = Commit(), Commit()
        rec.put(Claimed(too_long, "a" * 64, 10, refused))
        rec.put(Claimed("fine.png", "b" * 64, 10, fine))
        assert fine.wait(30), "the next image is recorded"
        assert refused.is_set() and not refused.wait(0) and rec.refused == 1 and not rec.down
    finally:
        rec.abandon()  # had it held them (as it did), close would wait for the server for ever
        rec.close()
        db.dispose()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["local", "queue"])
def test_a_server_that_goes_away_pauses_the_run(cfg, tmp_path: Path, samples: Path, pg_server: Server,
                                                monkeypatch, caplog, mode: str) -> None:
    """The server stopped (immediately, as a crash would) in the middle of a run: the recorder holds
    what it cannot write, says so once, reconnects when the server is back, and the run ends with
    every image done once (before: its events refused one by one, the images left for a rerun)."""
    import logging
    import threading

    import worker.store.recorder as recorder_mod

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(recorder_mod, "DB_RETRY_S", 0.2)
    folder = tmp_path / "in"
    folder.mkdir()
    data = (samples / "coffee.png").read_bytes()
    for i in range(200):
        (folder / f"p{i:03d}.png").write_bytes(data + i.to_bytes(2, "big"))
    c = dataclasses.replace(cfg, model="efficientnet-lite0", db=pg_server.url,
                            fleet=dataclasses.replace(cfg.fleet, mode=mode, lease_s=5.0))
    db = open_db(pg_server.url)
    try:
        with db.begin() as conn:  # this module's earlier tests used the database: start from none
            conn.execute(text("TRUNCATE images, runs, queue, scanners CASCADE"))
        out: list = []
        t = threading.Thread(target=lambda: out.append(run_folder(c, folder)))
        t.start()

        def done() -> int:
            try:
                with db.connect() as conn:
                    return conn.scalar(select(func.count()).where(ImageRow.status == "done"))
            except Exception:
                return -1

        assert wait_for(lambda: done() >= 20, 120)
        db.dispose()
        pg_server.stop()
        try:
            assert wait_for(lambda: "the database refuses writes" in caplog.text, 60)
        finally:
            pg_server.start()
        t.join(200)
        assert not t.is_alive() and out[0].figures["done"] + out[0].figures["skipped"] == 200
        assert out[0].figures["failed"] == 0
        assert "takes writes again after" in caplog.text and "could not record" not in caplog.text
        with db.connect() as conn:
            rows = conn.execute(select(ImageRow.status, ImageRow.attempts)).all()
        assert len(rows) == 200 and {r.status for r in rows} == {"done"}
    finally:
        db.dispose()
