"""Telling a file cut short from a complete one by its first and last bytes (worker/intake/complete.py)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from worker.images import jpeg_complete
from worker.intake.complete import TAIL_BYTES, cut_short, judge


def _encoded(samples: Path, fmt: str) -> bytes:
    """A real photograph (chelsea.png) in `fmt`, as a camera or a converter would write it."""
    img = Image.open(samples / "chelsea.png").convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _judged(path: Path, data: bytes) -> str | None:
    path.write_bytes(data)
    return cut_short(path, len(data))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "BMP", "WEBP"])
def test_whole_files_are_complete_and_their_first_parts_are_not(samples: Path, tmp_path: Path, fmt: str) -> None:
    data = _encoded(samples, fmt)
    path = tmp_path / f"a.{fmt.lower()}"
    assert _judged(path, data) is None
    for cut in (len(data) // 3, len(data) - 1):  # a first part, and all but the last byte
        assert _judged(path, data[:cut]) is not None, (fmt, cut)


def test_a_photo_longer_than_the_tail_read_is_judged_by_its_tail(samples: Path, tmp_path: Path) -> None:
    data = (samples / "hubble_deep_field.jpg").read_bytes()
    assert len(data) > 2 * TAIL_BYTES  # the tail read alone decides
    path = tmp_path / "hubble.jpg"
    assert _judged(path, data) is None
    assert _judged(path, data[: len(data) // 2]) == "no JPEG end-of-image marker after the last scan"
    assert judge(data[:16], data[-TAIL_BYTES:], len(data)) is None  # its tail alone says complete
    assert judge(data[:16], data[: len(data) // 2][-TAIL_BYTES:], len(data) // 2) is not None
    # bytes a camera appends after the end marker, shorter than the tail read: still complete
    assert _judged(path, data + b"\x00" * 1000 + b"TRAILER") is None


def test_a_trailer_longer_than_the_tail_read_is_judged_as_the_decoder_judges_it(samples: Path,
                                                                             tmp_path: Path) -> None:
    """A motion photo: a video of a few MB after the JPEG's end marker. The tail shows no end marker,
    so the file is read whole and gets the decoder's own check (worker.images.jpeg_complete)."""
    photo = (samples / "hubble_deep_field.jpg").read_bytes()
    path = tmp_path / "motion.jpg"
    assert _judged(path, photo + bytes(3 * TAIL_BYTES)) is None
    video = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    assert (_judged(path, photo + video) is None) == jpeg_complete(photo + video)
    assert _judged(path, photo[: len(photo) // 2] + bytes(3 * TAIL_BYTES)) is not None


def test_a_small_jpeg_cut_after_its_thumbnail_is_cut_short() -> None:
    """A whole file within the tail read gets the decoder's own check: the EOI of an EXIF thumbnail,
    before the main image's scan, does not count."""
    thumb = b"\xff\xd8\xff\xda" + b"\x11" * 20 + b"\xff\xd9"
    jpeg = b"\xff\xd8\xff\xe1\x00\x30" + thumb + b"\xff\xdb" + b"\x22" * 40 + b"\xff\xda" + b"\x33" * 50 + b"\xff\xd9"
    assert judge(jpeg[:16], jpeg, len(jpeg)) is None
    part = jpeg[: jpeg.rindex(b"\xff\xda") + 10]  # cut inside the main image's scan
    assert judge(part[:16], part, len(part)) == "no JPEG end-of-image marker after the last scan"


def test_empty_files_wait_and_formats_without_an_end_do_not(samples: Path, tmp_path: Path) -> None:
    assert _judged(tmp_path / "new.jpg", b"") == "empty"
    tiff = _encoded(samples, "TIFF")
    assert _judged(tmp_path / "a.tif", tiff[: len(tiff) // 2]) is None  # cannot be told: never held
    assert _judged(tmp_path / "text.jpg", b"hello") is None  # not an image: the decoder says so


def test_a_header_claiming_more_bytes_than_the_file_has(tmp_path: Path) -> None:
    bmp = b"BM" + (1000).to_bytes(4, "little") + bytes(58)
    assert _judged(tmp_path / "a.bmp", bmp) == "64 of the 1000 bytes its BMP header gives"


def test_pipes_links_and_vanished_files_are_not_read(samples: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    assert cut_short(fifo, 0) is None  # opened without blocking; a pipe cannot be read at an offset
    target = tmp_path / "cut.jpg"
    target.write_bytes((samples / "rocket.jpg").read_bytes()[:5000])
    link = tmp_path / "link.jpg"
    link.symlink_to(target)
    assert cut_short(link, 5000) is None  # never read through: the pipeline refuses the link
    assert cut_short(tmp_path / "gone.jpg", 5000) is None


def test_judging_does_not_depend_on_the_pixels(tmp_path: Path) -> None:
    """Noise compresses into long scans with many 0xFF bytes (stuffed as FF 00): no false end marker."""
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (600, 800, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=95)
    data = buf.getvalue()
    assert len(data) > TAIL_BYTES
    path = tmp_path / "noise.jpg"
    assert _judged(path, data) is None
    for k in range(1, 8):
        assert _judged(path, data[: len(data) * k // 8]) is not None
