"""`worker fleet`: the runs alive on a database (their heartbeats), what each holds and finishes, the queue by
state and who scans each folder. Read only; every figure in the database server's clock."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, and_, func, select

from worker.store.schema import QueueRow, Run, ScannerRow, utcnow

RATE_WINDOW_S = 60.0  # a run's rate: the files it finished over this long


@dataclass(frozen=True)
class Member:
    run: int
    host: str
    pid: int
    mode: str
    model: str
    root: str
    heartbeat_s: float  # since its last renewal
    leases: int  # files claimed and not yet finished
    rate: float  # files finished per second over the last RATE_WINDOW_S


@dataclass(frozen=True)
class Folder:
    model: str
    root: str
    states: dict[str, int]
    scanner: int | None  # the run holding the scanner's lease (None: no one now)
    scanner_host: str | None
    last_scan_s: float | None  # since the last full scan ended


@dataclass(frozen=True)
class FleetView:
    members: list[Member]
    folders: list[Folder]

    def as_dict(self) -> dict[str, Any]:
        return {"members": [asdict(m) for m in self.members], "folders": [asdict(f) for f in self.folders]}


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else round((now - then).total_seconds(), 1)


def fleet_view(engine: Engine, lease_s: float) -> FleetView:
    """The runs that renewed within two leases and have not finished, and every folder with a queue."""
    with engine.connect() as c:
        now: datetime = (c.execute(select(func.now())).scalar() if engine.dialect.name == "postgresql" else None) \
            or utcnow()
        alive = and_(Run.finished_at.is_(None), Run.heartbeat_at > now - timedelta(seconds=2 * lease_s))
        held = (select(QueueRow.owner, func.count().label("n")).where(QueueRow.state == "claimed")
                .group_by(QueueRow.owner).subquery())
        recent = (select(QueueRow.owner, func.count().label("n"))
                  .where(QueueRow.state.in_(("done", "failed")),
                         QueueRow.updated_at > now - timedelta(seconds=RATE_WINDOW_S))
                  .group_by(QueueRow.owner).subquery())
        members = [Member(r.id, r.host, r.pid, r.mode, r.model, r.root, _age(now, r.heartbeat_at) or 0.0,
                          int(r.held or 0), round((r.recent or 0) / RATE_WINDOW_S, 2))
                   for r in c.execute(select(Run.id, Run.host, Run.pid, Run.mode, Run.model, Run.root, Run.heartbeat_at,
                                             held.c.n.label("held"), recent.c.n.label("recent"))
                                      .outerjoin(held, held.c.owner == Run.id).outerjoin(recent, recent.c.owner == Run.id)
                                      .where(alive).order_by(Run.id))]
        states: dict[tuple[str, str], dict[str, int]] = {}
        for model, root, state, n in c.execute(select(QueueRow.model, QueueRow.root, QueueRow.state, func.count())
                                               .group_by(QueueRow.model, QueueRow.root, QueueRow.state)):
            states.setdefault((model, root), {})[state] = n
        scanners = {(s.model, s.root): s for s in c.execute(
            select(ScannerRow.model, ScannerRow.root, ScannerRow.leader, ScannerRow.lease_until, ScannerRow.scan_finished,
                   Run.host).outerjoin(Run, Run.id == ScannerRow.leader))}
    folders = []
    for key in sorted(set(states) | set(scanners)):
        s = scanners.get(key)
        leading = s is not None and s.lease_until is not None and s.lease_until > now
        folders.append(Folder(key[0], key[1], states.get(key, {}), s.leader if leading and s else None,
                              s.host if leading and s else None, _age(now, s.scan_finished) if s else None))
    return FleetView(members, folders)
