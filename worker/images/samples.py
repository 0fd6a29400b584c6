"""Decoded pixels as the worker's samples: BGR of 8 or 16 bits (or 32-bit floats), pages and
images checked against the pixel limit, and the TIFF tags every reader names."""

from __future__ import annotations


import numpy as np
from PIL import UnidentifiedImageError

from worker.errors import DecodeError, ImageTooLarge


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


def _is_32bit(mode: str, bits: int | tuple[int, ...]) -> bool:
    """Pillow's float mode, or its 32-bit integer one holding a TIFF's 32-bit samples (it also holds
    16-bit PGMs, which decode as pixels)."""
    return mode == "F" or (mode == "I" and _one(bits) == 32)


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


def widen(img: np.ndarray) -> np.ndarray:
    """uint8 -> uint16 over the same range (x * 257: 0 -> 0, 255 -> 65535)."""
    return img.astype(np.uint16) * np.uint16(257)


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


def _as_page(img: np.ndarray, name: str, depth: int) -> np.ndarray:
    """A decoded later page as `decode` gives a first one at this depth."""
    if depth == 32:
        return _as_samples(img, name)
    if img.ndim != 3 or img.shape[2] != 3 or img.shape[0] < 1 or img.shape[1] < 1:
        raise DecodeError(name, f"unexpected decoded shape {img.shape}")
    if img.dtype in (np.int16, np.int8):  # OpenCV's any-depth read of a signed page: 8 bits, as the first page's
        img = _unsigned(img)
    return widen(img) if depth == 16 and img.dtype == np.uint8 else img


def _check_pixels(width: int, height: int, name: str, max_pixels: int) -> None:
    if max_pixels and width * height > max_pixels:
        raise ImageTooLarge(name, f"{width}x{height} pixels is over the limit of {max_pixels} (pipeline.max_pixels)")


_GRAY16 = frozenset(("I;16", "I;16L", "I;16B", "I;16N"))  # Pillow's modes of 16-bit gray pixels


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
