"""Overlays: what each result draws on a copy of the image (the image itself untouched)."""

from __future__ import annotations

import numpy as np

from worker.outputs.overlays import overlay
from worker.tasks.results import ClassMask, Mask
from worker.tasks.segment import regions


def test_a_mask_is_tinted_and_its_regions_boxed() -> None:
    image = np.zeros((40, 60, 3), np.uint8)
    mask = np.zeros((40, 60), bool)
    mask[10:20, 5:30] = True
    out = overlay(image, Mask(mask=mask, label="text", score=0.9, regions=regions(mask.view(np.uint8))))
    assert not image.any() and out.shape == image.shape
    assert tuple(out[15, 15]) == (0, 0, 128)  # tinted red, half strength (rounded)
    assert tuple(out[10, 5]) == tuple(out[19, 29]) == (0, 255, 255)  # the box's corners, inside the region
    assert not out[30:, :].any()  # nothing drawn outside


def test_a_class_mask_tints_each_class_but_the_background() -> None:
    image = np.full((20, 30, 3), 100, np.uint8)
    classes = np.zeros((20, 30), np.uint8)
    classes[:, 10:20], classes[:, 20:] = 1, 2
    out = overlay(image, ClassMask(classes=classes, names=("bg", "a", "b"), scores=np.ones(3),
                                     pixels=np.array([200, 200, 200])))
    assert (out[:, :10] == 100).all()
    assert tuple(out[5, 15]) != tuple(out[5, 25]) and (out[:, 10:] != 100).any(axis=2).all()


def test_a_pose_model_s_seen_points_are_dotted_and_coco_s_skeleton_joins_them() -> None:
    """17 points (COCO's person): a dot at each point seen (visibility 0.5 or more), a limb between two
    seen ones (left shoulder 5 to left elbow 7), none to a point not seen (left wrist 9 at 0.2)."""
    from worker.tasks.results import Detections

    points = np.zeros((1, 17, 3), np.float32)
    points[0, :, :2] = [[10 + 5 * i, 10] for i in range(17)]  # a row of points, 5 px apart, off the limbs' way
    points[0, :, 2] = 1.0
    points[0, 5, :2], points[0, 7, :2] = (20, 60), (80, 60)  # a long left upper arm across the image
    points[0, 9] = (80, 90, 0.2)  # the left wrist, not seen
    image = np.zeros((100, 120, 3), np.uint8)
    out = overlay(image, Detections(np.array([[0, 0, 1, 1]], np.float32), np.array([0]), np.array([0.9], np.float32),
                                    ("person",), (120, 100), keypoints=points))
    assert out[60, 50].any()  # the arm, halfway
    assert out[60, 20].any() and out[10, 10].any()  # dots
    assert not out[90, 80].any() and not out[75, 80].any()  # the unseen wrist: no dot, no forearm
