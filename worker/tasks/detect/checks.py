"""A detector's output held to its card before any image is taken: the rows' layout, their values per
anchor or query, the classes, keypoints, angles and mask coefficients the card says; each refusal says
what the rows hold and what to write in the card."""

from __future__ import annotations

import math

import numpy as np

from worker.errors import ModelError
from worker.runtime.model_output import ModelOutput, Paired
from worker.tasks import OtherOutputs, check_labels
from worker.tasks.preprocess import CardPreprocessing
from worker.tasks.detect.rows import _anchors_last, _end2end_rows


class DetectorChecks(CardPreprocessing):
    """`check_output`, and what postprocessing reads of the card (the values per row)."""

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

    def _query_rows(self, output: np.ndarray) -> tuple[np.ndarray, bool]:
        """A DETR output of class logits as (Q, 4 + C) rows, and whether its last class is a background slot:
        one class more than the card's labels, as an RF-DETR fine-tuned on N classes gives N + 1 (never a box:
        RF-DETR's own ONNX decoder leaves it out too)."""
        labels = len(self.card.labels)
        background = bool(labels) and 5 + labels in output.shape and 4 + labels not in output.shape
        return (output.T if _anchors_last(output, labels + background) else output), background
