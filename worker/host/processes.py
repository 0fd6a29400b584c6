"""Whether a process named by its pid (in a run's row, in a temporary file's name) still exists here."""

from __future__ import annotations

import os


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
