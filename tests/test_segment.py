"""Segmentation postprocess: resize back, threshold, mean probability inside the mask."""

from __future__ import annotations

import dataclasses

import cv2
import numpy as np
import pytest

from tests.conftest import ROOT
from worker.models.card import find_card
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
