"""The prepare stage's reading of files: files larger than the size over which a TIFF's pages are counted
(PAGES_FROM_DISK_BYTES) are read from their first byte, in every format the worker reads."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from tests.conftest import image_rows
from worker.pipeline.prepare import PAGES_FROM_DISK_BYTES
from worker.service import run_folder


def _big_files(folder: Path) -> dict[str, tuple[int, int]]:
    """One valid file over PAGES_FROM_DISK_BYTES in each format (noise, which no codec shrinks); name -> (w, h)."""
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (4900, 4900, 3), dtype=np.uint8)  # 72 MB of pixels
    tall = np.concatenate([noise, noise[:3000]])  # a JPEG of noise at quality 100 takes ~0.9 byte per value
    writers = {
        "scan.bmp": lambda p: cv2.imwrite(str(p), noise),
        "scan.png": lambda p: cv2.imwrite(str(p), noise, [cv2.IMWRITE_PNG_COMPRESSION, 0]),
        "scan.jpg": lambda p: cv2.imwrite(str(p), tall, [cv2.IMWRITE_JPEG_QUALITY, 100]),
        "scan.tif": lambda p: cv2.imwrite(str(p), noise),
        "scan.webp": lambda p: Image.fromarray(noise).save(p, lossless=True, method=0, quality=0),
        "scan.gif": lambda p: Image.fromarray(rng.integers(0, 256, (9000, 8200), dtype=np.uint8), "L").save(p),
    }
    sizes = {}
    for name, write in writers.items():
        write(folder / name)
        assert (folder / name).stat().st_size > PAGES_FROM_DISK_BYTES, name
        with Image.open(folder / name) as im:
            sizes[name] = im.size
    return sizes


def test_files_over_64_mib_are_read_whole(cfg, effnet_onnx, tmp_path: Path) -> None:
    folder = tmp_path / "scans"
    folder.mkdir()
    sizes = _big_files(folder)
    cfg = dataclasses.replace(cfg, model="efficientnet-lite0")
    summary = run_folder(cfg, folder)
    assert summary.figures["done"] == len(sizes), summary.figures
    rows = image_rows(cfg)
    for name, (width, height) in sizes.items():
        data = (folder / name).read_bytes()
        assert rows[name].status == "done", (name, rows[name].error)
        assert rows[name].sha256 == hashlib.sha256(data).hexdigest(), name
        result = json.loads((cfg.outbox / f"{name}.json").read_text())
        assert result["sha256"] == rows[name].sha256
        assert result["image"] == {"width": width, "height": height}, name



def _garbled_jpeg(samples: Path) -> bytes:
    """rocket.jpg re-encoded, 2,000 bytes of its entropy-coded data overwritten: libjpeg decodes it, warning."""
    image = cv2.imread(str(samples / "rocket.jpg"))
    data = bytearray(cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes())
    middle = len(data) // 2
    data[middle:middle + 2000] = np.random.default_rng(1).bytes(2000)
    return bytes(data)


def test_a_jpeg_damaged_in_the_middle_is_done_with_a_warning(cfg, effnet_onnx, samples: Path, tmp_path: Path,
                                                            capfd) -> None:
    """Decoded as libjpeg (and OpenCV) recover it, the same pixels; done, its warning in the JSON, in the
    database and in the log: before, done with no word but libjpeg's own line on stderr."""
    from worker.images import decode

    data = _garbled_jpeg(samples)
    notes: list[str] = []
    image = decode(data, "garbled.jpg", 10**8, notes=notes)
    assert notes and "damaged JPEG data" in notes[0] and "Corrupt JPEG data" in notes[0], notes
    reference = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert np.abs(image.astype(int) - reference.astype(int)).max() <= 1
    decode((samples / "rocket.jpg").read_bytes(), "rocket.jpg", 10**8, notes=notes)
    assert len(notes) == 1  # a sound JPEG says nothing
    header = bytearray(cv2.imencode(".jpg", cv2.imread(str(samples / "rocket.jpg")))[1].tobytes())
    header[300:400] = np.random.default_rng(2).bytes(100)  # its Huffman tables: libjpeg warns, OpenCV decodes
    decode(bytes(header), "header.jpg", 10**8, notes=notes)
    assert len(notes) == 2 and "extraneous bytes before marker" in notes[1], notes
    folder = tmp_path / "scans"
    folder.mkdir()
    (folder / "garbled.jpg").write_bytes(data)
    shutil.copy(samples / "rocket.jpg", folder / "rocket.jpg")
    capfd.readouterr()
    cfg = dataclasses.replace(cfg, model="efficientnet-lite0")
    assert run_folder(cfg, folder).figures["done"] == 2
    assert "Corrupt JPEG data" not in capfd.readouterr().err  # libjpeg's own line no more
    rows = image_rows(cfg)
    assert rows["garbled.jpg"].status == "done" and rows["garbled.jpg"].error.startswith("warning: damaged JPEG data")
    assert rows["rocket.jpg"].error is None
    result = json.loads((cfg.outbox / "garbled.jpg.json").read_text())
    assert result["warnings"] == notes[:1] and "warnings" not in json.loads((cfg.outbox / "rocket.jpg.json").read_text())
    assert result["model_input"] == {"width": 224, "height": 224}
