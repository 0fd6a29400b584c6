"""The one writer: batches and their commits, grouping and hurrying, the WAL kept short beside it, readers
never blocked, refused events, and a full database disk that pauses the worker."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from tests.conftest import image_rows, wait_for
from tests.support.userns import own_user_namespace
from worker.service import run_folder, watch
from worker.store.db import make_engine, open_db
from worker.store.schema import ImageRow


def test_readers_never_see_database_locked_while_the_worker_writes(cfg, tmp_path: Path, samples: Path) -> None:
    import threading

    from worker.store.queries import Filters, query_images
    from worker.store.stats import run_stats

    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(30):
        shutil.copy(samples / "coffee.png", folder / f"c{i}.png")
        (folder / f"c{i}.png").write_bytes((folder / f"c{i}.png").read_bytes() + bytes([i]))  # distinct content
    open_db(cfg.db).dispose()
    errors: list[BaseException] = []
    reads = [0]
    stop = threading.Event()

    def reader() -> None:
        db = make_engine(cfg.db)
        while not stop.is_set():
            try:
                query_images(db, Filters(limit=50))
                run_stats(db, last=2)
                reads[0] += 1
            except BaseException as e:  # "database is locked" would land here
                errors.append(e)
                return
        db.dispose()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        summary = run_folder(cfg, folder)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert summary.figures["done"] == 30 and reads[0] > 10


def test_recorder_same_image_twice_in_one_batch(tmp_path: Path) -> None:
    """A replayed image (soak) or a file dropped again can finish twice before one commit."""
    from sqlalchemy import func, select

    from worker.intake.jobs import JobStatus
    from worker.store.recorder import Claimed, Finished, Recorder, RunInfo
    from worker.store.schema import ImageRow, LabelRow, ResultRow, TimingRow

    db = open_db(f"sqlite:///{tmp_path / 'r.db'}")
    rec = Recorder(db, RunInfo("soak", "/x", "m", "", "cpu", {}))
    timings = dict(queue_wait_ms=1, decode_ms=1, preprocess_ms=1, infer_ms=1, postprocess_ms=1, write_ms=1,
                   total_ms=1, batch_size=1)

    def done(score: float) -> Finished:
        return Finished("a.png", "s" * 64, 10, JobStatus.DONE, task="classify", score=score, payload={},
                        labels=((1, "cat", score),), timings=timings)

    rec._write([Claimed("a.png", "s" * 64, 10), done(0.1), Claimed("a.png", "s" * 64, 10), done(0.2)])
    with db.connect() as c:
        assert c.scalar(select(ImageRow.attempts)) == 2
    rec._write([Claimed("a.png", "s" * 64, 10), done(0.3)])
    rec.close()
    with db.connect() as c:
        # two claims before the first commit count 2; a done image claimed again starts a fresh count
        assert c.scalar(select(ImageRow.attempts)) == 1
        assert [r.score for r in c.execute(select(ResultRow.score))] == [0.3]
        assert c.scalar(select(func.count()).select_from(LabelRow)) == 1
        assert c.scalar(select(func.count()).select_from(TimingRow)) == 1
    db.dispose()


def test_recorder_claims_are_committed_before_the_caller_goes_on(tmp_path: Path) -> None:
    """The decode stage waits for a claim's commit, so an image that kills the worker while it is
    decoded has its attempt on record. Claims are committed when someone hurries the recorder and,
    grouped, when nobody does."""
    from sqlalchemy import select

    from worker.store.ledger import Ledger
    from worker.store.recorder import Claimed, Commit, Recorder, RunInfo
    from worker.store.schema import ImageRow

    db = open_db(f"sqlite:///{tmp_path / 'c.db'}")
    rec = Recorder(db, RunInfo("run", "/x", "m", "", "cpu", {}))
    ledger = Ledger(db, "m")
    try:
        for i, hurry in enumerate((True, False, True)):
            committed = Commit()
            rec.put(Claimed(f"{i}.png", "s" * 64, 10, committed))
            if hurry:
                rec.hurry()
            assert committed.wait(10)
            known = ledger.check(f"{i}.png", "s" * 64)  # another connection sees it: it is committed
            assert known is not None and (known.status, known.attempts) == ("processing", 1)
        assert ledger.check("0.png", "t" * 64) is None and Ledger(db, "other").check("0.png", "s" * 64) is None
    finally:
        ledger.close()
        rec.close()
    with db.connect() as c:
        assert sorted(c.scalars(select(ImageRow.rel_path))) == ["0.png", "1.png", "2.png"]
    db.dispose()


def test_the_recorder_compiles_the_claims_id_query_before_the_first_claim(tmp_path: Path) -> None:
    """SQLAlchemy compiles a statement at its first execution (about 1 ms): the recorder does that as
    it starts, so the first image's claim, which its decode thread waits for, finds it compiled."""
    from sqlalchemy.engine.default import CACHE_HIT

    from worker.store.recorder import Recorder, RunInfo

    db = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    rec = Recorder(db, RunInfo("run", "/x", "m", "", "cpu", {}))
    try:
        with db.connect() as c:
            assert c.execute(rec._ids, {"model": "m", "rels": ["a.png"]}).context.cache_hit == CACHE_HIT
    finally:
        rec.close()
        db.dispose()


def test_recorder_hurry_writes_at_once_whatever_the_grouping(tmp_path: Path, monkeypatch) -> None:
    """A thread about to wait for a commit hurries the recorder: with grouping set to an hour, the
    claim is still committed (and the events queued before it with it)."""
    from worker.store import recorder as recorder_mod
    from worker.store.recorder import Claimed, Commit, Recorder, RunInfo

    monkeypatch.setattr(recorder_mod, "GROUP_S", 3600.0)
    db = open_db(f"sqlite:///{tmp_path / 'h.db'}")
    rec = Recorder(db, RunInfo("run", "/x", "m", "", "cpu", {}))
    try:
        events = [Commit() for _ in range(3)]
        for i, committed in enumerate(events):
            rec.put(Claimed(f"{i}.png", "s" * 64, 10, committed))
        rec.hurry()
        assert all(e.wait(10) for e in events)
    finally:
        rec.close()
    db.dispose()


def test_recorder_writes_a_full_transaction_without_waiting_out_the_grouping(tmp_path: Path, monkeypatch) -> None:
    """The recorder gathers without being woken by each event (a wake-up per event cost more than the
    gathering saved); once a transaction's worth of events waits, it writes them without being hurried."""
    from worker.store import recorder as recorder_mod
    from worker.store.recorder import MAX_BATCH, Claimed, Commit, Recorder, RunInfo

    monkeypatch.setattr(recorder_mod, "GROUP_S", 3600.0)
    db = open_db(f"sqlite:///{tmp_path / 'b.db'}")
    rec = Recorder(db, RunInfo("run", "/x", "m", "", "cpu", {}))
    events = [Commit() for _ in range(MAX_BATCH + 10)]
    try:
        for i, committed in enumerate(events):
            rec.put(Claimed(f"{i}.png", "s" * 64, 10, committed))
        assert all(e.wait(10) for e in events[:MAX_BATCH])
    finally:
        rec.close()  # writes the rest at once
    assert all(e.wait(0) for e in events)
    db.dispose()


def test_recorder_commits_never_checkpoint_the_wal_its_own_thread_does(tmp_path: Path, monkeypatch) -> None:
    """SQLite checkpoints inside the commit that crosses 1000 WAL pages (fsync included: a 15 ms stall of
    the writer, and of any claim waiting on it); the recorder's connection leaves that to `checkpoint`."""
    from worker.intake.jobs import JobStatus
    from worker.store import recorder as R, wal

    monkeypatch.setattr(wal, "CHECKPOINT_S", 3600.0)  # the periodic thread stays idle in this test
    path = tmp_path / "w.db"
    db = open_db(f"sqlite:///{path}")
    rec = R.Recorder(db, R.RunInfo("run", "/x", "m", "", "cpu", {}))
    timings = dict(queue_wait_ms=1, decode_ms=1, preprocess_ms=1, infer_ms=1, postprocess_ms=1, write_ms=1,
                   total_ms=1, batch_size=1)
    payload = {"labels": ["x" * 100] * 20}  # about 2 KB per result row
    for k in range(60):  # one transaction per 50 images, as under load
        batch: list = []
        for i in range(50 * k, 50 * (k + 1)):
            batch += [R.Claimed(f"{i}.png", "s" * 64, 10),
                      R.Finished(f"{i}.png", "s" * 64, 10, JobStatus.DONE, task="classify", score=0.5,
                                 payload=payload, labels=((1, "cat", 0.5),) * 5, timings=timings)]
        rec._write(batch)
    page = 4096
    assert path.with_name("w.db-wal").stat().st_size > 1500 * page  # no commit checkpointed (or it would restart)
    raw = db.raw_connection()
    try:
        busy, frames, copied = wal.checkpoint(raw)
    finally:
        raw.close()
    assert busy == 0 and frames == copied > 1500
    rec.close()
    db.dispose()


def test_checkpoint_thread_empties_a_wal_that_outgrew_its_bound(tmp_path: Path, monkeypatch) -> None:
    """Under steady writes the log rarely starts over by itself (docs/database.md): past WAL_RESET_BYTES
    the checkpoint thread truncates it. Without that, the log stays at its size after the writes."""
    from worker.intake.jobs import JobStatus
    from worker.store import recorder as R, wal

    monkeypatch.setattr(wal, "CHECKPOINT_S", 0.05)
    bound = 64 * 4096
    monkeypatch.setattr(wal, "WAL_RESET_BYTES", bound)
    path = tmp_path / "w.db"
    db = open_db(f"sqlite:///{path}")
    rec = R.Recorder(db, R.RunInfo("run", "/x", "m", "", "cpu", {}))
    wal = path.with_name("w.db-wal")
    try:
        payload = {"labels": ["x" * 100] * 20}
        for k in range(20):
            rec._write([R.Finished(f"{i}.png", "s" * 64, 10, JobStatus.DONE, task="classify", score=0.5,
                                   payload=payload) for i in range(50 * k, 50 * (k + 1))])
        # a TRUNCATE empties the file; SQLite's own restarts reuse it at its largest size
        assert wait_for(lambda: wal.stat().st_size <= bound + 4096 + 32, timeout=10), wal.stat().st_size
        with db.connect() as c:  # nothing lost on the way
            assert c.scalar(select(func.count()).select_from(ImageRow)) == 1000
    finally:
        rec.close()
    db.dispose()


def test_a_reader_holding_its_snapshot_does_not_stall_the_writer_every_second(tmp_path: Path, monkeypatch) -> None:
    """A TRUNCATE that a reader makes give up is not retried until WAL_RESET_BACKOFF_S has passed."""
    import sqlite3
    import time

    from worker.intake.jobs import JobStatus
    from worker.store import recorder as R, wal

    attempts: list[str] = []
    real = wal.checkpoint

    def counted(conn, mode="PASSIVE", wait_ms=None):  # type: ignore[no-untyped-def]
        attempts.append(mode)
        return real(conn, mode, wait_ms)

    monkeypatch.setattr(wal, "checkpoint", counted)
    monkeypatch.setattr(wal, "CHECKPOINT_S", 0.02)
    monkeypatch.setattr(wal, "WAL_RESET_BYTES", 16 * 4096)
    monkeypatch.setattr(wal, "WAL_RESET_WAIT_MS", 20)
    path = tmp_path / "w.db"
    db = open_db(f"sqlite:///{path}")
    rec = R.Recorder(db, R.RunInfo("run", "/x", "m", "", "cpu", {}))
    reader = sqlite3.connect(path)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM images").fetchone()  # holds its snapshot until rollback
        payload = {"labels": ["x" * 100] * 20}
        for k in range(10):
            rec._write([R.Finished(f"{i}.png", "s" * 64, 10, JobStatus.DONE, task="classify", score=0.5,
                                   payload=payload) for i in range(50 * k, 50 * (k + 1))])
        time.sleep(0.5)  # about 25 checkpoint ticks with the log over its bound and the reader in place
        assert attempts.count("TRUNCATE") == 1, attempts.count("TRUNCATE")
    finally:
        reader.rollback()
        reader.close()
        rec.close()
    db.dispose()


@pytest.mark.parametrize("table", ["results", "images"])
def test_an_outcome_the_database_refuses_leaves_its_input_in_the_inbox(cfg, samples: Path, table: str, caplog) -> None:
    """A database that refuses writes (disk full, server down; here a trigger that aborts every insert
    into one table) must not stop the worker, and an input whose outcome is not on record must not be
    archived as if it were: it stays in the inbox and is processed once the database takes writes again."""
    import threading

    from worker.service import watch

    cfg.inbox.mkdir(parents=True)
    for name in ("page.png", "text.png"):
        shutil.copy(samples / name, cfg.inbox / name)
    db = open_db(cfg.db)
    with db.begin() as c:  # `images` refuses claims and outcomes alike; `results` only done outcomes
        c.execute(text(f"CREATE TRIGGER refuse BEFORE INSERT ON {table} BEGIN SELECT RAISE(ABORT, 'refused'); END"))
    summary = watch(cfg, threading.Event(), burst=True)
    assert summary.figures["images"] == 2
    assert sorted(p.name for p in cfg.inbox.iterdir()) == ["page.png", "text.png"]
    assert not (cfg.archive / "done").exists() or not list((cfg.archive / "done").iterdir())
    with db.connect() as c:
        assert c.execute(select(func.count()).where(ImageRow.status == "done")).scalar() == 0
    assert "could not be recorded" in caplog.text and "left in the inbox" in caplog.text

    with db.begin() as c:
        c.execute(text("DROP TRIGGER refuse"))
    watch(cfg, threading.Event(), burst=True)
    assert not list(cfg.inbox.iterdir())
    assert sorted(p.name for p in (cfg.archive / "done").iterdir()) == ["page.png", "text.png"]
    with db.connect() as c:
        assert c.execute(select(ImageRow.rel_path, ImageRow.status).order_by(ImageRow.rel_path)).all() == [
            ("page.png", "done"), ("text.png", "done")]
    db.dispose()


@pytest.mark.timeout(300)
def test_a_full_database_disk_pauses_the_worker_and_loses_nothing(cfg, tmp_path: Path, samples: Path,
                                                                  monkeypatch, caplog, request) -> None:
    """A real full filesystem (a small tmpfs) under the database: the recorder holds what it cannot
    write and the pipeline waits, saying so once (before: every batch failed, was retried one by one
    and refused, every rescan processed the unrecorded inputs again: about 21,500 log lines in 25 s);
    once there is room every image is done, once. Stopped while the database is still full, the
    watcher exits at once and leaves what it could not record in the inbox."""
    if not own_user_namespace(request, mounts=True):
        return  # it ran, and passed, with mounts of its own
    import subprocess
    import threading

    import worker.store.recorder as recorder_mod
    from tests.support.disks import fill
    from tests.support.watching import Watching

    monkeypatch.setattr(recorder_mod, "DB_RETRY_S", 0.1)
    caplog.set_level(logging.INFO)
    disk = tmp_path / "dbdisk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        cfg = dataclasses.replace(cfg, model="efficientnet-lite0", db=f"sqlite:///{disk / 'w.db'}",
                                  watch=dataclasses.replace(cfg.watch, status_log_s=0.3),
                                  pipeline=dataclasses.replace(cfg.pipeline, queue_size=2))  # intake waits
        cfg.inbox.mkdir(parents=True)
        data = (samples / "coffee.png").read_bytes()

        def drop(prefix: str, n: int) -> None:
            for i in range(n):  # distinct content
                (cfg.inbox / f"{prefix}{i:02d}.png").write_bytes(data + prefix.encode() + bytes([i]))

        with Watching(cfg) as w:
            assert w.ready.wait(120)
            ballast = fill(disk, 0)
            drop("a", 20)
            assert wait_for(lambda: "the database refuses writes (database or disk is full)" in caplog.text, 60)
            # the status line goes on meanwhile (intake waits for room, and looks up while it waits)
            assert wait_for(lambda: "status: nothing finished in the last" in caplog.text, 30)
            ballast.unlink()
            assert wait_for(lambda: len(list((cfg.archive / "done").glob("a*.png"))) == 20, 120)
        assert "takes writes again after" in caplog.text
        assert caplog.text.count("the database refuses writes") == 1
        assert "could not record" not in caplog.text and "left in the inbox" not in caplog.text
        rows = image_rows(cfg)
        assert len(rows) == 20 and {(r.status, r.attempts) for r in rows.values()} == {("done", 1)}

        # stopped (the first Ctrl-C) while the database is full: it does not wait for room
        with Watching(cfg) as w:
            assert w.ready.wait(120)
            ballast = fill(disk, 0)
            drop("b", 10)
            assert wait_for(lambda: caplog.text.count("the database refuses writes") == 2, 60)
            w.stop.set()
            w.thread.join(30)
            assert not w.thread.is_alive()
        ballast.unlink()
        left = sorted(p.name for p in cfg.inbox.iterdir())
        assert left and set(left) <= {f"b{i:02d}.png" for i in range(10)}  # not archived: not on record
        done = watch(cfg, threading.Event(), burst=True)  # the next start does them
        assert done.figures["failed"] == 0 and not list(cfg.inbox.iterdir())
        assert {r.status for r in image_rows(cfg).values()} == {"done"} and len(image_rows(cfg)) == 30
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
