"""Masks as PNGs encoded with numpy and zlib: binary masks as 1-bit grayscale, class masks as 8-bit,
instance masks as 8- or 16-bit.

OpenCV's PNG writer takes about 9 ms for a 1920x1440 mask (8-bit rows through libpng's filters,
or its own slow bit packing with IMWRITE_PNG_BILEVEL); packing 8 pixels per byte first and
deflating that takes about 1 ms and gives a file half the size. Any PNG reader opens it: OpenCV
and Pillow's convert("L") read 0 (background) and 255 (foreground).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_LEVEL = 3  # zlib level: 3 is as fast as 1 on masks and smaller; 6 doubles the time for ~30% less


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def encode_mask_png(mask: np.ndarray) -> bytes:
    """mask: (H, W) bool, True = foreground -> the bytes of a 1-bit grayscale PNG (white = foreground)."""
    if mask.ndim != 2 or mask.dtype != np.bool_:
        raise ValueError(f"mask must be a (H, W) bool array, got {mask.dtype} {mask.shape}")
    h, w = mask.shape
    if h == 0 or w == 0:
        raise ValueError(f"mask must not be empty, got {mask.shape}")
    packed = np.packbits(mask, axis=1)  # MSB first, rows padded to whole bytes, as PNG wants
    rows = np.zeros((h, packed.shape[1] + 1), dtype=np.uint8)  # column 0: filter type 0 (none) per row
    rows[:, 1:] = packed
    header = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)  # bit depth 1, grayscale, no interlace
    return (_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows.tobytes(), _LEVEL))
            + _chunk(b"IEND", b""))


def encode_class_png(classes: np.ndarray) -> bytes:
    """classes: (H, W) uint8 (or uint16) class or instance indices -> the bytes of an 8-bit (16-bit)
    grayscale PNG holding them as they are (any reader gets the index back as the pixel value)."""
    if classes.ndim != 2 or classes.dtype not in (np.uint8, np.uint16):
        raise ValueError(f"classes must be a (H, W) uint8 or uint16 array, got {classes.dtype} {classes.shape}")
    h, w = classes.shape
    if h == 0 or w == 0:
        raise ValueError(f"classes must not be empty, got {classes.shape}")
    depth = 8 * classes.itemsize
    rows = np.zeros((h, w * classes.itemsize + 1), dtype=np.uint8)  # column 0: filter type 0 (none) per row
    rows[:, 1:] = classes.astype(">u2").view(np.uint8) if depth == 16 else classes  # PNG is big-endian
    header = struct.pack(">IIBBBBB", w, h, depth, 0, 0, 0, 0)  # grayscale, no interlace
    return (_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows.tobytes(), _LEVEL))
            + _chunk(b"IEND", b""))
