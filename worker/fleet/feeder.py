"""The fleet's intake loop: lead the scan when no one else does, claim what the pipeline has room for,
submit it; in burst mode (`worker run`, `watch --burst`) return once the folder is done, files claimed by
dead hosts included (taken once their leases pass, one at a time)."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Protocol

from worker.config import Config
from worker.fleet.leases import RENEWALS_PER_LEASE, Leases
from worker.fleet.queue import Claim, ClaimQueue
from worker.fleet.scanner import FolderScan, InboxScan
from worker.host.names import on_disk
from worker.intake.intake import Intake
from worker.intake.jobs import Job
from worker.intake.scan import walk
from worker.pipeline.items import Counts
from worker.store.db import database_wide
from worker.store.wal import reason

log = logging.getLogger("worker.fleet")

# rows claimed in one transaction at most: a host keeps claiming while its pipeline has room, and a burst of
# files is shared among the hosts instead of going whole to the first that looks
CLAIM_MAX = 8
DB_WAIT_S = 2.0  # the database cannot be reached: tried again this often


class Scan(Protocol):
    def step(self) -> None: ...
    def stop(self) -> None: ...


class Fed(Protocol):
    """What the feeder needs of a pipeline."""

    counts: Counts

    def finish_or_abandon(self, stop: threading.Event | None) -> None: ...

    def submit(self, job: Job, stop: threading.Event | None = None,
               waiting: Callable[[], object] | None = None) -> bool: ...
    def depth(self) -> int: ...
    def drain(self, timeout: float | None = None) -> bool: ...


class Feeder:
    def __init__(self, queue: ClaimQueue, leases: Leases, pipeline: Fed, root: Path, scan: Scan, room: int,
                 poll_s: float) -> None:
        self.queue, self.leases, self.pipeline, self.root, self.scan = queue, leases, pipeline, root, scan
        self.room, self.poll_s = room, poll_s
        self.leading = False
        self._led_at = -float("inf")  # time.monotonic() of the last take or renewal of the scanner's lease
        self.since: datetime = queue.now()  # when this run joined, in the server's clock

    def run(self, stop: threading.Event, burst: bool, check: Callable[[], object] | None = None) -> None:
        """Feed until `stop`; burst: until every file of the folder is done or failed. While the database
        cannot be reached, the feeder waits for it (said once), as the recorder does."""
        down_since: float | None = None
        while not stop.is_set():
            if check is not None:
                check()
            try:
                if self._step(stop):
                    continue
                if burst and self.pipeline.depth() == 0 and self._folder_done():
                    return
            except Exception as e:
                if not database_wide(e):
                    raise
                if down_since is None:
                    down_since = time.monotonic()
                    log.error("the claim queue cannot be reached (%s): waiting for the database", reason(e))
                stop.wait(DB_WAIT_S)
                continue
            if down_since is not None:
                log.warning("the claim queue is back after %.0f s: going on", time.monotonic() - down_since)
                down_since = None
            stop.wait(self.poll_s)

    def _step(self, stop: threading.Event) -> bool:
        """One pass: lead and scan, then claim; whether anything was claimed."""
        self._lead()
        if self.leading:
            self.scan.step()
        return self._take_over_one(stop) or self._take() > 0

    def _lead(self) -> None:
        """Take the scanner's lease when it is free or has passed (its holder died); keep it while this runs. The
        leader renews it RENEWALS_PER_LEASE times a lease; the others look every poll, so that a leader that
        stopped and gave it up is followed at once."""
        every = self.queue.lease_s / RENEWALS_PER_LEASE if self.leading else self.poll_s
        if time.monotonic() - self._led_at < every:
            return
        self._led_at = time.monotonic()
        leading = self.queue.lead()
        if leading != self.leading:
            log.info("%s the scanner of %s for the fleet", "now" if leading else "no longer", self.root)
            if not leading:
                self.scan.stop()
        self.leading = leading

    def _take(self) -> int:
        claims = self.leases.claim(min(CLAIM_MAX, self.room - self.pipeline.depth()))
        for c in claims:
            self.pipeline.submit(self._job(c))
        return len(claims)

    def _take_over_one(self, stop: threading.Event) -> bool:
        """A file whose claimer's lease passed (a dead or paused host): processed alone, and waited for, so that a
        file that kills workers is charged alone and reaches quarantine without its neighbours."""
        claims = self.leases.claim(1, expired=True)
        if not claims:
            return False
        c = claims[0]
        if c.previous_owner is not None:  # the locks its open transactions hold go with its sessions
            if n := self.queue.end_sessions_of(c.previous_owner):
                log.warning("ended %d database session(s) of run %d, whose lease ran out", n, c.previous_owner)
        log.warning("%s was claimed by a worker whose lease ran out (dead, or cut off): processing it on its own",
                    c.rel)
        self.pipeline.submit(self._job(c))
        while not self.pipeline.drain(timeout=0.2) and not stop.is_set():
            pass
        return True

    def _job(self, c: Claim) -> Job:
        rel = on_disk(self.root, c.rel)
        # the queue's claim is the authority: the image's row is taken over whoever's run last touched it
        return Job(path=self.root / rel, rel=rel, size=c.size, mtime_ns=c.mtime_ns, take_over=True, ticket=c.ticket)

    def _folder_done(self) -> bool:
        left = self.queue.outstanding(self.since)
        return left.scanned and left.waiting == 0


def feed_folder(cfg: Config, folder: Path, pipeline: Fed, leases: Leases, stop: threading.Event,
                tick: Callable[[], object]) -> None:
    """`worker run DIR` in fleet mode: this host's share of the folder; returns once all of it is done."""
    scan = FolderScan(leases.queue, lambda: walk(folder, cfg.extensions, skip=(cfg.outbox,)), folder, cfg.fleet.scan_s)
    feeder = Feeder(leases.queue, leases, pipeline, folder, scan, cfg.pipeline.queue_size, cfg.fleet.poll_s)
    feeder.since = leases.queue.want_scan()  # done once a full scan begun after this has ended
    leases.queue.requeue_failed()  # a new run retries what failed, as on one host
    feeder.run(stop, burst=True, check=tick)
    done_before = leases.queue.done_before(feeder.since)  # skipped, as on one host, without even a claim
    pipeline.counts.skipped += done_before
    pipeline.counts.unread += done_before


def feed_inbox(cfg: Config, inbox: Path, pipeline: Fed, leases: Leases, stop: threading.Event, burst: bool,
               ready: threading.Event | None, tick: Callable[[], object]) -> None:
    """`worker watch` in fleet mode: the scanner (one host at a time) queues what is complete; every host claims."""
    # a file seen again longer than a lease after its row was finished is a new drop (moved or deleted inputs)
    again = None if cfg.inputs.watch == "keep" else cfg.fleet.lease_s
    scan = InboxScan(leases.queue, lambda found, done: Intake(inbox, cfg.extensions, cfg.watch.settle_s, 0.0, found,
                                                              done=done, incomplete_s=cfg.watch.incomplete_s),
                     cfg.fleet.scan_s, again)
    feeder = Feeder(leases.queue, leases, pipeline, inbox, scan, cfg.pipeline.queue_size, cfg.fleet.poll_s)
    log.info("watching %s with the fleet (run %d, lease %g s)", inbox, leases.queue.me, leases.queue.lease_s)
    if ready is not None:
        ready.set()
    feeder.run(stop, burst=burst, check=tick)
    pipeline.finish_or_abandon(stop)
