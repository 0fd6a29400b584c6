"""Segmentation: one probability map (binary: resized back to the image and thresholded), one map
per class (multi-class: resized back, each pixel takes its most probable class; class 0 is the
background), or integer class indices (an export that ends in ArgMax: resized back as they are)."""

from __future__ import annotations

from typing import Iterator

import cv2
import numpy as np

from worker.errors import ModelError
from worker.runtime.model_output import ModelOutput, one_array
from worker.tasks.results import ClassMask, Mask
from worker.tasks import OtherOutputs, activate, check_labels
from worker.tasks.preprocess import CardPreprocessing, Geometry

MAX_CLASSES = 256  # the class mask is an 8-bit PNG
MAX_REGIONS = 1000  # per image: the largest are kept, so a noisy mask cannot bloat the JSON


def regions(mask: np.ndarray) -> np.ndarray:
    """(H, W) uint8 0/1 mask -> (R, 5) int64 x1, y1, x2, y2 (pixel edges), pixels of its 8-connected
    regions: the MAX_REGIONS largest, in reading order (top to bottom, then left to right).

    Labelled within the bounding box of the mask's pixels (an empty mask, a person in a photo: a 1920 px
    image's labelling took 6-12 ms, whatever it held), from even coordinates: OpenCV labels 2x2 blocks
    from the origin, so that numbering, and the order of regions tied in size, stays as over the whole."""
    x, y, w, h = cv2.boundingRect(mask)
    if w == 0 or h == 0:
        return np.zeros((0, 5), np.int64)
    x, y = x & ~1, y & ~1
    crop = mask[y:y + h + 1, x:x + w + 1]
    _, _, stats, _ = cv2.connectedComponentsWithStats(crop, connectivity=8, ltype=cv2.CV_32S)
    s = stats[1:].astype(np.int64)  # row 0 is the background
    s[:, 0] += x
    s[:, 1] += y
    if len(s) > MAX_REGIONS:
        s = s[np.argsort(-s[:, 4], kind="stable")[:MAX_REGIONS]]
    s = s[np.lexsort((s[:, 0], s[:, 1]))]
    return np.column_stack([s[:, 0], s[:, 1], s[:, 0] + s[:, 2], s[:, 1] + s[:, 3], s[:, 4]])


def _multi_class(output: np.ndarray) -> bool:
    return output.ndim == 3 and output.shape[0] >= 2 and not _indices(output)


def _indices(output: np.ndarray) -> bool:
    """Integer class indices, (h, w) or (1, h, w), as an export that ends in ArgMax gives them."""
    return output.ndim >= 2 and np.issubdtype(output.dtype, np.integer) and \
        output.size == output.shape[-2] * output.shape[-1]


def _argmax(planes: Iterator[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(h, w) float32 planes, one per class -> (h, w) uint8 index of the highest plane (ties: the lower
    class, as numpy's argmax) and (h, w) float32 its value.

    Plane by plane and branch-free: where plane k beats every lower one the index becomes k, which is
    above any it had. numpy's argmax over the class axis, or assigning through a boolean mask, took
    5-10x longer."""
    best = next(planes).copy()
    classes = np.zeros(best.shape, np.uint8)
    for k, plane in enumerate(planes, start=1):
        higher = cv2.compare(plane, best, cv2.CMP_GT)  # 255 where strictly higher
        cv2.max(classes, cv2.bitwise_and(higher, k), dst=classes)  # type: ignore[call-overload]  # a scalar: fine
        cv2.max(best, plane, dst=best)
    return classes, best


class Segmenter(CardPreprocessing):
    def _maps(self, output: np.ndarray) -> np.ndarray:
        """One image's output with its class axis first, as the card's `output_layout` says where it is."""
        if self.card.postprocess.output_layout == "nhwc" and output.ndim == 3:  # (h, w, C) -> (C, h, w)
            return np.ascontiguousarray(np.moveaxis(output, -1, 0))  # OpenCV reads the planes: contiguous
        return output

    def _looks(self, output: np.ndarray) -> str | None:
        """Which layout one image's (a, b, c) output has, by which pair of axes has the input's aspect
        ratio: (b, c) channels first, (a, b) channels last; None when both or neither do."""
        if output.ndim != 3:
            return None
        h, w = self.size

        def fits(rows: int, cols: int) -> bool:  # within 10%: strided maps round their sizes
            return rows > 0 and cols > 0 and abs(np.log((rows / cols) / (h / w))) < 0.1

        first, last = fits(output.shape[1], output.shape[2]), fits(output.shape[0], output.shape[1])
        return None if first == last else "nchw" if first else "nhwc"

    def check_output(self, output: ModelOutput, others: OtherOutputs = ()) -> None:
        output = one_array(output, self.card.name)
        name, activation = self.card.postprocess.output, self.card.postprocess.activation
        looks = self._looks(output)  # read the other way round, a (256, 256, 1) output would be 256 classes
        if looks is not None and looks != self.card.postprocess.output_layout:
            raise ModelError(f"model '{self.card.name}': output '{name}' is (N, {', '.join(map(str, output.shape))})"
                             f", which looks {looks.upper()}: set postprocess.output_layout: {looks} in the card")
        output = self._maps(output)
        if _multi_class(output):
            if output.shape[0] > MAX_CLASSES:
                raise ModelError(f"model '{self.card.name}': output '{name}' has {output.shape[0]} class maps; "
                                 f"a class mask holds at most {MAX_CLASSES}")
            check_labels(self.card, output.shape[0], output)
            return
        if output.ndim < 2 or output.size != output.shape[-2] * output.shape[-1]:
            raise ModelError(f"model '{self.card.name}': a segmenter's output must be one probability map per "
                             f"image, (N, 1, h, w) or (N, h, w), one map per class, (N, C, h, w), or integer "
                             f"class indices, (N, h, w); output "
                             f"'{name}' is (N, {', '.join(map(str, output.shape))})")
        if _indices(output):
            if activation is not None:
                raise ModelError(f"model '{self.card.name}': output '{name}' is integer class indices "
                                 f"({output.dtype}): 'activation: {activation}' cannot apply (leave it out)")
            return
        if activation == "softmax":
            raise ModelError(f"model '{self.card.name}': 'activation: softmax' needs a map per class, but output "
                             f"'{name}' has one map (use sigmoid for one map of logits)")

    def postprocess(self, output: ModelOutput, geometry: Geometry) -> Mask | ClassMask:
        """output: (1, h, w) or (h, w) for one image (one map, or integer class indices), or (C, h, w)
        (one map per class); with `output_layout: nhwc`, (h, w, 1) or (h, w, C)."""
        output = self._maps(one_array(output, self.card.name))
        if _indices(output):
            return self._from_indices(output.reshape(output.shape[-2:]), geometry)
        if _multi_class(output):
            return self._classes(output, geometry)
        prob = output.reshape(output.shape[-2:]).astype(np.float32, copy=False)
        prob = activate(prob, self.card.postprocess.activation)
        h, w = geometry.orig_hw
        full = cv2.resize(prob, (w, h), interpolation=cv2.INTER_LINEAR)
        threshold = self.card.postprocess.threshold
        mask = full > threshold
        n = int(np.count_nonzero(mask))
        # the mean inside the mask without gathering it (2-3x faster on a 1920 px page): values at or
        # below the threshold become 0, the rest are summed (float64) and divided by their count
        _, kept = cv2.threshold(full, threshold, 0, cv2.THRESH_TOZERO)
        score = cv2.sumElems(kept)[0] / n if n else 0.0
        return Mask(mask=mask, label=self.card.label(0), score=score, regions=regions(mask.view(np.uint8)))

    def _classes(self, output: np.ndarray, geometry: Geometry) -> ClassMask:
        """(C, h, w) -> each pixel's most probable class at the original size (the maps are resized
        before the argmax, so class boundaries fall between the model's pixels), and each class's mean
        probability over the pixels the model gave it, at the model's resolution."""
        probs = activate(output.astype(np.float32, copy=False), self.card.postprocess.activation)
        c = probs.shape[0]
        h, w = geometry.orig_hw
        classes, _ = _argmax(cv2.resize(p, (w, h), interpolation=cv2.INTER_LINEAR) for p in probs)
        small, best = _argmax(iter(probs))
        sums = np.bincount(small.ravel(), weights=best.ravel(), minlength=c)
        given = np.bincount(small.ravel(), minlength=c)
        return self._class_mask(classes, np.divide(sums, given, out=np.zeros(c), where=given > 0))

    def _from_indices(self, output: np.ndarray, geometry: Geometry) -> ClassMask:
        """(h, w) integer class indices (an export that ends in ArgMax) -> the class mask at the original
        size, resized by nearest neighbour (an index has no in-between). It carries no probabilities:
        every class's score is 1.0."""
        low, high = int(output.min()), int(output.max())
        if low < 0 or high >= MAX_CLASSES:
            raise ValueError(f"class index {low if low < 0 else high} in output '{self.card.postprocess.output}' "
                             f"is outside 0-{MAX_CLASSES - 1}")
        c = max(len(self.card.labels), high + 1, 2)
        h, w = geometry.orig_hw
        classes = cv2.resize(output.astype(np.uint8), (w, h), interpolation=cv2.INTER_NEAREST)
        return self._class_mask(classes, np.ones(c))

    def _class_mask(self, classes: np.ndarray, scores: np.ndarray) -> ClassMask:
        """The result for (H, W) uint8 classes: each class's pixels and the foreground's regions."""
        c = len(scores)
        pixels = cv2.calcHist([classes], [0], None, [c], [0, c])[:, 0].astype(np.int64)  # 6x numpy's bincount
        found = [np.column_stack([np.full(len(r), k), r]) for k in np.flatnonzero(pixels) if k
                 for r in [regions((classes == k).view(np.uint8))]]
        found_all = np.concatenate(found) if found else np.zeros((0, 6), np.int64)
        if len(found_all) > MAX_REGIONS:  # the largest of all classes, kept in class and reading order
            keep = np.sort(np.argsort(-found_all[:, 5], kind="stable")[:MAX_REGIONS])
            found_all = found_all[keep]
        return ClassMask(classes=classes, names=tuple(self.card.label(i) for i in range(c)), scores=scores,
                         pixels=pixels, regions=found_all)
