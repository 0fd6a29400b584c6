"""Jobs and their states: the unit of work that flows from intake to the recorder."""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from worker.host.names import as_text


class JobStatus(str, enum.Enum):
    QUEUED = "queued"
    PROCESSING = "processing"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Job:
    """One input file as intake saw it. `rel` is the POSIX path relative to the intake root."""

    path: Path
    rel: str
    size: int
    mtime_ns: int
    enqueued_at: float = field(default_factory=time.perf_counter, compare=False, hash=False)
    # recovery of an image a dead worker left `processing`: its claim takes the row over (see Claimed)
    take_over: bool = field(default=False, compare=False, hash=False)
    # fleet mode: (queue row, generation) of this worker's claim on the file (worker.fleet.queue)
    ticket: tuple[int, int] | None = field(default=None, compare=False, hash=False)

    @cached_property
    def key(self) -> str:
        """`rel` as the database, JSON documents and logs know it (worker.host.names: undecodable bytes as \\xNN)."""
        return as_text(self.rel)

    @classmethod
    def from_path(cls, root: Path, path: Path) -> "Job":
        st = os.stat(path)
        text, top = os.fspath(path), os.fspath(root).rstrip(os.sep)
        if os.sep == "/" and text.startswith(top + "/"):  # pathlib's relative_to costs 4x the stat, per image
            rel = text[len(top) + 1:]
        else:
            rel = path.relative_to(root).as_posix()
        return cls(path=path, rel=rel, size=st.st_size, mtime_ns=st.st_mtime_ns)

    def as_tuple(self) -> tuple[str, str, int, int, float, bool]:
        """The job as plain values, for another process (a tuple pickles in a fraction of a dataclass's time)."""
        return os.fspath(self.path), self.rel, self.size, self.mtime_ns, self.enqueued_at, self.take_over

    @classmethod
    def from_tuple(cls, values: tuple[str, str, int, int, float, bool]) -> "Job":
        path, rel, size, mtime_ns, enqueued_at, take_over = values
        return cls(Path(path), rel, size, mtime_ns, enqueued_at, take_over)
