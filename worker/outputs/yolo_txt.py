"""Ultralytics' text format of a detector's result (opt-in, `outputs.yolo_txt`): one line per box, its
box (a pose model's keypoints after it; an oriented box's corners), or for an instance segmenter its
mask's outline, normalised to the image size, score last.

Results never write themselves; this module makes the text, and only the outbox writes it.
"""

from __future__ import annotations

import cv2
import numpy as np

from worker.tasks.results import Detections, instance_part, rotated_corners


def yolo_txt(result: Detections) -> str:
    """One line per box, as Ultralytics' `save_txt(save_conf=True)` writes a prediction.

    A detector's box: `class cx cy w h score`; a pose model's, each keypoint's `x y` or `x y visibility`
    after the box; an oriented box's, its corners `x1 y1 x2 y2 x3 y3 x4 y4`. An instance segmenter's:
    `class x1 y1 x2 y2 ... score`, the outline of the box's mask (its pixels in `result.instances`)
    through boundary pixels' centres, as `cv2.findContours` traces it; a mask of several parts is one
    outline joined by two-way seams, and a box whose mask has fewer than 3 outline points (none left,
    or a sliver) gets no line (a shorter polygon is no polygon to a YOLO loader; the JSON still lists
    the box)."""
    w, h = result.image_size
    lines = []
    corners = rotated_corners(result.rotated) if result.rotated is not None else None
    for k, ((x1, y1, x2, y2), c, s) in enumerate(zip(result.xyxy, result.class_ids, result.scores)):
        if corners is not None:  # Ultralytics' oriented box: its 4 corners
            values = " ".join(f"{x / w:.6f} {y / h:.6f}" for x, y in corners[k])
        elif result.instances is None:
            values = f"{(x1 + x2) / 2 / w:.6f} {(y1 + y2) / 2 / h:.6f} {(x2 - x1) / w:.6f} {(y2 - y1) / h:.6f}"
            if result.keypoints is not None:  # Ultralytics' pose line: each point's x, y (and visibility) after
                values += "".join(f" {x / w:.6f} {y / h:.6f}" + "".join(f" {v:.6f}" for v in rest)
                                  for x, y, *rest in result.keypoints[k])
        else:
            outline = mask_outline(result.instances, k + 1, (x1, y1, x2, y2))
            if len(outline) < 3:
                continue
            values = " ".join(f"{x:.6f} {y:.6f}" for x, y in outline / np.array([w, h], np.float64))
        lines.append(f"{int(c)} {values} {float(s):.4f}")
    return "".join(line + "\n" for line in lines)


def mask_outline(instances: np.ndarray, index: int, xyxy: tuple[float, float, float, float]) -> np.ndarray:
    """(P, 2) int x, y: the outline of the pixels equal to `index` within the box `xyxy` (where an
    instance's mask lies), its parts joined into one polygon; (0, 2) when there are none."""
    part, at = instance_part(instances, index, xyxy)
    contours, _ = cv2.findContours(part, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE, offset=at)
    return join_outlines([c.reshape(-1, 2) for c in contours])


def join_outlines(outlines: list[np.ndarray]) -> np.ndarray:
    """One closed (P, 2) polygon through every outline: each next outline is entered from the nearest
    point of those joined so far, walked round, and left back along the same seam, so the seam adds no
    area and every point of every outline is kept. One outline comes back as it is; none, as (0, 2)."""
    if not outlines:
        return np.zeros((0, 2), np.int64)
    path = outlines[0].astype(np.int64)
    for nxt in outlines[1:]:
        nxt = nxt.astype(np.int64)
        i, j = _nearest_pair(path, nxt)
        loop = np.concatenate([nxt[j:], nxt[:j + 1]])  # round the next outline, back to where it was entered
        path = np.concatenate([path[:i + 1], loop, path[i:]])
    return path


def _nearest_pair(a: np.ndarray, b: np.ndarray, chunk: int = 256) -> tuple[int, int]:
    """(i, j) with a[i] and b[j] nearest each other; b taken `chunk` points at a time, so that two long
    outlines (thousands of points each) need no matrix of every pair at once."""
    best, at = None, (0, 0)
    for start in range(0, len(b), chunk):
        d = ((a[:, None, :] - b[None, start:start + chunk, :]) ** 2).sum(axis=-1)  # (len(a), <= chunk)
        k = int(d.argmin())
        if best is None or d.flat[k] < best:
            best, at = d.flat[k], (k // d.shape[1], start + k % d.shape[1])
    return at
