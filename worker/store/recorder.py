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
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Union, cast

from sqlalchemy import (BindParameter, Connection, Engine, Integer, Table, and_, bindparam, case, delete, insert, or_,
                        select, update)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from worker import __version__
from worker.jobs import JobStatus
from worker.durations import span_text
from worker.store.db import BUSY_TIMEOUT_MS, database_wide
from worker.store.schema import ImageRow, LabelRow, MemorySample, ResultRow, Run, TimingRow, utcnow

# the mapped classes' tables (declared as FromClause, which they are more than)
IMAGES, RESULTS, LABELS = (cast(Table, c.__table__) for c in (ImageRow, ResultRow, LabelRow))
TIMINGS, SAMPLES = cast(Table, TimingRow.__table__), cast(Table, MemorySample.__table__)

log = logging.getLogger(__name__)
MAX_BATCH = 256  # events per transaction
# a transaction costs about 1 ms of Python whatever its size: under load, gather events this long
# before writing, so the recorder does not commit for every event (rows lag by at most this).
# A thread about to wait for a commit calls `hurry()`: what is queued is then written at once.
GROUP_S = 0.05
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
_UNCLAIMED: Any = object()
# a database refusing every write (disk full, server down): the batch is tried again this often, and
# the log reminded this often while it lasts
DB_RETRY_S = 5.0
DB_REMINDER_S = 600.0
# a claim older than this that its worker never finished is taken over by another worker's claim (a
# worker on another host that died: this host's dead workers are recovered at the next start)
STALE_CLAIM_S = 600.0


class _Hot:
    """A statement the recorder runs for every image, compiled once for the engine's dialect and run
    with executemany on the DB-API cursor of the recorder's connection (inside its transaction).

    SQLAlchemy's SQL and type conversions are kept (its bind processors: UTC datetimes, JSON); what
    is skipped is its per-execute machinery (statement cache lookup, row-by-row parameter processing
    through generic code), which cost more than SQLite itself (see tests/perf/hot_path.py)."""

    def __init__(self, stmt: Any, dialect: Any) -> None:
        compiled = stmt.compile(dialect=dialect)
        self.sql = compiled.string
        self._positional = bool(dialect.positional)
        if self._positional:  # SQLite's qmark: one value per placeholder, in the order of the SQL
            binds = [compiled.binds[n] for n in compiled.positiontup]
            self._names: list[str] = []
        else:  # PostgreSQL drivers' pyformat: a dict keyed by the names the SQL uses
            binds = list(compiled.bind_names)
            self._names = [compiled.escaped_bind_names.get(n, n) for n in compiled.bind_names.values()]
        # (key, literal value) per parameter: key for the caller's bindparam("key"), else the statement's own literal
        self._fields = [(b.key if b.required else None, b.value) for b in binds]
        self._procs = [b.type.dialect_impl(dialect).bind_processor(dialect) for b in binds]

    def run(self, conn: Connection, params: list[dict[str, Any]]) -> None:
        rows: list[Any] = []
        for p in params:
            values = [p[k] if k is not None else v for k, v in self._fields]  # KeyError: a caller bug, loud
            values = [f(x) if f is not None else x for f, x in zip(self._procs, values)]
            rows.append(values if self._positional else dict(zip(self._names, values)))
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.executemany(self.sql, rows)
        finally:
            cursor.close()


@dataclass(frozen=True)
class RunInfo:
    mode: str
    root: str
    model: str
    model_sha256: str
    providers: str
    config: dict[str, Any] = field(hash=False)
    card_sha256: str = ""  # models.card.settings_digest ("": none recorded)


class Commit:
    """Set by the recorder once an event's transaction has ended; `wait()` says whether it is recorded."""

    def __init__(self) -> None:
        self._ended = threading.Event()
        self._recorded = False
        self.taken_by: int | None = None  # a claim: the run of another live worker that holds the image

    def set(self, recorded: bool = True, taken_by: int | None = None) -> None:
        self._recorded, self.taken_by = recorded, taken_by
        self._ended.set()

    def is_set(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the event is in the database; False if the database refused it (or on timeout)."""
        return self._ended.wait(timeout) and self._recorded


@dataclass(frozen=True, eq=False)
class Claimed:
    """An image is about to be processed: status processing, attempts + 1.

    The decode stage waits for `committed`, so an image that kills the worker while it is decoded
    has its attempt on record."""

    rel: str
    sha256: str
    size: int
    committed: Commit | None = None
    stamp: str | None = None  # the file's "inode:mtime_ns:ctime_ns" as it was read (see ImageRow.stamp)
    # False: the claim yields to another live worker's (its `committed.taken_by` says whose); True: a
    # recovery, taking over the row a dead worker left `processing`
    take_over: bool = False
    # True: the image is knowingly done again (a soak's replay, a new version of the model's file);
    # False: the ledger saw it not done, so a row found `done` by now was finished by another worker
    # between that check and this claim, and the claim yields to it
    redo: bool = False


@dataclass(frozen=True, eq=False)
class Finished:
    """An image ended done or failed, with its result rows and timings."""

    rel: str
    sha256: str
    size: int
    status: JobStatus
    error: str | None = None
    task: str | None = None
    score: float = 0.0
    payload: dict[str, Any] | None = None
    json_path: str | None = None
    mask_path: str | None = None
    labels: tuple[tuple[int, str, float], ...] = ()
    timings: dict[str, float] | None = None
    committed: Commit | None = None
    undo_attempt: bool = False  # queued again through no fault of its own (outbox full): not an attempt


@dataclass(frozen=True, eq=False)
class Restamped:
    """An image was found done by its content, read under a new stamp (touched, copied back in place,
    or done before stamps were recorded): the stamp is recorded, so the next run need not read it."""

    rel: str
    sha256: str
    stamp: str
    committed: Commit | None = None  # nothing waits for it


@dataclass(frozen=True, eq=False)
class Sample:
    rss_bytes: int
    fds: int
    threads: int
    queue_depth: int
    images_done: int
    gpu_bytes: int | None
    at: datetime = field(default_factory=utcnow)


Event = Union[Claimed, Finished, Restamped, Sample]
_STOP = object()


class Recorder:
    """Creates the run row, then writes events on its own thread until `close()`."""

    def __init__(self, engine: Engine, info: RunInfo) -> None:
        self.engine = engine
        self.model = info.model
        self.root = info.root  # the inbox or the folder run: where the stamps recorded hold
        self.model_sha256, self.card_sha256 = info.model_sha256, info.card_sha256
        with Session(engine) as s, s.begin():
            run = Run(mode=info.mode, host=socket.gethostname(), pid=os.getpid(), root=info.root,
                      model=info.model, model_sha256=info.model_sha256, card_sha256=info.card_sha256 or None,
                      providers=info.providers, config=info.config, version=__version__)
            s.add(run)
            s.flush()
            self.run_id: int = run.id
        # upserts are dialect-specific (SQLite and PostgreSQL both have ON CONFLICT DO UPDATE)
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        self._claimed: dict[tuple[str, str], tuple[int, bool] | None] = {}  # claimed, not yet finished
        self._taken: dict[int, int] = {}  # id() of a claim in the batch being written -> the run holding its image
        self.refused = 0  # events the database refused (logged; their producers were told)
        self.down = False  # the database refuses every write: events are held (see _record)
        self._reminded = 0.0  # time.monotonic() of the last log line saying so
        self._abandon = threading.Event()  # shutting down: stop holding events for a database that is down
        self._statements()
        self._sqlite = engine.dialect.name == "sqlite"
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
        self._stop_checkpoints = threading.Event()
        self._checkpointer: threading.Thread | None = None
        if self._sqlite:
            self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="recorder-checkpoint", daemon=True)
            self._checkpointer.start()

    def _warm_up(self) -> None:
        """Compile the claims' id query now (about 1 ms of SQLAlchemy's, once) rather than in the
        first image's claim, which its decode thread waits for (docs/performance.md)."""
        if self._conn is None:
            return
        try:
            with self._conn.begin():
                self._conn.execute(self._ids, {"model": self.model, "rels": []}).all()
        except Exception as e:  # only a warm-up: the first claim says what is wrong
            log.debug("recorder warm-up: %s", _reason(e))

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
        self._stop_checkpoints.set()
        if self._checkpointer is not None:
            self._checkpointer.join()
        if self._conn is not None:
            self._release(self._conn)
        try:
            with Session(self.engine) as s, s.begin():
                s.execute(update(Run).where(Run.id == self.run_id).values(finished_at=utcnow()))
        except Exception as e:  # the database is down: the run shows as stopped without finishing
            log.error("recorder: cannot record the end of run %d: %s", self.run_id, _reason(e))

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
                if not isinstance(e, Sample) and e.committed is not None:
                    e.committed.set(id(e) not in refused, self._taken.pop(id(e), None))
            self._taken.clear()

    def _record(self, batch: list[Event]) -> set[int]:
        """Write one batch; returns the id() of the events the database refused for themselves. The
        events it refuses for the database as a whole (disk full, server down) are held and tried
        again until it takes them (see _wait_for_database), or until shutdown abandons them."""
        refused: set[int] = set()
        pending, down_since = batch, None
        while True:
            try:
                self._write(pending)
            except Exception as e:
                for ev in pending:  # read in the transaction that was rolled back: each retry reads its own
                    self._taken.pop(id(ev), None)
                self._reconnect(quiet=down_since is not None)
                if (down_since is not None or self.down) and self._abandon.is_set():
                    return refused | self._refuse(pending, e)
                # the database as a whole (disk full, server down, locked past the busy timeout): the batch
                # waits for it; one transaction per event would only fail (or wait) as many times over
                if not database_wide(e):  # one bad event must not stop the recorder: one by one
                    log.exception("recorder: batch of %d failed, retrying one by one", len(pending))
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
                if database_wide(err):  # the connection may be what broke (a server restart): a fresh one
                    self._reconnect(quiet=True)
                    held.append(e)
                    wide = err
                    continue
                log.error("recorder: could not record %s: %s", _describe(e), _reason(err))
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
                  "recorded; their inputs stay where they are for the next start", _reason(error), len(batch))
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
                      "recorded)", _reason(error), DB_RETRY_S, held)
        elif now - self._reminded >= DB_REMINDER_S:
            self._reminded = now
            log.error("recorder: the database still refuses writes after %s (%s); %d events held",
                      span_text(now - down_since), _reason(error), held + self._queue.qsize())
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
                log.error("recorder: cannot reconnect to the database: %s", _reason(e))

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

    def _checkpoint_loop(self) -> None:
        conn = self.engine.raw_connection()
        try:
            cur = conn.cursor()
            page = cur.execute("PRAGMA page_size").fetchone()[0]
            cur.close()
            next_reset = 0.0
            logged_at: float | None = None  # a failing checkpoint (a full disk): logged once, then hourly
            while not self._stop_checkpoints.wait(CHECKPOINT_S):
                try:
                    _, frames, _ = checkpoint(conn)
                    if frames * page > WAL_RESET_BYTES and time.monotonic() >= next_reset:
                        busy, _, _ = checkpoint(conn, "TRUNCATE", WAL_RESET_WAIT_MS)
                        next_reset = time.monotonic() + WAL_RESET_BACKOFF_S if busy else 0.0
                except Exception as e:  # a busy or failing checkpoint is retried next time; the WAL only grows meanwhile
                    now = time.monotonic()
                    if logged_at is None or now - logged_at >= 6 * DB_REMINDER_S:
                        log.error("recorder: WAL checkpoint failed (%s); retried every %g s", _reason(e), CHECKPOINT_S)
                        logged_at = now
                else:
                    if logged_at is not None:
                        log.warning("recorder: WAL checkpoints work again")
                        logged_at = None
        finally:
            conn.close()

    def _statements(self) -> None:
        """Built once with bind parameters: building SQLAlchemy statements per image costs more than running them."""
        now: BindParameter[Any] = bindparam("now")
        run: BindParameter[Any] = bindparam("run_id")
        ins = self._insert(IMAGES).values(
            run_id=run, rel_path=bindparam("rel"), sha256=bindparam("sha"), model=bindparam("model"),
            size=bindparam("size"), stamp=bindparam("stamp"), status=bindparam("status"), attempts=bindparam("inc"),
            error=None, created_at=now, updated_at=now)
        upsert = ins.on_conflict_do_update(
            index_elements=[IMAGES.c.rel_path, IMAGES.c.sha256, IMAGES.c.model],
            # attempts count towards quarantine until the image is done; a done image processed again
            # (a soak's replay, a new version of the model's file) starts a fresh count
            set_=dict(run_id=ins.excluded.run_id, status=ins.excluded.status, error=None,
                      updated_at=ins.excluded.updated_at, stamp=ins.excluded.stamp,
                      attempts=case((IMAGES.c.status == JobStatus.DONE.value, ins.excluded.attempts),
                                    else_=IMAGES.c.attempts + ins.excluded.attempts)),
            # two workers on one folder (two `run`s sharing a database): an image in another live worker's
            # hands is left to it; the ids query below tells the claimer whose it is
            where=and_(
                or_(IMAGES.c.status != JobStatus.PROCESSING.value, IMAGES.c.run_id == ins.excluded.run_id,
                    bindparam("force", type_=Integer) == 1,
                    IMAGES.c.updated_at < bindparam("stale_before", type_=IMAGES.c.updated_at.type)),
                # done meanwhile by another worker (after this one's ledger check): left done, and to it
                or_(IMAGES.c.status != JobStatus.DONE.value, IMAGES.c.run_id == ins.excluded.run_id,
                    bindparam("redo", type_=Integer) == 1)),
        )
        self._ids = select(IMAGES.c.id, IMAGES.c.rel_path, IMAGES.c.sha256, IMAGES.c.created_at, IMAGES.c.run_id).where(
            IMAGES.c.model == bindparam("model"), IMAGES.c.rel_path.in_(bindparam("rels", expanding=True)))
        finish = update(IMAGES).where(IMAGES.c.id == bindparam("image_id")).values(
            status=bindparam("status"), error=bindparam("error"), updated_at=bindparam("now"),
            attempts=case((IMAGES.c.attempts == 0, 1), else_=IMAGES.c.attempts) - bindparam("undo", type_=Integer))
        # a stamp is recorded on the image's row only when that row is this root's (see Ledger.check_stamp)
        restamp = update(IMAGES).where(
            IMAGES.c.rel_path == bindparam("rel"), IMAGES.c.sha256 == bindparam("sha"),
            IMAGES.c.model == bindparam("model"),
            IMAGES.c.run_id.in_(select(Run.id).where(Run.root == bindparam("root")))).values(stamp=bindparam("stamp"))
        dialect = self.engine.dialect
        self._hot = {"upsert": _Hot(upsert, dialect), "finish": _Hot(finish, dialect),
                     "restamp": _Hot(restamp, dialect)}
        for table, columns in ((RESULTS, ("image_id", "task", "score", "payload", "json_path", "mask_path")),
                               (LABELS, ("image_id", "class_id", "name", "score")),
                               (TIMINGS, tuple(c.key for c in TIMINGS.columns))):
            self._hot[table.name] = _Hot(insert(table).values({c: bindparam(c) for c in columns}), dialect)

    def _write(self, batch: list[Event]) -> None:
        """One transaction per batch; prepared statements and executemany, since this runs for every image."""
        now = utcnow()
        claims: list[dict[str, Any]] = []  # upserts, in event order (the same image may come twice)
        finishes: list[tuple[Finished, tuple[int, bool] | None]] = []  # None: its id comes from this batch
        samples: list[dict[str, Any]] = []
        claimed_now: list[Claimed] = []
        restamps: list[dict[str, Any]] = []
        for e in batch:
            if isinstance(e, Restamped):
                restamps.append(dict(rel=e.rel, sha=e.sha256, model=self.model, root=self.root, stamp=e.stamp))
            elif isinstance(e, Sample):
                samples.append(dict(run_id=self.run_id, at=e.at, rss_bytes=e.rss_bytes, fds=e.fds, threads=e.threads,
                                    queue_depth=e.queue_depth, images_done=e.images_done, gpu_bytes=e.gpu_bytes))
            elif isinstance(e, Claimed):
                self._claimed[(e.rel, e.sha256)] = None  # its id is filled in below
                claimed_now.append(e)
                claims.append(self._claim_params(e.rel, e.sha256, e.size, 1, now, e.take_over, e.redo, e.stamp))
            else:
                known = self._claimed.pop((e.rel, e.sha256), _UNCLAIMED)
                if known is _UNCLAIMED:  # failed before its claim (unreadable file, quarantined): a row all the same
                    claims.append(self._claim_params(e.rel, e.sha256, e.size, 0, now, True, True))
                    known = None
                finishes.append((e, known))
        if self._conn is None:
            self._conn = self._connect()
        conn = self._conn
        with conn.begin():
            ids = self._claim_all(conn, claims, now)
            for c in claimed_now:
                key = (c.rel, c.sha256)
                image_id, fresh, holder = ids[key]
                if holder != self.run_id:  # another live worker's: this one leaves the image alone
                    self._claimed.pop(key, None)
                    self._taken[id(c)] = holder
                elif key in self._claimed:  # not finished in this batch
                    self._claimed[key] = (image_id, fresh)
            finished: dict[int, dict[str, Any]] = {}  # image id -> its last outcome in this batch
            per_image: dict[int, dict[Any, list[dict[str, Any]]]] = {}  # image id -> its result rows
            stale: set[int] = set()
            for e, known in finishes:
                image_id, fresh = known or ids[(e.rel, e.sha256)][:2]
                finished[image_id] = dict(image_id=image_id, status=e.status.value, error=e.error, now=now,
                                          undo=int(e.undo_attempt))
                if not fresh:  # a retried image replaces its earlier rows: never two results
                    stale.add(image_id)
                # the same image twice in one batch (replays, a file dropped again): the last one wins
                rows = per_image[image_id] = {RESULTS: [], LABELS: [], TIMINGS: []}
                if e.status is JobStatus.DONE and e.task is not None:
                    rows[RESULTS].append(dict(image_id=image_id, task=e.task, score=e.score, payload=e.payload or {},
                                              json_path=e.json_path, mask_path=e.mask_path))
                    rows[LABELS] += [dict(image_id=image_id, class_id=c, name=n, score=sc) for c, n, sc in e.labels]
                if e.timings is not None:
                    rows[TIMINGS].append(dict(image_id=image_id, run_id=self.run_id, **e.timings))
            if finished:
                self._hot["finish"].run(conn, list(finished.values()))
            if stale:
                for table in (RESULTS, LABELS, TIMINGS):
                    conn.execute(delete(table).where(table.c.image_id.in_(sorted(stale))))
            for table in (RESULTS, LABELS, TIMINGS):
                values = [r for rows in per_image.values() for r in rows[table]]
                if values:
                    self._hot[table.name].run(conn, values)
            if samples:
                conn.execute(insert(SAMPLES), samples)
            if restamps:
                self._hot["restamp"].run(conn, restamps)

    def _claim_params(self, rel: str, sha256: str, size: int, inc: int, now: datetime, force: bool,
                      redo: bool, stamp: str | None = None) -> dict[str, Any]:
        return dict(run_id=self.run_id, rel=rel, sha=sha256, model=self.model, size=size, stamp=stamp,
                    status=JobStatus.PROCESSING.value, inc=inc, now=now, force=int(force), redo=int(redo),
                    stale_before=now - timedelta(seconds=STALE_CLAIM_S))

    def _claim_all(self, conn: Connection, claims: list[dict[str, Any]],
                   now: datetime) -> dict[tuple[str, str], tuple[int, bool, int]]:
        """Upsert the image rows as processing, attempts + inc, in one executemany; then read their ids
        in one query. Returns (rel, sha256) -> (id, fresh, run id holding it): fresh means first seen now,
        so it has no earlier result rows to replace; a run id not ours means another worker holds it."""
        if not claims:
            return {}
        self._hot["upsert"].run(conn, claims)
        wanted = {(c["rel"], c["sha"]) for c in claims}
        rows = conn.execute(self._ids, {"model": self.model, "rels": sorted({rel for rel, _ in wanted})})
        return {(r.rel_path, r.sha256): (r.id, r.created_at == now, r.run_id)
                for r in rows if (r.rel_path, r.sha256) in wanted}


def _reason(error: BaseException) -> str:
    """The driver's message, without SQLAlchemy's statement and background link."""
    return str(getattr(error, "orig", None) or error).strip().splitlines()[0]


def _describe(event: Event) -> str:
    if isinstance(event, Claimed):
        return f"the claim of {event.rel}"
    if isinstance(event, Finished):
        return f"the outcome of {event.rel} ({event.status.value})"
    if isinstance(event, Restamped):
        return f"the file stamp of {event.rel}"
    return "a memory sample"


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
