"""Directory walks and name rules shared by `run` (one walk) and `watch` (start-up scan, rescans)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

TEMP_SUFFIXES = (".part", ".tmp", ".temp", ".crdownload", ".partial", ".swp", ".swx", "~")


def _waits_for_rename(name: str) -> bool:
    """A hidden or temporary name: ignored until renamed, whatever its extension."""
    return name.startswith(".") or name.lower().endswith(TEMP_SUFFIXES)


def is_candidate(name: str, extensions: tuple[str, ...]) -> bool:
    """Hidden and temporary names are ignored until renamed; only image extensions count."""
    return not _waits_for_rename(name) and name.lower().endswith(extensions)


def not_an_image_name(name: str, extensions: tuple[str, ...]) -> bool:
    """A file left alone for good by its name (`notes.txt`, `photo.heic`): neither an image extension nor
    a hidden or temporary name (those wait to be renamed). Worth saying: someone expected it processed."""
    return not _waits_for_rename(name) and not name.lower().endswith(extensions)


def extension_of(name: str) -> str:
    """`.heic` for `photo.HEIC`, `no extension` for `README`: how the files left alone are counted."""
    return os.path.splitext(name)[1].lower() or "no extension"


def walk(root: Path, extensions: tuple[str, ...], skip: tuple[Path, ...] = (),
         others: Callable[[Path], object] | None = None) -> Iterator[Path]:
    """Every candidate file under root, sorted, without following symlinked folders; `others` is called
    with each file whose name is not an image's (not_an_image_name)."""
    skip_resolved = {p.resolve() for p in skip}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and (here / d).resolve() not in skip_resolved)
        for name in sorted(filenames):
            if is_candidate(name, extensions):
                yield here / name
            elif others is not None and not_an_image_name(name, extensions):
                others(here / name)
