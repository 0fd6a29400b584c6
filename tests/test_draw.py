"""Overlays: what each result draws on a copy of the image (the image itself untouched)."""

from __future__ import annotations

import numpy as np

from worker.draw import overlay
from worker.results import ClassMask, Mask
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
