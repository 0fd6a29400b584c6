"""The worker's side of its leases: renewed on a thread of their own, and the fence asked before outputs.

A lease is granted in the server's clock for `lease_s`; this host counts it from the moment it sent the
renewal (its own monotonic clock, never compared with another host's), less a margin. A worker that was
paused past that (SIGSTOP, a suspended VM, a hung read) asks the server again before it writes anything."""

from __future__ import annotations

import logging
import threading
import time

from worker.fleet.queue import Claim, ClaimQueue
from worker.store.db import database_wide

log = logging.getLogger("worker.fleet")

RENEWALS_PER_LEASE = 4  # a lease is renewed this often within its span (every 15 s for 60 s)
# a lease counts as held locally for this share of its span after the renewal was sent
HELD_SHARE = 0.75


class Leases:
    """This run's claims and their leases; `holds(ticket)` is the fence before a claim's outputs are written."""

    def __init__(self, queue: ClaimQueue) -> None:
        self.queue = queue
        self._lock = threading.Lock()
        self._mine: set[tuple[int, int]] = set()
        self._lost: set[tuple[int, int]] = set()
        self._held_until = 0.0  # time.monotonic() up to which every claim in _mine is surely still this run's
        self._stop = threading.Event()
        self.renew()  # the run's first heartbeat: alive from its start (worker fleet, requeue_failed)
        self._thread = threading.Thread(target=self._loop, name="leases", daemon=True)
        self._thread.start()

    def claim(self, k: int, expired: bool = False) -> list[Claim]:
        with self._lock:  # not while a renewal is judging which claims are lost
            sent = time.monotonic()
            claims = self.queue.claim(k, expired)
            self._mine.update(c.ticket for c in claims)
            if not self._mine - {c.ticket for c in claims}:
                self._held_until = max(self._held_until, sent + HELD_SHARE * self.queue.lease_s)
        return claims

    def settled(self, ticket: tuple[int, int]) -> None:
        """The claim's outcome is handed on (committed, or fenced off): no longer watched for loss here."""
        with self._lock:
            self._mine.discard(ticket)
            self._lost.discard(ticket)

    def holds(self, ticket: tuple[int, int]) -> bool:
        """Whether the claim is still this run's: from the last renewal while it is fresh, else asked anew.
        A database that cannot say is asked again for up to one lease span; then the claim counts as lost
        (its lease has passed by then: another worker may have it)."""
        deadline = time.monotonic() + self.queue.lease_s
        while True:
            with self._lock:
                if ticket in self._lost:
                    return False
                if time.monotonic() < self._held_until and ticket in self._mine:
                    return True
            try:
                self.renew()
            except Exception as e:
                if not database_wide(e) or time.monotonic() > deadline:
                    log.error("cannot confirm the claim of queue row %d (%s): its result is not written", ticket[0], e)
                    return False
                time.sleep(1.0)
                continue
            with self._lock:
                return ticket in self._mine and ticket not in self._lost

    def renew(self) -> None:
        with self._lock:
            sent = time.monotonic()
            kept = self.queue.renew()
            lost = self._mine - kept
            lost -= self.queue.still_mine(lost)  # finished by this run since it was claimed, not yet told here
            if lost:
                log.warning("%d claim(s) passed to other workers while this one held them (its lease ran out: "
                            "paused, or cut off from the database); their results here are discarded", len(lost))
            self._lost |= lost
            self._mine -= lost
            self._held_until = sent + HELD_SHARE * self.queue.lease_s

    def _loop(self) -> None:
        while not self._stop.wait(self.queue.lease_s / RENEWALS_PER_LEASE):
            try:
                self.renew()
            except Exception as e:  # the database is down or restarting: the next renewal tries again
                log.warning("could not renew this worker's leases: %s", e)

    def held(self) -> int:
        with self._lock:
            return len(self._mine)

    def close(self) -> None:
        """Stop renewing and give the claims left back to the queue."""
        self._stop.set()
        self._thread.join()
        try:
            if n := self.queue.release():
                log.info("%d claim(s) not processed went back to the queue for other workers", n)
        except Exception as e:
            log.warning("could not give this worker's claims back (%s): others take them once their leases pass", e)
