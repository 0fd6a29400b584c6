"""A detector's raw output read as rows: anchors or queries, boxes in the input's pixels as x1, y1, x2,
y2, whatever layout, box format and units the card names."""

from __future__ import annotations


import numpy as np


def decode_rows(output: np.ndarray, layout: str, classes: int = 0, input_hw: tuple[int, int] = (1, 1),
                box_format: str = "xyxy", box_units: str = "pixels") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (xyxy (A, 4) in input pixels, class ids (A,), scores (A,)), one best class per row.
    `classes`: how many the card names (0: none), which tells a yolov8 or detr output's orientation;
    `input_hw`: the network input's size, which fractions are of; `box_format` and `box_units`: how an
    end2end output gives its boxes (the other layouts fix them)."""
    if layout == "end2end":  # the model's own boxes, best class and score; [6, K] as some tools give it
        rows = _end2end_rows(output, 0)
        boxes, class_ids, scores = rows[:, :4], np.rint(rows[:, 5]), rows[:, 4]
    else:  # YOLO rows and DETR queries: cx, cy, w, h (DETR's as fractions), then the classes' scores
        box_format, box_units = "cxcywh", "fractions" if layout == "detr" else "pixels"
        if layout == "yolov5":
            boxes, obj, cls = output[:, :4], output[:, 4], output[:, 5:]
        else:
            rows = output.T if _anchors_last(output, classes) else output
            boxes, obj, cls = rows[:, :4], None, rows[:, 4:]
        class_ids = cls.argmax(axis=1)
        scores = cls[np.arange(len(cls)), class_ids]
        if obj is not None:
            scores = obj * scores
    return _input_pixels(boxes, box_format, box_units, input_hw), class_ids.astype(np.int64), scores.astype(np.float32)


def _input_pixels(boxes: np.ndarray, box_format: str, box_units: str, input_hw: tuple[int, int]) -> np.ndarray:
    """(K, 4) boxes as a model gives them -> (K, 4) float32 x1, y1, x2, y2 in input pixels."""
    xyxy = _as_xyxy(boxes.astype(np.float32), box_format)
    if box_units == "fractions":  # of the input's width and height
        xyxy = xyxy * np.array([input_hw[1], input_hw[0]] * 2, np.float32)
    return xyxy


def _end2end_rows(output: np.ndarray, extra: int) -> np.ndarray:
    """An end2end output whose rows end in `extra` more values (a pose model's keypoints, an instance
    segmenter's mask coefficients) as (K, 6 + extra), [6 + extra, K] transposed."""
    n = 6 + extra
    return output.T if output.shape[0] == n and output.shape[1] != n else output


def _as_xyxy(boxes: np.ndarray, box_format: str) -> np.ndarray:
    """(K, 4) boxes as xyxy, yxyx or cxcywh -> (K, 4) x1, y1, x2, y2."""
    if box_format == "yxyx":
        return boxes[:, [1, 0, 3, 2]]
    if box_format == "cxcywh":
        cx, cy, w, h = boxes.T
        return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
    return boxes


def _anchors_last(output: np.ndarray, classes: int) -> bool:
    """Whether a yolov8 (or detr) output is [4+C, A], as Ultralytics exports a YOLOv8, rather than
    [A, 4+C], as some tools transpose it and as Ultralytics exports an RT-DETR: the axis of 4 + the
    card's labels is the rows, or else the anchors (queries) are the longer axis (8,400 at 640 px,
    2,100 at 320, RT-DETR's 300 queries, against 4 + C)."""
    if classes and (output.shape[0] == 4 + classes) != (output.shape[1] == 4 + classes):
        return output.shape[0] == 4 + classes
    return output.shape[0] <= output.shape[1]
