"""Free space where the worker writes (outbox, archive, a SQLite database): the watcher's status line,
`worker run`'s log and `worker health` say when it runs low.

A watcher of months fills its disks: the archive keeps every input (a camera writing a 500 KB JPEG a
second adds about 43 GB a day). A full outbox or archive loses nothing (outputs wait for room, inputs
stay in the inbox: docs/reliability.md), but it stops the work; this says so while there is room
left, and how soon it runs out at the rate it is filling.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

log = logging.getLogger("worker.host.disks")

@dataclass(frozen=True)
class Filesystem:
    """One filesystem the worker writes to, named by what it holds there ("outbox and archive")."""

    path: Path  # a folder on it that exists
    holds: str


def filesystems(folders: Sequence[tuple[str, Path]]) -> list[Filesystem]:
    """(what, folder) -> one Filesystem per device among the folders that exist (or whose parent does:
    an archive made on first use), in the order first named."""
    seen: dict[int, tuple[Path, list[str]]] = {}
    for what, folder in folders:
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is None:
            continue
        dev = os.stat(existing).st_dev
        path, names = seen.setdefault(dev, (existing, []))
        if what not in names:
            names.append(what)
    return [Filesystem(path, _listed(names)) for path, names in seen.values()]


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


class LowDisk:
    """`check()` says, for each filesystem low on room, how much is free and how soon it fills at the
    rate it filled since the last check; None when none is low."""

    def __init__(self, disks: Sequence[Filesystem], clock: Callable[[], float], low_bytes: int,
                 low_fraction: float) -> None:
        """Low: under `low_bytes` free, or under `low_fraction` of the filesystem if that is more (the
        config's metrics.low_disk_gb and metrics.low_disk_percent)."""
        self._disks, self._clock = list(disks), clock
        self._low_bytes, self._low_fraction = low_bytes, low_fraction
        self._last: dict[Path, tuple[float, int]] = {}  # path -> (when, free bytes) at the last check

    def check(self) -> str | None:
        now, said = self._clock(), []
        for disk in self._disks:
            try:
                usage = shutil.disk_usage(disk.path)
            except OSError:  # unmounted, removed: the writes themselves will say
                continue
            before, self._last[disk.path] = self._last.get(disk.path), (now, usage.free)
            if usage.free >= max(self._low_bytes, self._low_fraction * usage.total):
                continue
            text = (f"low on disk: {_size(usage.free)} free ({usage.free / max(usage.total, 1):.0%}) on the "
                    f"filesystem of the {disk.holds} ({disk.path})")
            if before is not None and before[1] > usage.free and now > before[0]:
                per_s = (before[1] - usage.free) / (now - before[0])
                text += f", filling at {_size(per_s * 3600)}/h: full in about {_hours(usage.free / per_s)}"
            said.append(text)
        return "; ".join(said) or None


class DiskAlarm:
    """For a loop without a status line (`worker run`): `tick()` logs LowDisk's warning, checking at
    once and then at most every `period_s`."""

    def __init__(self, low: LowDisk, period_s: float, clock: Callable[[], float]) -> None:
        self._low, self._period, self._clock = low, period_s, clock
        self._next: float | None = None

    def tick(self) -> None:
        now = self._clock()
        if self._next is not None and now < self._next:
            return
        self._next = now + self._period
        if (text := self._low.check()) is not None:
            log.warning("%s", text)


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def _hours(seconds: float) -> str:
    if seconds < 3600:
        return f"{max(1, round(seconds / 60))} min"
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.0f} days"
