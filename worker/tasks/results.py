"""Per-image results: frozen dataclasses of numpy arrays, shapes checked on construction.

They never draw or write themselves; `worker.outputs.outbox` writes them and `summary()` is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np


@dataclass(frozen=True, eq=False)
class Mask:
    """Segmentation result.

    mask: (H, W) bool at the original image size (True = foreground).
    label: the foreground class name. score: mean probability inside the mask (0 when empty).
    regions: (R, 5) int64, the mask's connected regions (text lines, parts): x1, y1, x2, y2 in pixel-edge
    coordinates (x2 = x1 + width) and the region's pixels.
    """

    mask: np.ndarray
    label: str
    score: float
    regions: np.ndarray = field(default_factory=lambda: np.zeros((0, 5), np.int64))

    def __post_init__(self) -> None:
        if self.mask.ndim != 2 or self.mask.dtype != np.bool_:
            raise ValueError(f"Mask.mask must be a (H, W) bool array, got {self.mask.dtype} {self.mask.shape}")
        if self.regions.ndim != 2 or self.regions.shape[1] != 5:
            raise ValueError(f"Mask.regions must be (R, 5), got {self.regions.shape}")

    def summary(self) -> dict[str, Any]:
        pixels = int(np.count_nonzero(self.mask))
        fraction = pixels / self.mask.size if self.mask.size else 0.0
        return {"label": self.label, "mask_fraction": round(fraction, 6), "mask_pixels": pixels,
                "score": round(self.score, 6), "regions": region_dicts(self.regions)}


@dataclass(frozen=True, eq=False)
class ClassMask:
    """Multi-class segmentation result: a class for every pixel.

    classes: (H, W) uint8 class index at the original image size; class 0 is the background.
    names: C class names, index = class id (C <= 256).
    scores: (C,) float64, each class's mean probability over the pixels the model gave it (0 where none).
    pixels: (C,) int64, each class's pixels in `classes`.
    regions: (R, 6) int64, the foreground classes' connected regions: class id, x1, y1, x2, y2 (pixel
    edges), pixels.
    """

    classes: np.ndarray
    names: tuple[str, ...]
    scores: np.ndarray
    pixels: np.ndarray
    regions: np.ndarray = field(default_factory=lambda: np.zeros((0, 6), np.int64))

    def __post_init__(self) -> None:
        if self.classes.ndim != 2 or self.classes.dtype != np.uint8:
            raise ValueError(f"ClassMask.classes must be a (H, W) uint8 array, got {self.classes.dtype} "
                             f"{self.classes.shape}")
        if not 2 <= len(self.names) <= 256 or self.scores.shape != (len(self.names),):
            raise ValueError(f"ClassMask: {len(self.names)} names and scores of shape {self.scores.shape}")
        if self.regions.ndim != 2 or self.regions.shape[1] != 6:
            raise ValueError(f"ClassMask.regions must be (R, 6), got {self.regions.shape}")
        if self.pixels.shape != (len(self.names),) or int(self.pixels.sum()) != self.classes.size:
            raise ValueError(f"ClassMask.pixels {self.pixels.shape} must count the {self.classes.size} pixels "
                             f"of {len(self.names)} classes")

    @property
    def score(self) -> float:
        """The mean probability over every foreground pixel: each class's mean weighted by its pixels."""
        fg = self.pixels[1:]
        return float((self.scores[1:] * fg).sum() / fg.sum()) if fg.sum() else 0.0

    def summary(self) -> dict[str, Any]:
        h, w = self.classes.shape
        pixels = self.pixels
        fg = int(pixels[1:].sum())
        return {"mask_fraction": round(fg / (h * w), 6), "mask_pixels": fg, "score": round(self.score, 6),
                "classes": [{"class_id": c, "name": self.names[c], "fraction": round(int(n) / (h * w), 6),
                             "pixels": int(n), "score": round(float(self.scores[c]), 6)}
                            for c, n in enumerate(pixels) if n],
                "regions": [{"class_id": int(r[0]), "name": self.names[r[0]], "xyxy": [int(v) for v in r[1:5]],
                             "pixels": int(r[5])} for r in self.regions]}


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
    instances: an instance segmenter's masks, or None: (H, W) uint16, k + 1 where box k's mask is, 0
    elsewhere (where masks overlap, the better box's).
    keypoints: a pose model's, or None: (N, K, D) float32, each box's K points, x and y in original image
    pixels and, with D = 3, visibility 0-1. keypoint_names: the K points' names in order, or ().
    rotated: an oriented-box detector's boxes, or None: (N, 5) float32 cx, cy, w, h in original pixels and
    the angle in radians (w along it); `xyxy` is then each one's bounding box, clipped to the image.
    """

    xyxy: np.ndarray
    class_ids: np.ndarray
    scores: np.ndarray
    names: tuple[str, ...]
    image_size: tuple[int, int]
    instances: np.ndarray | None = None
    keypoints: np.ndarray | None = None
    rotated: np.ndarray | None = None
    keypoint_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.names)
        if self.xyxy.shape != (n, 4) or self.class_ids.shape != (n,) or self.scores.shape != (n,):
            raise ValueError(f"Detections: xyxy {self.xyxy.shape}, class_ids {self.class_ids.shape}, "
                             f"scores {self.scores.shape} must be ({n}, 4), ({n},), ({n},)")
        w, h = self.image_size
        if self.instances is not None and (self.instances.shape != (h, w) or self.instances.dtype != np.uint16):
            raise ValueError(f"Detections.instances must be a ({h}, {w}) uint16 array, got "
                             f"{self.instances.dtype} {self.instances.shape}")
        kp = self.keypoints
        if kp is not None and (kp.ndim != 3 or kp.shape[0] != n or kp.shape[2] not in (2, 3) or kp.dtype != np.float32):
            raise ValueError(f"Detections.keypoints must be a ({n}, K, 2 or 3) float32 array, got {kp.dtype} "
                             f"{kp.shape}")
        if self.keypoint_names and (kp is None or len(self.keypoint_names) != kp.shape[1]):
            raise ValueError(f"Detections.keypoint_names must name each of the K keypoints, got "
                             f"{len(self.keypoint_names)} names for keypoints {None if kp is None else kp.shape}")
        if self.rotated is not None and (self.rotated.shape != (n, 5) or self.rotated.dtype != np.float32):
            raise ValueError(f"Detections.rotated must be a ({n}, 5) float32 array, got {self.rotated.dtype} "
                             f"{self.rotated.shape}")

    def summary(self) -> dict[str, Any]:
        boxes = [{"class_id": int(c), "name": n, "score": round(float(s), 6), "xyxy": [round(float(v), 2) for v in b]}
                 for b, c, s, n in zip(self.xyxy, self.class_ids, self.scores, self.names)]
        if self.instances is not None:  # each box's mask: its pixels in the instance mask
            pixels = np.bincount(self.instances.ravel(), minlength=len(boxes) + 1)
            for k, box in enumerate(boxes):
                box["mask_pixels"] = int(pixels[k + 1])
        if self.rotated is not None:  # each oriented box as it is, and its corners
            for box, r, corners in zip(boxes, self.rotated, rotated_corners(self.rotated)):
                box["xywhr"] = [round(float(v), 2) for v in r[:4]] + [round(float(r[4]), 6)]
                box["corners"] = [[round(float(x), 2), round(float(y), 2)] for x, y in corners]
        if self.keypoints is not None:  # each box's points: [x, y] or [x, y, visibility]
            for box, points in zip(boxes, self.keypoints):
                box["keypoints"] = [[round(float(x), 2), round(float(y), 2), *[round(float(v), 4) for v in rest]]
                                    for x, y, *rest in points]
        if self.keypoint_names:  # once for every box: each box's points are in this order
            return {"boxes": boxes, "keypoint_names": list(self.keypoint_names)}
        return {"boxes": boxes}


Result = Union[Mask, ClassMask, Classification, Detections]


def instance_part(instances: np.ndarray, index: int, xyxy: Any) -> tuple[np.ndarray, tuple[int, int]]:
    """A box's instance mask cut out of an instance map ((H, W), `index` where the box's mask is): its
    pixels within the box (whole pixels it touches, where its mask can lie) as a 0/1 uint8 (h, w), and
    where that part starts (x, y)."""
    h, w = instances.shape[:2]
    u1, v1 = max(0, int(np.floor(xyxy[0]))), max(0, int(np.floor(xyxy[1])))
    u2, v2 = min(w, int(np.ceil(xyxy[2]))), min(h, int(np.ceil(xyxy[3])))
    return (instances[v1:v2, u1:u2] == index).view(np.uint8), (u1, v1)


def rotated_corners(xywhr: np.ndarray) -> np.ndarray:
    """(N, 5) cx, cy, w, h, angle -> (N, 4, 2) the corners, in Ultralytics' order (xywhr2xyxyxyxy)."""
    c, s = np.cos(xywhr[:, 4:5]), np.sin(xywhr[:, 4:5])
    along = np.concatenate([xywhr[:, 2:3] / 2 * c, xywhr[:, 2:3] / 2 * s], axis=1)  # half w, along the angle
    across = np.concatenate([-xywhr[:, 3:4] / 2 * s, xywhr[:, 3:4] / 2 * c], axis=1)  # half h, across it
    centre = xywhr[:, :2]
    return np.stack([centre + along + across, centre + along - across, centre - along - across,
                     centre - along + across], axis=1)


def region_dicts(regions: np.ndarray) -> list[dict[str, Any]]:
    """(R, 5) x1, y1, x2, y2, pixels -> the JSON's `regions` entries."""
    return [{"xyxy": [int(v) for v in r[:4]], "pixels": int(r[4])} for r in regions]


def labels_of(result: Result) -> list[tuple[int, str, float]]:
    """(class_id, name, score) rows for the database's label index, whatever the task."""
    if isinstance(result, Classification):
        return [(int(c), n, float(s)) for c, s, n in zip(result.class_ids, result.scores, result.names)]
    if isinstance(result, Detections):
        return [(int(c), n, float(s)) for c, s, n in zip(result.class_ids, result.scores, result.names)]
    if isinstance(result, ClassMask):  # each foreground class present, with its mean probability
        return [(c, result.names[c], float(result.scores[c])) for c, n in enumerate(result.pixels) if n and c]
    return [(0, result.label, result.score)] if result.mask.any() else []


def top_score(result: Result) -> float:
    if isinstance(result, (Mask, ClassMask)):
        return result.score
    return float(result.scores[0]) if len(result.scores) else 0.0
