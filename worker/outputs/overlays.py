"""Annotated overlay images (opt-in): boxes with names and scores, masks tinted (their regions boxed), top
labels written.

Results never draw themselves; this module does, and only the outbox calls it.
"""

from __future__ import annotations

import cv2
import numpy as np

from worker.tasks.results import ClassMask, Classification, Detections, Mask, Result, rotated_corners

_COLORS = np.array([(56, 56, 255), (151, 157, 255), (31, 112, 255), (29, 178, 255), (49, 210, 207),
                    (10, 249, 72), (23, 204, 146), (134, 219, 61), (52, 147, 26), (187, 212, 0)], np.uint8)


def overlay(image: np.ndarray, result: Result) -> np.ndarray:
    """A uint8 BGR copy of `image` (uint8, uint16 at depth 16, float32 at depth 32: its range stretched
    to 0-255) with the result drawn on it."""
    out: np.ndarray
    if image.dtype == np.uint16:
        out = (image >> 8).astype(np.uint8)
    elif image.dtype == np.float32:
        lo, hi = float(image.min()), float(image.max())
        out = np.rint((image - lo) * (255.0 / (hi - lo) if hi > lo else 0.0)).astype(np.uint8)
    else:
        out = image.copy()
    if isinstance(result, Mask):
        tint = np.zeros_like(out)
        tint[result.mask] = (0, 0, 255)
        out = cv2.addWeighted(out, 1.0, tint, 0.5, 0)
        for x1, y1, x2, y2, _ in result.regions:  # each region boxed (text lines, for PP-OCR)
            cv2.rectangle(out, (int(x1), int(y1)), (int(x2) - 1, int(y2) - 1), (0, 255, 255), 1)
    elif isinstance(result, ClassMask):  # each class but the background tinted in its own colour
        palette = np.zeros((256, 3), np.uint8)
        palette[1:] = _COLORS[np.arange(255) % len(_COLORS)]
        out = cv2.addWeighted(out, 1.0, palette[result.classes], 0.5, 0)
    elif isinstance(result, Detections):
        if result.instances is not None:  # each box's mask tinted in its class's colour
            palette = np.zeros((len(result.names) + 1, 3), np.uint8)
            palette[1:] = _COLORS[result.class_ids % len(_COLORS)]
            out = cv2.addWeighted(out, 1.0, palette[result.instances], 0.5, 0)
        corners = rotated_corners(result.rotated) if result.rotated is not None else None
        for k, ((x1, y1, x2, y2), c, s, n) in enumerate(zip(result.xyxy, result.class_ids, result.scores,
                                                             result.names)):
            color = tuple(int(v) for v in _COLORS[int(c) % len(_COLORS)])
            if corners is not None:  # an oriented box as it lies
                cv2.polylines(out, [np.rint(corners[k]).astype(np.int32)], True, color, 2, cv2.LINE_AA)
            else:
                cv2.rectangle(out, (int(x1), int(y1)), (int(x2), int(y2)), color, 2)
            cv2.putText(out, f"{n} {s:.2f}", (int(x1), max(int(y1) - 4, 12)), cv2.FONT_HERSHEY_SIMPLEX, 0.5,
                        color, 1, cv2.LINE_AA)
        if result.keypoints is not None:
            for points in result.keypoints:
                _draw_keypoints(out, points)
    elif isinstance(result, Classification):
        for i, (n, s) in enumerate(zip(result.names[:3], result.scores[:3])):
            cv2.putText(out, f"{n} {s:.2f}", (8, 20 + 20 * i), cv2.FONT_HERSHEY_SIMPLEX, 0.6, (0, 255, 0), 2,
                        cv2.LINE_AA)
    return out


# COCO's person skeleton (its 17 keypoints, 0-based): drawn for a pose model of 17 points
_COCO_SKELETON = ((15, 13), (13, 11), (16, 14), (14, 12), (11, 12), (5, 11), (6, 12), (5, 6), (5, 7), (6, 8),
                  (7, 9), (8, 10), (1, 2), (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6))
_SEEN = 0.5  # a keypoint's visibility from which it is drawn, as Ultralytics draws them


def _draw_keypoints(out: np.ndarray, points: np.ndarray) -> None:
    """One box's (K, D) keypoints as dots, those seen (visibility >= 0.5, or any without one), and
    COCO's skeleton between seen ones when there are 17."""
    seen = points[:, 2] >= _SEEN if points.shape[1] == 3 else np.ones(len(points), bool)
    at = [(int(round(x)), int(round(y))) for x, y in points[:, :2]]
    if len(points) == 17:
        for a, b in _COCO_SKELETON:
            if seen[a] and seen[b]:
                cv2.line(out, at[a], at[b], (255, 128, 0), 2, cv2.LINE_AA)
    for (x, y), ok in zip(at, seen):
        if ok:
            cv2.circle(out, (x, y), 3, (0, 255, 255), -1, cv2.LINE_AA)
