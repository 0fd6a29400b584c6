"""worker/outputs/yolo_txt.py: Ultralytics' text lines of a detector's boxes and an instance segmenter's masks
(against Ultralytics' own save_txt: tests/test_reference_detect.py)."""

from __future__ import annotations

import cv2
import numpy as np

from worker.tasks.results import Detections
from worker.outputs.yolo_txt import _nearest_pair, join_outlines, yolo_txt


def test_a_detector_s_boxes_are_centre_size_and_score_normalised_to_the_image() -> None:
    result = Detections(np.array([[10, 20, 50, 60], [0, 0, 200, 100]], np.float32), np.array([3, 0]),
                        np.array([0.9, 0.25], np.float32), ("c", "a"), (200, 100))
    assert yolo_txt(result) == ("3 0.150000 0.400000 0.200000 0.400000 0.9000\n"
                                "0 0.500000 0.500000 1.000000 1.000000 0.2500\n")


def test_a_mask_in_parts_is_one_polygon_through_every_outline_point_whose_fill_is_the_mask() -> None:
    """Three squares and a sliver too thin to outline as a polygon alone (it joins the others); a box
    whose mask lost every pixel to a better box gets no line."""
    instances = np.zeros((60, 90), np.uint16)
    instances[5:15, 5:15] = 1
    instances[40:55, 10:30] = 1
    instances[20:30, 60:85] = 1
    instances[50, 70:80] = 1
    result = Detections(np.array([[0, 0, 90, 60], [60, 20, 85, 30]], np.float32), np.array([1, 2]),
                        np.array([0.8, 0.6], np.float32), ("a", "b"), (90, 60), instances)
    (line,) = yolo_txt(result).splitlines()
    values = [float(v) for v in line.split()]
    assert values[0] == 1 and values[-1] == 0.8
    points = np.rint(np.reshape(values[1:-1], (-1, 2)) * (90, 60)).astype(np.int32)
    outlines = cv2.findContours((instances == 1).view(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)[0]
    assert len(outlines) == 4 and {tuple(p) for p in points} == {tuple(p) for c in outlines for p in c.reshape(-1, 2)}
    filled = np.zeros((60, 90), np.uint8)
    cv2.fillPoly(filled, [points], 1)
    seams = int(filled.sum()) - int((instances == 1).sum())
    assert filled[instances == 1].all() and 0 < seams < 90  # each seam a line of pixels between two parts


def test_outlines_join_at_their_nearest_points_whatever_their_length() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5000, (3000, 2)), rng.integers(0, 5000, (1000, 2))
    i, j = _nearest_pair(a, b)  # 256 points of b at a time
    d = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=-1)
    assert d[i, j] == d.min()
    square, far = np.array([[0, 0], [0, 9], [9, 9], [9, 0]]), np.array([[20, 0], [20, 5], [25, 5]])
    joined = join_outlines([square, far])
    # out from (9, 0) to (20, 0), round the triangle, and back: every point, the seam walked both ways
    assert joined.tolist() == [[0, 0], [0, 9], [9, 9], [9, 0], [20, 0], [20, 5], [25, 5], [20, 0], [9, 0]]
    assert join_outlines([]).shape == (0, 2) and join_outlines([square]).tolist() == square.tolist()
