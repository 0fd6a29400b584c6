"""Resize, colour order and normalisation, as the model card says. Shared by every task."""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from worker.models.card import ModelCard, Preprocess


@dataclass(frozen=True)
class Geometry:
    """How a network input maps back to the original image: x_orig = (x_in - left) / scale_x."""

    orig_hw: tuple[int, int]
    scale_x: float
    scale_y: float
    left: int = 0
    top: int = 0

    def rescaled(self, orig_hw: tuple[int, int]) -> "Geometry":
        """The same mapping for an image that was decoded smaller than its original size orig_hw."""
        fy, fx = orig_hw[0] / self.orig_hw[0], orig_hw[1] / self.orig_hw[1]
        return Geometry(orig_hw, self.scale_x / fx, self.scale_y / fy, self.left, self.top)


def needed_size(spec: Preprocess, size_hw: tuple[int, int], orig_hw: tuple[int, int]) -> tuple[int, int]:
    """The smallest (h, w) a decoded image may have without losing pixels the resize would keep."""
    h, w = orig_hw
    if spec.resize == "shorter-crop":
        s = spec.resize_shorter / min(h, w)
    elif spec.resize == "letterbox":
        s = min(size_hw[0] / h, size_hw[1] / w)
    else:
        return size_hw
    return int(round(h * s)), int(round(w * s))


def prepare(image: np.ndarray, spec: Preprocess, size_hw: tuple[int, int]) -> tuple[np.ndarray, Geometry]:
    """BGR (H, W, 3), uint8, uint16 (depth 16) or float32 (depth 32) -> float32 (C, h, w) in the card's
    colour order and normalisation (C: 3, or 1 for gray)."""
    resized, geo = resize_for(image, spec, size_hw)
    if spec.color == "rgb":
        resized = cv2.cvtColor(resized, cv2.COLOR_BGR2RGB)
    elif spec.color == "gray":  # after the resize: a third of the pixels to convert, the same luma to +-1
        resized = cv2.cvtColor(resized, cv2.COLOR_BGR2GRAY)[:, :, None]
    th, tw = size_hw
    # one channel at a time straight into CHW: broadcasting over a last axis of 3 runs numpy's inner
    # loop 3 elements at a time, ten times slower for the same float32 arithmetic
    x = np.empty((spec.channels, th, tw), dtype=np.float32)
    for c in range(spec.channels):
        np.subtract(resized[:, :, c], np.float32(spec.mean[c]), out=x[c], dtype=np.float32)
        x[c] *= np.float32(1.0) / np.float32(spec.std[c])
    return x, geo


def resize_for(image: np.ndarray, spec: Preprocess, size_hw: tuple[int, int]) -> tuple[np.ndarray, Geometry]:
    """(H, W, 3) -> (h, w, 3) of the same dtype, as the card's `resize` says (stretch, stretch sampled
    at (x * W / w, y * H / h), shorter side and centre crop, or letterbox), and the geometry that maps
    it back."""
    h, w = image.shape[:2]
    th, tw = size_hw
    if spec.resize == "stretch":
        resized = cv2.resize(image, (tw, th), interpolation=cv2.INTER_LINEAR)
        geo = Geometry((h, w), tw / w, th / h)
    elif spec.resize == "stretch-asymmetric":
        # the corner-to-corner matrix through warpPerspective, as MediaPipe builds it: warpAffine with the
        # same scales rounds its coordinates differently (94 of chelsea.png's mask pixels flipped)
        corners = np.array([[0, 0], [w, 0], [w, h], [0, h]], np.float32)
        matrix = cv2.getPerspectiveTransform(corners, np.array([[0, 0], [tw, 0], [tw, th], [0, th]], np.float32))
        resized = cv2.warpPerspective(image, matrix, (tw, th), flags=cv2.INTER_LINEAR,
                                      borderMode=cv2.BORDER_CONSTANT, borderValue=(0, 0, 0, 0))
        geo = Geometry((h, w), tw / w, th / h)
    elif spec.resize == "shorter-crop":
        s = spec.resize_shorter / min(h, w)
        nw, nh = int(round(w * s)), int(round(h * s))
        top, left = max((nh - th) // 2, 0), max((nw - tw) // 2, 0)
        if nw * nh > SLIVER_FACTOR * max(h * w, th * tw):
            resized = _crop_of_resize(image, (nh, nw), (top, left), (min(th, nh), min(tw, nw)))
        else:
            resized = cv2.resize(image, (nw, nh), interpolation=cv2.INTER_LINEAR)[top:top + th, left:left + tw]
        if resized.shape[:2] != (th, tw):  # shorter side below the crop size: pad, never fail
            resized = cv2.copyMakeBorder(resized, 0, th - resized.shape[0], 0, tw - resized.shape[1],
                                         cv2.BORDER_CONSTANT, value=(0, 0, 0))
        geo = Geometry((h, w), s, s, -left, -top)
    else:  # letterbox
        s = min(th / h, tw / w)
        nw, nh = max(int(round(w * s)), 1), max(int(round(h * s)), 1)
        left, top = (tw - nw) // 2, (th - nh) // 2
        resized = np.full((th, tw, 3), spec.pad_value, dtype=image.dtype)  # uint16 at depth 16, float32 at 32
        resized[top:top + nh, left:left + nw] = cv2.resize(image, (nw, nh), interpolation=cv2.INTER_LINEAR)
        geo = Geometry((h, w), s, s, left, top)
    return resized, geo


# shorter-crop resizes the whole image before it crops: a sliver (4 x 80000 pixels, its shorter side
# scaled up 64 times to 256) would take gigabytes and seconds. Past this many times the pixels of the
# image or of the crop, the crop is sampled straight from the image instead
SLIVER_FACTOR = 4


def _crop_of_resize(image: np.ndarray, size_hw: tuple[int, int], at: tuple[int, int],
                    crop_hw: tuple[int, int]) -> np.ndarray:
    """The (h, w) window at (top, left) of `image` resized to `size_hw`, without the rest: bilinear, at
    cv2.resize's positions ((x + 0.5) * W / w - 0.5, clamped to the image: edges replicated), in float and
    rounded, where resize keeps its weights to 1/2048: within one level of it."""
    (h, w), (nh, nw), (top, left), (ch, cw) = image.shape[:2], size_hw, at, crop_hw
    ys = np.clip((np.arange(top, top + ch) + 0.5) * (h / nh) - 0.5, 0, h - 1)
    xs = np.clip((np.arange(left, left + cw) + 0.5) * (w / nw) - 0.5, 0, w - 1)
    y0, x0 = ys.astype(np.intp), xs.astype(np.intp)  # floor: both are >= 0
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    wy, wx = (ys - y0).astype(np.float32)[:, None, None], (xs - x0).astype(np.float32)[None, :, None]

    def at_(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return image[np.ix_(rows, cols)].astype(np.float32)

    out = (at_(y0, x0) * (1 - wx) + at_(y0, x1) * wx) * (1 - wy) + (at_(y1, x0) * (1 - wx) + at_(y1, x1) * wx) * wy
    if image.dtype == np.float32:
        return out
    return np.clip(np.rint(out), 0, np.iinfo(image.dtype).max).astype(image.dtype)


class CardPreprocessing:
    """The preprocessing half every task shares: the card's resize, colour order and normalisation."""

    def __init__(self, card: ModelCard) -> None:
        self.card = card
        self.size = (card.input.size[0], card.input.size[1])

    def preprocess(self, image: np.ndarray) -> tuple[np.ndarray, Geometry]:
        return prepare(image, self.card.preprocess, self.size)
