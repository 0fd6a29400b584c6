"""The per-image skip and quarantine check: what the database says about one (path, content, model).

It runs for every image on the decode threads, so it skips SQLAlchemy's per-call machinery: the
statement is compiled once for the database's dialect (so it stays portable) and executed on one
DB-API connection per thread, checked out of the engine's pool and returned by `close()`.
Measured: about 9 us per check instead of about 100 us through `Connection.execute`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, bindparam, select

from worker.store.schema import ImageRow


@dataclass(frozen=True)
class Known:
    status: str
    attempts: int
    error: str | None


_LOOKUP = select(ImageRow.status, ImageRow.attempts, ImageRow.error).where(
    ImageRow.rel_path == bindparam("rel"), ImageRow.sha256 == bindparam("sha"), ImageRow.model == bindparam("model"))


class Ledger:
    def __init__(self, engine: Engine, model: str) -> None:
        self.engine, self.model = engine, model
        compiled = _LOOKUP.compile(dialect=engine.dialect)
        self._sql = compiled.string
        self._order = compiled.positiontup if engine.dialect.positional else None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[Any] = []

    def check(self, rel: str, sha256: str) -> Known | None:
        params = {"rel": rel, "sha": sha256, "model": self.model}
        conn = self._connection()
        cur = conn.cursor()
        try:
            cur.execute(self._sql, tuple(params[k] for k in self._order) if self._order else params)
            row = cur.fetchone()
        finally:
            cur.close()
        conn.rollback()  # end the read transaction some drivers open (PostgreSQL); a no-op on SQLite
        return Known(row[0], row[1], row[2]) if row else None

    def in_flight(self) -> list[str]:
        """Paths left `processing` for this model: a worker died while they were in flight."""
        with self.engine.connect() as c:
            return list(c.scalars(select(ImageRow.rel_path).distinct().where(
                ImageRow.model == self.model, ImageRow.status == "processing").order_by(ImageRow.rel_path)))

    def _connection(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.engine.raw_connection()
            with self._lock:
                self._conns.append(conn)
        return conn

    def close(self) -> None:
        """Return every thread's connection to the pool (call once the threads have stopped)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
