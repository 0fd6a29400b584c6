"""Instance masks: a YOLO segmenter's prototype masks weighted by each box's coefficients, or a
query-based segmenter's own masks, resized to the image as Ultralytics and RF-DETR do."""

from __future__ import annotations

import math

import numpy as np

from worker.tasks.preprocess import Geometry


def instance_masks(coefficients: np.ndarray, protos: np.ndarray, xyxy: np.ndarray, geometry: Geometry,
                   input_hw: tuple[int, int]) -> np.ndarray:
    """Each box's mask, as a YOLOv8-seg gives it, painted into one (H, W) uint16 map of the original
    image: k + 1 where box k's is (the best box's where they overlap), 0 elsewhere.

    coefficients: (N, M), each box's weights of the M prototype masks `protos` (M, h, w), which span the
    network input (`input_hw`); xyxy: (N, 4) the boxes in original pixels, best first. A box's mask is
    its weighted sum of the prototypes (logits) brought to the original's pixels as Ultralytics'
    process_mask_native brings them (`_prototype_weights`: upsampled, the letterbox's padding cropped,
    resized; both bilinear steps in one matrix per axis), above 0 (a probability of 0.5), and cropped to
    the box as Ultralytics crops it (pixel u when x1 <= u < x2): Ultralytics' `retina_masks=True` masks."""
    h, w = geometry.orig_hw
    out = np.zeros((h, w), np.uint16)
    if not len(xyxy):
        return out
    m, ph, pw = protos.shape
    protos = protos.astype(np.float32, copy=False)
    along_y, along_x = _prototype_weights(geometry, (ph, pw), input_hw)  # once per image: (h, ph), (w, pw)
    reach_y, reach_x = _reach(along_y), _reach(along_x)
    for k in range(len(xyxy) - 1, -1, -1):  # the worst first: a better box's mask is painted over it
        x1, y1, x2, y2 = xyxy[k]
        u1, v1 = max(0, int(np.ceil(x1))), max(0, int(np.ceil(y1)))
        u2, v2 = min(w, int(np.ceil(x2))), min(h, int(np.ceil(y2)))
        if u2 <= u1 or v2 <= v1:
            continue
        # only the prototype rows and columns the box's pixels draw on
        r1, r2, c1, c2 = reach_y[0][v1], reach_y[1][v2 - 1], reach_x[0][u1], reach_x[1][u2 - 1]
        logits = np.tensordot(coefficients[k].astype(np.float32), protos[:, r1:r2, c1:c2], axes=1)
        _paint(out, k, along_y[v1:v2, r1:r2], logits, along_x[u1:u2, c1:c2], v1, u1)
    return out


def query_masks(masks: np.ndarray, geometry: Geometry, input_hw: tuple[int, int]) -> np.ndarray:
    """Each box's own mask logits, as RF-DETR-Seg gives one per query over the whole input, painted into
    one (H, W) uint16 map of the original image as `instance_masks` paints them: k + 1 where box k's mask is
    (the better box's where they overlap: a query's second class gets only what its first leaves), 0
    elsewhere.

    masks: (N, h, w) logits, best box first. Each is brought to the original's pixels bilinearly as
    RF-DETR's PostProcess resizes it (F.interpolate, half-pixel centres; through a letterbox as
    `_prototype_weights` maps one) and taken above 0, not cropped to its box (RF-DETR's are not). Only the
    pixels that draw on a positive logit are computed: a bilinear blend of values <= 0 is not above 0."""
    h, w = geometry.orig_hw
    out = np.zeros((h, w), np.uint16)
    if not len(masks):
        return out
    along_y, along_x = _prototype_weights(geometry, masks.shape[1:], input_hw)  # once per image: (h, mh), (w, mw)
    (first_y, last_y), (first_x, last_x) = _reach(along_y), _reach(along_x)
    for k in range(len(masks) - 1, -1, -1):  # the worst first: a better box's mask is painted over it
        logits = masks[k].astype(np.float32, copy=False)
        rows, cols = np.flatnonzero((logits > 0).any(axis=1)), np.flatnonzero((logits > 0).any(axis=0))
        v = np.flatnonzero((first_y <= rows[-1]) & (last_y > rows[0])) if rows.size else rows
        u = np.flatnonzero((first_x <= cols[-1]) & (last_x > cols[0])) if cols.size else cols
        if not v.size or not u.size:
            continue
        v1, v2, u1, u2 = v[0], v[-1] + 1, u[0], u[-1] + 1
        r1, r2, c1, c2 = first_y[v1], last_y[v2 - 1], first_x[u1], last_x[u2 - 1]  # every logit those draw on
        _paint(out, k, along_y[v1:v2, r1:r2], logits[r1:r2, c1:c2], along_x[u1:u2, c1:c2], v1, u1)
    return out


def _paint(out: np.ndarray, k: int, along_y: np.ndarray, logits: np.ndarray, along_x: np.ndarray,
           top: int, left: int) -> None:
    """Box k's mask over the window of `out` at (top, left): the logits (r, c) brought to its (v, u) pixels
    by along_y (v, r) and along_x (u, c), set to k + 1 where above 0 (a probability of 0.5). Called worst
    box first, so that a better box's mask is painted over a worse one's."""
    patch = along_y @ logits @ along_x.T
    out[top:top + patch.shape[0], left:left + patch.shape[1]][patch > 0] = k + 1


def _reach(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each output pixel, the first prototype index it draws on and one past its last."""
    drawn = weights != 0
    first = drawn.argmax(axis=1)
    last = weights.shape[1] - drawn[:, ::-1].argmax(axis=1)
    return first, last


class _Axis:
    """One axis of Ultralytics' way from prototype masks to the image: upsampled `f` times (bilinear,
    PyTorch's half-pixel centres), the image's part [start, start + size) of that cropped, and that
    resized to `n_out` (bilinear again). `weights(o1, o2)` is the (o2 - o1, n_proto) matrix taking a
    prototype row (or column) of logits to output pixels o1..o2-1: both steps in one."""

    def __init__(self, n_proto: int, f: int, start: int, size: int, n_out: int) -> None:
        self.n_proto, self.f, self.start, self.size, self.n_out = n_proto, f, start, size, n_out

    def weights(self, o1: int, o2: int) -> np.ndarray:
        o = np.arange(o1, o2, dtype=np.float64)
        i0, i1, l2 = _taps((o + 0.5) * (self.size / self.n_out) - 0.5, self.size)  # in the crop
        a = np.zeros((o2 - o1, self.n_proto), np.float32)
        rows = np.arange(o2 - o1)
        for i, wi in ((i0, 1 - l2), (i1, l2)):
            r = (self.start + i).astype(np.float64)  # in the upsampled prototypes
            j0, j1, l1 = _taps((r + 0.5) / self.f - 0.5, self.n_proto)
            a[rows, j0] += wi * (1 - l1)  # each row once per statement: no index repeats within one
            a[rows, j1] += wi * l1
        return a


def _taps(src: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PyTorch's bilinear taps (align_corners=False): a source position clamped at 0, its two
    neighbours (the last repeated at the edge) and the weight of the second."""
    src = np.maximum(src, 0.0)
    i0 = np.minimum(src.astype(np.int64), n - 1)
    return i0, np.minimum(i0 + 1, n - 1), src - i0


def _prototype_weights(geometry: Geometry, proto_hw: tuple[int, int],
                       input_hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(h, ph) and (w, pw): the matrices taking prototype rows and columns of logits to the original's
    pixels. After a letterbox, Ultralytics' process_mask_native (8.4): the prototypes (a quarter of the
    input, as YOLO gives them) upsampled by the least of 1, 2, 4 that puts the padding on whole pixels,
    the image's part cropped (scale_masks' rounding) and resized to the image. Otherwise (a stretch, a
    crop) each original pixel's centre sampled through `geometry` (Ultralytics letterboxes always)."""
    (h, w), (ph, pw), (ih, iw) = geometry.orig_hw, proto_hw, input_hw
    ratio = ih // ph
    padded = geometry.left >= 0 and geometry.top >= 0 and (geometry.left or geometry.top)
    if not padded or ratio < 1 or (ih, iw) != (ratio * ph, ratio * pw):
        return (_sampled(h, ph, geometry.scale_y * ph / ih, geometry.top * ph / ih),
                _sampled(w, pw, geometry.scale_x * pw / iw, geometry.left * pw / iw))
    gain = min(ih / h, iw / w)
    pad = (ih - max(round(h * gain), 1)) | (iw - max(round(w * gain), 1))
    f = ratio // math.gcd(ratio, pad | pad // 2)
    fh, fw = f * ph, f * pw
    gain2 = min(fh / h, fw / w)
    size_h, size_w = max(round(h * gain2), 1), max(round(w * gain2), 1)
    top, left = round((fh - size_h) / 2 - 0.1), round((fw - size_w) / 2 - 0.1)
    return _Axis(ph, f, top, size_h, h).weights(0, h), _Axis(pw, f, left, size_w, w).weights(0, w)


def _sampled(n_out: int, n_proto: int, scale: float, offset: float) -> np.ndarray:
    """(n_out, n_proto): output pixel o's centre at prototype position (o + 0.5) x scale + offset,
    sampled bilinearly (half-pixel centres, the edges repeated)."""
    j0, j1, lam = _taps((np.arange(n_out) + 0.5) * scale + offset - 0.5, n_proto)
    a = np.zeros((n_out, n_proto), np.float32)
    a[np.arange(n_out), j0] += 1 - lam  # each row once per statement: j0 == j1 at the edge adds up
    a[np.arange(n_out), j1] += lam
    return a
