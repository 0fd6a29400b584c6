"""COCO annotations read back as pixels, as pycocotools reads them."""

from __future__ import annotations

import numpy as np
from pycocotools import mask as coco_mask


def rasterise(polygons: list[list[float]], h: int, w: int) -> np.ndarray:
    """What a COCO consumer makes of an annotation's polygons: pycocotools' own rasterisation."""
    if not polygons:
        return np.zeros((h, w), bool)
    return coco_mask.decode(coco_mask.merge(coco_mask.frPyObjects(polygons, h, w))).astype(bool)
