"""What the stages hand the recorder: frozen events, and the `Commit` flag that says once an
event's transaction has ended whether it is in the database."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Union


from worker.intake.jobs import JobStatus
from worker.store.schema import utcnow


@dataclass(frozen=True)
class RunInfo:
    mode: str
    root: str
    model: str
    model_sha256: str
    providers: str
    config: dict[str, Any] = field(hash=False)
    card_sha256: str = ""  # models.card.settings_digest ("": none recorded)


# Commit.taken_by of a fleet finish fenced off: its claim passed to another worker, whose outcome stands
LEASE_LOST = 0


class Commit:
    """Set by the recorder once an event's transaction has ended; `wait()` says whether it is recorded."""

    def __init__(self, then: Callable[[bool], None] | None = None) -> None:
        """`then(recorded)`: called once the transaction has ended, on the recorder's thread (fleet mode publishes
        an image's staged outputs there, or discards them)."""
        self._then = then
        self._ended = threading.Event()
        self._recorded = False
        # a claim: the run of another live worker that holds the image; a fleet finish: LEASE_LOST
        self.taken_by: int | None = None

    def set(self, recorded: bool = True, taken_by: int | None = None) -> None:
        self._recorded, self.taken_by = recorded, taken_by
        if self._then is not None:
            try:
                self._then(recorded)
            except Exception:  # an output that cannot be published must not stop the recorder: logged
                logging.getLogger(__name__).exception("after the commit of an image's outcome")
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
    # fleet mode: (queue row, generation) of the claim; the outcome is written only while that claim holds
    ticket: tuple[int, int] | None = None


@dataclass(frozen=True, eq=False)
class Settled:
    """Fleet mode: a claimed file needed no processing (found done by its content): its queue row is done."""

    ticket: tuple[int, int]
    committed: Commit | None = None


@dataclass(frozen=True, eq=False)
class StampRenewed:
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


Event = Union[Claimed, Finished, StampRenewed, Sample, Settled]


def describe(event: Event) -> str:
    if isinstance(event, Claimed):
        return f"the claim of {event.rel}"
    if isinstance(event, Finished):
        return f"the outcome of {event.rel} ({event.status.value})"
    if isinstance(event, StampRenewed):
        return f"the file stamp of {event.rel}"
    if isinstance(event, Settled):
        return f"the end of queue row {event.ticket[0]}'s claim"
    return "a memory sample"
