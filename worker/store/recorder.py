"""The only writer to the database: one thread, batched transactions.

Stages hand it frozen events; it writes them in order. An event can carry a `Commit` that is set
once its transaction has ended, for the callers that must not act before (the archive move), and says
whether the event is in the database. An event the database refuses (a constraint, a bad value,
after a retry one by one) is logged and reported as not recorded, and the recorder keeps going. A
database that refuses every write (disk full, server down) is waited for instead: the recorder
holds its batch and tries again every DB_RETRY_S, and the stages, waiting for their commits, pause
with it; nothing is refused, nothing repeats, the log says so once (then every DB_REMINDER_S).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import Any

from sqlalchemy import Connection, Engine, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from worker import __version__
from worker.host.durations import span_text
from worker.store.db import database_wide, session_name, transient
from worker.store.shared import TRANSIENT_TRIES, transient_pause
from worker.store.events import (LEASE_LOST, Claimed, Commit, Event, Finished, RunInfo, Sample, Settled,
                                 StampRenewed, describe)
from worker.store.wal import WalCheckpointer, reason
from worker.store.writes import BatchMarks, EventWrites
from worker.store.schema import Run, utcnow


log = logging.getLogger(__name__)
# the events are defined beside the recorder; their producers may import them from here
__all__ = ["Claimed", "Commit", "Event", "Finished", "Recorder", "StampRenewed", "RunInfo", "Sample", "Settled"]
MAX_BATCH = 256  # events per transaction
# a transaction costs about 1 ms of Python whatever its size: under load, gather events this long
# before writing, so the recorder does not commit for every event (rows lag by at most this).
# A thread about to wait for a commit calls `hurry()`: what is queued is then written at once.
GROUP_S = 0.05
# a database refusing every write (disk full, server down): the batch is tried again this often, and
# the log reminded this often while it lasts
DB_RETRY_S = 5.0
DB_REMINDER_S = 600.0
_STOP = object()


class Recorder(EventWrites):
    """Creates the run row, then writes events on its own thread until `close()`."""

    def __init__(self, engine: Engine, info: RunInfo, run_id: int | None = None) -> None:
        """`run_id`: write into that run (a prepare process's, for its inference process) instead of
        creating one; the run's owner stamps its end."""
        self.engine = engine
        self.model = info.model
        self.root = info.root  # the inbox or the folder run: where the stamps recorded hold
        self.model_sha256, self.card_sha256 = info.model_sha256, info.card_sha256
        self._owns_run = run_id is None
        if run_id is not None:
            self.run_id: int = run_id
        else:
            self.run_id = self._create_run(info)
        # upserts are dialect-specific (SQLite and PostgreSQL both have ON CONFLICT DO UPDATE)
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        self._claimed: dict[tuple[str, str], tuple[int, bool] | None] = {}  # claimed, not yet finished
        self._taken: dict[int, int] = {}  # id() of a claim in the batch being written -> the run holding its image
        self._lost: set[int] = set()  # id() of fleet finishes the fence turned away (EventWrites._fence)
        self.lost = 0  # fleet finishes turned away: their claims had passed to other workers
        self.refused = 0  # events the database refused (logged; their producers were told)
        self.down = False  # the database refuses every write: events are held (see _record)
        self._reminded = 0.0  # time.monotonic() of the last log line saying so
        self._abandon = threading.Event()  # shutting down: stop holding events for a database that is down
        self._statements()
        self._sqlite = engine.dialect.name == "sqlite"
        # a server's connection can break after it committed and before it said so (SQLite's cannot)
        self._batches = None if self._sqlite else BatchMarks(engine, self._insert, self.run_id)
        # held by the recorder thread (a pool checkout per transaction costs more); None after a failed
        # reconnect (the server is down): the next write connects first
        self._conn: Connection | None = self._connect()
        self._warm_up()
        # bounded like every queue: if the database stalls, the stages wait instead of piling up events
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=10_000)
        # set by hurry() and close(): the recorder stops gathering and writes what is queued
        self._hurried = threading.Event()
        self._closing = False  # set by close(): no more gathering, whatever is queued
        self._thread = threading.Thread(target=self._loop, name="recorder", daemon=True)
        self._thread.start()
        # one checkpointer per database: the run's owner's (a prepare process's recorder writes into its run)
        self._checkpointer = WalCheckpointer(engine) if self._sqlite and self._owns_run else None

    def _create_run(self, info: RunInfo) -> int:
        with Session(self.engine) as s, s.begin():
            run = Run(mode=info.mode, host=socket.gethostname(), pid=os.getpid(), root=info.root,
                      model=info.model, model_sha256=info.model_sha256, card_sha256=info.card_sha256 or None,
                      providers=info.providers, config=info.config, version=__version__,
                      session=session_name() if self.engine.dialect.name == "postgresql" else None)
            s.add(run)
            s.flush()
            return int(run.id)

    def _warm_up(self) -> None:
        """Compile the claims' id query now (about 1 ms of SQLAlchemy's, once) rather than in the
        first image's claim, which its decode thread waits for (docs/performance.md)."""
        if self._conn is None:
            return
        try:
            with self._conn.begin():
                self._conn.execute(self._ids, {"model": self.model, "rels": []}).all()
        except Exception as e:  # only a warm-up: the first claim says what is wrong
            log.debug("recorder warm-up: %s", reason(e))

    def put(self, event: Event) -> None:
        self._queue.put(event)
        if self._queue.qsize() >= MAX_BATCH:  # a full transaction's worth is waiting: no point gathering more
            self._hurried.set()

    def hurry(self) -> None:
        """Write what is queued now instead of gathering for up to GROUP_S: the caller is about to
        wait for a `committed` flag (a decode thread with nothing else to do, an idle watcher's image)."""
        self._hurried.set()

    def depth(self) -> int:
        return self._queue.qsize()

    def abandon(self) -> None:
        """Shutting down (Ctrl-C): while the database refuses every write, stop waiting for it; the
        events held and those that follow are refused (their inputs stay where they are)."""
        self._abandon.set()

    def close(self) -> None:
        """Write everything queued, stamp the run's end, stop the thread."""
        self._closing = True
        self._queue.put(_STOP)
        self._hurried.set()
        self._thread.join()
        if self.refused:
            log.error("%d events could not be recorded (logged above): their images are not on record as done, "
                      "and the next run, or watch's next rescan, processes them again", self.refused)
        if self._checkpointer is not None:
            self._checkpointer.stop()
        if self._conn is not None:
            self._release(self._conn)
        if self._batches is not None:
            try:
                self._batches.forget()
            except Exception as e:  # the database is down: its row goes with its run (`worker db prune`)
                log.debug("recorder: batch marks not forgotten: %s", reason(e))
        if not self._owns_run:
            return
        try:
            with Session(self.engine) as s, s.begin():
                s.execute(update(Run).where(Run.id == self.run_id).values(finished_at=utcnow()))
        except Exception as e:  # the database is down: the run shows as stopped without finishing
            log.error("recorder: cannot record the end of run %d: %s", self.run_id, reason(e))

    def _loop(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]  # sleep until there is something to write
            # then gather for GROUP_S, or until hurried, without taking events one by one: a thread blocked
            # on the queue is woken by every put (a futex wake-up, the GIL held), two or three per image
            if batch[0] is not _STOP and not self._closing and self._queue.qsize() < MAX_BATCH - 1:
                self._hurried.wait(GROUP_S)
            self._hurried.clear()
            while len(batch) < MAX_BATCH and batch[-1] is not _STOP:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in batch
            batch = [e for e in batch if e is not _STOP]
            if not batch:
                continue
            refused = self._record(batch)  # id() of the events the database would not take
            for e in batch:
                if id(e) in self._lost:
                    self.lost += 1
                    log.warning("discarded %s: its claim passed to another worker (this one's lease ran out), "
                                "whose outcome stands", describe(e))
                    if e.committed is not None:
                        e.committed.set(False, LEASE_LOST)
                elif not isinstance(e, Sample) and e.committed is not None:
                    e.committed.set(id(e) not in refused, self._taken.pop(id(e), None))
            self._taken.clear()
            self._lost.clear()

    def _record(self, batch: list[Event]) -> set[int]:
        """Write one batch; returns the id() of the events the database refused for themselves. The
        events it refuses for the database as a whole (disk full, server down) are held and tried
        again until it takes them (see _wait_for_database), or until shutdown abandons them."""
        refused: set[int] = set()
        pending, down_since, raced = batch, None, 0
        # the attempt that failed may have been committed all the same (its acknowledgement lost with the
        # connection): what its fence and claims found, kept until the database says whether it was
        unsure: tuple[set[int], dict[int, int]] | None = None
        asked = False
        while True:
            try:
                if unsure is not None:
                    if self._landed():  # raises while the database cannot be asked: held as a write would be
                        self._lost, self._taken = unsure
                        log.warning("recorder: the connection broke as a batch of %d was committed; the database "
                                    "has it: not written again", len(pending))
                        self._back_up(down_since)
                        return refused
                    unsure = None
                self._write(pending)
            except Exception as e:
                if self._batches is not None and unsure is None and database_wide(e) and not transient(e):
                    unsure = (set(self._lost), dict(self._taken))  # the connection broke: maybe at its commit
                for ev in pending:  # read in the transaction that was rolled back: each retry reads its own
                    self._taken.pop(id(ev), None)
                    self._lost.discard(id(ev))
                if transient(e) and raced < TRANSIENT_TRIES:  # lost a race with another worker: again, at once
                    raced += 1
                    log.info("recorder: %s; writing the batch again", reason(e))
                    transient_pause(raced)
                    continue
                self._reconnect(quiet=down_since is not None)
                if unsure is not None and not asked:  # the server may well be up: asked at once, not after a wait
                    asked = True
                    continue
                if (down_since is not None or self.down) and self._abandon.is_set():
                    return refused | self._refuse(pending, e)
                # the database as a whole (disk full, server down, locked past the busy timeout): the batch
                # waits for it; one transaction per event would only fail (or wait) as many times over
                if not database_wide(e):  # one bad event must not stop the recorder: one by one
                    log.exception("recorder: batch of %d failed, retrying one by one", len(pending))
                    unsure = None  # refused for an event of its own: rolled back
                    bad, pending, wide = self._one_by_one(pending)
                    refused |= bad
                    if not pending:
                        self._back_up(down_since)
                        return refused
                    e = wide or e
                down_since = self._wait_for_database(e, down_since, len(pending))
                continue
            self._back_up(down_since)
            return refused

    def _landed(self) -> bool:
        """Whether the batch whose write failed was committed all the same (PostgreSQL: the server asked on a
        connection of its own; raises where it cannot be asked). Writing it again would charge its claims a
        second attempt, tally its outcomes twice and take its own fenced outcomes for lost ones."""
        return self._batches is not None and self._batches.landed()

    def _back_up(self, down_since: float | None) -> None:
        if down_since is not None:
            self.down = False
            log.warning("recorder: the database takes writes again after %s: going on",
                        span_text(time.monotonic() - down_since))

    def _one_by_one(self, events: list[Event]) -> tuple[set[int], list[Event], Exception | None]:
        """The events of a failed batch, one transaction each. Returns the id() of those refused for
        themselves (logged), those refused for the database as a whole (held), and the last such error."""
        bad: set[int] = set()
        held: list[Event] = []
        wide: Exception | None = None
        for e in events:
            try:
                self._write([e])
            except Exception as err:
                self._taken.pop(id(e), None)
                self._lost.discard(id(e))
                if database_wide(err):  # the connection may be what broke (a server restart): a fresh one
                    self._reconnect(quiet=True)
                    held.append(e)
                    wide = err
                    continue
                log.error("recorder: could not record %s: %s", describe(e), reason(err))
                bad.add(id(e))
                if isinstance(e, Claimed):  # not on record: its outcome must claim the row itself
                    self._claimed.pop((e.rel, e.sha256), None)
        if bad:
            self.refused += len(bad)
            self._reconnect()
        return bad, held, wide

    def _refuse(self, batch: list[Event], error: Exception) -> set[int]:
        """Shutting down while the database is down: the held events are not recorded."""
        log.error("recorder: shutting down with the database still refusing writes (%s): %d events not "
                  "recorded; their inputs stay where they are for the next start", reason(error), len(batch))
        for e in batch:
            if isinstance(e, Claimed):
                self._claimed.pop((e.rel, e.sha256), None)
        self.refused += len(batch)
        return {id(e) for e in batch}

    def _wait_for_database(self, error: Exception, down_since: float | None, held: int) -> float:
        """The database refuses every write: say so (once, then every DB_REMINDER_S), wait DB_RETRY_S.
        Meanwhile the stages wait for their commits and intake for room: the worker pauses, and its
        heartbeat (the memory samples) stops, which `worker health` reports as stalled."""
        now = time.monotonic()
        if down_since is None:
            down_since = self._reminded = now
            self.down = True
            log.error("recorder: the database refuses writes (%s): the pipeline waits for it, trying again every "
                      "%g s; %d events held, nothing is lost (inputs stay where they are until their outcome is "
                      "recorded)", reason(error), DB_RETRY_S, held)
        elif now - self._reminded >= DB_REMINDER_S:
            self._reminded = now
            log.error("recorder: the database still refuses writes after %s (%s); %d events held",
                      span_text(now - down_since), reason(error), held + self._queue.qsize())
        self._abandon.wait(DB_RETRY_S)
        return down_since

    def _reconnect(self, quiet: bool = False) -> None:
        """After a failed transaction: a fresh connection, in case the old one is broken (server restart)."""
        try:
            if self._conn is not None:
                self._release(self._conn)
        except Exception:
            pass
        self._conn = None
        try:
            self._conn = self._connect()
        except Exception as e:  # the next write tries again (and fails as the database's fault)
            if not quiet:
                log.error("recorder: cannot reconnect to the database: %s", reason(e))

    def _connect(self) -> Connection:
        conn = self.engine.connect()
        if self._sqlite:  # checkpoints are _checkpoint_loop's (see CHECKPOINT_S); a pragma, outside any transaction
            conn.connection.dbapi_connection.execute("PRAGMA wal_autocheckpoint=0")  # type: ignore[union-attr]
        return conn

    def _release(self, conn: Connection) -> None:
        """Back to the pool as it came: the next user of this connection checkpoints as SQLite normally does."""
        try:
            if self._sqlite:
                conn.connection.dbapi_connection.execute("PRAGMA wal_autocheckpoint=1000")  # type: ignore[union-attr]
        finally:
            conn.close()


