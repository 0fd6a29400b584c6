"""Non-maximum suppression: axis-aligned boxes (per class or across them) and oriented boxes by their
probabilistic IoU, as Ultralytics computes it."""

from __future__ import annotations


import numpy as np


def nms(xyxy: np.ndarray, scores: np.ndarray, iou: float) -> np.ndarray:
    """Greedy non-maximum suppression; indices kept, best first."""
    order = np.argsort(-scores, kind="stable")
    area = (xyxy[:, 2] - xyxy[:, 0]) * (xyxy[:, 3] - xyxy[:, 1])
    keep: list[int] = []
    while order.size:
        i = order[0]
        keep.append(int(i))
        rest = order[1:]
        x1 = np.maximum(xyxy[i, 0], xyxy[rest, 0])
        y1 = np.maximum(xyxy[i, 1], xyxy[rest, 1])
        x2 = np.minimum(xyxy[i, 2], xyxy[rest, 2])
        y2 = np.minimum(xyxy[i, 3], xyxy[rest, 3])
        inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
        overlap = inter / np.maximum(area[i] + area[rest] - inter, 1e-9)
        order = rest[overlap <= iou]
    return np.asarray(keep, dtype=np.int64)


PROBIOU_EPS = 1e-7  # Ultralytics' eps


def probiou(a: np.ndarray, b: np.ndarray, eps: float = PROBIOU_EPS) -> np.ndarray:
    """(N, 5) and (M, 5) oriented boxes (cx, cy, w, h, angle) -> (N, M) their probabilistic IoU: 1 minus
    the Hellinger distance of the boxes taken as Gaussians (arXiv 2106.06072), as Ultralytics'
    batch_probiou computes it, whose NMS for oriented boxes this is."""
    return _probiou(a[:, None, :], b[None, :, :], eps)


def _probiou(a: np.ndarray, b: np.ndarray, eps: float = PROBIOU_EPS) -> np.ndarray:
    """probiou of boxes a (..., 5) and b (..., 5), broadcast against each other: pairs, or every pair."""
    def covariance(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        w2, h2, cos, sin = r[..., 2] ** 2 / 12, r[..., 3] ** 2 / 12, np.cos(r[..., 4]), np.sin(r[..., 4])
        return w2 * cos ** 2 + h2 * sin ** 2, w2 * sin ** 2 + h2 * cos ** 2, (w2 - h2) * cos * sin

    a, b = a.astype(np.float64), b.astype(np.float64)
    (a1, b1, c1), (a2, b2, c2) = covariance(a), covariance(b)
    dx, dy = a[..., 0] - b[..., 0], a[..., 1] - b[..., 1]
    with np.errstate(invalid="ignore", divide="ignore"):  # a nan box, a det rounded below 0: nan, never over iou
        det = (a1 + a2) * (b1 + b2) - (c1 + c2) ** 2
        t1 = ((a1 + a2) * dy ** 2 + (b1 + b2) * dx ** 2) / (det + eps) * 0.25
        t2 = ((c1 + c2) * -dx * dy) / (det + eps) * 0.5
        t3 = np.log(det / (4 * np.sqrt(np.clip(a1 * b1 - c1 ** 2, 0, None) * np.clip(a2 * b2 - c2 ** 2, 0, None))
                           + eps) + eps) * 0.5
        bd = np.clip(t1 + t2 + t3, eps, 100.0)
        return 1 - np.sqrt(1.0 - np.exp(-bd) + eps)


def rotated_nms(xywhr: np.ndarray, class_ids: np.ndarray, scores: np.ndarray, iou: float) -> np.ndarray:
    """Oriented boxes kept, best first, class by class, as Ultralytics suppresses them (its fast NMS):
    a box goes when any better box of its class overlaps it by more than `iou` (probabilistic IoU),
    whether or not that one was kept itself."""
    kept: list[np.ndarray] = []
    for c in np.unique(class_ids):
        idx = np.flatnonzero(class_ids == c)
        idx = idx[np.argsort(-scores[idx], kind="stable")]
        kept.append(idx[~_overlapped(xywhr[idx].astype(np.float64), iou)])
    if not kept:
        return np.zeros(0, dtype=np.int64)
    out = np.concatenate(kept)
    return out[np.argsort(-scores[out], kind="stable")]


def _overlapped(boxes: np.ndarray, iou: float, block: int = 1 << 16) -> np.ndarray:
    """(N, 5) oriented boxes, best first -> (N,) bool: overlapped by more than `iou` by a better one.

    Only pairs that can overlap that much get their IoU. The Bhattacharyya distance of two boxes is at
    least |d|^2 / (4 (tr_a + tr_b)) (d: their centres' offset; tr = (w^2 + h^2) / 12, the trace of a box's
    covariance; the log term is >= 0) whenever their summed covariance is not near-singular, which one box
    of w x h >= 1 px^2 ensures; so a pair overlaps by more than `iou` only within |d| < max(R_a, R_b),
    R = sqrt(8 bd_max tr): boxes whose x-intervals [cx - R, cx + R] meet, found by a sweep over them sorted
    (`block` pairs at a time). Boxes under 1 px^2 reach every box, and two of them always get their IoU."""
    n, gone = len(boxes), np.zeros(len(boxes), bool)
    bd_max = _distance_below(iou)
    if n < 2 or bd_max <= 0:
        return gone
    cx, cy, w, h = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    tr, tiny = (w ** 2 + h ** 2) / 12, ~(w * h >= 1.0)  # nan sides: tiny, so compared with every box
    reach = np.where(tiny, np.inf, np.sqrt(8 * bd_max * tr))
    lo, hi = cx - reach, cx + reach
    order = np.argsort(lo, kind="stable")
    ends = np.searchsorted(lo[order], hi[order], side="right")  # sorted p meets q in p+1 .. ends[p]-1
    counts = np.maximum(ends - np.arange(n) - 1, 0)
    first = np.concatenate([[0], np.cumsum(counts)])
    p0 = 0
    while p0 < n:  # sorted positions p0 .. p1-1 at a time, their pairs at most `block` (or one p's)
        p1 = max(int(np.searchsorted(first, first[p0] + block, side="right")) - 1, p0 + 1)
        p = np.repeat(np.arange(p0, p1), counts[p0:p1])
        q = p + 1 + np.arange(len(p)) - np.repeat(first[p0:p1] - first[p0], counts[p0:p1])
        i, j = order[p], order[q]
        near = ~((cx[i] - cx[j]) ** 2 + (cy[i] - cy[j]) ** 2 >= 4 * bd_max * (tr[i] + tr[j])) | (tiny[i] & tiny[j])
        i, j = i[near], j[near]
        gone[np.maximum(i, j)[_probiou(boxes[i], boxes[j]) > iou]] = True  # the worse of the pair goes
        p0 = p1
    return gone


def _distance_below(iou: float) -> float:
    """The Bhattacharyya distance under which two boxes' probiou (eps and all) is above `iou`, with a margin
    for rounding (inf: any distance; 0: none, iou >= 1)."""
    if iou >= 1:
        return 0.0
    inside = 1 + PROBIOU_EPS - (1 - iou) ** 2  # probiou > iou <=> exp(-bd) > inside
    if inside <= 0:
        return np.inf
    return -np.log(inside) * 1.001 + 1e-4


def classwise_nms(xyxy: np.ndarray, class_ids: np.ndarray, scores: np.ndarray, iou: float) -> np.ndarray:
    keep = [idx[nms(xyxy[idx], scores[idx], iou)] for c in np.unique(class_ids)
            for idx in [np.flatnonzero(class_ids == c)]]
    if not keep:
        return np.zeros(0, dtype=np.int64)
    kept = np.concatenate(keep)
    return kept[np.argsort(-scores[kept], kind="stable")]
