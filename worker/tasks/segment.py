"""Segmentation: a per-pixel probability map, resized back to the image and thresholded."""

from __future__ import annotations

import cv2
import numpy as np

from worker.results import Mask
from worker.tasks.preprocess import CardPreprocessing, Geometry


class Segmenter(CardPreprocessing):
    def postprocess(self, output: np.ndarray, geometry: Geometry) -> Mask:
        """output: (1, h, w) or (h, w) probabilities for one image."""
        prob = output.reshape(output.shape[-2:])
        h, w = geometry.orig_hw
        full = cv2.resize(prob, (w, h), interpolation=cv2.INTER_LINEAR)
        mask = full > self.card.postprocess.threshold
        score = float(full[mask].mean()) if mask.any() else 0.0
        return Mask(mask=mask, label=self.card.label(0), score=score)
