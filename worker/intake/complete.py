"""Whether a file in the inbox looks cut short, judged from its first and last bytes.

A close-after-write event, or a size that holds for `watch.settle_s`, says a writer stopped, not
that it finished: an upload resumed after a dropped connection (FTP's append, `curl -C -`) closes
the first part, then opens the file again and appends the rest. A part taken at once fails as a
truncated image and is archived, and the rest then lands as a second, headless file: the image is
lost. The intake holds a file that looks cut short until it has not changed for `watch.incomplete_s`.

The tail decides most files; one that looks cut short by its tail is read whole (up to
FULL_READ_BYTES), so that data appended after the end (a phone's motion photo puts a video after the
JPEG) is judged as the decoder judges it. A wrong "cut short" only delays the file; a wrong
"complete" is what every file got before. Formats with no end to check (TIFF) are never held.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from worker.images import PNG_SIGNATURE, jpeg_complete

# enough of the tail for a JPEG's end marker behind a small trailer, and a PNG's or GIF's last chunk
TAIL_BYTES = 64 * 1024
# a file that looks cut short by its tail is read whole up to this size (from the page cache: 0.3 ms
# for half of a 528 KB photo, 6 ms for one with 3 MB appended); a larger one is judged by its tail alone
FULL_READ_BYTES = 64 * 1024 * 1024
_HEAD_BYTES = 16


def cut_short(path: Path, size: int) -> str | None:
    """Why the file at `path` (of `size` bytes) looks unfinished, or None when it looks complete, cannot
    be told, or cannot be read (the pipeline then says why it cannot read it)."""
    try:
        # O_NONBLOCK: a named pipe with an image's name must not block the intake; O_NOFOLLOW: never
        # read through a symbolic link (the pipeline refuses those)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        head = os.pread(fd, _HEAD_BYTES, 0)
        start = max(size - TAIL_BYTES, 0)
        tail = os.pread(fd, size - start, start) if size else b""
        why = judge(head, tail, size)
        if why is not None and len(tail) < size <= FULL_READ_BYTES:
            whole = os.pread(fd, size, 0)  # shorter if it was cut meanwhile: judged as it is now
            why = judge(whole[:_HEAD_BYTES], whole, len(whole))
    except OSError:
        return None
    finally:
        os.close(fd)
    return why


def judge(head: bytes, tail: bytes, size: int) -> str | None:
    """`cut_short` on bytes: `head` is the file's start, `tail` its last bytes (the whole file when
    `len(tail) == size`)."""
    if size == 0:
        return "empty"  # made, not yet written (some writers create a file, then open it again to write)
    if head[:2] == b"\xff\xd8":
        if len(tail) == size:  # the whole file: the decoder's own check
            complete = jpeg_complete(tail)
        else:  # its end: the last end marker with no scan after it (the scans before it are the decoder's)
            eoi = tail.rfind(b"\xff\xd9")
            complete = eoi != -1 and tail.find(b"\xff\xda", eoi) == -1
        return None if complete else "no JPEG end-of-image marker after the last scan"
    if head[:8] == PNG_SIGNATURE:
        iend = tail.rfind(b"\x00\x00\x00\x00IEND")  # length 0 and type; its 4-byte CRC must follow
        return None if iend != -1 and len(tail) - iend >= 12 else "no PNG end chunk"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return None if tail.endswith(b";") else "no GIF trailer"
    if head[:2] == b"BM" and len(head) >= 6:
        (declared,) = struct.unpack_from("<I", head, 2)
        return f"{size} of the {declared} bytes its BMP header gives" if size < declared else None
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        declared = struct.unpack_from("<I", head, 4)[0] + 8
        return f"{size} of the {declared} bytes its WebP header gives" if size < declared else None
    return None
