"""Pillow, for what OpenCV cannot read: its pixels as the worker's samples, its warnings kept out of
the log."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from worker.errors import DecodeError
from worker.images import samples
from worker.images.samples import (_BITS, _COMPRESSION, _EXTRA_SAMPLES, _FORMAT, _GRAY16, _LENGTH, _WIDTH, _as_page,
                                   _as_samples, _check_pixels, _gray3, _high_byte, _is_32bit, _one,
                                   _samples_not_pixels, _undecodable)
from worker.images.tiff_directories import _tiff_fields


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


def _pillow_page(im: Image.Image, name: str, depth: int) -> np.ndarray:
    """The frame Pillow is at, as `decode` gives a first page at this depth."""
    if depth == 32 and _is_32bit(im.mode, getattr(im, "tag_v2", {}).get(_BITS, 0)):
        return _as_samples(np.asarray(im), name)
    return _as_page(_pillow_pixels(im, name, deep=depth != 8, floats=depth == 32), name, depth)


def _check_page(im: Image.Image, name: str, max_pixels: int, depth: int) -> None:
    if depth != 32 and (why := _samples_not_pixels(im.mode, getattr(im, "tag_v2", {}).get(258, 0), im.format)):
        raise DecodeError(name, why)
    _check_pixels(im.size[0], im.size[1], name, max_pixels)


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
        if isinstance(e, UnidentifiedImageError) and fields.get(_COMPRESSION) not in samples.OPENCV_LACKS and \
                not {_WIDTH, _LENGTH, _BITS} <= fields.keys():
            raise DecodeError(name, "not an image (unknown or corrupt format)") from None
        raise _undecodable(name, e, fields) from None


def _bgr(im: Image.Image) -> np.ndarray:
    """A Pillow image (any mode, a frame as composed) as BGR (H, W, 3) uint8."""
    return np.ascontiguousarray(np.asarray(im.convert("RGB"))[:, :, ::-1])


def _over_black(im: Image.Image) -> np.ndarray:
    """A TIFF's colour with alpha as OpenCV reads it (libtiff's RGBA interface): premultiplied, i.e. over
    black, BGR (H, W, 3) uint8. Pillow holds it straight (RGBA: it divides associated alpha out as it
    loads), or as stored (RGBa); PNG, WebP and the rest drop alpha instead, in OpenCV as here."""
    rgba = np.asarray(im)
    rgb = rgba[:, :, :3] if im.mode == "RGBa" else \
        ((rgba[:, :, :3].astype(np.uint16) * rgba[:, :, 3:] + 127) // 255).astype(np.uint8)  # libtiff's rounding
    return np.ascontiguousarray(rgb[:, :, ::-1])


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
        compression = samples.OPENCV_LACKS.get(tags.get(_COMPRESSION, 0), "its compression")
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
