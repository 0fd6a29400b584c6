"""A corpus of hostile and odd inputs, each with the outcome the worker must record for it."""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
from PIL import Image


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(width: int = 40000, height: int = 40000) -> bytes:
    """A valid PNG header announcing width x height grayscale pixels, with almost no data behind it."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
            + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 1000)) + _png_chunk(b"IEND", b""))


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def build(folder: Path, samples: Path) -> dict[str, tuple[str, str]]:
    """Write the corpus under folder; returns rel -> (expected status, substring of the error or '')."""
    folder.mkdir(parents=True, exist_ok=True)
    photo = cv2.imread(str(samples / "chelsea.png"))
    rgb = Image.fromarray(photo[:, :, ::-1])
    jpeg = cv2.imencode(".jpg", photo)[1].tobytes()
    files: dict[str, tuple[bytes, str, str]] = {
        "empty.jpg": (b"", "failed", "empty file"),
        "truncated.jpg": (jpeg[: len(jpeg) // 3], "failed", "truncated JPEG"),
        "random.jpg": (np.random.default_rng(0).bytes(4096), "failed", "not an image"),
        "text.png": (b"I am a text file, not a PNG\n" * 10, "failed", "not an image"),
        "one_pixel.png": (cv2.imencode(".png", photo[:1, :1])[1].tobytes(), "done", ""),
        "bomb.png": (bomb_png(), "failed", "over the limit"),
        "sixteen_bit.png": (cv2.imencode(".png", photo.astype(np.uint16) * 257)[1].tobytes(), "done", ""),
        "gray.png": (cv2.imencode(".png", cv2.cvtColor(photo, cv2.COLOR_BGR2GRAY))[1].tobytes(), "done", ""),
        "rgba.png": (_save(rgb.convert("RGBA"), "PNG"), "done", ""),
        "palette.png": (_save(rgb.convert("P"), "PNG"), "done", ""),
        "cmyk.jpg": (_save(rgb.convert("CMYK"), "JPEG"), "done", ""),
        "multipage.tif": (_save(rgb, "TIFF", save_all=True, append_images=[rgb.rotate(90, expand=True)]), "done", ""),
        "measurements.tif": (_save(Image.fromarray(photo[:, :, 1].astype(np.float32) / 255, mode="F"), "TIFF"),
                             "failed", "a TIFF of 32-bit float samples, not 8- or 16-bit pixels"),
        # Pillow cannot open a colour one; OpenCV would decode it at 8 bits, clipped, as pixels
        "colour_measurements.tif": (cv2.imencode(".tiff", photo.astype(np.float32) / 255,
                                                 [cv2.IMWRITE_TIFF_COMPRESSION, 1])[1].tobytes(),
                                    "failed", "a TIFF of 32-bit float samples, not 8- or 16-bit pixels"),
        "animated.gif": (_save(rgb.convert("P"), "GIF", save_all=True, append_images=[rgb.rotate(180).convert("P")]),
                         "done", ""),
        "with space.jpg": (jpeg, "done", ""),
        "ünïcødé 画像.jpg": (jpeg[:-1] + b"\xd9", "done", ""),
        "-leading-dash.jpg": (jpeg, "done", ""),
        "--help.png": (cv2.imencode(".png", photo[::2, ::2])[1].tobytes(), "done", ""),
        "a/b/c/d/e/f/g/h/i/deep.png": (cv2.imencode(".png", photo[::3, ::3])[1].tobytes(), "done", ""),
        "dup_one.png": (cv2.imencode(".png", photo[::4, ::4])[1].tobytes(), "done", ""),
        "dup_two.png": (cv2.imencode(".png", photo[::4, ::4])[1].tobytes(), "done", ""),
        # names that are not UTF-8 (Latin-1 from an old share): Python holds their bytes as surrogates
        "caf\udce9.jpg": (jpeg, "done", ""),
        "d\udce4ta/n\udcfcmero.png": (cv2.imencode(".png", photo[::5, ::5])[1].tobytes(), "done", ""),
        "br\udcf6ken.jpg": (b"not an image at all\n" * 20, "failed", "not an image"),
        # 250 bytes, near the filesystem's 255: its outputs' names (".json", ".error.json") are cut short
        "長" * 82 + ".jpg": (jpeg, "done", ""),
        "壊" * 82 + ".jpg": (jpeg[: len(jpeg) // 4], "failed", "truncated JPEG"),
    }
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90 degrees clockwise: upright is taller than wide
    files["exif_rotated.jpg"] = (_save(rgb, "JPEG", exif=exif), "done", "")
    expected: dict[str, tuple[str, str]] = {}
    for rel, (data, status, why) in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
        expected[rel] = (status, why)
    with open(folder / "huge.tif", "wb") as f:  # sparse: 700 MiB on paper, nothing on disk; never read
        f.truncate(700 << 20)
    expected["huge.tif"] = ("failed", "bytes is more than any image within the pixel limit")
    os.mkfifo(folder / "pipe.jpg")  # opening it for reading would block until a writer came
    expected["pipe.jpg"] = ("failed", "not a regular file (a named pipe)")
    os.symlink("/etc/hostname", folder / "link_outside.jpg")
    expected["link_outside.jpg"] = ("failed", "symbolic link: not followed")
    if os.geteuid() != 0:  # root reads anything: the permission case only exists for other users
        (folder / "unreadable.jpg").write_bytes(jpeg)
        (folder / "unreadable.jpg").chmod(0)
        expected["unreadable.jpg"] = ("failed", "cannot read file")
    return expected
