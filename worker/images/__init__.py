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
Everything else, and any JPEG libjpeg only warns about, is OpenCV's."""

from __future__ import annotations

from collections.abc import Generator
from typing import Callable

import cv2
import numpy as np
import simplejpeg
from PIL import Image

from worker.errors import DecodeError, ImageTooLarge
from worker.images import samples
from worker.images.headers import (PNG_SIGNATURE, _check_jpeg_complete, _jpeg_header, _without_colour_profile,
                                   check_header, jpeg_complete, upright_size)
from worker.images.pillow import _check_page, _decode_with_pillow, _opened, _pillow_32bit, _pillow_page
from worker.images.samples import _BITS, _COMPRESSION, _LENGTH, _WIDTH, _as_samples, _check_pixels, _unsigned, widen
from worker.images.tiff import _page_flags, _tiff_pages, file_pages, reopenable
from worker.images.tiff_directories import (_TIFF_MAGIC, _page_directories, _reader, _tiff_directories, _tiff_fields,
                                            tiff_32bit, tiff_pages)

# what the rest of the worker reads images with
__all__ = ["PNG_SIGNATURE", "check_header", "decode", "decode_reduced", "file_pages", "frames", "jpeg_complete",
           "later_pages", "reopenable", "tiff_32bit", "tiff_pages", "upright_size", "widen"]


Image.MAX_IMAGE_PIXELS = None  # we apply our own, configurable limit below


cv2.setNumThreads(1)  # decode threads are ours; OpenCV's own pool would oversubscribe the cores


def decode(data: bytes, name: str, max_pixels: int, depth: int = 8, notes: list[str] | None = None) -> np.ndarray:
    """Decode to BGR (H, W, 3), uint8; with `depth` 16, uint16: a 16-bit file's own pixels, any other
    widened (255 -> 65535); with `depth` 32, float32: a 32-bit file's own samples (float or integer),
    any other file's pixels at their own depth (0-255 or 0-65535). Raises DecodeError or ImageTooLarge
    with the file name. What the decoder recovered from (a JPEG's corrupt data, decoded as libjpeg fills
    it) is appended to `notes`."""
    if depth == 32:
        return _decode_samples(data, name, max_pixels)
    img = _decode(data, name, max_pixels, deep=depth == 16, notes=notes)
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
    img = None if fields.get(_COMPRESSION) in samples.OPENCV_LACKS else cv2.imdecode(np.frombuffer(data, dtype=np.uint8),
                                                                            cv2.IMREAD_UNCHANGED)
    if img is None:
        img = _decode_with_pillow(data, name, convert=False)
    return _as_samples(img, name)


def _decode(data: bytes, name: str, max_pixels: int, deep: bool, floats: bool = False,
            notes: list[str] | None = None) -> np.ndarray:
    """BGR (H, W, 3), uint8, or with `deep` a 16-bit file's uint16 (JPEGs are 8-bit either way), and
    with `floats` too an HDR format's float32 (Radiance, a TIFF's LogLuv) as OpenCV decodes it."""
    if not data:
        raise DecodeError(name, "empty file")
    jpeg = _jpeg_header(data) if data[:2] == b"\xff\xd8" else None
    size = (jpeg.width, jpeg.height) if jpeg is not None else check_header(data, name)
    if size is not None:
        _check_pixels(size[0], size[1], name, max_pixels)
    damage = ""  # what libjpeg warned about, said once the image is decoded all the same
    if data[:2] == b"\xff\xd8":
        _check_jpeg_complete(data, name)
        if jpeg is None or jpeg.plain:  # None: its markers could not be walked to the frame (damage there)
            try:  # the same libjpeg-turbo decode as OpenCV's, with less overhead (see the module docstring)
                return simplejpeg.decode_jpeg(data, colorspace="BGR", fastdct=False, fastupsample=False)
            except ValueError as e:  # what libjpeg warns about: decoded as it (and OpenCV) recovers, and said
                damage = str(e)
                try:
                    img = simplejpeg.decode_jpeg(data, colorspace="BGR", fastdct=False, fastupsample=False,
                                                 strict=False)
                except ValueError:  # not past the header: OpenCV's tolerance decides, below
                    pass
                else:
                    _note_damage(notes, damage)
                    return img
    elif data[:8] == PNG_SIGNATURE:
        data = _without_colour_profile(data)
    elif _animated_webp(data):  # OpenCV refuses it, with an ERROR line on stderr each time: Pillow's
        return _decode_with_pillow(data, name)
    elif data[:4] in _TIFF_MAGIC and _tiff_fields(data).get(_COMPRESSION) in samples.OPENCV_LACKS:
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
    if damage:
        _note_damage(notes, damage)
    return img


def _note_damage(notes: list[str] | None, warning: str) -> None:
    if notes is not None:
        notes.append(f"damaged JPEG data, decoded as libjpeg recovers it (part of the image may be grey or "
                     f"smeared): {warning}")


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


_REDUCED = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}


def decode_reduced(data: bytes, name: str, max_pixels: int, needed: Callable[[tuple[int, int]], tuple[int, int]],
                   depth: int = 8, notes: list[str] | None = None) -> tuple[np.ndarray, tuple[int, int]]:
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
    img = decode(data, name, max_pixels, depth, notes)
    return img, (img.shape[0], img.shape[1])
