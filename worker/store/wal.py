"""SQLite's write-ahead log kept short beside the recorder's writes: a thread of its own checkpoints it every
CHECKPOINT_S (PASSIVE: never blocking the writer), and empties it (TRUNCATE) once it grows past
WAL_RESET_BYTES."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sqlalchemy import Engine

from worker.store.db import BUSY_TIMEOUT_MS

log = logging.getLogger("worker.store.recorder")

# SQLite copies its write-ahead log into the database file every 1000 pages, inside the commit that
# crosses the mark, fsync included: a 14-19 ms stall here, and in watch mode the image whose claim waited
# on that commit was the slowest of its run. The recorder's connection turns that off, and a thread of
# its own checkpoints this often instead, beside the writes (PASSIVE: it never blocks them).
CHECKPOINT_S = 1.0
# SQLite starts its log over only when a write begins right after a checkpoint copied everything, and a
# writer committing every few tens of ms while a checkpoint takes longer rarely leaves that gap: under
# full load the log grew to 220 MB in 40 s (docs/database.md). Past this size the checkpoint thread
# runs a TRUNCATE checkpoint, which empties the log; it holds the writer only while it runs, and
# waits at most WAL_RESET_WAIT_MS for readers (a `worker query` mid-read) before giving up until next time.
WAL_RESET_BYTES = 64 << 20
WAL_RESET_WAIT_MS = 200
WAL_RESET_BACKOFF_S = 60.0  # after a reader made it give up: not every second while that reader stays
FAILURE_REMINDER_S = 3600.0  # a failing checkpoint (a full disk) is logged once, then this often


def reason(error: BaseException) -> str:
    """The driver's message, without SQLAlchemy's statement and background link."""
    return str(getattr(error, "orig", None) or error).strip().splitlines()[0]


class WalCheckpointer:
    """Checkpoints a SQLite database's log on its own thread from construction until `stop()`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="recorder-checkpoint", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        conn = self.engine.raw_connection()
        try:
            cur = conn.cursor()
            page = cur.execute("PRAGMA page_size").fetchone()[0]
            cur.close()
            next_reset = 0.0
            logged_at: float | None = None  # a failing checkpoint (a full disk): logged once, then hourly
            while not self._stop.wait(CHECKPOINT_S):
                try:
                    _, frames, _ = checkpoint(conn)
                    if frames * page > WAL_RESET_BYTES and time.monotonic() >= next_reset:
                        busy, _, _ = checkpoint(conn, "TRUNCATE", WAL_RESET_WAIT_MS)
                        next_reset = time.monotonic() + WAL_RESET_BACKOFF_S if busy else 0.0
                except Exception as e:  # a busy or failing checkpoint is retried next time; the WAL only grows meanwhile
                    now = time.monotonic()
                    if logged_at is None or now - logged_at >= FAILURE_REMINDER_S:
                        log.error("recorder: WAL checkpoint failed (%s); retried every %g s", reason(e), CHECKPOINT_S)
                        logged_at = now
                else:
                    if logged_at is not None:
                        log.warning("recorder: WAL checkpoints work again")
                        logged_at = None
        finally:
            conn.close()


def checkpoint(dbapi_conn: Any, mode: str = "PASSIVE", wait_ms: int | None = None) -> tuple[int, int, int]:
    """One checkpoint of a SQLite database: (busy, frames in the WAL, frames copied to the database).

    PASSIVE never waits; TRUNCATE waits up to `wait_ms` (instead of the busy timeout) for the writer
    and the readers, then empties the log."""
    if mode not in ("PASSIVE", "FULL", "RESTART", "TRUNCATE"):
        raise ValueError(f"no checkpoint mode {mode!r}")
    cur = dbapi_conn.cursor()
    try:
        if wait_ms is not None:
            cur.execute(f"PRAGMA busy_timeout={int(wait_ms)}")
        busy, frames, copied = cur.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
    finally:
        if wait_ms is not None:
            cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cur.close()
    return busy, frames, copied
