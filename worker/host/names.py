"""File names as the database, the JSON documents and the logs know them.

POSIX file names are bytes. Python decodes a name that is not valid UTF-8 (a Latin-1 name from an
old Windows share or zip file) with surrogate escapes, which no UTF-8 database, JSON file or terminal
takes: such an image could be neither recorded nor reported. It is recorded under its name with each
undecodable byte written as \\xNN ("caf\\xe9.png"), while its outputs and archived input keep the
real name; `on_disk` maps a recorded name back where one must find its file again.
"""

from __future__ import annotations

import re
from pathlib import Path

_ESCAPED = re.compile(r"\\x([89a-f][0-9a-f])")
# control characters (C0, DEL, C1): a name may hold them (a newline, an escape sequence), and printed as
# they are they break a table's rows, forge log lines or drive the terminal
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def as_text(name: str) -> str:
    """`name` as text any UTF-8 consumer takes: itself, or with its undecodable bytes as \\xNN."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def on_disk(root: Path, text: str) -> str:
    """The name under `root` that a recorded name stands for: itself, or, when nothing is there by
    that name and it holds \\xNN escapes, the name with those bytes put back."""
    if "\\x" not in text or (root / text).exists():
        return text
    return _ESCAPED.sub(lambda m: chr(0xDC00 + int(m[1], 16)), text)


def printable(text: str) -> str:
    """`text` for a terminal or a log line: its control characters as escapes (\\n, \\t, \\x1b); the
    database, JSON and CSV keep them as they are."""
    return _CONTROL.sub(lambda m: _NAMED.get(m[0], f"\\x{ord(m[0]):02x}"), text)
