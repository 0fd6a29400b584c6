"""A multi-page TIFF's pages decoded in chunks, from memory or straight from its file."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import BinaryIO, Callable

import cv2
import numpy as np
from PIL import Image

from worker.errors import DecodeError, ImageTooLarge
from worker.images.pillow import _opened, _pillow_page
from worker.images import samples
from worker.images.samples import _COMPRESSION, _LENGTH, _WIDTH, _as_page, _check_pixels, _not_pixels, _undecodable
from worker.images.tiff_directories import _file_reader, _page_directories, _samples_32bit, _tiff_directories


# a TIFF's later pages are decoded this many at a time, and at most this many pixels at once: libtiff finds
# page k by walking the k pages before it, so one call per page costs a long file time quadratic in its pages
PAGE_CHUNK = 16
PAGE_CHUNK_PIXELS = 16_000_000


def file_pages(f: BinaryIO, path: str, name: str, max_pixels: int,
               depth: int = 8) -> Generator[np.ndarray, None, None]:
    """Every page of a multi-page TIFF, the first included, read from disk as it is decoded: for a file too
    large to read whole (a long stack of microscope images). Its directories are read from `f`, OpenCV
    decodes from `path`, which names the same file (`reopenable`); each page as later_pages gives it."""
    flags = _page_flags(depth)
    yield from _tiff_pages(_tiff_directories(_file_reader(f)),
                           lambda start, stop: cv2.imreadmulti(path, start, stop - start, flags=flags),
                           lambda: _opened(f), 0, name, max_pixels, depth)


def reopenable(f: BinaryIO, path: Path) -> str:
    """A path that opens the very file `f` has open even if it has been renamed or replaced since (Linux's
    /proc/self/fd), or, where there is none, its path."""
    proc = f"/proc/self/fd/{f.fileno()}"
    return proc if os.path.exists(proc) else str(path)


def _page_flags(depth: int) -> int:
    return cv2.IMREAD_UNCHANGED if depth == 32 else cv2.IMREAD_COLOR | (cv2.IMREAD_ANYDEPTH if depth == 16 else 0)


def _tiff_pages(directories: list[dict[int, int]], decode_tiff: Callable[[int, int], tuple[bool, Sequence[np.ndarray]]],
                open_pillow: Callable[[], contextlib.AbstractContextManager[Image.Image]],
                page: int, name: str, max_pixels: int, depth: int) -> Generator[np.ndarray, None, None]:
    """A TIFF's pages `page` onwards (counted as _page_directories does), checked from their `directories`,
    decoded by `decode_tiff(start, stop)` over directories: a run of pages a call, never a reduced image.
    A run OpenCV cannot read (a compression its build lacks) is read by Pillow, opened once by
    `open_pillow` and stepped from page to page."""
    pages = _page_directories(directories)
    pillow, im = contextlib.ExitStack(), None
    try:
        while page < len(pages):
            chunk, pixels = 0, 0
            while page + chunk < len(pages) and chunk < PAGE_CHUNK:
                if chunk and pages[page + chunk] != pages[page] + chunk:  # a reduced image in between
                    break
                fields = directories[pages[page + chunk]]
                w, h = fields.get(_WIDTH, 0), fields.get(_LENGTH, 0)
                if chunk and pixels + w * h > PAGE_CHUNK_PIXELS:
                    break
                try:
                    _check_tiff_page(fields, name, max_pixels, depth)
                except (DecodeError, ImageTooLarge):
                    if chunk:  # the pages before it first: then it is the next, and says so
                        break
                    raise
                chunk, pixels = chunk + 1, pixels + w * h
            run = range(pages[page], pages[page] + chunk)
            ok, mats = (False, ()) if directories[run.start].get(_COMPRESSION) in samples.OPENCV_LACKS else \
                decode_tiff(run.start, run.stop)
            if ok and len(mats) == chunk:
                for img in mats:
                    yield _as_page(img, name, depth)
            else:
                im = im or pillow.enter_context(open_pillow())
                for k in run:
                    im.seek(k)  # Pillow counts every directory, as OpenCV does
                    yield _pillow_page(im, name, depth)
            page += chunk
    except (DecodeError, ImageTooLarge):
        raise
    except Exception as e:
        raise _undecodable(name, e, directories[pages[page]] if page < len(pages) else {}) from None
    finally:
        pillow.close()


def _check_tiff_page(fields: dict[int, int], name: str, max_pixels: int, depth: int) -> None:
    if depth != 32 and (kind := _samples_32bit(fields)) is not None:
        raise DecodeError(name, _not_pixels("TIFF", kind))
    if not (fields.get(_WIDTH) and fields.get(_LENGTH)):
        raise DecodeError(name, "a page whose directory gives no size")
    _check_pixels(fields[_WIDTH], fields[_LENGTH], name, max_pixels)
