"""A TIFF's own chain of directories, read from its bytes or its file: its pages' fields, how many
pages it has, and whether its samples are 32-bit."""

from __future__ import annotations

import struct
from typing import BinaryIO, Callable


from worker.images.samples import _BITS, _FIELDS, _FORMAT, _REDUCED_IMAGE, _SUBFILE


def _tiff_fields(data: bytes) -> dict[int, int]:
    """The first value of each of the tags above in a TIFF's first directory ({} for any other file, or
    one cut short: decoding says what is wrong with it)."""
    directories = _tiff_directories(_reader(data), 1)
    return directories[0] if directories else {}


def _reader(data: bytes) -> Callable[[int, int], bytes]:
    view = memoryview(data)
    return lambda at, n: bytes(view[at:at + n])


def _file_reader(f: BinaryIO) -> Callable[[int, int], bytes]:
    def read_at(at: int, n: int) -> bytes:
        f.seek(at)
        return f.read(n)
    return read_at


# a TIFF's pages counted by walking its directories stop here (each costs a read): far past any real stack
MAX_TIFF_PAGES = 1_000_000
# a directory of more entries than a classic TIFF's can hold is taken as the end of the chain (a BigTIFF's
# 8-byte count could otherwise ask for a read of the whole file); real ones hold a few dozen
MAX_TIFF_ENTRIES = 0xFFFF


def _tiff_directories(read_at: Callable[[int, int], bytes], limit: int = MAX_TIFF_PAGES) -> list[dict[int, int]]:
    """Each page's directory of a TIFF (classic or BigTIFF), in the order of the file's chain of them, as
    the first value of each of the tags above; [] for any other file or a first directory cut short. The
    walk ends at a directory cut short or seen before (a loop). Read from the file's directories alone:
    Pillow cannot open a colour TIFF of float samples, whose pages are counted all the same."""
    head = read_at(0, 16)
    order = {b"II": "<", b"MM": ">"}.get(head[:2])
    if order is None or len(head) < 8:
        return []
    (magic,) = struct.unpack_from(order + "H", head, 2)
    if magic == 42:  # classic: 2-byte entry counts, 12-byte entries, 4-byte offsets
        count_fmt, entry_fmt, offset_fmt, (at,) = "H", "HHI4s", "I", struct.unpack_from(order + "I", head, 4)
    elif magic == 43 and len(head) == 16:  # BigTIFF: 8-byte counts and offsets, 20-byte entries
        count_fmt, entry_fmt, offset_fmt, (at,) = "Q", "HHQ8s", "Q", struct.unpack_from(order + "Q", head, 8)
    else:
        return []
    count_size, entry_size, offset_size = (struct.calcsize(order + f) for f in (count_fmt, entry_fmt, offset_fmt))
    directories: list[dict[int, int]] = []
    seen: set[int] = set()
    try:
        while at and at not in seen and len(directories) < limit:
            seen.add(at)
            (entries,) = struct.unpack(order + count_fmt, read_at(at, count_size))
            if entries > MAX_TIFF_ENTRIES:
                break
            raw = read_at(at + count_size, entries * entry_size + offset_size)
            found: dict[int, int] = {}
            for k in range(entries):
                tag, kind, count, value = struct.unpack_from(order + entry_fmt, raw, k * entry_size)
                if tag not in _FIELDS or kind not in (3, 4):  # SHORT, LONG
                    continue
                size = 2 if kind == 3 else 4
                if count * size > len(value):  # the values did not fit in the entry: it holds their offset
                    value = read_at(struct.unpack(order + offset_fmt, value)[0], size)
                found[tag] = struct.unpack_from(order + ("H" if kind == 3 else "I"), value)[0]
            directories.append(found)
            (at,) = struct.unpack_from(order + offset_fmt, raw, entries * entry_size)
    except struct.error:  # cut short: the pages before it stand
        pass
    return directories


def _page_directories(directories: list[dict[int, int]]) -> list[int]:
    """Which directories are pages: not a reduced version of another image (a thumbnail, a preview, a level
    of a pyramid, in the same chain as the pages); the first always (decoding takes it)."""
    return [k for k, fields in enumerate(directories) if k == 0 or not fields.get(_SUBFILE, 0) & _REDUCED_IMAGE]


def tiff_32bit(data: bytes) -> str | None:
    """'float' or 'integer' when a TIFF's first image holds 32-bit samples (BitsPerSample 32; SampleFormat 3
    is IEEE float), read from its first directory; None for any other file, or a TIFF of pixels."""
    return _samples_32bit(_tiff_fields(data))


def _samples_32bit(fields: dict[int, int]) -> str | None:
    """tiff_32bit, from one directory's fields (_tiff_directories)."""
    if fields.get(_BITS) != 32:
        return None
    return "float" if fields.get(_FORMAT) == 3 else "integer"


_TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # classic and BigTIFF, either byte order


def tiff_pages(f: BinaryIO) -> int:
    """How many pages the open file holds when it is a TIFF (its directories read, no pixels); 0 when it
    is not a TIFF."""
    return len(_page_directories(_tiff_directories(_file_reader(f))))
