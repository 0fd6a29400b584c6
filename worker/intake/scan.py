"""Directory walks and name rules shared by `run` (one walk) and `watch` (start-up scan, rescans)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

TEMP_SUFFIXES = (".part", ".tmp", ".temp", ".crdownload", ".partial", ".swp", ".swx", "~")


def is_candidate(name: str, extensions: tuple[str, ...]) -> bool:
    """Hidden and temporary names are ignored until renamed; only image extensions count."""
    low = name.lower()
    if name.startswith(".") or low.endswith(TEMP_SUFFIXES):
        return False
    return low.endswith(extensions)


def walk(root: Path, extensions: tuple[str, ...], skip: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Every candidate file under root, sorted, without following symlinked folders."""
    skip_resolved = {p.resolve() for p in skip}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and (here / d).resolve() not in skip_resolved)
        for name in sorted(filenames):
            if is_candidate(name, extensions):
                yield here / name
