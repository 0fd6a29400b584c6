"""The pause while the outbox's disk is full: no fault of the images'. An image whose outputs found no
room waits here, in order, with intake paused; the decode threads wait too, one of them looking for
room every ROOM_CHECK_S, and once there is room the waiting images go first. On shutdown nothing waits
for room any more: what waits stays queued for the next start."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from worker.errors import OutboxFull
from worker.intake.jobs import Job

log = logging.getLogger(__name__)

# while the outbox's disk is full, one decode thread looks for room this often (and takes no new job)
ROOM_CHECK_S = 5.0
# and the log says again this often that the worker is still paused: an operator who missed the first
# line, or looks at the log hours later, sees how long it has waited and how many images wait
FULL_REMINDER_S = 600.0


class FullOutboxPause:
    """Whether the outbox has room, and the jobs that wait for it (any thread may call any method)."""

    def __init__(self, has_room: Callable[[], bool], where: Path) -> None:
        self._has_room, self._where = has_room, where  # where: the outbox's root, for the log
        self._room = threading.Event()
        self._room.set()
        self._checking = threading.Lock()  # one thread at a time looks for room
        self._stopped = threading.Event()  # shutting down: nothing waits for room any more
        self._paused_at = self._reminded_at = 0.0  # time.monotonic() of the pause and of its last log line
        self._waiting: deque[Job] = deque()

    @property
    def full(self) -> bool:
        return not self._room.is_set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def defer(self, job: Job, reason: OutboxFull) -> None:
        """`job` found no room: it waits, and intake pauses (said once per pause)."""
        if self._room.is_set():
            log.error("%s: pausing until there is room (checked every %g s); waiting images keep their place",
                      reason, ROOM_CHECK_S)
            self._paused_at = self._reminded_at = time.monotonic()
        self._room.clear()
        self._waiting.append(job)

    def next_waiting(self) -> Job | None:
        """The oldest job that waited for room, or None: they go before any new job."""
        try:
            return self._waiting.popleft()
        except IndexError:  # none, or another thread took the last
            return None

    def wait(self) -> None:
        """Block while the outbox is full, until there is room or `stop_waiting()`."""
        while not self._room.wait(ROOM_CHECK_S) and not self._stopped.is_set():
            with self._checking:
                if self._room.is_set():
                    continue
                now = time.monotonic()
                if self._has_room():
                    log.warning("room in the outbox again after %.0f s: resuming (%d images waited)",
                                now - self._paused_at, len(self._waiting))
                    self._room.set()
                elif now - self._reminded_at >= FULL_REMINDER_S:
                    log.error("%s: still no room after %.0f s; %d images wait (make room to resume)",
                              self._where, now - self._paused_at, len(self._waiting))
                    self._reminded_at = now

    def stop_waiting(self) -> list[Job]:
        """Shutdown: no thread waits for room any more. Returns the jobs that were waiting for it (they stay
        queued in the database, their inputs where they are, for the next start)."""
        self._stopped.set()
        taken = []
        while (job := self.next_waiting()) is not None:
            taken.append(job)
        if taken:
            log.warning("%d images still wait for room in the outbox: queued, for the next start", len(taken))
        return taken
