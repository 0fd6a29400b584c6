"""Detection: decode YOLOv5-layout ([A, 5+C]: cx, cy, w, h, objectness, class probabilities) or
YOLOv8-layout ([4+C, A], no objectness) rows and suppress them class by class, or take an end-to-end
model's own boxes ([K, 6]: x1, y1, x2, y2, score, class) or a DETR's one box per query ([Q, 4+C]: cx,
cy, w, h as fractions of the input, class probabilities) as they are; then map the boxes back to the
original image. An instance segmenter's rows (YOLOv8-seg, YOLOv5-seg) end in mask coefficients for its
prototype masks: each kept box gets its mask (`instance_masks`); a pose model's in its keypoints, which
follow their box; an oriented-box detector's (YOLOv8-obb) in its box's angle: those are suppressed by
their probabilistic IoU (`rotated_nms`)."""

from __future__ import annotations

import math

import numpy as np

from worker.errors import ModelError
from worker.model_output import ModelOutput, Paired
from worker.results import Detections, rotated_corners
from worker.tasks import OtherOutputs, check_labels, sigmoid
from worker.tasks.preprocess import CardPreprocessing, Geometry


def decode_rows(output: np.ndarray, layout: str, classes: int = 0, input_hw: tuple[int, int] = (1, 1),
                box_format: str = "xyxy", box_units: str = "pixels") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (xyxy (A, 4) in input pixels, class ids (A,), scores (A,)), one best class per row.
    `classes`: how many the card names (0: none), which tells a yolov8 or detr output's orientation;
    `input_hw`: the network input's size, which fractions are of; `box_format` and `box_units`: how an
    end2end output gives its boxes (the other layouts fix them)."""
    if layout == "end2end":  # the model's own boxes, best class and score; [6, K] as some tools give it
        rows = _end2end_rows(output, 0)
        boxes, class_ids, scores = rows[:, :4], np.rint(rows[:, 5]), rows[:, 4]
    else:  # YOLO rows and DETR queries: cx, cy, w, h (DETR's as fractions), then the classes' scores
        box_format, box_units = "cxcywh", "fractions" if layout == "detr" else "pixels"
        if layout == "yolov5":
            boxes, obj, cls = output[:, :4], output[:, 4], output[:, 5:]
        else:
            rows = output.T if _anchors_last(output, classes) else output
            boxes, obj, cls = rows[:, :4], None, rows[:, 4:]
        class_ids = cls.argmax(axis=1)
        scores = cls[np.arange(len(cls)), class_ids]
        if obj is not None:
            scores = obj * scores
    return _input_pixels(boxes, box_format, box_units, input_hw), class_ids.astype(np.int64), scores.astype(np.float32)


def _input_pixels(boxes: np.ndarray, box_format: str, box_units: str, input_hw: tuple[int, int]) -> np.ndarray:
    """(K, 4) boxes as a model gives them -> (K, 4) float32 x1, y1, x2, y2 in input pixels."""
    xyxy = _as_xyxy(boxes.astype(np.float32), box_format)
    if box_units == "fractions":  # of the input's width and height
        xyxy = xyxy * np.array([input_hw[1], input_hw[0]] * 2, np.float32)
    return xyxy


def _end2end_rows(output: np.ndarray, extra: int) -> np.ndarray:
    """An end2end output whose rows end in `extra` more values (a pose model's keypoints, an instance
    segmenter's mask coefficients) as (K, 6 + extra), [6 + extra, K] transposed."""
    n = 6 + extra
    return output.T if output.shape[0] == n and output.shape[1] != n else output


def _as_xyxy(boxes: np.ndarray, box_format: str) -> np.ndarray:
    """(K, 4) boxes as xyxy, yxyx or cxcywh -> (K, 4) x1, y1, x2, y2."""
    if box_format == "yxyx":
        return boxes[:, [1, 0, 3, 2]]
    if box_format == "cxcywh":
        cx, cy, w, h = boxes.T
        return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
    return boxes


def _anchors_last(output: np.ndarray, classes: int) -> bool:
    """Whether a yolov8 (or detr) output is [4+C, A], as Ultralytics exports a YOLOv8, rather than
    [A, 4+C], as some tools transpose it and as Ultralytics exports an RT-DETR: the axis of 4 + the
    card's labels is the rows, or else the anchors (queries) are the longer axis (8,400 at 640 px,
    2,100 at 320, RT-DETR's 300 queries, against 4 + C)."""
    if classes and (output.shape[0] == 4 + classes) != (output.shape[1] == 4 + classes):
        return output.shape[0] == 4 + classes
    return output.shape[0] <= output.shape[1]


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


class Detector(CardPreprocessing):
    def check_output(self, output: ModelOutput, others: OtherOutputs = ()) -> None:
        layout = self.card.postprocess.layout
        output, protos = (output.rows, output.protos) if isinstance(output, Paired) else (output, None)
        if layout == "detr" and self.card.postprocess.activation == "sigmoid":  # logits: any value is one
            self._check_query_logits(output, protos)
            return
        kd, m, obb = self._keypoint_values(), len(protos) if protos is not None else 0, int(self.card.postprocess.obb)
        if layout == "end2end":
            self._check_end2end(output, kd, m, obb)
        else:
            self._check_anchor_rows(output, others, kd, m, obb, paired=protos is not None)

    def _what_follows(self, kd: int) -> str:
        """What a row holds after its class scores when no mask coefficients do, for the errors."""
        if kd:
            return f", then K x D = {kd} keypoint values (postprocess.keypoints)"
        return ", then the box's angle (postprocess.obb)" if self.card.postprocess.obb else ""

    def _check_end2end(self, output: np.ndarray, kd: int, m: int, obb: int) -> None:
        """[K, 6 + extras] rows: the class count is not in the shape (ids past the labels are named by number)."""
        points = f", then M = {m} mask coefficients for output '{self.card.postprocess.masks}'" if m else \
            self._what_follows(kd)
        first = "cx, cy, w, h" if obb else "x1, y1, x2, y2"
        if output.ndim != 2 or 6 + kd + m + obb not in output.shape:
            raise ModelError(f"model '{self.card.name}': layout end2end needs one image's output as "
                             f"[K, {6 + kd + m + obb}] ({first}, score, class{points}); output "
                             f"'{self.card.postprocess.named}' is {list(output.shape)}")
        if kd:
            self._check_visibility(_end2end_rows(output, kd)[:, 6:])
        if obb:
            self._check_angles(_end2end_rows(output, obb)[:, 6], end2end=True)

    def _check_anchor_rows(self, output: np.ndarray, others: OtherOutputs, kd: int, m: int, obb: int, *,
                           paired: bool) -> None:
        """yolov5 [A, 5+C], yolov8 [4+C, A] and detr [Q, 4+C] rows, either way round, each ending in an
        instance segmenter's mask coefficients, a pose model's keypoints or an oriented box's angle. `paired`:
        the card names a prototype output (postprocess.masks), so these are a segmenter's rows already."""
        layout = self.card.postprocess.layout
        per_row = 5 if layout == "yolov5" else 4  # box (+ objectness) before the class scores
        extra = m + kd + obb
        axis = 0 if layout != "yolov5" and output.ndim == 2 and _anchors_last(output, self._values(extra)) else 1
        if output.ndim != 2 or output.shape[axis] <= per_row + extra:
            want = {"yolov8": "[4+C, A] (or [A, 4+C])", "detr": "[Q, 4+C] (or [4+C, Q])"}.get(layout, "[A, 5+C]")
            more = "+M" if m else f"+{kd}" if kd else "+1" if extra else ""
            want = want.replace("C]", f"C{more}]").replace("C, ", f"C{more}, ")
            masks = f", M = {m} mask coefficients for output '{self.card.postprocess.masks}'" if m else \
                self._what_follows(kd)
            raise ModelError(f"model '{self.card.name}': layout {layout} needs one image's output as {want}{masks}; "
                             f"output '{self.card.postprocess.named}' is {list(output.shape)}")
        rows = output if axis == 1 else output.T
        if not paired and not kd and layout in ("yolov5", "yolov8") and \
                (said := self._instance_segmenter(output.shape[axis] - per_row, others)):
            raise ModelError(f"model '{self.card.name}': output '{self.card.postprocess.named}' "
                             f"{tuple(output.shape)} holds {per_row} box values, {said}")
        if said := self._not_scores(rows, per_row, extra):
            raise ModelError(f"model '{self.card.name}': output '{self.card.postprocess.named}' "
                             f"{tuple(output.shape)} holds {per_row} box values, then {said}")
        if kd:
            self._check_visibility(rows[:, rows.shape[1] - kd:])
        if obb:
            self._check_angles(rows[:, -1])
        check_labels(self.card, output.shape[axis] - per_row - extra, output)

    def _check_query_logits(self, output: np.ndarray, protos: np.ndarray | None) -> None:
        """A DETR output of class logits (RF-DETR's): [Q, 4+C] or [4+C, Q], C the card's labels or one more
        (the background slot); RF-DETR-Seg's masks one per query."""
        if output.ndim != 2 or min(output.shape) <= 4:
            raise ModelError(f"model '{self.card.name}': layout detr needs one image's output as [Q, 4+C] (or "
                             f"[4+C, Q]); output '{self.card.postprocess.named}' is {list(output.shape)}")
        rows, background = self._query_rows(output)
        classes, labels = rows.shape[1] - 4, len(self.card.labels)
        if labels and classes not in (labels, labels + 1):
            raise ModelError(f"model '{self.card.name}': the card lists {labels} labels, but output "
                             f"'{self.card.postprocess.named}' {tuple(output.shape)} has {classes} classes "
                             f"(or one more, the last, read as the background slot RF-DETR adds)")
        if protos is not None and len(protos) != len(rows):
            raise ModelError(f"model '{self.card.name}': output '{self.card.postprocess.masks}' "
                             f"{list(protos.shape)} (the card's postprocess.masks) is not one mask per query "
                             f"of output '{self.card.postprocess.named}' {tuple(output.shape)} ({len(rows)} "
                             f"queries), as RF-DETR-Seg gives them")

    def _check_angles(self, angles: np.ndarray, end2end: bool = False) -> None:
        """An oriented-box detector's angles from the warm-up: YOLOv8-obb gives (sigmoid - 0.25) x pi,
        -pi/4 to 3pi/4. Anything else there (a class score past the labels, a plain detector's last
        class) is not an angle. YOLO26-obb's rows (end2end) give theirs raw: not checked."""
        if end2end or not angles.size:
            return
        if float(angles.min()) < -math.pi / 4 - 0.01 or float(angles.max()) > 3 * math.pi / 4 + 0.01:
            raise ModelError(f"model '{self.card.name}': postprocess.obb reads each row's last value as its box's "
                             f"angle, -pi/4 to 3pi/4 radians as YOLOv8-obb gives it, but output "
                             f"'{self.card.postprocess.named}' gives {float(angles.min()):.4g} to "
                             f"{float(angles.max()):.4g} there: not an oriented-box model's rows")

    def _keypoint_values(self) -> int:
        """K x D: the values each row ends in for a pose model's keypoints; 0 for other detectors."""
        kp = self.card.postprocess.keypoints
        return kp[0] * kp[1] if kp else 0

    def _check_visibility(self, values: np.ndarray) -> None:
        """A pose model's keypoint values (A, K x D) from the warm-up: with D = 3 every third is a
        visibility 0-1 (Ultralytics' export applies its sigmoid). A [K, 3] card on a [K', 2] model reads
        coordinates there: refused, or every point would get a visibility of hundreds."""
        k, d = self.card.postprocess.keypoints
        if d != 3 or not values.size:
            return
        top = float(values.reshape(len(values), k, d)[:, :, 2].max())
        if top > 1.01:
            raise ModelError(f"model '{self.card.name}': postprocess.keypoints [{k}, 3] reads every third keypoint "
                             f"value as a visibility (0 to 1), but output '{self.card.postprocess.named}' gives up "
                             f"to {top:.4g} there: its keypoints are not [{k}, 3] (the model's kpt_shape, in its "
                             f"metadata, says what they are)")

    def _not_scores(self, rows: np.ndarray, per_row: int, extra: int) -> str | None:
        """What the values a layout reads as scores (0 to 1: every YOLO and DETR export applies its
        sigmoid) hold instead, from `rows` (A, values) of the warm-up's output, whose last `extra` the
        card reads otherwise; None when they are scores. A pose model's keypoints (pixels) or an oriented
        box's angle read as classes would give boxes of nonsense."""
        first = per_row - 1 if self.card.postprocess.layout == "yolov5" else per_row  # an objectness too
        scores = rows[:, first:rows.shape[1] - extra]
        if not scores.size or (float(scores.min()) >= -0.01 and float(scores.max()) <= 1.01):  # float16 aside
            return None
        span = f"from {float(scores.min()):.4g} to {float(scores.max()):.4g}"
        labels, values, kp = len(self.card.labels), rows.shape[1] - per_row - extra, self.card.postprocess.keypoints
        classes = rows[:, per_row:per_row + labels]
        if labels and values > labels and float(classes.min()) >= -0.01 and float(classes.max()) <= 1.01:
            more = values - labels
            said = (f"the card's {labels} class score{'s' if labels > 1 else ''} and {more} more "
                    f"value{'s' if more > 1 else ''}, {span}")
            if kp or self.card.postprocess.obb:
                reads = (f"the {kp[0] * kp[1]} that postprocess.keypoints {list(kp)}" if kp
                         else "the angle postprocess.obb")
                return (f"{said}, before {reads} reads: the card's {'keypoints are' if kp else 'layout is'} not "
                        f"the model's (its metadata, kpt_shape or task, says what it gives)")
            if more == 1:
                return f"{said}: an oriented box's angle, as YOLOv8-obb gives it? postprocess.obb: true reads it"
            shape = f"[{more // 3}, 3]" if more % 3 == 0 else f"[{more // 2}, 2]" if more % 2 == 0 else "[K, D]"
            return (f"{said}: keypoints, as a pose model such as YOLOv8-pose gives them? Name their shape in the "
                    f"card (the model's kpt_shape), postprocess.keypoints: {shape}")
        if self.card.postprocess.layout == "detr":
            return (f"values {span} where class probabilities (0 to 1) should be: logits, as RF-DETR exports "
                    f"them? postprocess.activation: sigmoid reads them so")
        return (f"values {span} where class scores (0 to 1) should be: not a detector's rows as layout "
                f"{self.card.postprocess.layout} reads them (a pose model's keypoints? postprocess.keypoints: "
                f"[K, D] names them; an oriented box's angle? postprocess.obb: true; or scores before their "
                f"sigmoid)")

    def _values(self, coefficients: int) -> int:
        """What a row holds after its box, as `_anchors_last` counts it: the card's classes and any mask
        coefficients; 0 (unknown) for a card without labels."""
        return len(self.card.labels) + coefficients if self.card.labels else 0

    def _instance_segmenter(self, values: int, others: OtherOutputs) -> str | None:
        """What a YOLO instance segmenter's rows hold (a -seg export: each box's class scores, then M mask
        coefficients for the M prototype masks of a second output (N, M, h, w)), or None when these are
        not such rows. Read as a detector's, its coefficients would be taken for classes."""
        labels = len(self.card.labels)
        for name, shape in others:
            m = shape[1] if len(shape) == 4 and isinstance(shape[1], int) else 0
            if 0 < m < values and (values - m == labels or not labels):
                classes = f"{values - m} class scores" if labels else "then class scores"
                return (f"{classes} and {m} mask coefficients for output '{name}' {list(shape)}: an instance "
                        f"segmenter (as YOLOv8-seg exports); name that output in the card, postprocess.masks: "
                        f"{name}, for each box's mask")
        return None

    def postprocess(self, output: ModelOutput, geometry: Geometry) -> Detections:
        p = self.card.postprocess
        rows, protos = (output.rows, output.protos) if isinstance(output, Paired) else (output, None)
        if p.layout == "detr" and p.activation == "sigmoid":
            return self._query_pairs(rows, protos, geometry)
        kd = self._keypoint_values()
        extra = len(protos) if protos is not None else kd or int(p.obb)
        tail = np.zeros((0, 0), np.float32)  # each row's mask coefficients, keypoints or angle: split off its end
        if extra:
            if p.layout == "yolov8" and _anchors_last(rows, self._values(extra)):
                rows = rows.T
            elif p.layout == "end2end":
                rows = _end2end_rows(rows, extra)
            rows, tail = rows[:, :-extra], rows[:, -extra:]
        xyxy, class_ids, scores = decode_rows(rows, p.layout, len(self.card.labels), self.size, p.box_format,
                                              p.box_units)
        sel = scores >= p.threshold
        if p.obb:
            return self._oriented(rows[sel, :4], tail[sel, 0], class_ids[sel], scores[sel], geometry)
        xyxy, class_ids, scores = xyxy[sel], class_ids[sel], scores[sel]
        if p.layout in ("end2end", "detr"):  # one box per object already: a NMS could drop boxes the model kept
            keep = np.argsort(-scores, kind="stable")[:p.max_detections]
        else:
            keep = classwise_nms(xyxy, class_ids, scores, p.iou)[:p.max_detections]  # best first
        xyxy, class_ids, scores = xyxy[keep], class_ids[keep], scores[keep]
        h, w = geometry.orig_hw
        xyxy = geometry.to_original(xyxy.reshape(-1, 2, 2), clip=True).reshape(-1, 4)  # both corners
        instances = keypoints = None
        if protos is not None:
            instances = instance_masks(tail[sel][keep], protos, xyxy, geometry, self.size)
        elif kd:
            keypoints = self._keypoints(tail[sel][keep], geometry)
        return Detections(xyxy=xyxy.astype(np.float32), class_ids=class_ids, scores=scores,
                          names=tuple(self.card.label(int(c)) for c in class_ids), image_size=(w, h),
                          instances=instances, keypoints=keypoints,
                          keypoint_names=p.keypoint_names if keypoints is not None else ())

    def _oriented(self, xywh: np.ndarray, angles: np.ndarray, class_ids: np.ndarray, scores: np.ndarray,
                  geometry: Geometry) -> Detections:
        """An oriented-box detector's candidates (cx, cy, w, h in input pixels, the angle, class, score)
        -> its boxes, as Ultralytics' OBBPredictor gives them: suppressed by probabilistic IoU
        (`rotated_nms`; NMS-free rows as they are), the best `max_detections`, then centre and sides mapped
        back through the letterbox (each side by its axis's scale) and the angle kept; `xyxy` each one's
        bounding box."""
        p = self.card.postprocess
        xywhr = np.concatenate([xywh, angles[:, None]], axis=1).astype(np.float32)
        if p.layout == "end2end":  # one box per object already
            keep = np.argsort(-scores, kind="stable")[:p.max_detections]
        else:
            keep = rotated_nms(xywhr, class_ids, scores, p.iou)[:p.max_detections]
        xywhr, class_ids, scores = xywhr[keep], class_ids[keep], scores[keep]
        xywhr[:, :2] = geometry.to_original(xywhr[:, :2])
        xywhr[:, 2] /= geometry.scale_x
        xywhr[:, 3] /= geometry.scale_y
        corners = rotated_corners(xywhr)
        h, w = geometry.orig_hw
        xyxy = np.concatenate([corners.min(axis=1), corners.max(axis=1)], axis=1)
        xyxy = np.clip(xyxy, 0, [w, h, w, h]).astype(np.float32)
        return Detections(xyxy=xyxy, class_ids=class_ids, scores=scores,
                          names=tuple(self.card.label(int(c)) for c in class_ids), image_size=(w, h), rotated=xywhr)

    def _query_rows(self, output: np.ndarray) -> tuple[np.ndarray, bool]:
        """A DETR output of class logits as (Q, 4 + C) rows, and whether its last class is a background slot:
        one class more than the card's labels, as an RF-DETR fine-tuned on N classes gives N + 1 (never a box:
        RF-DETR's own ONNX decoder leaves it out too)."""
        labels = len(self.card.labels)
        background = bool(labels) and 5 + labels in output.shape and 4 + labels not in output.shape
        return (output.T if _anchors_last(output, labels + background) else output), background

    def _query_pairs(self, output: np.ndarray, masks: np.ndarray | None, geometry: Geometry) -> Detections:
        """A DETR's queries with class logits, (Q, 4 + C): cx, cy, w, h as fractions of the input, then C
        logits (RF-DETR's `dets` and `labels` joined) -> its boxes as RF-DETR's postprocessing selects them:
        each logit's sigmoid, every query/class pair at or above the threshold a box (a query's classes are
        independent: it can give one per class), best first (ties by query, then class), at most
        `max_detections` and at most Q (RF-DETR's num_select is its query count); no NMS. Boxes mapped back
        to the original and clipped to it; with `masks` (Q, h, w), RF-DETR-Seg's mask logits per query,
        each box gets its query's (`query_masks`)."""
        p = self.card.postprocess
        rows, background = self._query_rows(output)
        logits = rows[:, 4:rows.shape[1] - background].astype(np.float32)
        scores = sigmoid(logits)  # float32, as RF-DETR's
        queries, class_ids = np.nonzero(scores >= p.threshold)  # in order of query, then class
        picked = scores[queries, class_ids]
        order = np.argsort(-picked, kind="stable")[:min(p.max_detections, len(rows))]  # RF-DETR takes Q at most
        queries, class_ids, picked = queries[order], class_ids[order].astype(np.int64), picked[order]
        xyxy = _input_pixels(rows[queries, :4], "cxcywh", "fractions", self.size)
        xyxy = geometry.to_original(xyxy.reshape(-1, 2, 2), clip=True).reshape(-1, 4)
        h, w = geometry.orig_hw
        instances = query_masks(masks[queries], geometry, self.size) if masks is not None else None
        return Detections(xyxy=xyxy.astype(np.float32), class_ids=class_ids, scores=picked,
                          names=tuple(self.card.label(int(c)) for c in class_ids), image_size=(w, h),
                          instances=instances)

    def _keypoints(self, values: np.ndarray, geometry: Geometry) -> np.ndarray:
        """(N, K x D) keypoint values of the kept boxes, in input pixels (or fractions of the input, as an
        end2end card's box_units says) -> (N, K, D) float32 in original pixels, clipped to the image as
        Ultralytics clips them; a visibility as it is."""
        k, d = self.card.postprocess.keypoints
        points = values.reshape(len(values), k, d).astype(np.float32)  # a copy: the output stays as it was
        if self.card.postprocess.box_units == "fractions":
            points[:, :, 0] *= self.size[1]
            points[:, :, 1] *= self.size[0]
        points[:, :, :2] = geometry.to_original(points[:, :, :2], clip=True)
        return points


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
