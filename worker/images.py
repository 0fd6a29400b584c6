"""Decode image bytes into a uint8 BGR array (H, W, 3), the way OpenCV's imread does (uint16 for a
card with `preprocess.depth: 16`; float32 of the file's own values, a float TIFF's too, for depth 32).

One place knows the quirks: EXIF orientation (applied, so results are in upright coordinates),
16-bit (scaled to 8-bit, unless depth 16), grayscale (replicated to 3 channels), RGBA (alpha
dropped without compositing, as the reference runtimes do), palette, CMYK. The pixel limit is
checked from the header, before the pixels are decoded, so a decompression bomb costs nothing.

Plain JPEGs (Huffman-coded, 8-bit, gray or YCbCr, no EXIF rotation: nearly every photo) go to
simplejpeg, the same libjpeg-turbo decode with the same settings as OpenCV's, with less overhead
around it (about 15% less time on 1920 px photos, 5-10% on 640 px ones: tests/perf/hot_path.py); the
pixels are equal, which tests/test_images.py checks.
Everything else, and any JPEG libjpeg only warns about, is OpenCV's.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import struct
import warnings
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import cv2
import numpy as np
import simplejpeg
from PIL import Image, ImageOps, UnidentifiedImageError

from worker.errors import DecodeError, ImageTooLarge

Image.MAX_IMAGE_PIXELS = None  # we apply our own, configurable limit below
cv2.setNumThreads(1)  # decode threads are ours; OpenCV's own pool would oversubscribe the cores


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_HUFFMAN_SOF = frozenset((0xC0, 0xC1, 0xC2))  # baseline, extended, progressive (not lossless, not arithmetic)


@dataclass(frozen=True)
class _JpegHeader:
    width: int
    height: int
    plain: bool  # Huffman-coded, 8-bit, gray or 3-component, no EXIF rotation: simplejpeg decodes it as OpenCV does


def _jpeg_header(data: bytes) -> _JpegHeader | None:
    """The frame header of a JPEG (walking the markers up to start-of-frame), or None when not found."""
    i, n = 2, len(data)
    orientation = 1  # as displayed unless an EXIF block says otherwise
    while i + 9 < n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _SOF:
            precision, h, w, components = struct.unpack_from(">BHHB", data, i + 4)
            plain = marker in _HUFFMAN_SOF and precision == 8 and components in (1, 3) and orientation == 1
            return _JpegHeader(w, h, plain) if w and h else None
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # no length field
            i += 2
            continue
        length = struct.unpack_from(">H", data, i + 2)[0]
        if marker == 0xE1 and data[i + 4:i + 10] == b"Exif\x00\x00":
            # a second EXIF block, or one we cannot read: leave it to OpenCV (orientation 0 = unknown)
            orientation = _exif_orientation(data[i + 10:i + 2 + length]) if orientation == 1 else 0
        i += 2 + length
    return None


def _exif_orientation(tiff: bytes) -> int:
    """The orientation tag (0x0112) of an EXIF block's first IFD: 1 when absent, 0 when unreadable."""
    order = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if order is None:
        return 0
    try:
        ifd = struct.unpack_from(order + "I", tiff, 4)[0]
        for k in range(struct.unpack_from(order + "H", tiff, ifd)[0]):
            tag, kind, count, value = struct.unpack_from(order + "HHIH", tiff, ifd + 2 + 12 * k)
            if tag == 0x0112:
                return value if kind == 3 and count == 1 else 0
    except struct.error:
        return 0
    return 1


def check_header(data: bytes, name: str, samples32: bool = False) -> tuple[int, int] | None:
    """The image's (width, height) read from its header, or None when Pillow does not know the format;
    raises DecodeError for a header that cannot be read, and, unless `samples32` (a card's depth 32), for
    samples that are not pixels: 32-bit float or integer TIFFs (measurements, which decoding at 8 or 16
    bits would clip to black or white without a word).

    JPEG and PNG headers are read directly (this runs for every image; opening it with Pillow
    costs more than the rest of the checks together); other formats, and anything odd, go to Pillow."""
    if data[:2] == b"\xff\xd8" and (jpeg := _jpeg_header(data)) is not None:
        return jpeg.width, jpeg.height
    if data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR" and len(data) >= 24:
        w, h = struct.unpack_from(">II", data, 16)
        if w and h:
            return w, h
    # from the TIFF's own header: Pillow cannot open a colour TIFF of float samples, and OpenCV decoded one
    # at 8 or 16 bits as if its values were pixels
    if not samples32 and (kind := tiff_32bit(data)) is not None:
        raise DecodeError(name, _not_pixels("TIFF", kind))
    try:
        with _opened(data) as im:
            size, mode, kind = im.size, im.mode, im.format
            bits = getattr(im, "tag_v2", {}).get(258, 0)  # a TIFF's BitsPerSample (one, or one per sample)
    except UnidentifiedImageError:
        return None
    except Exception as e:  # truncated headers and the like
        raise DecodeError(name, f"unreadable image header ({type(e).__name__}: {e})") from None
    if not samples32 and (why := _samples_not_pixels(mode, bits, kind)) is not None:
        raise DecodeError(name, why)
    return size


def _samples_not_pixels(mode: str, bits: int | tuple[int, ...], kind: str | None) -> str | None:
    """Why an image Pillow opened in this mode (with a TIFF's BitsPerSample) holds measurements, not pixels;
    None for pixels."""
    return _not_pixels(kind or "file", "float" if mode == "F" else "integer") if _is_32bit(mode, bits) else None


def _not_pixels(kind: str, samples: str) -> str:
    return (f"a {kind} of 32-bit {samples} samples, not 8- or 16-bit pixels: save it at 8 or 16 bits, or give "
            f"the model's card preprocess.depth: 32 to take its samples as they are")


_WIDTH, _LENGTH, _BITS, _FORMAT = 256, 257, 258, 339  # TIFF tags: ImageWidth, ImageLength, BitsPerSample, SampleFormat
_COMPRESSION = 259
_EXTRA_SAMPLES = 338  # what a sample past the colour ones is: 1 associated (premultiplied) alpha, 2 unassociated
_SAMPLES = 277  # SamplesPerPixel
# TIFF compressions OpenCV's wheels build without, the first three of which Pillow's read (modern microscopy
# writes Zstandard and LZMA; whole-slide scanners JPEG 2000): such a page goes to Pillow straight away, since
# OpenCV's try prints warnings to stderr for each one (any other page OpenCV cannot read still falls back
# to Pillow, after them), and a failure names the compression
OPENCV_LACKS = {34925: "LZMA", 50000: "Zstandard", 50001: "WebP", 34887: "LERC", 50002: "JPEG XL",
                33003: "JPEG 2000", 33005: "JPEG 2000", 34712: "JPEG 2000"}
_SUBFILE, _REDUCED_IMAGE = 254, 0x1  # NewSubfileType, and its bit for a reduced version of another image
_FIELDS = (_WIDTH, _LENGTH, _BITS, _FORMAT, _SUBFILE, _COMPRESSION, _SAMPLES)  # what _tiff_directories reads


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


def _is_32bit(mode: str, bits: int | tuple[int, ...]) -> bool:
    """Pillow's float mode, or its 32-bit integer one holding a TIFF's 32-bit samples (it also holds
    16-bit PGMs, which decode as pixels)."""
    return mode == "F" or (mode == "I" and _one(bits) == 32)


def decode(data: bytes, name: str, max_pixels: int, depth: int = 8) -> np.ndarray:
    """Decode to BGR (H, W, 3), uint8; with `depth` 16, uint16: a 16-bit file's own pixels, any other
    widened (255 -> 65535); with `depth` 32, float32: a 32-bit file's own samples (float or integer),
    any other file's pixels at their own depth (0-255 or 0-65535). Raises DecodeError or ImageTooLarge
    with the file name."""
    if depth == 32:
        return _decode_samples(data, name, max_pixels)
    img = _decode(data, name, max_pixels, deep=depth == 16)
    return widen(img) if depth == 16 and img.dtype == np.uint8 else img


def _decode_samples(data: bytes, name: str, max_pixels: int) -> np.ndarray:
    """Depth 32: BGR (H, W, 3) float32 of the file's own values; refused when any is NaN or infinite (a
    measurement's "no data", which would make every output of the model NaN)."""
    fields = _tiff_fields(data)
    if data[:2] == b"\xff\xd8" or data[:8] == PNG_SIGNATURE or not (fields.get(_BITS) == 32 or _pillow_32bit(data)):
        return _decode(data, name, max_pixels, deep=True, floats=True).astype(np.float32)
    size = check_header(data, name, samples32=True)
    if size is None and {_WIDTH, _LENGTH} <= fields.keys():  # a colour float TIFF, which Pillow cannot open
        size = fields[_WIDTH], fields[_LENGTH]
    if size is None:
        raise DecodeError(name, "a TIFF of 32-bit samples whose size cannot be read")
    _check_pixels(size[0], size[1], name, max_pixels)
    # IMREAD_UNCHANGED: OpenCV's colour decode clips a float TIFF's negative values and refuses a gray one
    img = None if fields.get(_COMPRESSION) in OPENCV_LACKS else cv2.imdecode(np.frombuffer(data, dtype=np.uint8),
                                                                            cv2.IMREAD_UNCHANGED)
    if img is None:
        img = _decode_with_pillow(data, name, convert=False)
    return _as_samples(img, name)


def _as_samples(img: np.ndarray, name: str) -> np.ndarray:
    """A decoded page of 32-bit samples, (H, W), (H, W, 3) or (H, W, 4), as BGR (H, W, 3) float32; refused
    when any is NaN or infinite."""
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    elif img.ndim == 3 and img.shape[2] == 4:
        img = img[:, :, :3]  # alpha dropped, as for pixels
    if img.ndim != 3 or img.shape[2] != 3 or img.shape[0] < 1 or img.shape[1] < 1:
        raise DecodeError(name, f"unexpected decoded shape {img.shape}")
    img = np.ascontiguousarray(img, dtype=np.float32)
    if not np.isfinite(img).all():
        bad = int(img.size - np.isfinite(img).sum()) // 3
        raise DecodeError(name, f"{bad} of its {img.shape[0] * img.shape[1]} samples are NaN or infinite (no "
                                f"data): the model would give NaN for the whole image")
    return img


def _pillow_32bit(data: bytes) -> bool:
    """Whether Pillow reads the file as 32-bit samples."""
    try:
        with _opened(data) as im:
            return _is_32bit(im.mode, getattr(im, "tag_v2", {}).get(258, 0))
    except Exception:  # not an image Pillow knows: decoding says why
        return False


# Pillow's own warnings (a decompression bomb, a malformed TIFF tag, a palette's transparency, ...) are
# attributed to its modules; its deprecations, raised for the caller, are not, and still show.
_PILLOW_MODULES = r"PIL\."
_PILLOW_WARNINGS = ("ignore", None, Warning, re.compile(_PILLOW_MODULES), 0)  # as `filterwarnings` files it


def _quiet_pillow_warnings() -> None:
    """Silence Pillow's warnings, process-wide: the worker checks sizes and reports problems itself.
    A filter added once rather than `catch_warnings` around each open, which swaps the process's filter
    list and is not thread-safe: two decode threads interleaving could restore each other's copy and
    leave every warning ignored. Checked on each open, since a caller's `catch_warnings` (pytest's
    around each test) may drop it again."""
    if _PILLOW_WARNINGS not in warnings.filters:
        warnings.filterwarnings("ignore", module=_PILLOW_MODULES)


@contextlib.contextmanager
def _opened(data: bytes | BinaryIO) -> Iterator[Image.Image]:
    """The file (its bytes, or the open file, left open) as Pillow opens it (its header read, no pixels),
    Pillow's warnings silenced."""
    _quiet_pillow_warnings()
    with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
        yield im


def widen(img: np.ndarray) -> np.ndarray:
    """uint8 -> uint16 over the same range (x * 257: 0 -> 0, 255 -> 65535)."""
    return img.astype(np.uint16) * np.uint16(257)


def _decode(data: bytes, name: str, max_pixels: int, deep: bool, floats: bool = False) -> np.ndarray:
    """BGR (H, W, 3), uint8, or with `deep` a 16-bit file's uint16 (JPEGs are 8-bit either way), and
    with `floats` too an HDR format's float32 (Radiance, a TIFF's LogLuv) as OpenCV decodes it."""
    if not data:
        raise DecodeError(name, "empty file")
    jpeg = _jpeg_header(data) if data[:2] == b"\xff\xd8" else None
    size = (jpeg.width, jpeg.height) if jpeg is not None else check_header(data, name)
    if size is not None:
        _check_pixels(size[0], size[1], name, max_pixels)
    if data[:2] == b"\xff\xd8":
        _check_jpeg_complete(data, name)
        if jpeg is not None and jpeg.plain:
            try:  # the same libjpeg-turbo decode as OpenCV's, with less overhead (see the module docstring)
                return simplejpeg.decode_jpeg(data, colorspace="BGR", fastdct=False, fastupsample=False)
            except ValueError:  # anything libjpeg merely warns about: OpenCV's tolerance decides, below
                pass
    elif data[:8] == PNG_SIGNATURE:
        data = _without_colour_profile(data)
    elif _animated_webp(data):  # OpenCV refuses it, with an ERROR line on stderr each time: Pillow's
        return _decode_with_pillow(data, name)
    elif data[:4] in _TIFF_MAGIC and _tiff_fields(data).get(_COMPRESSION) in OPENCV_LACKS:
        return _decode_with_pillow(data, name, deep=deep, floats=floats)
    buf = np.frombuffer(data, dtype=np.uint8)
    # applies EXIF orientation, gray->3 channels, and 16->8 bit unless deep
    img = cv2.imdecode(buf, cv2.IMREAD_COLOR | (cv2.IMREAD_ANYDEPTH if deep else 0))
    if deep and not floats and img is not None and img.dtype not in (np.uint8, np.uint16):
        # a signed TIFF in 8 bits as OpenCV's 8-bit read gives it; anything else (Radiance HDR) read so
        img = _unsigned(img) if img.dtype in (np.int16, np.int8) else cv2.imdecode(buf, cv2.IMREAD_COLOR)
    if img is None:
        img = _decode_with_pillow(data, name, deep=deep, floats=floats)  # GIF, some TIFFs and WebPs OpenCV cannot read
    if img.ndim != 3 or img.shape[2] != 3 or img.shape[0] < 1 or img.shape[1] < 1:
        raise DecodeError(name, f"unexpected decoded shape {img.shape}")
    return img


def _animated_webp(data: bytes) -> bool:
    """An animated WebP: its extended header (VP8X) has the animation flag (0x02 of its flags byte)."""
    return data[:4] == b"RIFF" and data[8:16] == b"WEBPVP8X" and len(data) > 20 and bool(data[20] & 0x02)


def frames(data: bytes) -> int:
    """How many pages or frames the file holds (a multi-page TIFF, an animated GIF, WebP or PNG): decoding
    takes the first, and the result says how many there were. A JPEG holds one; so does a PNG without an
    animation control chunk (`acTL`, before the image data), both known without opening them again; a
    TIFF's pages are counted from its directories (_page_directories), any other file's frames by Pillow."""
    if data[:2] == b"\xff\xd8":
        return 1
    if data[:8] == PNG_SIGNATURE and data.find(b"acTL", 8, max(data.find(b"IDAT"), 8)) < 0:
        return 1
    if data[:4] in _TIFF_MAGIC:
        return max(len(_page_directories(_tiff_directories(_reader(data)))), 1)
    try:
        with _opened(data) as im:
            return max(int(getattr(im, "n_frames", 1)), 1)
    except Exception:  # decoding took the first frame; what follows it is no reason to fail the image
        return 1


# a TIFF's later pages are decoded this many at a time, and at most this many pixels at once: libtiff finds
# page k by walking the k pages before it, so one call per page costs a long file time quadratic in its pages
PAGE_CHUNK = 16
PAGE_CHUNK_PIXELS = 16_000_000


def later_pages(data: bytes, name: str, max_pixels: int, depth: int = 8) -> Generator[np.ndarray, None, None]:
    """The pages after the first of a multi-page file (TIFF pages, GIF/WebP/PNG frames), in order, each as
    `decode` gives a first page: a TIFF's as OpenCV decodes it at the card's depth, a GIF's, WebP's or
    PNG's frame as Pillow composes it. Each page's size is held to the pixel limit before it is decoded,
    and a page of 32-bit samples is refused unless `depth` is 32. Raises DecodeError or ImageTooLarge
    for the page that would come next, whose reason does not say which page (the caller counts).

    A TIFF's pages are decoded a few at a time (PAGE_CHUNK): libtiff finds page k by walking the pages
    before it. Pillow stays open and steps from one frame to the next, for the same reason."""
    if data[:4] not in _TIFF_MAGIC:
        yield from _frames_after_first(data, name, max_pixels, depth)
        return
    buf = np.frombuffer(data, dtype=np.uint8)
    flags = _page_flags(depth)
    yield from _tiff_pages(_tiff_directories(_reader(data)),
                           lambda start, stop: cv2.imdecodemulti(buf, flags, None, (start, stop)),
                           lambda: _opened(data), 1, name, max_pixels, depth)


_TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # classic and BigTIFF, either byte order


def tiff_pages(f: BinaryIO) -> int:
    """How many pages the open file holds when it is a TIFF (its directories read, no pixels); 0 when it
    is not a TIFF."""
    return len(_page_directories(_tiff_directories(_file_reader(f))))


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
            ok, mats = (False, ()) if directories[run.start].get(_COMPRESSION) in OPENCV_LACKS else \
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


def _undecodable(name: str, e: Exception, fields: dict[int, int]) -> DecodeError:
    """Why a file could not be decoded; for a TIFF (`fields`: its page's directory) whose compression OpenCV's
    build lacks, that Pillow's libtiff lacks it too (Pillow 10.0's has no Zstandard) rather than its bare
    error code; for one whose samples neither takes, what they are."""
    compression = fields.get(_COMPRESSION)
    if compression in OPENCV_LACKS:
        why = "" if isinstance(e, UnidentifiedImageError) else f" ({type(e).__name__}: {e})"  # names a BytesIO
        return DecodeError(name, f"cannot decode: neither OpenCV nor Pillow here reads this TIFF (compressed with "
                                 f"{OPENCV_LACKS[compression]}){why}")
    if isinstance(e, UnidentifiedImageError) and {_WIDTH, _LENGTH, _BITS} <= fields.keys():
        kind = {2: "signed integers", 3: "floats"}.get(fields.get(_FORMAT, 1), "unsigned integers")
        return DecodeError(name, f"cannot decode: neither OpenCV nor Pillow here reads this TIFF "
                                 f"({fields.get(_SAMPLES, 1)} samples of {fields[_BITS]}-bit {kind} per pixel)")
    return DecodeError(name, f"cannot decode ({type(e).__name__}: {e})")


def _check_tiff_page(fields: dict[int, int], name: str, max_pixels: int, depth: int) -> None:
    if depth != 32 and (kind := _samples_32bit(fields)) is not None:
        raise DecodeError(name, _not_pixels("TIFF", kind))
    if not (fields.get(_WIDTH) and fields.get(_LENGTH)):
        raise DecodeError(name, "a page whose directory gives no size")
    _check_pixels(fields[_WIDTH], fields[_LENGTH], name, max_pixels)


def _frames_after_first(data: bytes, name: str, max_pixels: int, depth: int) -> Generator[np.ndarray, None, None]:
    """A GIF's, WebP's or PNG's frames after the first, as Pillow composes them."""
    try:
        with _opened(data) as im:
            for page in range(1, max(int(getattr(im, "n_frames", 1)), 1)):
                im.seek(page)  # onwards from where it is
                _check_page(im, name, max_pixels, depth)
                yield _pillow_page(im, name, depth)
    except (DecodeError, ImageTooLarge):
        raise
    except Exception as e:
        raise DecodeError(name, f"cannot decode ({type(e).__name__}: {e})") from None


def _pillow_page(im: Image.Image, name: str, depth: int) -> np.ndarray:
    """The frame Pillow is at, as `decode` gives a first page at this depth."""
    if depth == 32 and _is_32bit(im.mode, getattr(im, "tag_v2", {}).get(_BITS, 0)):
        return _as_samples(np.asarray(im), name)
    return _as_page(_pillow_pixels(im, name, deep=depth != 8, floats=depth == 32), name, depth)


def _check_page(im: Image.Image, name: str, max_pixels: int, depth: int) -> None:
    if depth != 32 and (why := _samples_not_pixels(im.mode, getattr(im, "tag_v2", {}).get(258, 0), im.format)):
        raise DecodeError(name, why)
    _check_pixels(im.size[0], im.size[1], name, max_pixels)


def _as_page(img: np.ndarray, name: str, depth: int) -> np.ndarray:
    """A decoded later page as `decode` gives a first one at this depth."""
    if depth == 32:
        return _as_samples(img, name)
    if img.ndim != 3 or img.shape[2] != 3 or img.shape[0] < 1 or img.shape[1] < 1:
        raise DecodeError(name, f"unexpected decoded shape {img.shape}")
    if img.dtype in (np.int16, np.int8):  # OpenCV's any-depth read of a signed page: 8 bits, as the first page's
        img = _unsigned(img)
    return widen(img) if depth == 16 and img.dtype == np.uint8 else img


_REDUCED = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}


def upright_size(data: bytes, name: str) -> tuple[int, int] | None:
    """(height, width) as displayed (EXIF orientation applied), from the header only."""
    try:
        with _opened(data) as im:
            w, h = im.size
            rotated = im.getexif().get(0x0112, 1) in (5, 6, 7, 8)
    except Exception:
        return None
    return (w, h) if rotated else (h, w)


def decode_reduced(data: bytes, name: str, max_pixels: int, needed: Callable[[tuple[int, int]], tuple[int, int]],
                   depth: int = 8) -> tuple[np.ndarray, tuple[int, int]]:
    """Like decode, but a large JPEG is decoded at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling,
    several times cheaper) when the result still has at least `needed(orig_hw)` pixels.
    Returns (image, original upright (height, width)). Opt-in: results change slightly."""
    if data[:2] == b"\xff\xd8" and (orig := upright_size(data, name)) is not None:
        nh, nw = needed(orig)
        k = next((k for k in (8, 4, 2) if orig[0] // k >= nh and orig[1] // k >= nw), 1)
        if k > 1:
            _check_pixels(orig[1], orig[0], name, max_pixels)
            _check_jpeg_complete(data, name)
            img = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), _REDUCED[k])
            if img is not None:
                return (widen(img) if depth == 16 else img.astype(np.float32) if depth == 32 else img), orig
    img = decode(data, name, max_pixels, depth)
    return img, (img.shape[0], img.shape[1])


def _check_pixels(width: int, height: int, name: str, max_pixels: int) -> None:
    if max_pixels and width * height > max_pixels:
        raise ImageTooLarge(name, f"{width}x{height} pixels is over the limit of {max_pixels} (pipeline.max_pixels)")


def _without_colour_profile(png: bytes) -> bytes:
    """The PNG without its iCCP chunk. OpenCV ignores colour profiles, but its libpng prints a warning
    to stderr for a malformed one (common: "known incorrect sRGB profile") on every decode, which
    would fill a hot folder's log; the decoded pixels are the same."""
    pos = 8
    while pos + 8 <= len(png):
        length, kind = struct.unpack_from(">I4s", png, pos)
        if kind == b"iCCP":  # at most one, before the image data
            return png[:pos] + png[pos + 12 + length:]
        if kind in (b"IDAT", b"IEND"):
            return png
        pos += 12 + length
    return png


def jpeg_complete(data: bytes) -> bool:
    """Whether a JPEG's end-of-image marker follows its last start-of-scan marker (markers cannot
    occur inside entropy-coded data, so an EXIF thumbnail's own EOI, which comes earlier, does not
    count). Searched from the ends: the last EOI is normally the file's last two bytes and the first
    scan follows the headers, so neither search crosses the entropy-coded data (an rfind for the last
    scan does: 0.7 ms on a 350 KB photo)."""
    eoi = data.rfind(b"\xff\xd9")
    return eoi != -1 and data.find(b"\xff\xda", eoi) == -1 and data.find(b"\xff\xda", 0, eoi) != -1


def _check_jpeg_complete(data: bytes, name: str) -> None:
    """libjpeg decodes a truncated JPEG 'successfully', filling the rest with gray; refuse it instead."""
    if not jpeg_complete(data):
        raise DecodeError(name, "truncated JPEG (no end-of-image marker after the last scan)")


def _decode_with_pillow(data: bytes, name: str, convert: bool = True, deep: bool = False,
                        floats: bool = False) -> np.ndarray:
    """BGR (H, W, 3) uint8 (with `deep`, a 16-bit file's uint16, and with `floats` a signed one's values:
    _pillow_pixels); with `convert` False, the first frame's own samples (H, W), as Pillow holds them (a
    float or 32-bit integer TIFF's)."""
    try:
        with _opened(data) as opened:
            opened.seek(0)  # multi-frame (GIF, TIFF): the first frame
            if not convert:
                return np.asarray(ImageOps.exif_transpose(opened))
            return _pillow_pixels(ImageOps.exif_transpose(opened), name, deep, getattr(opened, "tag_v2", {}), floats)
    except DecodeError:
        raise
    except Exception as e:
        fields = _tiff_fields(data)
        if isinstance(e, UnidentifiedImageError) and fields.get(_COMPRESSION) not in OPENCV_LACKS and \
                not {_WIDTH, _LENGTH, _BITS} <= fields.keys():
            raise DecodeError(name, "not an image (unknown or corrupt format)") from None
        raise _undecodable(name, e, fields) from None


def _bgr(im: Image.Image) -> np.ndarray:
    """A Pillow image (any mode, a frame as composed) as BGR (H, W, 3) uint8."""
    return np.ascontiguousarray(np.asarray(im.convert("RGB"))[:, :, ::-1])


_GRAY16 = frozenset(("I;16", "I;16L", "I;16B", "I;16N"))  # Pillow's modes of 16-bit gray pixels


def _over_black(im: Image.Image) -> np.ndarray:
    """A TIFF's colour with alpha as OpenCV reads it (libtiff's RGBA interface): premultiplied, i.e. over
    black, BGR (H, W, 3) uint8. Pillow holds it straight (RGBA: it divides associated alpha out as it
    loads), or as stored (RGBa); PNG, WebP and the rest drop alpha instead, in OpenCV as here."""
    rgba = np.asarray(im)
    rgb = rgba[:, :, :3] if im.mode == "RGBa" else \
        ((rgba[:, :, :3].astype(np.uint16) * rgba[:, :, 3:] + 127) // 255).astype(np.uint8)  # libtiff's rounding
    return np.ascontiguousarray(rgb[:, :, ::-1])


def _high_byte(signed: np.ndarray) -> np.ndarray:
    """int16 -> uint8 as OpenCV's 8-bit read of a signed 16-bit TIFF gives it: the high byte of each
    sample's bits (-1 -> 255, 256 -> 1, -30000 -> 138)."""
    return (signed.view(np.uint16) >> 8).astype(np.uint8)


def _unsigned(signed: np.ndarray) -> np.ndarray:
    """A signed TIFF's int16 or int8 samples as OpenCV's 8-bit read of the file gives them."""
    return _high_byte(signed) if signed.dtype == np.int16 else signed.view(np.uint8)


def _gray3(gray: np.ndarray) -> np.ndarray:
    """(H, W) -> (H, W, 3), the one channel three times, as OpenCV gives a gray image in colour."""
    return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))


def _one(value: int | tuple[int, ...]) -> int:
    """A TIFF field Pillow gives as a number or a tuple of one per sample: the largest."""
    return max(value) if isinstance(value, tuple) else value


def _pillow_pixels(im: Image.Image, name: str, deep: bool, tags: Mapping[int, Any] | None = None,
                   floats: bool = False) -> np.ndarray:
    """A frame Pillow decoded, as OpenCV would decode it: BGR (H, W, 3) uint8, or with `deep` a 16-bit
    gray frame's own uint16, or with `floats` (depth 32) a signed 16-bit gray frame's own values (int16).
    Pillow's conversion to RGB clips 16-bit gray at 255 (a microscope's frame would come out white), where
    OpenCV keeps the high byte; it holds 16-bit colour at 8 bits only, which depth 16 refuses rather than
    widen. A TIFF's colour with alpha comes over black, its gray with associated alpha as stored and its
    CMYK converted as libtiff gives them to OpenCV. `tags`: a TIFF's (the frame's own unless given: a transposed copy has none)."""
    tags = getattr(im, "tag_v2", {}) if tags is None else tags
    if im.mode in _GRAY16:
        gray = np.asarray(im).astype(np.uint16)  # native byte order, whatever the file's
        gray8or16 = gray if deep else (gray >> 8).astype(np.uint8)
        return _gray3(gray8or16)
    bits = tags.get(_BITS, 8)
    if im.mode == "I" and _one(bits) == 16 and _one(tags.get(_FORMAT, 1)) == 2:  # signed 16-bit gray, as int32
        # as OpenCV decodes such a TIFF: its values at depth 32, else the high byte of each sample's bits
        # (-1 -> 255, 256 -> 1), which depth 16 widens as it does any 8-bit image
        signed = np.asarray(im).astype(np.int16)
        return _gray3(signed if floats else _high_byte(signed))
    if floats and im.mode == "L" and _one(tags.get(_FORMAT, 1)) == 2:  # signed 8-bit gray: its values at depth 32
        return _gray3(np.asarray(im).view(np.int8))
    if im.mode == "La":  # gray stored premultiplied, which OpenCV takes as it is (Pillow converts it to nothing)
        return _gray3(np.asarray(im)[:, :, 0])
    if deep and _one(bits) == 16:
        compression = OPENCV_LACKS.get(tags.get(_COMPRESSION, 0), "its compression")
        raise DecodeError(name, f"a 16-bit colour TIFF that OpenCV cannot read ({compression}): Pillow reads "
                                f"it at 8 bits only, which would lose the low 8 of each sample: save it "
                                f"uncompressed, or with LZW or Deflate")
    if im.mode in ("RGBA", "RGBa") and _one(tags.get(_EXTRA_SAMPLES, 0)) in (1, 2):
        return _over_black(im)  # a TIFF's alpha, as libtiff hands it to OpenCV
    if im.mode == "CMYK" and tags:  # a TIFF's CMYK as libtiff converts it for OpenCV (Pillow's rounds: +-1)
        cmyk = np.asarray(im).astype(np.uint16)
        white = 255 - cmyk[:, :, 3:]
        return np.ascontiguousarray((white * (255 - cmyk[:, :, 2::-1]) // 255).astype(np.uint8))  # Y M C -> B G R
    return _bgr(im)
