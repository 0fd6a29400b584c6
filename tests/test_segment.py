"""Segmentation postprocess: resize back, threshold, mean probability inside the mask."""

from __future__ import annotations

import dataclasses

import cv2
import numpy as np
import pytest

from tests.conftest import ROOT
from worker.models.lookup import find_card
from worker.tasks.preprocess import Geometry
from worker.tasks.segment import Segmenter


@pytest.mark.parametrize("threshold", [0.3, -0.2, 2.0])
def test_mask_and_score_match_the_plain_formula(threshold: float) -> None:
    card = find_card(ROOT / "models", "ppocr-det")
    card = dataclasses.replace(card, postprocess=dataclasses.replace(card.postprocess, threshold=threshold))
    prob = np.random.default_rng(3).normal(0.2, 0.4, (1, 64, 80)).astype(np.float32)  # negatives too (logits)
    result = Segmenter(card).postprocess(prob, Geometry((150, 190), 80 / 190, 64 / 150))
    full = cv2.resize(prob[0], (190, 150), interpolation=cv2.INTER_LINEAR)
    want = full > threshold
    assert result.mask.shape == (150, 190) and np.array_equal(result.mask, want)
    assert result.score == pytest.approx(float(full[want].mean()) if want.any() else 0.0, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("activation", [None, "softmax", "sigmoid"])
def test_class_mask_matches_the_plain_formula(activation: str | None) -> None:
    card = find_card(ROOT / "models", "ppocr-det")
    card = dataclasses.replace(card, labels=("bg", "a", "b", "c"),
                               postprocess=dataclasses.replace(card.postprocess, activation=activation))
    out = np.random.default_rng(5).normal(0, 2, (4, 20, 30)).astype(np.float32)
    result = Segmenter(card).postprocess(out, Geometry((45, 70), 30 / 70, 20 / 45))
    probs = out.astype(np.float64)
    if activation == "softmax":
        probs = np.exp(probs) / np.exp(probs).sum(axis=0)
    elif activation == "sigmoid":
        probs = 1 / (1 + np.exp(-probs))
    full = np.stack([cv2.resize(p.astype(np.float32), (70, 45), interpolation=cv2.INTER_LINEAR) for p in probs])
    want = full.argmax(axis=0)
    assert result.classes.shape == (45, 70) and (result.classes == want).mean() > 0.999  # float ties aside
    small = probs.argmax(axis=0)  # scores: over the pixels the model gave each class, at its resolution
    for c in range(4):
        sel = small == c
        assert result.scores[c] == pytest.approx(probs.max(axis=0)[sel].mean() if sel.any() else 0.0, rel=1e-4)
    assert result.names == ("bg", "a", "b", "c")
    doc = result.summary()
    assert doc["mask_pixels"] == int((result.classes > 0).sum()) and sum(x["pixels"] for x in doc["classes"]) == 45 * 70


def test_regions_are_boxes_of_connected_parts_in_reading_order_and_capped() -> None:
    from worker.tasks.segment import MAX_REGIONS, regions

    mask = np.zeros((50, 80), np.uint8)
    mask[30:40, 5:20] = 1  # lower
    mask[2:6, 50:79] = 1  # upper right
    mask[2:4, 10:12] = 1  # upper left, touching nothing
    mask[6, 79] = 1  # diagonal neighbour of the upper right part: 8-connected to it
    got = regions(mask)
    assert got.tolist() == [[10, 2, 12, 4, 4], [50, 2, 80, 7, 4 * 29 + 1], [5, 30, 20, 40, 150]]
    dots = np.zeros((100, 100), np.uint8)
    dots[::2, ::2] = 1  # 2,500 single pixels
    dots[40:45, 40:45] = 1  # and one of 25 (it swallows 9 dots)
    many = regions(dots)
    assert len(many) == MAX_REGIONS and many[:, 4].max() == 25 and regions(np.zeros((4, 4), np.uint8)).shape == (0, 5)


def test_regions_labelled_within_the_mask_s_bounds_are_those_of_the_whole_image(monkeypatch) -> None:
    """regions() labels only the bounding box of the mask's pixels: the same regions, in the same order,
    as labelling the whole image, the largest kept among regions tied in size as well (random masks in a
    random corner of the image; labelling from an odd corner numbered some tied regions otherwise)."""
    import worker.tasks.segment as segment

    def whole(mask: np.ndarray) -> np.ndarray:
        _, _, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8, ltype=cv2.CV_32S)
        s = stats[1:].astype(np.int64)
        if len(s) > segment.MAX_REGIONS:
            s = s[np.argsort(-s[:, 4], kind="stable")[:segment.MAX_REGIONS]]
        s = s[np.lexsort((s[:, 0], s[:, 1]))]
        return np.column_stack([s[:, 0], s[:, 1], s[:, 0] + s[:, 2], s[:, 1] + s[:, 3], s[:, 4]])

    rng = np.random.default_rng(2)
    for cap in (1000, 5):
        monkeypatch.setattr(segment, "MAX_REGIONS", cap)
        for _ in range(600):
            h, w = rng.integers(2, 60, 2)
            mask = (rng.random((h, w)) < rng.uniform(0.05, 0.6)).astype(np.uint8)
            mask[: rng.integers(0, h)] = 0
            mask[:, : rng.integers(0, w)] = 0
            mask[rng.integers(1, h + 1):] = 0
            want, got = whole(mask), segment.regions(mask)
            assert got.shape == want.shape and np.array_equal(got, want), (cap, mask.shape)
