"""The claim queue's statements (PostgreSQL): enqueue, claim with FOR UPDATE SKIP LOCKED, renew, settle.
A row's state is queued, claimed, done or failed (docs/database.md#fleet).

Each is one short transaction on the worker's shared connection; rows are locked in key order, and a
transaction that loses a race anyway (deadlock, serialization failure) is run again at once."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Sequence

from worker.store.shared import SharedConnection


@dataclass(frozen=True)
class Claim:
    """A queue row claimed by this worker: `generation` fences its finish."""

    id: int
    rel: str  # as the database knows it (worker.host.names.as_text)
    size: int
    mtime_ns: int
    generation: int
    previous_owner: int | None  # the run whose lease on it expired (dead, frozen or cut off); None: it was queued

    @property
    def ticket(self) -> tuple[int, int]:
        return self.id, self.generation


@dataclass(frozen=True)
class Outstanding:
    """What is left of a folder: rows not yet done or failed, and whether a full scan has ended since `since`."""

    waiting: int
    scanned: bool


_ENQUEUE = """
INSERT INTO queue (model, root, rel_path, size, mtime_ns, state, generation, attempts, created_at, updated_at)
SELECT %(model)s, %(root)s, t.r, t.s, t.m, 'queued', 0, 0, now(), now()
FROM unnest(%(rels)s::text[], %(sizes)s::bigint[], %(mtimes)s::bigint[]) AS t(r, s, m)
ORDER BY t.r, t.s, t.m
ON CONFLICT (model, root, rel_path, size, mtime_ns) DO UPDATE
SET state = 'queued', owner = NULL, lease_until = NULL, updated_at = now()
WHERE queue.state IN ('done', 'failed') AND queue.updated_at < now() - make_interval(secs => %(after)s)
"""
# (DO NOTHING takes no lock on a row already there: a rescan does not contend with the workers' finishes)
_ENQUEUE_NEW = _ENQUEUE.split("ON CONFLICT")[0] + "ON CONFLICT DO NOTHING"

_CLAIM = """
UPDATE queue AS q
SET state = 'claimed', owner = %(me)s, generation = q.generation + 1, attempts = q.attempts + 1,
    lease_until = now() + make_interval(secs => %(lease)s), updated_at = now()
FROM (SELECT id, CASE WHEN state = 'claimed' THEN owner END AS previous_owner FROM queue
      WHERE model = %(model)s AND root = %(root)s
        AND (CASE WHEN %(expired)s THEN state = 'claimed' AND lease_until < now() ELSE state = 'queued' END)
      ORDER BY id LIMIT %(k)s FOR UPDATE SKIP LOCKED) AS c
WHERE q.id = c.id
RETURNING q.id, q.rel_path, q.size, q.mtime_ns, q.generation, c.previous_owner
"""

_RENEW = """
WITH renewed AS (
    UPDATE queue SET lease_until = now() + make_interval(secs => %(lease)s)
    WHERE owner = %(me)s AND state = 'claimed' RETURNING id, generation),
beat AS (UPDATE runs SET heartbeat_at = now() WHERE id = %(me)s)
SELECT id, generation FROM renewed
"""

# the fence: a finish counts only while the claim is still this run's, at this generation (a row already in the
# finish's state, by this run at this generation, is this finish's own, committed before its acknowledgement was lost)
SETTLE = """
UPDATE queue AS q SET state = v.state, lease_until = CASE WHEN v.state = 'claimed' THEN q.lease_until END,
                      updated_at = now()
FROM unnest(%(ids)s::bigint[], %(gens)s::int[], %(states)s::text[]) AS v(id, gen, state)
WHERE q.id = v.id AND q.generation = v.gen AND q.owner = %(me)s AND (q.state = 'claimed' OR q.state = v.state)
RETURNING q.id
"""

# the runs alive: not finished, and renewing (a run renews at its start, then RENEWALS_PER_LEASE times per lease)
ALIVE = "SELECT id FROM runs WHERE finished_at IS NULL AND heartbeat_at > now() - make_interval(secs => 2 * %(lease)s)"

_END_SESSIONS = """
SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity AS a JOIN runs AS r ON a.application_name = r.session
WHERE a.datname = current_database() AND r.id = %(owner)s AND r.id <> %(me)s
"""

_LEAD = """
INSERT INTO scanners (model, root, leader, lease_until) VALUES (%(model)s, %(root)s, %(me)s,
                                                              now() + make_interval(secs => %(lease)s))
ON CONFLICT (model, root) DO UPDATE SET leader = EXCLUDED.leader, lease_until = EXCLUDED.lease_until
WHERE scanners.leader = EXCLUDED.leader OR scanners.lease_until IS NULL OR scanners.lease_until < now()
RETURNING leader
"""


class ClaimQueue:
    """One folder's queue for one model, as seen by run `me` (its id is the claims' owner)."""

    def __init__(self, shared: SharedConnection, me: int, model: str, root: str, lease_s: float) -> None:
        self.shared, self.me, self.model, self.root, self.lease_s = shared, me, model, root, lease_s
        self._key = {"me": me, "model": model, "root": root, "lease": lease_s}

    def now(self) -> datetime:
        """The server's clock: every lease and scan time is in it, never a host's."""
        return self.shared.run("SELECT now()")[0][0]  # type: ignore[no-any-return]

    def enqueue(self, files: Sequence[tuple[str, int, int]], requeue_after_s: float | None = None) -> None:
        """Rows for files seen by the scanner, (rel, size, mtime_ns) each; a file already there is left as it is,
        unless `requeue_after_s` is given and its row was finished longer ago than that (dropped again)."""
        if files:
            rels, sizes, mtimes = (list(column) for column in zip(*files))
            self.shared.run(_ENQUEUE if requeue_after_s is not None else _ENQUEUE_NEW,
                            {**self._key, "rels": rels, "sizes": sizes, "mtimes": mtimes, "after": requeue_after_s},
                            fetch=False)

    def claim(self, k: int, expired: bool = False) -> list[Claim]:
        """Up to `k` queued rows, oldest first, or (`expired`) rows whose owner's lease has passed."""
        if k <= 0:
            return []
        rows = self.shared.run(_CLAIM, {**self._key, "k": k, "expired": expired})
        return sorted((Claim(*row) for row in rows), key=lambda c: c.id)

    def renew(self) -> set[tuple[int, int]]:
        """Extend every lease this run holds (and its heartbeat); returns the claims still its own."""
        return {(i, g) for i, g in self.shared.run(_RENEW, self._key)}

    def end_sessions_of(self, owner: int) -> int:
        """End the database sessions of run `owner`, whose lease on a claim passed (dead, frozen or cut off): a
        frozen worker's open transaction would otherwise hold the rows it locked until it thaws (PostgreSQL ends
        an idle one itself, not one frozen within a pipeline of statements). Returns how many were ended."""
        return len(self.shared.run(_END_SESSIONS, {**self._key, "owner": owner}))

    def still_mine(self, claims: set[tuple[int, int]]) -> set[tuple[int, int]]:
        """Of these claims, those still this run's at their generation, whatever their state (finished by it since)."""
        if not claims:
            return set()
        found = self.shared.run("SELECT id, generation FROM queue WHERE id = ANY(%(ids)s) AND owner = %(me)s",
                                {**self._key, "ids": [i for i, _ in claims]})
        return {(i, g) for i, g in found} & claims

    def lead(self) -> bool:
        """Take or keep the scanner's lease for this folder; True while this run holds it."""
        return bool(self.shared.run(_LEAD, self._key))

    def want_scan(self) -> datetime:
        """A `run` joining: ask the scanner for a full scan begun after now (the server's clock, returned)."""
        rows = self.shared.run("INSERT INTO scanners (model, root, scan_wanted) VALUES (%(model)s, %(root)s, now()) "
                               "ON CONFLICT (model, root) DO UPDATE SET scan_wanted = EXCLUDED.scan_wanted "
                               "RETURNING scan_wanted", self._key)
        return rows[0][0]  # type: ignore[no-any-return]

    def scan_wanted(self) -> bool:
        """Whether a run has asked for a scan since the last one began, or none ever began, or the last one never
        finished (its scanner died or froze mid-scan: the runs waiting for a scan begun after they joined would
        otherwise wait for ever)."""
        rows = self.shared.run("SELECT scan_started IS NULL OR scan_wanted >= scan_started OR scan_finished IS NULL "
                               "OR scan_finished < scan_started FROM scanners "
                               "WHERE model = %(model)s AND root = %(root)s", self._key)
        return bool(rows and rows[0][0])

    def scan_started(self) -> datetime:
        rows = self.shared.run("UPDATE scanners SET scan_started = now() WHERE model = %(model)s AND root = %(root)s "
                               "AND leader = %(me)s RETURNING scan_started", self._key)
        return rows[0][0] if rows else self.now()  # type: ignore[no-any-return]

    def scan_finished(self, started: datetime) -> None:
        self.shared.run("UPDATE scanners SET scan_finished = now() WHERE model = %(model)s AND root = %(root)s "
                        "AND leader = %(me)s AND scan_started = %(started)s", {**self._key, "started": started},
                        fetch=False)

    def outstanding(self, since: datetime) -> Outstanding:
        rows = self.shared.run(
            "SELECT (SELECT count(*) FROM queue WHERE model = %(model)s AND root = %(root)s "
            "        AND state IN ('queued', 'claimed')),"
            "       (SELECT scan_started >= %(since)s AND scan_finished >= scan_started FROM scanners "
            "        WHERE model = %(model)s AND root = %(root)s)", {**self._key, "since": since})
        waiting, scanned = rows[0]
        return Outstanding(int(waiting), bool(scanned))

    def done_before(self, since: datetime) -> int:
        """Files of the folder done before `since` (a run's start): what that run skipped unread."""
        rows = self.shared.run("SELECT count(*) FROM queue WHERE model = %(model)s AND root = %(root)s "
                               "AND state = 'done' AND updated_at < %(since)s", {**self._key, "since": since})
        return int(rows[0][0])

    def requeue_failed(self) -> int:
        """A new `run` retries the images that failed in runs no longer alive, as a rerun does on one host (not
        those its live peers failed just now)."""
        rows = self.shared.run("UPDATE queue SET state = 'queued', owner = NULL, lease_until = NULL, updated_at = now() "
                               "WHERE model = %(model)s AND root = %(root)s AND state = 'failed' AND (owner IS NULL "
                               "OR owner NOT IN (" + ALIVE + ")) RETURNING id", self._key)
        return len(rows)

    def release(self) -> int:
        """Shutting down: this run's claims back to the queue at once (others need not wait for the leases
        to pass), and its scanner lease given up. Returns how many claims."""
        rows = self.shared.run("UPDATE queue SET state = 'queued', owner = NULL, lease_until = NULL, updated_at = now() "
                               "WHERE owner = %(me)s AND state = 'claimed' RETURNING id", self._key)
        self.shared.run("UPDATE scanners SET lease_until = NULL WHERE leader = %(me)s", self._key, fetch=False)
        return len(rows)
