"""The recorder's write path: its statements built once and compiled for the database's dialect, and one
batch of events written in one transaction (claims first, as upserts, then outcomes, stamps and samples)."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (BindParameter, Connection, Engine, Integer, Table, and_, bindparam, case, delete, insert, or_,
                        select, update)

from worker.fleet.queue import SETTLE
from worker.intake.jobs import JobStatus
from worker.store.events import Claimed, Event, Finished, Settled, StampRenewed, Sample
from worker.store import tallies
from worker.store.schema import BatchRow, ImageRow, LabelRow, MemorySample, ResultRow, Run, TimingRow, utcnow

# the mapped classes' tables (declared as FromClause, which they are more than)
IMAGES, RESULTS, LABELS = (cast(Table, c.__table__) for c in (ImageRow, ResultRow, LabelRow))
TIMINGS, SAMPLES = cast(Table, TimingRow.__table__), cast(Table, MemorySample.__table__)
BATCHES = cast(Table, BatchRow.__table__)
_UNCLAIMED: Any = object()
# a claim older than this that its worker never finished is taken over by another worker's claim (a
# worker on another host that died: this host's dead workers are recovered at the next start)
STALE_CLAIM_S = 600.0


class CompiledStatement:
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


class BatchMarks:
    """A recorder's batch numbers, each written in its batch's transaction (table `batches`): after a commit whose
    acknowledgement was lost (the connection broke), the server says whether that batch was committed."""

    def __init__(self, engine: Engine, insert: Any, run_id: int) -> None:
        self.engine, self.run_id = engine, run_id
        self.writer = secrets.token_hex(16)
        self.sent = 0  # the number of the last batch whose transaction was begun
        ins = insert(BATCHES).values(writer=self.writer, run_id=run_id, last=bindparam("last"))
        self._mark = CompiledStatement(ins.on_conflict_do_update(index_elements=[BATCHES.c.writer],
                                                                 set_=dict(last=ins.excluded.last)), engine.dialect)

    def begin(self) -> None:
        """A new batch: its number, whether its transaction gets as far as `mark` or not."""
        self.sent += 1

    def mark(self, conn: Connection) -> None:
        self._mark.run(conn, [{"last": self.sent}])

    def landed(self) -> bool:
        """Whether the last batch sent was committed (asked on a connection of its own; raises where the
        database cannot be asked)."""
        with self.engine.connect() as c:
            last = c.execute(select(BATCHES.c.last).where(BATCHES.c.writer == self.writer)).scalar()
        return last == self.sent

    def forget(self) -> None:
        """The recorder's end: its row is no longer needed (one left by a killed worker goes with its run)."""
        with self.engine.begin() as c:
            c.execute(delete(BATCHES).where(BATCHES.c.writer == self.writer))


class EventWrites:
    """What the recorder writes with; its state is the recorder's (`Recorder.__init__` sets it)."""

    engine: Engine
    model: str
    root: str
    run_id: int
    _insert: Any  # the dialect's insert, for upserts
    _claimed: dict[tuple[str, str], tuple[int, bool] | None]
    _taken: dict[int, int]
    _conn: Connection | None
    _lost: set[int]  # id() of the fleet finishes in the batch being written that the fence turned away
    _batches: BatchMarks | None  # PostgreSQL: each batch's number, written in its transaction

    def _connect(self) -> Connection:
        raise NotImplementedError

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
        self._hot = {"upsert": CompiledStatement(upsert, dialect), "finish": CompiledStatement(finish, dialect),
                     "restamp": CompiledStatement(restamp, dialect),
                     "tallies": CompiledStatement(tallies.upsert(self._insert), dialect)}
        for table, columns in ((RESULTS, ("image_id", "task", "score", "payload", "json_path", "mask_path")),
                               (LABELS, ("image_id", "class_id", "name", "score")),
                               (TIMINGS, tuple(c.key for c in TIMINGS.columns))):
            self._hot[table.name] = CompiledStatement(insert(table).values({c: bindparam(c) for c in columns}), dialect)

    def _write(self, batch: list[Event]) -> None:
        """One transaction per batch; prepared statements and executemany, since this runs for every image."""
        now = utcnow()
        claims: list[dict[str, Any]] = []  # upserts, in event order (the same image may come twice)
        finishes: list[tuple[Finished, tuple[int, bool] | None]] = []  # None: its id comes from this batch
        samples: list[dict[str, Any]] = []
        claimed_now: list[Claimed] = []
        restamps: list[dict[str, Any]] = []
        unclaimed: list[Finished] = []  # failed before their claim: a row all the same, written below
        for e in batch:
            if isinstance(e, StampRenewed):
                restamps.append(dict(rel=e.rel, sha=e.sha256, model=self.model, root=self.root, stamp=e.stamp))
            elif isinstance(e, Sample):
                samples.append(dict(run_id=self.run_id, at=e.at, rss_bytes=e.rss_bytes, fds=e.fds, threads=e.threads,
                                    queue_depth=e.queue_depth, images_done=e.images_done, gpu_bytes=e.gpu_bytes))
            elif isinstance(e, Settled):
                continue  # only its queue row: the fence below
            elif isinstance(e, Claimed):
                self._claimed[(e.rel, e.sha256)] = None  # its id is filled in below
                claimed_now.append(e)
                claims.append(self._claim_params(e.rel, e.sha256, e.size, 1, now, e.take_over, e.redo, e.stamp))
            else:
                known = self._claimed.pop((e.rel, e.sha256), _UNCLAIMED)
                if known is _UNCLAIMED:  # failed before its claim (unreadable file, quarantined): a row all the same
                    unclaimed.append(e)
                    known = None
                finishes.append((e, known))
        if self._conn is None:
            self._conn = self._connect()
        conn = self._conn
        if self._batches is not None:
            self._batches.begin()
        with conn.begin():
            if fenced := [e for e in batch if isinstance(e, (Finished, Settled)) and e.ticket is not None]:
                self._fence(conn, fenced)
                finishes = [(e, known) for e, known in finishes if id(e) not in self._lost]
            claims += [self._claim_params(e.rel, e.sha256, e.size, 0, now, True, True) for e in unclaimed
                       if id(e) not in self._lost]
            # rows locked in key order: two workers' transactions then never wait for each other in a cycle
            claims.sort(key=lambda c: (c["rel"], c["sha"]))
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
                self._hot["finish"].run(conn, [finished[i] for i in sorted(finished)])
            if stale:
                for table in (RESULTS, LABELS, TIMINGS):
                    conn.execute(delete(table).where(table.c.image_id.in_(sorted(stale))))
            for table in (RESULTS, LABELS, TIMINGS):
                values = [r for rows in per_image.values() for r in rows[table]]
                if values:
                    self._hot[table.name].run(conn, values)
            if finishes:
                self._hot["tallies"].run(conn, tallies.as_rows(self.run_id, tallies.tally([e for e, _ in finishes], now)))
            if samples:
                conn.execute(insert(SAMPLES), samples)
            if restamps:
                self._hot["restamp"].run(conn, restamps)
            if self._batches is not None:
                self._batches.mark(conn)

    def _fence(self, conn: Connection, events: list[Finished | Settled]) -> None:
        """Fleet mode: end each event's claim in the queue, where the claim is still this run's at its
        generation; the events whose claim passed to another worker are noted in `_lost`, and not written."""
        states = {JobStatus.DONE: "done", JobStatus.FAILED: "failed", JobStatus.QUEUED: "claimed"}
        events = sorted(events, key=lambda e: e.ticket or (0, 0))  # rows locked in id order
        tickets = [e.ticket for e in events if e.ticket is not None]
        won = {row[0] for row in conn.exec_driver_sql(SETTLE, {
            "ids": [t[0] for t in tickets], "gens": [t[1] for t in tickets], "me": self.run_id,
            "states": [states[e.status] if isinstance(e, Finished) else "done" for e in events]})}
        for e in events:
            if e.ticket is not None and e.ticket[0] not in won:
                self._lost.add(id(e))

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
