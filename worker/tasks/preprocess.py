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
    input_hw: tuple[int, int] | None = None  # the network input it fills (a rect letterbox's own); None: the card's

    def to_original(self, xy: np.ndarray, clip: bool = False) -> np.ndarray:
        """(..., 2) x, y in network-input pixels -> the same in the original's (`clip`: within it)."""
        x, y = (xy[..., 0] - self.left) / self.scale_x, (xy[..., 1] - self.top) / self.scale_y
        if clip:
            x, y = np.clip(x, 0, self.orig_hw[1]), np.clip(y, 0, self.orig_hw[0])
        return np.stack([x, y], axis=-1)

    def rescaled(self, orig_hw: tuple[int, int]) -> "Geometry":
        """The same mapping for an image that was decoded smaller than its original size orig_hw."""
        fy, fx = orig_hw[0] / self.orig_hw[0], orig_hw[1] / self.orig_hw[1]
        return Geometry(orig_hw, self.scale_x / fx, self.scale_y / fy, self.left, self.top, self.input_hw)


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


def prepare(image: np.ndarray, spec: Preprocess, size_hw: tuple[int, int],
            interpolation: int = cv2.INTER_LINEAR) -> tuple[np.ndarray, Geometry]:
    """BGR (H, W, 3), uint8, uint16 (depth 16) or float32 (depth 32) -> float32 (C, h, w) in the card's
    colour order and normalisation (C: 3, or 1 for gray). `interpolation`: the worker's is bilinear; the
    parity check (worker.models.mismatches) tries others."""
    if spec.float_resize and image.dtype != np.float32:
        image = image.astype(np.float32)  # resized unrounded: the card's exporter resized floats
    resized, geo = resize_for(image, spec, size_hw, interpolation)
    if spec.color == "rgb":
        resized = cv2.cvtColor(resized, cv2.COLOR_BGR2RGB)
    elif spec.color == "gray":  # after the resize: a third of the pixels to convert, the same luma to +-1
        resized = cv2.cvtColor(resized, cv2.COLOR_BGR2GRAY)[:, :, None]
    th, tw = resized.shape[:2]  # the card's size, or less for a rect letterbox
    # one channel at a time straight into CHW: broadcasting over a last axis of 3 runs numpy's inner
    # loop 3 elements at a time, ten times slower for the same float32 arithmetic
    x = np.empty((spec.channels, th, tw), dtype=np.float32)
    for c in range(spec.channels):
        np.subtract(resized[:, :, c], np.float32(spec.mean[c]), out=x[c], dtype=np.float32)
        x[c] *= np.float32(1.0) / np.float32(spec.std[c])
    return x, geo


def resize_for(image: np.ndarray, spec: Preprocess, size_hw: tuple[int, int],
               interpolation: int = cv2.INTER_LINEAR) -> tuple[np.ndarray, Geometry]:
    """(H, W, 3) -> (h, w, 3) of the same dtype, as the card's `resize` says (stretch, stretch sampled
    at (x * W / w, y * H / h), shorter side and centre crop, or letterbox), and the geometry that maps
    it back. A rect letterbox (`spec.rect`) pads each side only up to a multiple of `spec.stride`, as
    Ultralytics' LetterBox(auto=True) does for models of dynamic height and width: (h', w') <= size_hw."""
    h, w = image.shape[:2]
    th, tw = size_hw
    if spec.resize == "stretch":
        resized = cv2.resize(image, (tw, th), interpolation=interpolation)
        geo = Geometry((h, w), tw / w, th / h, input_hw=(th, tw))
    elif spec.resize == "stretch-asymmetric" and max(h, w) >= WARP_MAX:
        resized = _sample(image, np.arange(th) * (h / th), np.arange(tw) * (w / tw), replicate=False)
        geo = Geometry((h, w), tw / w, th / h, input_hw=(th, tw))
    elif spec.resize == "stretch-asymmetric":
        # the corner-to-corner matrix through warpPerspective, as MediaPipe builds it: warpAffine with the
        # same scales rounds its coordinates differently (94 of chelsea.png's mask pixels flipped)
        corners = np.array([[0, 0], [w, 0], [w, h], [0, h]], np.float32)
        matrix = cv2.getPerspectiveTransform(corners, np.array([[0, 0], [tw, 0], [tw, th], [0, th]], np.float32))
        resized = cv2.warpPerspective(image, matrix, (tw, th), flags=cv2.INTER_LINEAR,
                                      borderMode=cv2.BORDER_CONSTANT, borderValue=(0, 0, 0, 0))
        geo = Geometry((h, w), tw / w, th / h, input_hw=(th, tw))
    elif spec.resize == "shorter-crop":
        s = spec.resize_shorter / min(h, w)
        nw, nh = int(round(w * s)), int(round(h * s))
        top, left = max((nh - th) // 2, 0), max((nw - tw) // 2, 0)
        if nw * nh > SLIVER_FACTOR * max(h * w, th * tw):  # the crop's pixels at resize's positions
            ys = (np.arange(top, top + min(th, nh)) + 0.5) * (h / nh) - 0.5
            resized = _sample(image, ys, (np.arange(left, left + min(tw, nw)) + 0.5) * (w / nw) - 0.5)
        else:
            resized = cv2.resize(image, (nw, nh), interpolation=interpolation)[top:top + th, left:left + tw]
        if resized.shape[:2] != (th, tw):  # shorter side below the crop size: pad, never fail
            resized = cv2.copyMakeBorder(resized, 0, th - resized.shape[0], 0, tw - resized.shape[1],
                                         cv2.BORDER_CONSTANT, value=(0, 0, 0))
        geo = Geometry((h, w), s, s, -left, -top, (th, tw))
    else:  # letterbox
        s = min(th / h, tw / w)
        nw, nh = max(int(round(w * s)), 1), max(int(round(h * s)), 1)
        if spec.rect:
            th, tw = nh + (th - nh) % spec.stride, nw + (tw - nw) % spec.stride
        left, top = ((tw - nw) // 2, (th - nh) // 2) if spec.pad_at == "center" else (0, 0)
        resized = np.full((th, tw, 3), spec.pad_value, dtype=image.dtype)  # uint16 at depth 16, float32 at 32
        resized[top:top + nh, left:left + nw] = cv2.resize(image, (nw, nh), interpolation=interpolation)
        # each side's own scale, as resized (nh / h, not s: 213 rows for 400 where s gives 213.3), as
        # Ultralytics maps its boxes back since 8.4 (scale_boxes); s was up to a pixel off at the far edge
        geo = Geometry((h, w), nw / w, nh / h, left, top, (th, tw))
    return resized, geo


# shorter-crop resizes the whole image before it crops: a sliver (4 x 80000 pixels, its shorter side
# scaled up 64 times to 256) would take gigabytes and seconds. Past this many times the pixels of the
# image or of the crop, the crop is sampled straight from the image instead
SLIVER_FACTOR = 4


# OpenCV's warps take images under 32767 pixels a side (SHRT_MAX): a wider one (a panorama, a line scan)
# is stretched by `_sample` instead
WARP_MAX = 32767


def _sample(image: np.ndarray, ys: np.ndarray, xs: np.ndarray, replicate: bool = True) -> np.ndarray:
    """`image` sampled bilinearly at rows `ys` and columns `xs` (source coordinates), in float and
    rounded: (len(ys), len(xs), 3) of the image's dtype. Beyond the last row or column the image's edge
    repeats (`replicate`, cv2.resize's way: within one level of it, whose weights are kept to 1/2048)
    or is black (warpPerspective's constant border, as stretch-asymmetric samples)."""
    h, w = image.shape[:2]
    if replicate:  # cv2.resize clamps its positions to the image
        ys, xs = np.clip(ys, 0, h - 1), np.clip(xs, 0, w - 1)
    y0, x0 = ys.astype(np.intp), xs.astype(np.intp)  # floor: both are >= 0
    wy, wx = (ys - y0).astype(np.float32)[:, None, None], (xs - x0).astype(np.float32)[None, :, None]
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)

    def at(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return image[np.ix_(rows, cols)].astype(np.float32)

    past_y, past_x = (y0 + 1 >= h)[:, None, None], (x0 + 1 >= w)[None, :, None]  # the neighbour is off the image
    below, right, corner = at(y1, x0), at(y0, x1), at(y1, x1)
    if not replicate:
        below, right, corner = (np.where(past_y, 0, below), np.where(past_x, 0, right),
                                np.where(past_y | past_x, 0, corner))
    out = (at(y0, x0) * (1 - wx) + right * wx) * (1 - wy) + (below * (1 - wx) + corner * wx) * wy
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
