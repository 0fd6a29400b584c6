"""Segmentation: a per-pixel probability map, resized back to the image and thresholded."""

from __future__ import annotations

import cv2
import numpy as np

from worker.errors import ModelError
from worker.results import Mask
from worker.tasks.preprocess import CardPreprocessing, Geometry


class Segmenter(CardPreprocessing):
    def check_output(self, output: np.ndarray) -> None:
        if output.ndim < 2 or output.size != output.shape[-2] * output.shape[-1]:
            raise ModelError(f"model '{self.card.name}': a segmenter's output must be one probability map per "
                             f"image, (N, 1, h, w) or (N, h, w); output '{self.card.postprocess.output}' is "
                             f"(N, {', '.join(map(str, output.shape))})")

    def postprocess(self, output: np.ndarray, geometry: Geometry) -> Mask:
        """output: (1, h, w) or (h, w) probabilities for one image."""
        prob = output.reshape(output.shape[-2:])
        h, w = geometry.orig_hw
        full = cv2.resize(prob, (w, h), interpolation=cv2.INTER_LINEAR)
        threshold = self.card.postprocess.threshold
        mask = full > threshold
        n = int(np.count_nonzero(mask))
        # the mean inside the mask without gathering it (2-3x faster on a 1920 px page): values at or
        # below the threshold become 0, the rest are summed (float64) and divided by their count
        _, kept = cv2.threshold(full, threshold, 0, cv2.THRESH_TOZERO)
        score = cv2.sumElems(kept)[0] / n if n else 0.0
        return Mask(mask=mask, label=self.card.label(0), score=score)
