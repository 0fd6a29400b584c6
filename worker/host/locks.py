"""The one place that takes flock locks (the inbox while it is watched, a new database's migration)."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def flocked(path: Path, *, wait: bool, create: bool = False) -> Iterator[bool | None]:
    """An exclusive flock on `path` (a folder, or a file created if `create`) while inside.

    Yields True when held; False when another process holds it and `wait` is False; None where it
    cannot be taken here (no fcntl, a path that cannot be opened, a filesystem without flock such as
    some NFS mounts). Released on exit, and when the process ends, however it ends."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield None
        return
    try:
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, 0o666)
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            held: bool | None = True
        except OSError as e:
            held = False if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
        yield held
    finally:
        os.close(fd)
