"""One database connection shared by a worker's threads, one short transaction at a time.

Fleet mode holds two connections per worker whatever its thread counts: the recorder's, and this one,
used by the claim queue, its lease keeper and the per-image skip checks (worker.store.ledger)."""

from __future__ import annotations

import logging
import random
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from sqlalchemy import Engine

from worker.store.db import database_wide, transient

log = logging.getLogger(__name__)

# a transaction that lost a race (deadlock, serialization failure) is run again this many times at most,
# after a pause of up to TRANSIENT_PAUSE_S x its try number (jittered: two losers do not meet again)
TRANSIENT_TRIES = 8
TRANSIENT_PAUSE_S = 0.02


def transient_pause(attempt: int) -> None:
    time.sleep(random.uniform(0.5, 1.0) * TRANSIENT_PAUSE_S * attempt)


class SharedConnection:
    """A DB-API connection checked out of the engine's pool, used by one thread at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.RLock()
        self._conn: Any = None

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A cursor in a transaction of its own, committed on leaving (rolled back on an error). A broken
        connection (a server restart) is dropped, and the next transaction connects anew."""
        with self._lock:
            if self._conn is None:
                self._conn = self.engine.raw_connection()
            conn = self._conn
            cur = conn.cursor()
            try:
                yield cur
                conn.commit()
            except BaseException:
                try:
                    conn.rollback()
                except Exception:
                    self._drop()
                raise
            finally:
                try:
                    cur.close()
                except Exception:
                    pass

    def run(self, sql: str, params: Any = None, fetch: bool = True) -> list[tuple[Any, ...]]:
        """One statement in its own transaction, run again at once when it loses a race; its rows."""
        for attempt in range(1, TRANSIENT_TRIES + 1):
            try:
                with self.transaction() as cur:
                    cur.execute(sql, params)
                    return list(cur.fetchall()) if fetch and cur.description is not None else []
            except Exception as e:
                if not transient(e) or attempt == TRANSIENT_TRIES:
                    if database_wide(e):  # perhaps the connection itself (a server restart): a fresh one next
                        self._drop()
                    raise
                log.debug("lost a race (%s): trying again", e)
                transient_pause(attempt)
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.invalidate() if hasattr(conn, "invalidate") else conn.close()
            except Exception:
                pass

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                finally:
                    self._conn = None
