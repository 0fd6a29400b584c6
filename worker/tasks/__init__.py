"""Pre- and post-processing per task. `adapter_for(card)` is the only place that maps a task to code."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from worker.errors import ModelError
from worker.runtime.model_output import ModelOutput
from worker.models.card import ModelCard
from worker.tasks.results import Result
from worker.tasks.preprocess import Geometry

# a model's other outputs, as onnxruntime declares them: (name, shape with symbolic dimensions as text)
OtherOutputs = Sequence[tuple[str, tuple[int | str, ...]]]


class TaskAdapter(Protocol):
    def preprocess(self, image: np.ndarray) -> tuple[np.ndarray, Geometry]:
        """BGR (H, W, 3), uint8 (uint16 at depth 16, float32 at 32) -> float32 (C, h, w) network input
        (C: 3, or 1 for gray) and the geometry to map back."""
        ...

    def postprocess(self, output: ModelOutput, geometry: Geometry) -> Result:
        """One image's slice of the network output -> a result in original-image coordinates."""
        ...

    def check_output(self, output: ModelOutput, others: OtherOutputs = ()) -> None:
        """Raise ModelError when one image's output contradicts the card (shape, number of classes).
        `others`: the model's outputs the card does not use, (name, shape), for saying what it is."""
        ...


def check_labels(card: ModelCard, classes: int, output: np.ndarray) -> None:
    """The card's labels, when it has any, must name every class the model outputs, and no more."""
    if card.labels and len(card.labels) != classes:
        raise ModelError(f"model '{card.name}': the card lists {len(card.labels)} labels, but output "
                         f"'{card.postprocess.named}' {tuple(output.shape)} has {classes} classes")


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) in the logits' own float type, without overflow: logits below the floor of
    -log(max float) (-88 in float32, -709 in float64), whose exp(-x) would overflow to inf with a warning,
    give what the floor gives (6e-39 in float32: no threshold tells them apart)."""
    floor = logits.dtype.type(np.floor(np.log(np.finfo(logits.dtype).max)))
    return 1 / (1 + np.exp(-np.maximum(logits, -floor)))


def activate(scores: np.ndarray, activation: str | None, axis: int = 0) -> np.ndarray:
    """Scores -> probabilities as a card's `postprocess.activation` says: softmax over `axis`, sigmoid,
    or as they are (`none`, or None: each task chooses its default before calling)."""
    if activation == "softmax":
        z = np.exp(scores - scores.max(axis=axis, keepdims=True))
        return z / z.sum(axis=axis, keepdims=True)
    if activation == "sigmoid":
        return sigmoid(scores)
    return scores


def adapter_for(card: ModelCard) -> TaskAdapter:
    if card.task == "segment":
        from worker.tasks.segment import Segmenter

        return Segmenter(card)
    if card.task == "classify":
        from worker.tasks.classify import Classifier

        return Classifier(card)
    from worker.tasks.detect import Detector

    return Detector(card)
