"""Opening a database: migrations both ways (and one failing half-way), the migration lock, a newer
worker's schema, folders that cannot be written, URLs that are not databases."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect, text

from tests.conftest import read_only_view
from tests.support.userns import own_user_namespace
from worker.errors import StoreError
from worker.service import run_folder
from worker.store.db import database, downgrade, make_engine, open_db, upgrade
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


HALF_DONE = """revision = '0007'
down_revision = '0006'
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
    (scripts / "versions" / "0007_half_done.py").write_text(HALF_DONE)
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


def test_a_missing_folder_for_the_database_is_made_one_deep_and_never_at_the_root(tmp_path: Path, caplog) -> None:
    """var/ of var/worker.db is made (and said); a path of missing folders, or one at the filesystem's root (a
    share not mounted there), is refused naming it: before, both were made silently."""
    import logging
    import uuid

    caplog.set_level(logging.INFO, logger="worker.store.db")
    with database(f"sqlite:///{tmp_path / 'var' / 'worker.db'}"):
        pass
    assert (tmp_path / "var" / "worker.db").is_file() and f"made the folder {tmp_path / 'var'}" in caplog.text
    with pytest.raises(StoreError, match=f"its folder {tmp_path / 'a' / 'b'} does not exist \\(nor does {tmp_path / 'a'}\\)"):
        open_db(f"sqlite:///{tmp_path / 'a' / 'b' / 'w.db'}")
    top = Path("/") / f"worker-test-{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreError, match="worker makes no folder at the filesystem's root"):
        open_db(f"sqlite:///{top / 'w.db'}")
    assert not top.exists() and not (tmp_path / "a").exists()
