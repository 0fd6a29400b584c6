"""A real filesystem made full for a test: its room taken by a ballast file, given back by deleting it."""

from __future__ import annotations

import os
from pathlib import Path


def fill(fs: Path, leave: int) -> Path:
    """Fill the filesystem at fs, then give back `leave` bytes: a ballast file to delete later."""
    ballast = fs / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError:  # full
            pass
    os.truncate(ballast, max(ballast.stat().st_size - leave, 0))
    return ballast
