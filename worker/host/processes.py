"""Whether a process named by its pid (in a run's row) or its life (in a temporary file's name) still exists here."""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path


def process_exists(pid: int) -> bool:
    """Whether a process with this pid exists on this host (whoever owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def is_gone(pid: int) -> bool:
    """Whether a process that wrote `pid` on this host is gone: no such process, or this one (a container
    restarts its worker under the same pid, so that pid names the life before this one)."""
    return pid == os.getpid() or not process_exists(pid)


# A process's life on this machine, as a temporary file's name carries it: pids repeat (in every container a
# worker may be pid 1; a restarted one gets an old pid again), so the pid is given with the pid namespace and
# boot it lives in and the time it started. Another namespace's (another container's) life cannot be told here.
_LIFE = re.compile(r"^([0-9a-f]{8})-(\d+)-(\d+)$")


@functools.cache
def _space() -> str:
    """8 hex digits naming this boot and pid namespace (the same for every process that can see the others)."""
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(path) if path.endswith("/pid") else Path(path).read_text().strip())
        except OSError:  # not Linux: pids alone, as before
            parts.append("")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]


def _started(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat's 22nd field); None if none is there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None if process_exists(pid) is False else 0  # not Linux: 0, whatever the pid's life
    return int(stat.rsplit(")", 1)[1].split()[19])


def life() -> str:
    """This process's life: `space-pid-started`."""
    pid = os.getpid()
    return f"{_space()}-{pid}-{_started(pid) or 0}"


def life_ended(token: str) -> bool | None:
    """Whether the life a token names (`life()`) has ended: True, False, or None where this process cannot
    tell (another pid namespace or boot: another container's, or a token of another form)."""
    m = _LIFE.match(token)
    if m is None or m[1] != _space():
        return None
    pid, started = int(m[2]), int(m[3])
    now = _started(pid)
    return now is None or (started != 0 and now != started)
