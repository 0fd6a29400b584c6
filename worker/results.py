"""Per-image results: frozen dataclasses of numpy arrays, shapes checked on construction.

They never draw or write themselves; `worker.outbox` writes them and `summary()` is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np


@dataclass(frozen=True, eq=False)
class Mask:
    """Segmentation result.

    mask: (H, W) bool at the original image size (True = foreground).
    label: the foreground class name. score: mean probability inside the mask (0 when empty).
    """

    mask: np.ndarray
    label: str
    score: float

    def __post_init__(self) -> None:
        if self.mask.ndim != 2 or self.mask.dtype != np.bool_:
            raise ValueError(f"Mask.mask must be a (H, W) bool array, got {self.mask.dtype} {self.mask.shape}")

    @property
    def fraction(self) -> float:
        return float(self.mask.mean()) if self.mask.size else 0.0

    def summary(self) -> dict[str, Any]:
        h, w = self.mask.shape
        return {"label": self.label, "fg_fraction": round(self.fraction, 6), "fg_pixels": int(self.mask.sum()),
                "score": round(self.score, 6), "size": [w, h]}


@dataclass(frozen=True, eq=False)
class Classification:
    """Top-k classes, best first.

    class_ids: (K,) int64. scores: (K,) float64 probabilities. names: K names.
    uncertain: top-1 probability below the card's threshold.
    """

    class_ids: np.ndarray
    scores: np.ndarray
    names: tuple[str, ...]
    uncertain: bool

    def __post_init__(self) -> None:
        k = len(self.names)
        if self.class_ids.shape != (k,) or self.scores.shape != (k,):
            raise ValueError(f"Classification: class_ids {self.class_ids.shape} and scores {self.scores.shape} must be ({k},)")

    def summary(self) -> dict[str, Any]:
        return {"uncertain": self.uncertain, "labels": [
            {"class_id": int(c), "name": n, "score": round(float(s), 6)}
            for c, s, n in zip(self.class_ids, self.scores, self.names)]}


@dataclass(frozen=True, eq=False)
class Detections:
    """Boxes, best first.

    xyxy: (N, 4) float32, x1 y1 x2 y2 in original image pixels. class_ids: (N,) int64.
    scores: (N,) float32. names: N names. image_size: (W, H) of the original image.
    """

    xyxy: np.ndarray
    class_ids: np.ndarray
    scores: np.ndarray
    names: tuple[str, ...]
    image_size: tuple[int, int]

    def __post_init__(self) -> None:
        n = len(self.names)
        if self.xyxy.shape != (n, 4) or self.class_ids.shape != (n,) or self.scores.shape != (n,):
            raise ValueError(f"Detections: xyxy {self.xyxy.shape}, class_ids {self.class_ids.shape}, "
                             f"scores {self.scores.shape} must be ({n}, 4), ({n},), ({n},)")

    def summary(self) -> dict[str, Any]:
        return {"boxes": [
            {"class_id": int(c), "name": n, "score": round(float(s), 6), "xyxy": [round(float(v), 2) for v in b]}
            for b, c, s, n in zip(self.xyxy, self.class_ids, self.scores, self.names)]}


Result = Union[Mask, Classification, Detections]


def labels_of(result: Result) -> list[tuple[int, str, float]]:
    """(class_id, name, score) rows for the database's label index, whatever the task."""
    if isinstance(result, Classification):
        return [(int(c), n, float(s)) for c, s, n in zip(result.class_ids, result.scores, result.names)]
    if isinstance(result, Detections):
        return [(int(c), n, float(s)) for c, s, n in zip(result.class_ids, result.scores, result.names)]
    return [(0, result.label, result.score)] if result.mask.any() else []


def top_score(result: Result) -> float:
    if isinstance(result, Mask):
        return result.score
    return float(result.scores[0]) if len(result.scores) else 0.0
