"""Engine factory: SQLite pragmas (WAL, busy timeout) and migrations on start."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from worker.errors import StoreError

BUSY_TIMEOUT_MS = 30_000


def migrations_dir() -> Path:
    """`migrations/` at the project root (the package is installed from a checkout)."""
    here = Path(__file__).resolve().parents[2] / "migrations"
    if (here / "env.py").exists():
        return here
    raise StoreError(f"migrations folder not found at {here}; install worker from its checkout (pip install -e .)")


def make_engine(url: str) -> Engine:
    """A SQLAlchemy engine; for SQLite: WAL, busy timeout, foreign keys, parent folder created."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if u.database and u.database != ":memory:":
        try:
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"database {u.database}: cannot create its folder: {e}") from None
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


def alembic_config(engine: Engine) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    cfg = alembic_config(engine)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    except Exception as e:
        raise StoreError(f"database {engine.url}: migration to {revision} failed: {e}") from e


def downgrade(engine: Engine, revision: str) -> None:
    cfg = alembic_config(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def open_db(url: str) -> Engine:
    """Engine with the schema migrated to the latest revision."""
    engine = make_engine(url)
    upgrade(engine)
    return engine
