"""Detection: decode YOLOv5-layout ([A, 5+C]: cx, cy, w, h, objectness, class probabilities) or
YOLOv8-layout ([4+C, A], no objectness) rows and suppress them class by class, or take an end-to-end
model's own boxes ([K, 6]: x1, y1, x2, y2, score, class) or a DETR's one box per query ([Q, 4+C]: cx,
cy, w, h as fractions of the input, class probabilities) as they are; then map the boxes back to the
original image. An instance segmenter's rows (YOLOv8-seg, YOLOv5-seg) end in mask coefficients for its
prototype masks: each kept box gets its mask (`instance_masks`); a pose model's in its keypoints, which
follow their box; an oriented-box detector's (YOLOv8-obb) in its box's angle: those are suppressed by
their probabilistic IoU (`rotated_nms`)."""

from __future__ import annotations


import numpy as np

from worker.runtime.model_output import ModelOutput, Paired
from worker.tasks.results import Detections, rotated_corners
from worker.tasks import sigmoid
from worker.tasks.preprocess import Geometry
from worker.tasks.detect.checks import DetectorChecks
from worker.tasks.detect.masks import instance_masks, query_masks
from worker.tasks.detect.nms import classwise_nms, rotated_nms
from worker.tasks.detect.rows import _anchors_last, _end2end_rows, _input_pixels, decode_rows


class Detector(DetectorChecks):
    """Boxes (and their masks, keypoints or angles) from a detector's output, in the image's pixels."""


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
        xyxy, class_ids, scores = decode_rows(rows, p.layout, len(self.card.labels), self._input_hw(geometry),
                                              p.box_format, p.box_units)
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
            instances = instance_masks(tail[sel][keep], protos, xyxy, geometry, self._input_hw(geometry))
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
        xyxy = _input_pixels(rows[queries, :4], "cxcywh", "fractions", self._input_hw(geometry))
        xyxy = geometry.to_original(xyxy.reshape(-1, 2, 2), clip=True).reshape(-1, 4)
        h, w = geometry.orig_hw
        instances = query_masks(masks[queries], geometry, self._input_hw(geometry)) if masks is not None else None
        return Detections(xyxy=xyxy.astype(np.float32), class_ids=class_ids, scores=picked,
                          names=tuple(self.card.label(int(c)) for c in class_ids), image_size=(w, h),
                          instances=instances)

    def _input_hw(self, geometry: Geometry) -> tuple[int, int]:
        """The size of the network input the image filled: the card's, or less under a rect letterbox."""
        return geometry.input_hw or self.size

    def _keypoints(self, values: np.ndarray, geometry: Geometry) -> np.ndarray:
        """(N, K x D) keypoint values of the kept boxes, in input pixels (or fractions of the input, as an
        end2end card's box_units says) -> (N, K, D) float32 in original pixels, clipped to the image as
        Ultralytics clips them; a visibility as it is."""
        k, d = self.card.postprocess.keypoints
        points = values.reshape(len(values), k, d).astype(np.float32)  # a copy: the output stays as it was
        if self.card.postprocess.box_units == "fractions":
            ih, iw = self._input_hw(geometry)
            points[:, :, 0] *= iw
            points[:, :, 1] *= ih
        points[:, :, :2] = geometry.to_original(points[:, :, :2], clip=True)
        return points
