"""Engine factory: SQLite pragmas (WAL, busy timeout) and migrations on start."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import sqlite3
import urllib.parse
from pathlib import Path
from typing import Iterator

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.pool import NullPool

from worker.config import shipped
from worker.errors import StoreError
from worker.host.locks import flocked
from worker.host.mounts import network_filesystem

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 30_000
# PostgreSQL ends the session of a worker frozen within a transaction (SIGSTOP, a suspended VM) after this long:
# the rows it locked would otherwise hold up the worker that takes its claims over until it thaws
IDLE_IN_TRANSACTION_S = 10


def migrations_dir() -> Path:
    """The Alembic scripts: the checkout's `migrations/`, or a wheel's copy of it."""
    here = shipped("migrations")
    if (here / "env.py").exists():
        return here
    raise StoreError(f"migrations folder not found at {here}; reinstall worker (pip install -e . from its "
                     f"checkout, or a wheel built from it)")


def _parse(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError:
        raise StoreError(f"database URL {url!r} cannot be parsed (e.g. sqlite:///var/worker.db, "
                         f"postgresql+psycopg://USER@HOST/DBNAME)") from None


def _make_folder(folder: Path, database: str) -> None:
    """A SQLite file's folder, made when missing: one folder (var/ of var/worker.db), never a path of them nor
    one at the filesystem's root (a share not mounted there would put the history on the system disk)."""
    if folder.is_dir():
        return
    if not folder.parent.is_dir() or folder.parent == Path(folder.anchor):
        why = "worker makes no folder at the filesystem's root" if folder.parent.is_dir() else \
            f"nor does {folder.parent}"
        raise StoreError(f"database {database}: its folder {folder} does not exist ({why}): make it, or check the "
                         f"path (a share not mounted?)")
    try:
        folder.mkdir(exist_ok=True)
    except OSError as e:
        raise StoreError(f"database {database}: cannot create its folder: {e.strerror or e}") from None
    log.info("made the folder %s for the database", folder)


def make_engine(url: str) -> Engine:
    """A SQLAlchemy engine; for SQLite: WAL, busy timeout, foreign keys, parent folder created."""
    u = _parse(url)
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        raise StoreError(f"database URL {url!r}: SQLite and PostgreSQL are supported, not {u.get_backend_name()}")
    if u.get_backend_name() != "sqlite":
        try:
            # no pool: the connections a worker holds are its recorder's and (fleet mode) the one its claims and
            # skip checks share (worker.store.shared); others are brief and closed at once (docs/database.md#fleet)
            # named in pg_stat_activity by host and pid: which worker holds which connection
            return create_engine(url, poolclass=NullPool, connect_args={
                "application_name": session_name(),
                "options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_S * 1000}"})
        except (ImportError, NoSuchModuleError) as e:
            raise StoreError(f"database URL {url!r}: its driver is not installed ({e}); for PostgreSQL: "
                             f"pip install -e '.[postgres]' and postgresql+psycopg://USER@HOST/DBNAME") from None
    if u.database and u.database != ":memory:":
        _make_folder(Path(u.database).absolute().parent, u.database)
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; WAL keeps it consistent
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    return engine


_TOKEN = secrets.token_hex(4)


def session_name() -> str:
    """This process's PostgreSQL sessions' application_name: worker@HOST:PID:TOKEN (random: two containers'
    workers can share a hostname and a pid), recorded with its run (`runs.session`)."""
    return f"worker@{socket.gethostname()[:36]}:{os.getpid()}:{_TOKEN}"


def alembic_config(engine: Engine) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    cfg = alembic_config(engine)
    try:
        # inside the flock: a new file's first connection switches it to WAL, which two processes doing it at
        # once can fail with `database is locked` (the busy timeout does not cover it)
        with _one_migrator(engine):
            # every command opens its database through here (a health check every few seconds, a query):
            # one at the newest revision reads it and is done, without the write lock a migration takes
            try:
                current, script = _schema(engine, cfg)
            except Exception as e:  # not reached (a server down, a wrong password) or not a database: not migrating
                raise StoreError(f"database {engine.url}: cannot open it: {_driver_words(e)}"
                                 f"{_folder_hint(engine, e)}") from e
            if revision == "head" and current == set(script.get_heads()):
                return
            _refuse_newer(engine, current, script)
            with _migrating(engine) as conn:
                if engine.dialect.name == "postgresql":  # held to the end of the transaction
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
    except StoreError:
        raise
    except Exception as e:
        raise StoreError(f"database {engine.url}: migration to {revision} failed: {_driver_words(e)}"
                         f"{_folder_hint(engine, e)}") from e


def _driver_words(error: BaseException) -> BaseException:
    """What the database driver said, without SQLAlchemy's statement and link to its error page."""
    return getattr(error, "orig", None) or error


def _sqlite_says(error: BaseException, *codes: str) -> bool:
    """Whether SQLite's result code for the error is one of `codes` (SQLITE_READONLY: its extended codes,
    SQLITE_READONLY_DIRECTORY and the like, too)."""
    name = getattr(_driver_words(error), "sqlite_errorname", None) or ""
    return any(name == code or name.startswith(code + "_") for code in codes)


def _folder_hint(engine: Engine, error: Exception) -> str:
    """Why SQLite could not open a database whose folder this process cannot write (a read-only mount,
    another account's folder): its messages, `unable to open database file` (SQLITE_CANTOPEN) and
    `attempt to write a readonly database` (SQLITE_READONLY), do not say."""
    path = engine.url.database if engine.dialect.name == "sqlite" else None
    if not path or path == ":memory:" or not _sqlite_says(error, "SQLITE_CANTOPEN", "SQLITE_READONLY"):
        return ""
    folder = Path(path).absolute().parent
    if os.access(folder, os.W_OK):
        return ""
    return (f" ({folder} is not writable here: SQLite in WAL mode needs the database's folder writable to write "
            f"to it, for the -wal and -shm files beside it (query, stats, health and export only read it: they can); "
            f"{_WAYS_OUT})")


# what to do about a database folder this process cannot write, said by every error about one
_RUN_AS_WRITER = "run as the account that writes it"
_WAYS_OUT = f"{_RUN_AS_WRITER}, give this one write access to the folder, or use PostgreSQL"


def refused_write_hint(error: BaseException) -> str:
    """Why SQLite refused a statement that writes (`attempt to write a readonly database`) to an account
    that may only read: `worker retry` beside a running worker, from another account."""
    if not _sqlite_says(error, "SQLITE_READONLY"):
        return ""
    return (" (this account may read the database but not write it: SQLite writes need the database, its -wal and "
            f"-shm files and their folder writable; {_RUN_AS_WRITER})")


@contextlib.contextmanager
def _migrating(engine: Engine) -> Iterator[Connection]:
    """A connection in a transaction for Alembic. On SQLite, with foreign keys off until it ends: batch
    mode rebuilds a table (copy, drop, rename), and SQLite drops a table that other rows refer to only
    with them off (its advice for schema changes, "ALTER TABLE": a downgrade of a database in use failed
    with `FOREIGN KEY constraint failed`). After a migration that ran, the rows are checked before the
    transaction commits.

    pysqlite begins a transaction only before INSERT, UPDATE or DELETE, so a migration's CREATE, DROP
    and ALTER ran outside one: a migration failing half-way left its new tables and rebuilt ones
    behind. The transaction is begun here explicitly (IMMEDIATE: the write lock from the start, no
    other writer between the revision read and the DDL), and SQLite rolls DDL back like any change."""
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as conn:
        if sqlite:  # outside any transaction, or SQLite ignores it
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()
        try:
            with conn.begin():
                if sqlite:  # pysqlite then sees a transaction open and commits or rolls it back at the end
                    conn.exec_driver_sql("BEGIN IMMEDIATE")
                was = _heads(conn) if sqlite else None
                yield conn
                # only after a migration that ran: the check reads every row, and most starts migrate nothing
                if sqlite and _heads(conn) != was and \
                        (broken := conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()):
                    raise StoreError(f"the migration leaves {len(broken)} rows referring to rows that are not "
                                     f"there (table, row, parent, key: {tuple(broken[0])}, ...)")
        finally:
            if sqlite:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()


def _schema(engine: Engine, cfg: AlembicConfig) -> tuple[set[str], ScriptDirectory]:
    """The database's current revisions (none: no schema yet) and this worker's migration scripts."""
    with engine.connect() as conn:
        current = _heads(conn)
    return current, ScriptDirectory.from_config(cfg)


def _refuse_newer(engine: Engine, current: set[str], script: ScriptDirectory) -> None:
    """A database migrated by a newer worker (its revision not among these scripts): Alembic said only
    `Can't locate revision identified by '0004'`. Say what happened and the two ways out."""
    known = {s.revision for s in script.walk_revisions()}
    if unknown := sorted(current - known):
        from worker import __version__

        newest = ", ".join(script.get_heads())
        raise StoreError(f"database {engine.url}: its schema is at revision {', '.join(unknown)}, which worker "
                         f"{__version__} does not know (its newest is {newest}): a newer worker migrated it. Run "
                         f"that worker, or with it `worker db downgrade {newest}` first")


def revision_of(engine: Engine) -> str:
    """The schema's revision as `db upgrade` and `db downgrade` say it: `0003 (the newest)`, `base (empty)`."""
    current, script = _schema(engine, alembic_config(engine))
    if not current:
        return "base (no schema)"
    newest = " (the newest)" if current == set(script.get_heads()) else ""
    return ", ".join(sorted(current)) + newest


def _heads(conn: Connection) -> set[str]:
    """The schema's Alembic revisions (none: no schema yet)."""
    return set(MigrationContext.configure(conn).get_current_heads())


MIGRATION_LOCK_KEY = 0x776F726B  # "work": PostgreSQL advisory lock taken while migrating


@contextlib.contextmanager
def _one_migrator(engine: Engine) -> Iterator[None]:
    """Two processes starting on a new SQLite file at once (two watchers sharing a database, a query
    beside a starting worker) would both create the tables, and the second would fail. The migration
    holds an exclusive flock on `<database>-migrate.lock` beside it: its transaction's write lock alone
    would make the second wait no longer than the busy timeout, where rebuilding a large table may take
    minutes. Not on the database file: closing any descriptor of that file drops every POSIX lock
    SQLite holds on it in this process. Not on its folder: that may be a watched inbox, whose lock
    `worker watch` holds for as long as it runs."""
    path = engine.url.database if engine.dialect.name == "sqlite" else None
    if not path or path == ":memory:":
        yield
        return
    db = Path(path).absolute()
    # where the lock cannot be taken (a read-only folder), no migration can create tables there either
    with flocked(db.with_name(db.name + "-migrate.lock"), wait=True, create=True):
        yield


def downgrade(engine: Engine, revision: str) -> None:
    cfg = alembic_config(engine)
    try:
        with _one_migrator(engine):
            _refuse_newer(engine, *_schema(engine, cfg))
            with _migrating(engine) as conn:
                cfg.attributes["connection"] = conn
                command.downgrade(cfg, revision)
    except StoreError:
        raise
    except Exception as e:
        raise StoreError(f"database {engine.url}: migration down to {revision} failed: {_driver_words(e)}") from e


def backend_of(url: str) -> str:
    """sqlite or postgresql (or what else the URL names, refused when opened)."""
    return _parse(url).get_backend_name()


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite URL (None for another database, or SQLite in memory)."""
    u = _parse(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:":
        return None
    return Path(u.database)


def open_db(url: str, create: bool = True, read_only: bool = False) -> Engine:
    """Engine with the schema migrated to the latest revision. `create=False` (the commands that only
    read, and those that change existing rows) refuses a SQLite file that does not exist, instead of
    making an empty one at a mistyped path. `read_only` (query, stats, health, export): a SQLite file in
    a folder this process cannot write is opened read-only, unmigrated (see `_reader`)."""
    if (file := sqlite_file(url)) is not None:
        path = file.absolute()
        if path.is_dir():  # SQLite would say `unable to open database file`
            raise StoreError(f"{path} is a folder: --db (or the config's db) names the database file, "
                             f"e.g. sqlite:///{path / 'worker.db'}")
        if not create and not path.exists():
            raise StoreError(f"no database at {path} (`worker run` or `worker watch` makes it; "
                             f"--db or the config's db names another)")
        if read_only and not os.access(path.parent, os.W_OK):
            return _reader(url, path)
        if create and (share := network_filesystem(path.parent)):
            log.warning("database %s is on a network share (%s): SQLite's WAL mode needs a local disk (a share's "
                        "locks are not to be trusted, and no other machine can use the file meanwhile): put it on a "
                        "local disk, or use PostgreSQL", path, share)
    engine = make_engine(url)
    if read_only:
        _require_current(engine)
    else:
        upgrade(engine)
    return engine


def _require_current(engine: Engine) -> None:
    """A command that only reads never migrates (a `worker query` must not rewrite the tables under a worker
    of another version): a schema older than this worker's is refused with the way to upgrade it."""
    cfg = alembic_config(engine)
    try:
        current, script = _schema(engine, cfg)
    except Exception as e:
        engine.dispose()
        raise StoreError(f"database {engine.url}: cannot open it: {_driver_words(e)}{_folder_hint(engine, e)}") from e
    heads = set(script.get_heads())
    if current == heads:
        return
    engine.dispose()
    _refuse_newer(engine, current, script)
    where = engine.url.render_as_string(hide_password=True)
    raise StoreError(f"database {where}: its schema is at revision {', '.join(sorted(current)) or 'none'}, older "
                     f"than this worker's {', '.join(sorted(heads))}; this command only reads, so it does not "
                     f"migrate it: run `worker db upgrade --db {where}` (or start `worker run` or `watch` on it) first")


def database(url: str, create: bool = True, read_only: bool = False) -> contextlib.AbstractContextManager[Engine]:
    """`open_db` for one block (a command, a bench round): see `disposing`."""
    return disposing(open_db(url, create, read_only))


def _reader(url: str, path: Path) -> Engine:
    """A database in a folder this process cannot write (another account's, a read-only mount), for a
    command that only reads it. While a worker has it open, its -wal and -shm files exist and SQLite
    reads it through them read-only (`mode=ro`). Without them no worker has it open, and the file holds
    everything (the last connection to close folds the log in and deletes it): it is read as it is
    (`immutable`, which needs no -shm). A worker that starts during such a read may make it fail (run
    it again), never the database. It cannot be migrated from here, so it must be at this worker's
    newest revision already."""
    wal = path.with_name(path.name + "-wal")

    def connect() -> sqlite3.Connection:  # decided per connection: a worker may have started since
        mode = "mode=ro" if wal.exists() else "mode=ro&immutable=1"
        uri = "file:" + urllib.parse.quote(str(path)) + "?" + mode
        return sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)

    engine = create_engine(url, creator=connect)
    try:
        current, script = _schema(engine, alembic_config(engine))
    except Exception as e:
        engine.dispose()
        files = (path, wal, path.with_name(path.name + "-shm"))
        unreadable = [p for p in files if p.exists() and not os.access(p, os.R_OK)]
        if unreadable:  # SQLite says `unable to open database file` for this too
            raise StoreError(f"database {path}: cannot open it read-only: this account may not read "
                             f"{', '.join(map(str, unreadable))} (give it read access, or run as the account that "
                             f"writes it)") from None
        raise StoreError(f"database {path}: cannot open it read-only: {_driver_words(e)} ({path.parent} is not "
                         f"writable here, and SQLite reads a database with a -wal file beside it through its -shm "
                         f"file, which it cannot create there; {_WAYS_OUT})") from None
    if current != set(script.get_heads()):
        engine.dispose()
        raise StoreError(f"database {path}: its schema is at revision {', '.join(sorted(current)) or 'none'}, not "
                         f"{', '.join(script.get_heads())}, and it cannot be migrated from here ({path.parent} is "
                         f"not writable): start this version of the worker on it first")
    return engine


@contextlib.contextmanager
def disposing(engine: Engine) -> Iterator[Engine]:
    """The engine for one block: its pooled connections are closed at the end, not left open until the
    garbage collector finds the engine (Python 3.13 then warns of each `unclosed database`)."""
    try:
        yield engine
    finally:
        engine.dispose()


def database_wide(error: BaseException) -> bool:
    """A failure of the database as a whole (disk full, I/O error, server down or restarting), not of
    one event (a constraint, a bad value): PEP 249's OperationalError or InterfaceError, as the driver
    raised it (the recorder's compiled statements) or wrapped by SQLAlchemy."""
    orig = getattr(error, "orig", None) or error
    if transient(error):  # an OperationalError in psycopg, yet no outage: retried at once (see transient)
        return False
    if str(getattr(orig, "sqlstate", None) or "").startswith("54"):  # PostgreSQL's "program limit exceeded":
        return False  # an OperationalError there, yet one event's (a path too long for the index), not the server's
    return any(c.__name__ in ("OperationalError", "InterfaceError") for c in (*type(error).__mro__, *type(orig).__mro__))


# PostgreSQL's serialization_failure and deadlock_detected: the transaction lost a race with another
# worker's and is to be run again at once (after a short, jittered pause), not waited for as an outage
TRANSIENT_SQLSTATES = ("40001", "40P01")


def transient(error: BaseException) -> bool:
    """Whether the error is a lost race (serialization failure, deadlock), as the driver or SQLAlchemy raised it."""
    orig = getattr(error, "orig", None) or error
    return str(getattr(orig, "sqlstate", None) or "") in TRANSIENT_SQLSTATES
