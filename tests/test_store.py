"""Database: migrations both ways, WAL, queries with filters, statistics."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import func, inspect, select, text

from tests.conftest import image_rows, read_only_view, wait_for
from tests.support.userns import own_user_namespace
from worker.errors import StoreError
from worker.measure.metrics import percentiles, slope_per_hour, slope_se_per_hour
from worker.service import run_folder, watch
from worker.store.db import downgrade, make_engine, open_db, upgrade
from worker.store.queries import Filters, glob_to_like, query_images, run_stats
from worker.store.schema import ImageRow, Run

TABLES = {"runs", "images", "results", "labels", "timings", "memory_samples"}


def test_migrations_upgrade_and_downgrade(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    upgrade(engine)
    assert TABLES <= set(inspect(engine).get_table_names())
    with engine.connect() as c:
        assert c.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert c.execute(text("PRAGMA busy_timeout")).scalar() >= 1000
    with pytest.raises(StoreError, match="migration down to nosuch failed: Can't locate revision"):
        downgrade(engine, "nosuch")  # said in a line, as an upgrade's failure is, not a traceback
    downgrade(engine, "base")
    assert not TABLES & set(inspect(engine).get_table_names())
    upgrade(engine)
    assert TABLES <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_migrations_both_ways_keep_the_records_of_a_database_in_use(cfg, tmp_path: Path, samples: Path) -> None:
    """A downgrade (back to an older worker) and the upgrade after it, on a database with runs, images,
    results, labels, timings and memory samples: the rebuilt tables keep every row (SQLite drops a
    table that other rows refer to only with foreign keys off: the downgrade failed, FOREIGN KEY
    constraint failed), then `base` empties it."""
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("page.png", "text.png"):
        shutil.copy(samples / name, folder / name)
    assert run_folder(cfg, folder).figures["done"] == 2
    engine = make_engine(cfg.db)

    def counts() -> dict[str, int]:
        with engine.connect() as c:
            return {t: c.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in sorted(TABLES)}

    before = counts()
    assert before["images"] == 2 and before["timings"] == 2 and before["memory_samples"] >= 1
    downgrade(engine, "0002")
    assert counts() == before
    assert not [t for t in inspect(engine).get_table_names() if t.startswith("_alembic_tmp")]
    upgrade(engine)
    assert counts() == before
    with engine.connect() as c:
        assert c.execute(text("PRAGMA foreign_keys")).scalar() == 1  # on again for what follows
        assert c.execute(text("PRAGMA foreign_key_check")).all() == []
    downgrade(engine, "base")
    assert not TABLES & set(inspect(engine).get_table_names())
    engine.dispose()
    assert run_folder(cfg, folder).figures["done"] == 2  # a start migrates the emptied file again


HALF_DONE = """revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

from alembic import op
import sqlalchemy as sa


def upgrade() -> None:
    op.create_table('half_done', sa.Column('id', sa.Integer, primary_key=True))
    with op.batch_alter_table('runs') as batch_op:  # the table rebuilt: copied, dropped, renamed
        batch_op.add_column(sa.Column('extra', sa.Integer, nullable=True))
    op.execute("DELETE FROM timings")
    raise RuntimeError('the disk filled up half-way')


def downgrade() -> None:
    pass
"""


def test_a_migration_that_fails_half_way_leaves_the_database_as_it_was(cfg, tmp_path: Path, samples: Path,
                                                                       monkeypatch) -> None:
    """SQLite ran a migration's DDL outside any transaction (pysqlite begins one only before INSERT,
    UPDATE or DELETE): one that failed half-way left its new table, its rebuilt table and its deleted
    rows behind, at the old revision, and the next start failed on the table already there."""
    import worker.store.db as db

    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(samples / "page.png", folder / "page.png")
    assert run_folder(cfg, folder).figures["done"] == 1
    scripts = tmp_path / "migrations"
    shutil.copytree(db.migrations_dir(), scripts, ignore=shutil.ignore_patterns("__pycache__"))
    (scripts / "versions" / "0004_half_done.py").write_text(HALF_DONE)
    monkeypatch.setattr(db, "migrations_dir", lambda: scripts)
    engine = make_engine(cfg.db)

    def state() -> tuple:
        with engine.connect() as c:
            return (sorted(inspect(c).get_table_names()), [col["name"] for col in inspect(c).get_columns("runs")],
                    {t: c.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in sorted(TABLES)},
                    c.execute(text("SELECT version_num FROM alembic_version")).scalar_one())

    before = state()
    for _ in range(2):  # the same failure again: nothing was left behind by the first
        with pytest.raises(StoreError, match="migration to head failed: the disk filled up half-way"):
            upgrade(engine)
        assert state() == before
    with engine.connect() as c:
        assert c.execute(text("PRAGMA foreign_keys")).scalar() == 1
    engine.dispose()


def test_a_database_at_the_newest_revision_is_opened_without_the_write_lock(tmp_path: Path) -> None:
    """Every command opens its database through the migrations; at the newest revision it only reads,
    so a health check or a query does not wait for (or hold up) a watcher's writes. A migration's
    transaction takes the write lock: this one would wait the busy timeout and fail."""
    import sqlite3

    path = tmp_path / "m.db"
    engine = make_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")  # a recorder's transaction, held
        engine = make_engine(f"sqlite:///{path}")
        upgrade(engine)
        with engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM runs")).scalar_one() == 0
        engine.dispose()
    finally:
        writer.execute("ROLLBACK")
        writer.close()


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads Linux's /proc/locks")
def test_nothing_opens_a_new_database_before_it_holds_the_migration_lock(tmp_path: Path) -> None:
    """Workers, queries and health checks started together on a file that does not exist yet: its first
    connection switches it to WAL, which two processes doing at once can fail with `database is locked`
    (the busy timeout does not cover it). Once the check for the newest revision came before the
    migration lock, that raced: 5 of 40 pairs of processes failed, and so did this file's
    two-runs test at times. Here the lock is held, and a start must wait for it before the file exists."""
    import subprocess
    import sys

    from tests.conftest import wait_for
    from worker.host.locks import flocked

    db = tmp_path / "new.db"
    code = "import sys; from worker.store.db import open_db; open_db(sys.argv[1]).dispose()"
    with flocked(tmp_path / "new.db-migrate.lock", wait=True, create=True):
        proc = subprocess.Popen([sys.executable, "-c", code, f"sqlite:///{db}"], stderr=subprocess.PIPE, text=True)
        # the kernel lists a process blocked on a flock with "->" (see proc(5), /proc/locks)
        assert wait_for(lambda: any("->" in line and " FLOCK " in line and f" {proc.pid} " in line
                                    for line in Path("/proc/locks").read_text().splitlines()), timeout=60)
        assert not db.exists()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert db.exists()


def test_a_database_a_newer_worker_migrated_is_refused_saying_so(tmp_path: Path) -> None:
    """Going back to an older worker (a wheel reinstalled) on a database a newer one migrated: before,
    Alembic's `Can't locate revision identified by '0099'`, from every command."""
    path = tmp_path / "m.db"
    engine = make_engine(f"sqlite:///{path}")
    upgrade(engine)
    with engine.begin() as c:
        c.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    for attempt in (lambda: upgrade(engine), lambda: downgrade(engine, "0002")):
        with pytest.raises(StoreError, match="its schema is at revision 0099, which worker .* does not know "
                                             r"\(its newest is (\d{4})\): a newer worker migrated it. Run that "
                                             r"worker, or with it `worker db downgrade \1` first"):
            attempt()
    with engine.connect() as c:  # left as it was
        assert c.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == "0099"
    engine.dispose()


def test_a_database_in_a_folder_it_cannot_write_is_read_with_or_without_a_worker(tmp_path: Path, request) -> None:
    """A database on a read-only mount (or in another account's folder): SQLite said only `unable to
    open database file` (or `attempt to write a readonly database`), from `worker query` too, and no
    reader could read it. Now the reading commands open it read-only: through its -wal and -shm files
    while a worker has it open, and as it is (immutable) when none has (SQLite cannot create the -shm
    file there)."""
    if not own_user_namespace(request, mounts=True):
        return  # it ran, and passed, with mounts of its own
    import subprocess
    import sys

    def run_row(model: str) -> dict[str, Any]:
        return dict(mode="run", host="h", pid=1, root="/in", model=model, model_sha256="0" * 64, providers="CPU",
                    config={}, version="0")

    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    engine = make_engine(f"sqlite:///{src / 'w.db'}")
    upgrade(engine)
    with engine.begin() as c:
        c.execute(Run.__table__.insert().values(**run_row("m")))
        c.execute(ImageRow.__table__.insert().values(run_id=1, rel_path="bad.png", sha256="0" * 64, model="m",
                                                     size=5, status="failed", attempts=3, error="not an image"))
    engine.dispose()
    assert not (src / "w.db-wal").exists()  # closed: the log folded in and deleted
    with read_only_view(src, ro):
        with pytest.raises(StoreError, match=f"{ro} is not writable here: SQLite in WAL mode needs the database's "
                                             "folder writable to write to it"):
            open_db(f"sqlite:///{ro / 'w.db'}", create=False)
        # a command that only reads (query, stats, health, export) opens it read-only, no worker running
        reader = open_db(f"sqlite:///{ro / 'w.db'}", create=False, read_only=True)
        with reader.connect() as c:
            assert c.execute(text("SELECT model FROM runs")).scalars().all() == ["m"]
        reader.dispose()
        writer = make_engine(f"sqlite:///{src / 'w.db'}")
        with writer.begin() as c:  # a worker, open on the database: its -wal and -shm files exist meanwhile
            c.execute(Run.__table__.insert().values(**run_row("m2")))
        held = writer.connect()
        try:
            reader = open_db(f"sqlite:///{ro / 'w.db'}", create=False, read_only=True)
            with reader.connect() as c:  # the row still in the log is read too
                assert c.execute(text("SELECT model FROM runs ORDER BY id")).scalars().all() == ["m", "m2"]
            reader.dispose()
            from click.testing import CliRunner

            from worker.cli import cli
            out = CliRunner().invoke(cli, ["stats", "--db", f"sqlite:///{ro / 'w.db'}"])
            assert out.exit_code == 0 and "run 1 run model=m" in out.output, out.output + str(out.exception)
            # a command that writes: SQLite refuses its statement, said in a line (before: a traceback)
            retry = subprocess.run([sys.executable, "-m", "worker", "retry", "--db", f"sqlite:///{ro / 'w.db'}"],
                                   capture_output=True, text=True, timeout=120)
            assert retry.returncode == 1 and "Traceback" not in retry.stderr, retry.stderr
            assert retry.stderr.endswith("error: database: attempt to write a readonly database (this account may "
                                         "read the database but not write it: SQLite writes need the database, its "
                                         "-wal and -shm files and their folder writable; run as the account that "
                                         "writes it)\n"), retry.stderr
        finally:
            held.close()
            writer.dispose()
        # a -wal file without its -shm (what no clean stop leaves): SQLite cannot read it from here, said why
        (src / "w.db-wal").touch()
        with pytest.raises(StoreError, match=f"cannot open it read-only: unable to open database file \\({ro} is "
                                             "not writable here, and SQLite reads a database with a -wal file beside "
                                             "it through its -shm file, which it cannot create there"):
            open_db(f"sqlite:///{ro / 'w.db'}", create=False, read_only=True)


def test_a_database_url_naming_a_folder_is_refused_as_such(tmp_path: Path) -> None:
    """`--db sqlite:////srv/scans` (the folder, not a file in it) said only `migration to head failed:
    unable to open database file`, with SQLAlchemy's link, from every command."""
    from click.testing import CliRunner

    from worker.cli import cli

    for create, read_only in ((True, False), (False, False), (False, True)):
        with pytest.raises(StoreError, match=f"^{tmp_path} is a folder: --db \\(or the config's db\\) names the "
                                             f"database file, e.g. sqlite:///{tmp_path}/worker.db$"):
            open_db(f"sqlite:///{tmp_path}", create=create, read_only=read_only)
    out = CliRunner().invoke(cli, ["query", "--db", f"sqlite:///{tmp_path}"])
    assert out.exit_code != 0 and f"{tmp_path} is a folder" in out.output + out.stderr + str(out.exception), out.output


def test_a_file_that_is_not_a_database_is_said_in_the_drivers_words(tmp_path: Path) -> None:
    """Any database that cannot be opened (not a database, a server down) said `migration to head
    failed: (sqlite3.DatabaseError) ...` with SQLAlchemy's statement and link to its error page."""
    photo = tmp_path / "a.jpg"
    photo.write_bytes(b"\xff\xd8" + b"x" * 4096)
    with pytest.raises(StoreError) as caught:
        open_db(f"sqlite:///{photo}", create=False)
    assert str(caught.value) == f"database sqlite:///{photo}: cannot open it: file is not a database"


def test_the_migrations_build_the_schema_the_models_describe(tmp_path: Path) -> None:
    """Alembic's own comparison: a model changed without a migration (or the reverse) fails here."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from worker.store.schema import Base

    engine = make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    upgrade(engine)
    with engine.connect() as c:
        diff = compare_metadata(MigrationContext.configure(c), Base.metadata)
    engine.dispose()
    assert diff == []


def test_glob_to_like() -> None:
    assert glob_to_like("line3/*.png") == "line3/%.png"
    assert glob_to_like("a_b%?") == "a\\_b\\%_"


def test_query_filters_and_stats(cfg, tmp_path: Path, samples: Path) -> None:
    folder = tmp_path / "in"
    (folder / "line3").mkdir(parents=True)
    shutil.copy(samples / "page.png", folder / "line3" / "page.png")
    shutil.copy(samples / "astronaut.png", folder / "astronaut.png")
    (folder / "line3" / "bad.png").write_bytes(b"nope")
    for name in ("bad2.jpg", "bad3.jpg", "bad4.jpg"):  # more failures than successes: they must not skew timings
        (folder / "line3" / name).write_bytes(b"")
    summary = run_folder(cfg, folder)
    db = open_db(cfg.db)

    def rels(**kw) -> list[str]:
        return sorted(r["rel_path"] for r in query_images(db, Filters(**kw)))

    bad = ["line3/bad.png", "line3/bad2.jpg", "line3/bad3.jpg", "line3/bad4.jpg"]
    assert rels() == ["astronaut.png", *bad, "line3/page.png"]
    assert rels(status="failed") == bad
    assert rels(path="line3/*") == [*bad, "line3/page.png"]
    # a file as the user sees it (the folder run joined to the relative path), or a glob on that
    assert rels(path=str(folder / "line3" / "page.png")) == ["line3/page.png"]
    assert rels(path=f"{folder}/line3/../astronaut.png") == ["astronaut.png"]
    assert rels(path=f"{folder}/*/bad?.jpg") == bad[1:] and rels(path="/elsewhere/line3/page.png") == []
    assert rels(label="text", min_score=0.5) == ["line3/page.png"]
    assert rels(min_score=0.99999) == []
    assert rels(run_id=summary.run_id) == rels()
    with pytest.raises(StoreError, match=f"no run {summary.run_id + 1} on record"):  # a typo, not "nothing"
        rels(run_id=summary.run_id + 1)
    now = datetime.now(timezone.utc)
    assert rels(since=now - timedelta(hours=1)) == rels() and rels(since=now + timedelta(hours=1)) == []
    assert rels(until=now - timedelta(hours=1)) == []

    (stats,) = run_stats(db, run_id=summary.run_id, warmup_s=0)
    assert stats["counts"] == {"done": 2, "failed": 4}
    assert stats["images_per_s"] > 0 and stats["batch_size_mean"] == 1.0
    assert all(stats["latency_ms"][s]["p50"] > 0 for s in ("decode_ms", "preprocess_ms", "infer_ms", "write_ms"))
    assert stats["memory"]["samples"] >= 2 and stats["memory"]["rss_peak_mb"] > 50
    res = stats["results"]  # what the two done images held: PP-OCR's text, where it found some
    with_text = rels(label="text", status="done")
    assert res["task"] == "segment" and res["images"] == 2 and "line3/page.png" in with_text
    assert res["labels"] == [{"name": "text", "images": len(with_text)}] and res["none"] == 2 - len(with_text)
    assert 0.5 < res["score"]["p50"] <= 1.0  # the mean probability over the text's pixels
    db.dispose()


def test_percentiles_and_slope() -> None:
    assert percentiles([1, 2, 3, 4, 100])["p50"] == 3
    t = [0, 600, 1200, 1800, 3600]
    assert abs(slope_per_hour(t, [100 + 2 * x / 3600 for x in t]) - 2.0) < 1e-9
    assert slope_per_hour([0, 1], [1, 2]) != slope_per_hour([0, 1], [1, 2])  # nan with too few points


def test_a_slopes_standard_error_counts_how_rss_wanders_not_only_its_scatter() -> None:
    """A 100-minute soak: RSS wandered by +-4 MB over minutes, and a second half with no leak
    in it fitted 3.8 MB/h, which the samples' own scatter (each taken as independent) called
    significant. The error read from block means is what a verdict can trust."""
    t = np.arange(0, 3000, 5.0)  # 50 minutes sampled every 5 s
    noise = np.random.default_rng(1).normal(0, 0.7, t.size)
    wander = 180 + 3 * np.sin(2 * np.pi * t / 1100)  # no trend: a slow swing of 3 MB
    slope, se = slope_per_hour(t, wander + noise), slope_se_per_hour(t, wander + noise)
    h = t / 3600
    residuals = wander + noise - np.polyval(np.polyfit(h, wander + noise, 1), h)
    naive = np.sqrt((residuals ** 2).sum() / (t.size - 2) / ((h - h.mean()) ** 2).sum())
    assert abs(slope) > 2 * naive  # "a trend", to the sample-by-sample error
    assert abs(slope) < 2 * se and se > 3 * naive  # within the noise, to the block means' error
    leak = 180 + 10 * h + noise  # a steady leak of 10 MB/h: its slope stands clear of its error
    assert abs(slope_per_hour(t, leak) - 10) < 1 and slope_se_per_hour(t, leak) < 1
    assert np.isnan(slope_se_per_hour(t[:15], leak[:15]))  # too few samples for 8 blocks of 2


def test_memory_trend_judges_the_second_half_after_warm_up(tmp_path: Path) -> None:
    """Settling steps early in a run move the whole-window slope, not the second half's; a leak moves both."""
    from sqlalchemy.orm import Session

    from worker.store.schema import MemorySample, Run

    db = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    t0 = datetime(2026, 11, 30, tzinfo=timezone.utc)
    # 15 minutes sampled every 5 s, as a soak here measured it: settling = 200 MB, +1.2 MB at 4 min,
    # +0.8 MB at 5 min, then flat; leak = 200 MB growing 10 MB/h throughout
    shapes = {"settling": lambda s: 200 + 1.2 * (s >= 240) + 0.8 * (s >= 300), "leak": lambda s: 200 + 10 * s / 3600}
    with Session(db) as session:
        for name, rss_mb in shapes.items():
            run = Run(mode="soak", host="h", pid=1, root="/", model=name, model_sha256="", providers="cpu",
                      config={}, version="0", started_at=t0, finished_at=t0 + timedelta(minutes=15))
            session.add(run)
            session.flush()
            session.add_all(MemorySample(run_id=run.id, at=t0 + timedelta(seconds=s), rss_bytes=int(rss_mb(s) * 2**20),
                                         fds=10, threads=10, queue_depth=0, images_done=s) for s in range(0, 900, 5))
        session.commit()
    trend = {r["model"]: r["memory"] for r in run_stats(db, last=2, warmup_s=180)}
    db.dispose()
    assert trend["settling"]["slope_mb_per_h"] > 2 and trend["settling"]["late_slope_mb_per_h"] == 0
    assert abs(trend["leak"]["slope_mb_per_h"] - 10) < 0.01 and abs(trend["leak"]["late_slope_mb_per_h"] - 10) < 0.01
    assert trend["leak"]["late_samples"] == trend["leak"]["steady_samples"] // 2


def test_stats_of_a_months_long_run_reads_every_kth_row(tmp_path: Path, monkeypatch) -> None:
    """Beyond SAMPLE_CAP samples (TIMING_CAP timings) `stats` reads every k-th, and says so; the peak,
    the first and last sample, the mean batch and the processed count stay exact (before: every row
    read, 12 s and 800 MB of RSS for 58 days of samples)."""
    from sqlalchemy.orm import Session

    import worker.store.queries as queries
    from worker.store.schema import MemorySample, Run, TimingRow

    monkeypatch.setattr(queries, "SAMPLE_CAP", 100)
    monkeypatch.setattr(queries, "TIMING_CAP", 100)
    db = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    t0 = datetime(2026, 9, 1, tzinfo=timezone.utc)
    with Session(db) as session:
        run = Run(mode="watch", host="h", pid=1, root="/", model="m", model_sha256="", providers="cpu",
                  config={}, version="0", started_at=t0, finished_at=t0 + timedelta(hours=10))
        session.add(run)
        session.flush()
        # 1,000 samples over 10 h growing 1 MB/h, and one spike of 500 MB that the stride skips
        session.add_all(MemorySample(id=i, run_id=run.id, at=t0 + timedelta(seconds=36 * (i - 1)),
                                     rss_bytes=int((500 if i == 503 else 100 + (i - 1) * 36 / 3600) * 2**20),
                                     fds=10, threads=10, queue_depth=0, images_done=i) for i in range(1, 1001))
        for i in range(1, 1001):
            session.add(ImageRow(id=i, run_id=run.id, rel_path=f"{i}.png", sha256=f"{i:064d}", model="m", size=1,
                                 status="done", attempts=1, created_at=t0, updated_at=t0))
        session.flush()
        session.add_all(TimingRow(image_id=i, run_id=run.id, queue_wait_ms=0, decode_ms=0, preprocess_ms=0,
                                  infer_ms=0, postprocess_ms=0, write_ms=0, total_ms=float(i), batch_size=1 + (i == 7))
                        for i in range(1, 1001))
        session.commit()
    (st,) = run_stats(db, run_id=1, warmup_s=0)
    db.dispose()
    m = st["memory"]
    assert (m["samples"], m["sample_stride"], m["steady_samples"]) == (1000, 10, 101)  # every 10th, and the first
    assert m["rss_peak_mb"] == 500.0 and m["rss_start_mb"] == 100.0 and m["rss_end_mb"] == 110.0
    assert abs(m["slope_mb_per_h"] - 1.0) < 0.01
    assert st["latency_images"] == {"read": 100, "of": 1000, "stride": 10}
    assert abs(st["latency_ms"]["total_ms"]["p50"] - 500) < 10 and st["batch_size_mean"] == 1.0  # 1.001, rounded
    assert st["images_per_s"] == round(1000 / 36000, 2)


def test_latency_window_is_bounded_and_ordered() -> None:
    from worker.measure.metrics import LatencyWindow

    w = LatencyWindow(head=3, tail=4)
    for v in range(10):
        w.add(float(v))
    assert w.first().tolist() == [0, 1, 2] and w.last().tolist() == [6, 7, 8, 9] and w.count == 10
    small = LatencyWindow(head=3, tail=4)
    small.add(5.0)
    assert small.last().tolist() == [5.0]


def test_readers_never_see_database_locked_while_the_worker_writes(cfg, tmp_path: Path, samples: Path) -> None:
    import threading

    from worker.store.queries import Filters, query_images, run_stats

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


def test_a_ledger_connects_ahead_and_its_checks_use_that_connection(tmp_path: Path) -> None:
    """A decode thread opens its connection as it starts (Pipeline._warm_up_prepare), so its first image
    does not pay for it; the checks after use that one, and close() gives it back. A database that
    cannot be reached at that moment costs the thread nothing: the check says it cannot tell."""
    from worker.store.ledger import Ledger

    db = open_db(f"sqlite:///{tmp_path / 'l.db'}")
    ledger = Ledger(db, "m")
    try:
        assert db.pool.checkedout() == 0
        ledger.connect()
        assert db.pool.checkedout() == 1
        assert ledger.check("a.png", "s" * 64) is None
        ledger.connect()  # again: still the one connection
        assert db.pool.checkedout() == 1
    finally:
        ledger.close()
    assert db.pool.checkedout() == 0
    db.dispose()

    from sqlalchemy import create_engine

    gone = create_engine(f"sqlite:///{tmp_path / 'no-such-folder' / 'l.db'}")  # a folder nobody made
    unreachable = Ledger(gone, "m")
    unreachable.connect()  # does not raise
    assert gone.pool.checkedout() == 0
    assert unreachable.check("a.png", "s" * 64) is None
    unreachable.close()
    gone.dispose()


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


def test_in_flight_are_the_images_of_workers_that_are_gone(tmp_path: Path) -> None:
    """Recovery takes over the images a dead worker left `processing`, never a live worker's: a second
    worker on the same database (another inbox, a `run` beside a `watch`) leaves them to their owner."""
    import subprocess
    import sys

    from worker.store.ledger import Ledger
    from worker.store.recorder import Claimed, Commit, Recorder, RunInfo
    from worker.store.schema import Run

    db = open_db(f"sqlite:///{tmp_path / 'f.db'}")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    runs: dict[str, Recorder] = {}
    try:
        # "restarted" keeps this process's pid: a container's worker restarts under the same pid
        for name in ("live", "killed", "finished", "elsewhere", "restarted"):
            rec = Recorder(db, RunInfo("watch", "/in", "m", "", "cpu", {}))
            committed = Commit()
            rec.put(Claimed(f"{name}.png", "s" * 64, 10, committed))
            assert committed.wait(10)
            runs[name] = rec  # open: its run is not finished
        # the runs as other processes would have left them: one alive, one killed, one on another host
        with db.begin() as c:
            c.execute(Run.__table__.update().where(Run.id == runs["live"].run_id).values(pid=other.pid))
            c.execute(Run.__table__.update().where(Run.id == runs["elsewhere"].run_id).values(host="another-host"))
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        with db.begin() as c:
            c.execute(Run.__table__.update().where(Run.id == runs["killed"].run_id).values(pid=dead.pid))
        runs["finished"].close()
        ledger = Ledger(db, "m")
        assert ledger.in_flight() == ["finished.png", "killed.png", "restarted.png"]
        other.kill()
        other.wait()
        assert ledger.in_flight() == ["finished.png", "killed.png", "live.png", "restarted.png"]
        ledger.close()
    finally:
        other.kill()
        other.wait()
        for name in ("live", "killed", "elsewhere", "restarted"):
            if name in runs:
                runs[name].close()
    db.dispose()


def test_workers_starting_at_once_on_a_new_database_migrate_it_once(tmp_path: Path) -> None:
    """Two watchers sharing a new database, started together (or a query beside a starting worker):
    the second must not fail creating tables the first just created."""
    import threading

    for attempt in range(5):
        url = f"sqlite:///{tmp_path / f'new{attempt}.db'}"
        errors: list[BaseException] = []

        def start() -> None:
            try:
                open_db(url).dispose()
            except BaseException as e:  # noqa: BLE001 (collected, asserted below)
                errors.append(e)

        threads = [threading.Thread(target=start) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_a_claim_yields_to_another_live_workers_unless_stale_or_a_recovery(tmp_path: Path) -> None:
    """Two workers on one database (two `run`s of one folder): the second claim of an image that the
    first holds is not taken; a claim left for longer than STALE_CLAIM_S (a worker on another host that
    died) is, and so is a recovery's."""
    from worker.intake.jobs import JobStatus
    from worker.store.recorder import Claimed, Commit, Finished, RunInfo, Recorder
    from worker.store.writes import STALE_CLAIM_S

    db = open_db(f"sqlite:///{tmp_path / 'c.db'}")
    first, second = (Recorder(db, RunInfo("run", "/in", "m", "", "cpu", {})) for _ in range(2))
    try:
        def claim(rec: Recorder, rel: str, take_over: bool = False) -> Commit:
            committed = Commit()
            rec.put(Claimed(rel, "s" * 64, 10, committed, take_over=take_over))
            assert committed.wait(10)
            return committed

        for rel in ("held.png", "stale.png", "recovered.png"):
            assert claim(first, rel).taken_by is None
        with db.begin() as c:
            c.execute(ImageRow.__table__.update().where(ImageRow.rel_path == "stale.png")
                      .values(updated_at=datetime.now(timezone.utc) - timedelta(seconds=STALE_CLAIM_S + 60)))
        assert claim(second, "held.png").taken_by == first.run_id
        assert claim(second, "stale.png").taken_by is None
        assert claim(second, "recovered.png", take_over=True).taken_by is None
        assert claim(second, "new.png").taken_by is None
        with db.connect() as c:
            rows = {r.rel_path: (r.run_id, r.attempts) for r in c.execute(select(ImageRow))}
        assert rows == {"held.png": (first.run_id, 1), "stale.png": (second.run_id, 2),
                        "recovered.png": (second.run_id, 2), "new.png": (second.run_id, 1)}

        # done by the first between the second's ledger check and its claim: left done, and to the first
        # (before: taken over and processed again); a redo (a replay, a retrained model) takes it over
        def finish(rec: Recorder, rel: str) -> None:
            committed = Commit()
            rec.put(Finished(rel, "s" * 64, 10, JobStatus.DONE, committed=committed))
            assert committed.wait(10)

        for rel in ("done.png", "redone.png"):
            assert claim(first, rel).taken_by is None
            finish(first, rel)
        assert claim(second, "done.png").taken_by == first.run_id
        committed = Commit()
        second.put(Claimed("redone.png", "s" * 64, 10, committed, redo=True))
        assert committed.wait(10) and committed.taken_by is None
        with db.connect() as c:
            rows = {r.rel_path: (r.run_id, r.status) for r in c.execute(select(ImageRow))}
        assert rows["done.png"] == (first.run_id, "done") and rows["redone.png"] == (second.run_id, "processing")
    finally:
        first.close()
        second.close()
    db.dispose()


def test_two_runs_of_one_folder_share_the_work(effnet_onnx: Path, tmp_path: Path, samples: Path) -> None:
    """Two `worker run` processes over one folder and database: each image is processed by one of
    them, once (an image finished in the window between the other's ledger check and its claim is
    left done), with no database error (before: both processed nearly every image, and their result
    rows collided, failing the tracebacks check and the count of `done` below)."""
    import subprocess
    import sys

    from tests.conftest import CACHE, ROOT

    folder = tmp_path / "shared"
    folder.mkdir()
    data = (samples / "coffee.png").read_bytes()
    for i in range(300):  # distinct content
        (folder / f"img{i:03d}.png").write_bytes(data + i.to_bytes(2, "big"))
    conf = tmp_path / "c.yaml"
    conf.write_text(f"outbox: out\ndb: sqlite:///w.db\nmodel: efficientnet-lite0\nmodels_dir: {ROOT / 'models'}\n"
                    f"cache_dir: {CACHE}\n")
    cmd = [sys.executable, "-m", "worker", "--config", str(conf), "run", str(folder), "--no-progress"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert not any("Traceback" in err or "failed, retrying" in err for _, err in outs), outs
    with open_db(f"sqlite:///{tmp_path / 'w.db'}").connect() as c:
        rows = c.execute(select(ImageRow.rel_path, ImageRow.run_id, ImageRow.status, ImageRow.attempts,
                                ImageRow.error)).all()
        results = c.execute(text("SELECT count(*) FROM results")).scalar()
    # before a worker's start left the other's temporary files alone (it deleted them in flight): one CI
    # run failed img000.png ("cannot write its outputs ...: No such file or directory"), another left an
    # image at attempts 2 (failed by one worker, then claimed again by the other)
    odd = [r for r in rows if r.status != "done" or r.attempts != 1]
    assert len(rows) == 300 and not odd and results == 300, (odd, [err for _, err in outs])
    done = [int(re.search(r"done (\d+),", out)[1]) for out, _ in outs]
    assert sum(done) == 300, (done, outs)  # before the claim yielded to a row done meanwhile: up to 302 here


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


def test_stats_in_a_window_cover_only_what_happened_in_it(tmp_path: Path) -> None:
    """`stats --since/--until`: a watcher of ten days asked about its last day gets that day's counts,
    rate, latency and memory (the warm-up still counted from the run's start), and only runs active then."""
    from sqlalchemy.orm import Session

    from worker.store.schema import MemorySample, Run, TimingRow

    db = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    t0 = datetime(2026, 9, 1, tzinfo=timezone.utc)
    day = timedelta(days=1)
    with Session(db) as session:
        old = Run(mode="run", host="h", pid=1, root="/old", model="m", model_sha256="", providers="cpu", config={},
                  version="0", started_at=t0 - 2 * day, finished_at=t0 - day)
        watcher = Run(mode="watch", host="h", pid=2, root="/in", model="m", model_sha256="", providers="cpu",
                      config={}, version="0", started_at=t0)  # still running
        session.add_all([old, watcher])
        session.flush()
        old_id, watcher_id = old.id, watcher.id
        # a row an hour for ten days (the pipeline did 1 image/s, 2 on the last day, as a soak replaying
        # its images counts them); the last day's took twice as long, and RSS grew 1 MB an hour then
        for i in range(240):
            at = t0 + timedelta(hours=i, minutes=30)
            session.add(ImageRow(id=i + 1, run_id=watcher.id, rel_path=f"{i}.png", sha256=f"{i:064d}", model="m",
                                 size=1, status="failed" if i % 48 == 47 else "done", attempts=1, created_at=at,
                                 updated_at=at))
            session.flush()
            session.add(TimingRow(image_id=i + 1, run_id=watcher.id, queue_wait_ms=1, decode_ms=1, preprocess_ms=1,
                                  infer_ms=1, postprocess_ms=1, write_ms=1, total_ms=20.0 if i >= 216 else 10.0,
                                  batch_size=1))
        session.add_all(MemorySample(run_id=watcher.id, at=t0 + timedelta(hours=h), fds=10, threads=10, queue_depth=0,
                                     images_done=3600 * h + 3600 * max(0, h - 216),
                                     rss_bytes=int((100 + max(0, h - 216)) * 2**20))
                        for h in range(241))
        session.commit()
    last_day = t0 + 9 * day
    (st,) = run_stats(db, since=last_day, warmup_s=3600)
    assert st["run"] == watcher_id and st["window"] == {"since": last_day.isoformat(), "until": None}
    assert st["counts"] == {"done": 23, "failed": 1}  # hours 216-239; 239 failed
    assert st["latency_ms"]["total_ms"]["p50"] == 20.0 and st["latency_images"]["of"] == 23
    assert st["images_per_s"] == 2.0
    m = st["memory"]
    assert (m["rss_start_mb"], m["rss_end_mb"], m["samples"]) == (100.0, 124.0, 25)
    assert m["steady_samples"] == 25 and abs(m["slope_mb_per_h"] - 1.0) < 0.01  # its start is long past the warm-up
    # the whole run, for comparison: ten days, mostly flat and fast
    (whole,) = run_stats(db, run_id=watcher_id, warmup_s=3600)
    assert whole["counts"] == {"done": 235, "failed": 5} and whole["latency_ms"]["total_ms"]["p50"] == 10.0
    assert whole["memory"]["samples"] == 241 and whole["window"] == {"since": None, "until": None}
    # a window in the old run's time: only it; one before every run: none
    (st,) = run_stats(db, since=t0 - 1.5 * day, until=t0 - 1.2 * day)
    assert st["run"] == old_id and st["counts"] == {} and st["images_per_s"] == 0.0
    assert run_stats(db, since=t0 - 5 * day, until=t0 - 4 * day) == []
    (st,) = run_stats(db, since=t0 + 2 * day, until=t0 + 3 * day)  # a day in the middle of the watch
    assert st["counts"] == {"done": 24} and st["memory"]["rss_end_mb"] == 100.0
    assert 0.95 <= st["images_per_s"] <= 1.0  # its samples reach the window's last hour, not its end
    db.dispose()


def test_stats_say_what_the_images_held(tmp_path: Path) -> None:
    """Per run, what its done images held: a classifier's top labels (the best of each image's top-k,
    whatever order its rows came in), a detector's boxes by class with the images holding them and the
    images with none, and the score's percentiles (a detector's over the images with boxes); in a window,
    only the images last updated in it. `worker stats` prints it as one line."""
    from click.testing import CliRunner
    from sqlalchemy.orm import Session

    from worker.cli import cli
    from worker.store.schema import LabelRow, ResultRow, Run

    db = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    t0 = datetime(2026, 9, 1, tzinfo=timezone.utc)
    found = {  # run -> (image, task, score, [(label, score)], status): label rows in the order written
        "classify": [("a", 0.9, [("b", 0.05), ("a", 0.9)]), ("a", 0.8, [("a", 0.8), ("c", 0.1)]),
                     ("b", 0.7, [("b", 0.7), ("a", 0.2)]), ("c", 0.6, [("c", 0.6)]), ("x", 0.0, None)],
        "detect": [("1", 0.9, [("person", 0.9), ("car", 0.7), ("person", 0.5)]), ("2", 0.0, []),
                   ("3", 0.4, [("car", 0.4)])],
    }
    ids = {}
    with Session(db) as session:
        n = 0
        for task, images in found.items():
            run = Run(mode="run", host="h", pid=1, root=f"/{task}", model=task, model_sha256="", providers="cpu",
                      config={}, version="0", started_at=t0, finished_at=t0 + timedelta(hours=3))
            session.add(run)
            session.flush()
            ids[task] = run.id
            for i, (name, score, labels) in enumerate(images):
                n += 1
                at = t0 + timedelta(hours=i)
                session.add(ImageRow(id=n, run_id=run.id, rel_path=f"{name}.png", sha256=f"{n:064d}", model=task,
                                     size=1, status="failed" if labels is None else "done", attempts=1,
                                     created_at=at, updated_at=at))
                session.flush()
                if labels is not None:
                    session.add(ResultRow(image_id=n, task=task, score=score, payload={}))
                    session.add_all(LabelRow(image_id=n, class_id=0, name=label, score=s) for label, s in labels)
        session.commit()

    (classify,) = run_stats(db, run_id=ids["classify"])
    res = classify["results"]
    assert (res["task"], res["images"], res["none"]) == ("classify", 4, 0)
    assert res["labels"] == [{"name": "a", "images": 2}, {"name": "b", "images": 1}, {"name": "c", "images": 1}]
    assert res["score"]["p50"] == pytest.approx(0.75)
    (detect,) = run_stats(db, run_id=ids["detect"])
    res = detect["results"]
    assert (res["task"], res["images"], res["none"]) == ("detect", 3, 1)
    assert res["labels"] == [{"name": "car", "images": 2, "boxes": 2}, {"name": "person", "images": 1, "boxes": 2}]
    assert res["score"]["p50"] == pytest.approx(0.65)  # of the two images with boxes: 0.9 and 0.4
    (late,) = run_stats(db, run_id=ids["detect"], since=t0 + timedelta(hours=1.5))
    assert late["results"]["labels"] == [{"name": "car", "images": 1, "boxes": 1}] and late["results"]["none"] == 0
    assert run_stats(db, run_id=ids["detect"], since=t0 + timedelta(hours=2.5))[0]["results"] == {}
    db.dispose()

    text = CliRunner().invoke(cli, ["stats", "--db", f"sqlite:///{tmp_path / 'w.db'}"]).output
    assert "  results: 4 images done; top label a 2 (50.0%), b 1 (25.0%), c 1 (25.0%); top-1 probability p5 " in text
    assert ("  results: 3 images done; boxes of car 2 in 2 (66.7%), person 2 in 1 (33.3%); nothing in 1 (33.3%); "
            "best box's score p5 0.425, p50 0.65, p95 0.875") in text, text
