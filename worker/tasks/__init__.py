"""Pre- and post-processing per task. `adapter_for(card)` is the only place that maps a task to code."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from worker.models.card import ModelCard
from worker.results import Result
from worker.tasks.preprocess import Geometry


class TaskAdapter(Protocol):
    def preprocess(self, image: np.ndarray) -> tuple[np.ndarray, Geometry]:
        """uint8 BGR (H, W, 3) -> float32 (3, h, w) network input and the geometry to map back."""
        ...

    def postprocess(self, output: np.ndarray, geometry: Geometry) -> Result:
        """One image's slice of the network output -> a result in original-image coordinates."""
        ...


def adapter_for(card: ModelCard) -> TaskAdapter:
    if card.task == "segment":
        from worker.tasks.segment import Segmenter

        return Segmenter(card)
    if card.task == "classify":
        from worker.tasks.classify import Classifier

        return Classifier(card)
    from worker.tasks.detect import Detector

    return Detector(card)
