"""YOLOv3-tiny, built here from Darknet files, against OpenCV's Darknet reader; YOLOv8 decoding."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CACHE, REFERENCE, ROOT, run_on
from worker.errors import ModelError
from worker.runtime.model_output import Paired
from worker.models.lookup import find_card
from worker.tasks.detect import Detector
from worker.tasks.detect.nms import classwise_nms
from worker.tasks.detect.rows import decode_rows
from worker.tasks.preprocess import Geometry

REF = json.loads((REFERENCE / "yolov3_tiny.json").read_text())


def iou(a, b) -> float:
    x1, y1, x2, y2 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    inter = max(x2 - x1, 0) * max(y2 - y1, 0)
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


@pytest.fixture(scope="module")
def processed(tmp_path_factory, samples: Path, yolo_onnx: Path):
    return run_on(tmp_path_factory.mktemp("yolo"), samples, REF["images"], "yolov3-tiny")


@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_boxes_match_reference(processed, name: str) -> None:
    cfg, summary = processed
    assert summary.figures["failed"] == 0
    boxes = json.loads((cfg.outbox / f"{name}.json").read_text())["boxes"]
    ref = REF["images"][name]["detections"]
    for r in ref:
        match = [b for b in boxes if b["class_id"] == r["class_id"] and iou(b["xyxy"], r["box_xyxy"]) >= 0.9]
        assert match, f"{name}: reference {r} not matched in {boxes}"
        assert abs(match[0]["score"] - r["score"]) <= 0.02
    matched = {id(b) for r in ref for b in boxes if b["class_id"] == r["class_id"] and iou(b["xyxy"], r["box_xyxy"]) >= 0.9}
    extra = [b for b in boxes if id(b) not in matched and b["score"] > 0.3]
    assert not extra, f"{name}: extra boxes {extra}"


def _card():
    return find_card(ROOT / "models", "yolov3-tiny")


def test_yolov8_layout_decoding_on_constructed_output() -> None:
    card = _card()
    card = dataclasses.replace(card, postprocess=dataclasses.replace(card.postprocess, layout="yolov8"),
                               labels=("a", "b", "c"))
    # 3 classes, 4 anchors: [4+C, A]; two overlapping class-1 boxes, one class-2 box, one below threshold
    rows = np.array([
        # cx,  cy,  w,  h,   a,   b,    c
        [100, 100, 40, 20, 0.0, 0.90, 0.0],
        [102, 101, 40, 20, 0.0, 0.80, 0.0],  # suppressed by the first (IoU ~0.85)
        [102, 101, 40, 20, 0.0, 0.00, 0.7],  # other class: kept
        [300, 300, 10, 10, 0.1, 0.10, 0.1],  # below 0.25
    ], dtype=np.float32)
    geo = Geometry(orig_hw=(208, 416), scale_x=1.0, scale_y=1.0, left=0, top=104)  # letterboxed 416x208
    det = Detector(card).postprocess(rows.T.copy(), geo)
    assert det.names == ("b", "c")
    np.testing.assert_allclose(det.scores, [0.9, 0.7], rtol=1e-6)
    np.testing.assert_allclose(det.xyxy[0], [80, 0, 120, 6], atol=1e-4)  # y mapped back by -104, clipped at 0
    # transposed, [A, 4+C], as some tools give it: the card's 3 labels tell the orientation (4 anchors)
    turned = Detector(card).postprocess(rows.copy(), geo)
    assert turned.names == det.names and np.array_equal(turned.xyxy, det.xyxy)
    Detector(card).check_output(rows.copy())
    # without labels, the anchors are the longer axis: 8,400 of them against 4 + 80
    unnamed = dataclasses.replace(card, labels=())
    many = np.zeros((8400, 84), np.float32)
    many[7, :4], many[7, 4 + 17] = (200, 100, 40, 20), 0.9
    (cls,) = Detector(unnamed).postprocess(many, geo).class_ids
    assert cls == 17 and Detector(unnamed).postprocess(many.T.copy(), geo).class_ids.tolist() == [17]


def test_yolov5_layout_uses_objectness() -> None:
    rows = np.array([[50, 50, 10, 10, 0.5, 0.9, 0.1]], dtype=np.float32)
    xyxy, cls, scores = decode_rows(rows, "yolov5")
    assert cls.tolist() == [0] and abs(scores[0] - 0.45) < 1e-6
    np.testing.assert_allclose(xyxy[0], [45, 45, 55, 55])


def test_classwise_nms_keeps_other_classes() -> None:
    xyxy = np.array([[0, 0, 10, 10], [1, 1, 10, 10], [0, 0, 10, 10]], np.float32)
    keep = classwise_nms(xyxy, np.array([0, 0, 1]), np.array([0.9, 0.8, 0.7], np.float32), 0.45)
    assert keep.tolist() == [0, 2]


@pytest.mark.parametrize("seed", range(6))
def test_rotated_nms_suppresses_what_comparing_every_pair_suppresses(seed: int) -> None:
    """rotated_nms gives each probiou only to pairs near enough to overlap by more than `iou`, found by a
    sweep (`_overlapped`): it keeps exactly what Ultralytics' fast NMS keeps comparing every pair (here
    written out as the full matrix of `probiou`, held to Ultralytics' own in the golden test), whatever the
    threshold, on boxes packed or spread, sides of 0 and under a pixel, duplicates, a nan, sweeps of one
    pair at a time or all at once."""
    from worker.tasks.detect.nms import _overlapped, probiou, rotated_nms

    rng = np.random.default_rng(seed)
    for spread in (0, 20, 300, 3000):
        n = int(rng.integers(50, 300))
        boxes = np.column_stack([rng.uniform(0, spread, (n, 2)), rng.uniform(0, 120, n), rng.uniform(0, 60, n),
                                 rng.uniform(-3, 3, n)])
        if spread == 0:  # where the sweep's bound is tight or fails: one thin box repeated along its length,
            angle, along = rng.uniform(-3, 3), np.sort(rng.uniform(0, 400, n))  # where its IoU falls slowest,
            boxes = np.column_stack([along * np.cos(angle), along * np.sin(angle), np.full(n, 60.0),
                                     np.full(n, 1.0), np.full(n, angle)])
            boxes[n // 2:, 3] = 0.0  # and lines on one line, which probiou takes for one box wherever they are
            boxes[-5:, 2:4] = 0.0  # and dots, each the same as any other to probiou
        few = rng.integers(0, n, n // 5)
        boxes[few, 2] *= rng.choice([0.0, 1e-3, 0.05], len(few))  # lines, dots, slivers
        boxes[rng.integers(0, n, n // 10)] = boxes[rng.integers(0, n, n // 10)]  # duplicates
        if seed % 2:
            boxes[rng.integers(0, n), rng.integers(0, 5)] = np.nan
        with np.errstate(invalid="ignore"):
            pairs = probiou(boxes, boxes)
        pairs[np.tril_indices(n)] = 0  # [i, j], i better than j
        for iou in (0.0, 1e-9, 0.01, 0.3, 0.45, 0.7, 0.99, 1.0):
            for block in (1, 97, 1 << 20):
                assert np.array_equal(_overlapped(boxes, iou, block), (pairs > iou).any(axis=0)), (spread, iou, block)
    scores = rng.uniform(0, 1, n).astype(np.float32)
    classes = rng.integers(0, 3, n)
    kept = rotated_nms(boxes.astype(np.float32), classes, scores, 0.45)
    assert scores[kept].tolist() == sorted(scores[kept].tolist(), reverse=True) and len(set(kept.tolist())) == len(kept)


def test_max_detections_keeps_the_best_boxes() -> None:
    card = _card()
    # 8 anchors, 8 classes, one box each at a different place: nothing suppressed, scores 0.3 .. 0.93
    scores = np.linspace(0.3, 0.93, 8, dtype=np.float32)
    rows = np.zeros((8, 5 + 80), np.float32)
    rows[:, 0], rows[:, 1], rows[:, 2:4], rows[:, 4] = np.arange(8) * 50 + 20, 100, 30, 1.0
    rows[np.arange(8), 5 + np.arange(8)] = scores
    geo = Geometry(orig_hw=(416, 416), scale_x=1.0, scale_y=1.0)
    every = Detector(card).postprocess(rows, geo)
    assert len(every.scores) == 8
    capped = Detector(dataclasses.replace(card, postprocess=dataclasses.replace(card.postprocess, max_detections=3)))
    best = capped.postprocess(rows, geo)
    np.testing.assert_allclose(best.scores, scores[::-1][:3], rtol=1e-6)
    assert best.class_ids.tolist() == [7, 6, 5]


def test_reduced_jpeg_decoding_maps_boxes_back_to_the_original(tmp_path: Path, samples: Path, yolo_onnx: Path) -> None:
    """pipeline.jpeg_reduce on a 1920x1280 photo (decoded at 1/4): the same objects, boxed in the
    original's coordinates within IoU 0.9 of the full decode's."""
    import cv2

    from worker.config import load
    from worker.service import run_folder

    photo = cv2.resize(cv2.imread(str(samples / "coffee.png")), (1920, 1280), interpolation=cv2.INTER_CUBIC)
    boxes = {}
    for reduce in (False, True):
        folder = tmp_path / f"in-{reduce}"
        folder.mkdir()
        cv2.imwrite(str(folder / "coffee.jpg"), photo, [cv2.IMWRITE_JPEG_QUALITY, 95])
        base = load(ROOT / "config.yaml")
        cfg = dataclasses.replace(base, outbox=tmp_path / f"out-{reduce}", db=f"sqlite:///{tmp_path / f'{reduce}.db'}",
                                  cache_dir=CACHE, models_dir=ROOT / "models", model="yolov3-tiny",
                                  pipeline=dataclasses.replace(base.pipeline, jpeg_reduce=reduce))
        assert run_folder(cfg, folder).figures["done"] == 1
        doc = json.loads((cfg.outbox / "coffee.jpg.json").read_text())
        assert doc["image"] == {"width": 1920, "height": 1280}
        boxes[reduce] = doc["boxes"]
    assert boxes[False] and [b["name"] for b in boxes[True]] == [b["name"] for b in boxes[False]]
    for full, reduced in zip(boxes[False], boxes[True]):
        assert iou(full["xyxy"], reduced["xyxy"]) >= 0.9 and abs(full["score"] - reduced["score"]) < 0.1


def test_end2end_layout_takes_the_models_own_boxes_without_a_second_nms() -> None:
    card = _card()
    card = dataclasses.replace(card, postprocess=dataclasses.replace(card.postprocess, layout="end2end"),
                               labels=("a", "b", "c"))
    rows = np.array([  # x1, y1, x2, y2, score, class, as YOLOv10 / YOLO26 / nms=True exports give them
        [80, 100, 120, 120, 0.80, 1],
        [82, 101, 122, 121, 0.90, 1],  # overlaps the first (IoU ~0.85): the model kept both, so do we
        [10, 110, 30, 130, 0.70, 2],
        [0, 0, 0, 0, 0.0, 0],  # padding
    ], dtype=np.float32)
    geo = Geometry(orig_hw=(208, 416), scale_x=1.0, scale_y=1.0, left=0, top=104)
    det = Detector(card).postprocess(rows, geo)
    assert det.names == ("b", "b", "c")
    np.testing.assert_allclose(det.scores, [0.9, 0.8, 0.7], rtol=1e-6)  # best first
    np.testing.assert_allclose(det.xyxy[0], [82, 0, 122, 17], atol=1e-4)  # mapped back by -104, clipped
    turned = Detector(card).postprocess(rows.T.copy(), geo)  # [6, K], as some tools transpose it
    assert turned.names == det.names and np.array_equal(turned.xyxy, det.xyxy)
    for box_format, first in (("yxyx", [101, 82, 121, 122]), ("cxcywh", [21, 40.5, 143, 161.5])):
        again = dataclasses.replace(card, postprocess=dataclasses.replace(card.postprocess, box_format=box_format))
        got = Detector(again).postprocess(rows, geo)  # the same rows read another way: y1 x1 y2 x2, or centre and size
        np.testing.assert_allclose(got.xyxy[0], np.clip(np.array(first, np.float32) - [0, 104, 0, 104], 0, None),
                                   atol=1e-4)
    with pytest.raises(ModelError, match=r"layout end2end needs one image's output as \[K, 6\].* is \[300, 85\]"):
        Detector(card).check_output(np.zeros((300, 85), np.float32))
    Detector(card).check_output(rows)


def test_detr_layout_scales_fractions_to_the_input_and_keeps_every_query() -> None:
    """Ultralytics' RT-DETR export: [Q, 4+C], cx, cy, w, h as fractions of the input, then each class's
    probability; one box per query, so no NMS (two queries on one object both stay)."""
    card = _card()
    card = dataclasses.replace(card, postprocess=dataclasses.replace(card.postprocess, layout="detr", threshold=0.5),
                               labels=("a", "b", "c"))  # input 416x416
    rows = np.array([  # cx, cy, w, h (fractions), then a, b, c
        [0.50, 0.50, 0.25, 0.50, 0.1, 0.8, 0.2],
        [0.51, 0.50, 0.25, 0.50, 0.1, 0.7, 0.2],  # nearly the first box (IoU ~0.92): kept all the same
        [0.25, 0.75, 0.10, 0.10, 0.0, 0.0, 0.9],
        [0.10, 0.10, 0.10, 0.10, 0.3, 0.2, 0.1],  # best class under the threshold
    ], dtype=np.float32)
    geo = Geometry(orig_hw=(832, 832), scale_x=0.5, scale_y=0.5)  # the original was twice the input
    det = Detector(card).postprocess(rows, geo)
    assert det.names == ("c", "b", "b")
    np.testing.assert_allclose(det.scores, [0.9, 0.8, 0.7], rtol=1e-6)  # best first
    np.testing.assert_allclose(det.xyxy[0], [166.4, 582.4, 249.6, 665.6], atol=1e-3)  # 0.2-0.3 x 832, 0.7-0.8 x 832
    np.testing.assert_allclose(det.xyxy[1], [312, 208, 520, 624], atol=1e-3)
    assert det.class_ids.tolist() == [2, 1, 1]
    turned = Detector(card).postprocess(rows.T.copy(), geo)  # [4+C, Q]: the axis of 4 + the labels is the rows
    assert turned.names == det.names and np.allclose(turned.xyxy, det.xyxy)
    Detector(card).check_output(rows)
    with pytest.raises(ModelError, match=r"the card lists 3 labels.* 80 classes"):
        Detector(card).check_output(np.zeros((300, 84), np.float32))
    wanted = r"layout detr needs one image's output as \[Q, 4\+C\] \(or \[4\+C, Q\]\).* is \[300\]"
    with pytest.raises(ModelError, match=wanted):
        Detector(card).check_output(np.zeros(300, np.float32))


@pytest.mark.parametrize("image", ["240x480", "270x480"])
def test_instance_masks_match_ultralytics_own(image: str) -> None:
    """Each box's mask from an instance segmenter's prototypes and coefficients, against the masks
    Ultralytics' own `process_mask_native` made from the same numbers (tests/data/make/ultralytics_masks.py:
    24 boxes on an image letterboxed into a 160x160 input, Ultralytics 8.4.190, as a YOLOv8-seg
    prediction with retina_masks=True gives them): a 240x480 image, whose padding is 10 prototype pixels,
    and a 270x480 one, whose 8.75 Ultralytics upsamples 4 times to crop (sampled once instead: IoU down
    to 0.98 there). Floating point differs where a logit is ~0."""
    from worker.tasks.detect.masks import instance_masks

    golden = np.load(ROOT / "tests" / "data" / "ultralytics_masks.npz")
    w, size = int(golden["shape"][1]), int(golden["input_size"])
    h = int(image.split("x")[0])
    scale = size / w  # the images are wider than tall: the width fills the input
    nh = round(h * scale)
    geometry = Geometry(orig_hw=(h, w), scale_x=1 / 3, scale_y=nh / h, left=0, top=(size - nh) // 2)
    boxes_key, masks_key = ("boxes", "masks") if image == "240x480" else ("boxes_270", "masks_270")
    expected = np.unpackbits(golden[masks_key], axis=-1, count=w).astype(bool)  # (sets, boxes, h, w)
    differing, pixels, ious = 0, 0, []
    for s in range(len(golden["protos"])):
        protos, boxes = golden["protos"][s].astype(np.float32), golden[boxes_key][s]
        for k in range(len(boxes)):  # each box alone: painted together, the better box's covers the others'
            mine = instance_masks(golden["coefficients"][s][k:k + 1], protos, boxes[k:k + 1], geometry,
                                  (size, size)) == 1
            theirs = expected[s, k]
            differing += int((mine != theirs).sum())
            pixels += int(theirs.sum())
            union = (mine | theirs).sum()
            ious.append((mine & theirs).sum() / union if union else 1.0)  # both empty: the same
    # identical here (24 of 24 each when made); a last bit of floating point may flip a pixel elsewhere
    assert pixels > 50_000 and min(ious) > 0.999 and differing <= pixels * 1e-4, (min(ious), differing, pixels)


def test_yolo_txt_lines_of_instance_masks_match_ultralytics_save_txt() -> None:
    """An instance segmenter's `<rel>.txt` line per box against the line Ultralytics'
    `Results.save_txt(save_conf=True)` wrote for the same box and mask (tests/data/make/ultralytics_masks.py,
    Ultralytics 8.4.190): the class, the outline's points normalised to the image, the score; no line
    for a box without a mask. A mask of several parts is one polygon in both, its outlines joined by
    seams, which each joins in its own order: there the same points, and a polygon that fills the mask."""
    import cv2

    from worker.tasks.results import Detections
    from worker.outputs.yolo_txt import yolo_txt

    golden = np.load(ROOT / "tests" / "data" / "ultralytics_masks.npz")
    h, w = (int(v) for v in golden["shape"])
    masks = np.unpackbits(golden["masks"], axis=-1, count=w).astype(bool)
    joined = 0
    for s in range(len(golden["boxes"])):
        for k in range(len(golden["boxes"][s])):
            result = Detections(golden["boxes"][s][k:k + 1], golden["classes"][s][k:k + 1],
                                golden["scores"][s][k:k + 1], ("x",), (w, h), masks[s, k].astype(np.uint16))
            mine, theirs = yolo_txt(result).strip(), str(golden["txt"][s][k])
            if not theirs:
                assert mine == "" and masks[s, k].sum() == 0
                continue
            m, t = [float(v) for v in mine.split()], [float(v) for v in theirs.split()]
            assert m[0] == t[0] and m[-1] == pytest.approx(t[-1], abs=1e-4), (mine[:40], theirs[:40])
            points = np.array(m[1:-1]).reshape(-1, 2)
            theirs_points = np.array(t[1:-1]).reshape(-1, 2)
            parts = len(cv2.findContours(masks[s, k].view(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)[0])
            if parts == 1:
                assert points.shape == theirs_points.shape and np.abs(points - theirs_points).max() < 1e-5
                continue
            joined += 1
            pixels = np.rint(points * (w, h)).astype(np.int32)
            assert {tuple(p) for p in pixels} == {tuple(p) for p in np.rint(theirs_points * (w, h)).astype(int)}
            filled, theirs_filled = np.zeros((h, w), np.uint8), np.zeros((h, w), np.uint8)
            cv2.fillPoly(filled, [pixels], 1)
            cv2.fillPoly(theirs_filled, [np.rint(theirs_points * (w, h)).astype(np.int32)], 1)
            # every pixel of the mask, and no more of the seams' than Ultralytics' joins draw (2-154 here)
            assert filled[masks[s, k]].all() and filled.sum() <= theirs_filled.sum(), (k, filled.sum(),
                                                                                      theirs_filled.sum())
    assert joined >= 5


def test_pose_boxes_and_keypoints_match_ultralytics_own(tmp_path: Path) -> None:
    """A YOLOv8-pose output's boxes, scores, classes and keypoints for a 427x640 photo letterboxed into a
    320x320 input, against what Ultralytics' own PosePredictor postprocessing made of the same numbers
    (tests/data/make/ultralytics_pose.py, Ultralytics 8.4.190): NMS, then boxes and keypoints back to the photo
    with each side's own scale, clipped to it; a visibility as the model gave it."""
    result, golden, (h, w) = _on_golden(tmp_path, "ultralytics_pose.npz", "keypoints: [17, 3]")
    assert len(result.scores) == len(golden["conf"]) > 100
    order = np.argsort(-golden["conf"], kind="stable")  # best first, as the worker lists them
    assert np.array_equal(result.class_ids, golden["cls"][order].astype(np.int64))
    assert np.allclose(result.scores, golden["conf"][order], atol=1e-6)
    assert np.abs(result.xyxy - golden["xyxy"][order]).max() < 1e-3
    assert result.keypoints is not None and result.keypoints.shape == (len(order), 17, 3)
    assert np.abs(result.keypoints - golden["keypoints"][order]).max() < 1e-3
    assert result.keypoints[:, :, 0].max() == w and result.keypoints[:, :, 1].min() == 0  # clipped, as theirs


def test_oriented_boxes_match_ultralytics_own(tmp_path: Path) -> None:
    """A YOLOv8-obb output's oriented boxes for a 427x640 photo letterboxed into a 320x320 input, against
    what Ultralytics' own OBBPredictor postprocessing made of the same numbers
    (tests/data/make/ultralytics_obb.py, Ultralytics 8.4.190): its fast NMS on the boxes' probabilistic IoU,
    then centre and sides back to the photo, the angle as it was; their corners in its order."""
    result, golden, (h, w) = _on_golden(tmp_path, "ultralytics_obb.npz", "obb: true")
    assert len(result.scores) == len(golden["conf"]) > 200
    order = np.argsort(-golden["conf"], kind="stable")
    assert np.array_equal(result.class_ids, golden["cls"][order].astype(np.int64))
    assert np.allclose(result.scores, golden["conf"][order], atol=1e-6)
    assert result.rotated is not None and np.abs(result.rotated - golden["xywhr"][order]).max() < 1e-3
    from worker.tasks.results import rotated_corners
    assert np.abs(rotated_corners(result.rotated) - golden["corners"][order]).max() < 1e-3
    # the bounding boxes of the corners, clipped to the photo
    corners = golden["corners"][order]
    expected = np.clip(np.concatenate([corners.min(1), corners.max(1)], 1), 0, [w, h, w, h])
    assert np.abs(result.xyxy - expected).max() < 1e-3


def _on_golden(tmp_path: Path, name: str, postprocess: str):
    """The worker's detector on a golden file's made-up YOLOv8 output (tests/data/`name`), read under a
    card of a 320x320 letterboxed input, two classes and `postprocess` added, for the file's photo size:
    (the result, the golden arrays, (h, w)); the card is held to the output first, as at a start."""
    from worker.models.card import load_card
    from worker.tasks import adapter_for
    from worker.tasks.preprocess import resize_for

    golden = np.load(ROOT / "tests" / "data" / name)
    (tmp_path / "model.yaml").write_text(
        "name: golden\ntask: detect\nonnx: golden.onnx\ninput: {name: images, size: [320, 320]}\n"
        "preprocess: {color: rgb, resize: letterbox, pad_value: 114, mean: [0, 0, 0], std: [255, 255, 255]}\n"
        f"postprocess: {{output: output0, layout: yolov8, threshold: 0.25, iou: 0.45, {postprocess}}}\n"
        "labels: [a, b]\n")
    card = load_card(tmp_path / "model.yaml")
    detector = adapter_for(card)
    h, w = (int(v) for v in golden["shape"])
    _, geometry = resize_for(np.zeros((h, w, 3), np.uint8), card.preprocess, (320, 320))
    detector.check_output(golden["raw"])
    return detector.postprocess(golden["raw"], geometry), golden, (h, w)


@pytest.mark.parametrize("checkpoint, labels", [("finetuned", 3), ("coco", 91)])
def test_rfdetr_pairs_match_rfdetr_own(tmp_path: Path, checkpoint: str, labels: int) -> None:
    """RF-DETR's two outputs, joined (`outputs: [dets, labels]`) and read as logits (`activation: sigmoid`),
    against what RF-DETR 1.11.2's own decoder made of the same numbers for a 427x640 photo
    (tests/data/make/rfdetr_decode.py): every query/class pair over the threshold a box, best first, the best
    300; a fine-tuned model's last slot (one more than its labels) its background, never a box; a COCO
    checkpoint's 91 slots all named. The greedy reading, each query's best class, keeps fewer."""
    from worker.models.card import load_card
    from worker.tasks import adapter_for
    from worker.tasks.preprocess import resize_for

    golden = np.load(ROOT / "tests" / "data" / "rfdetr_decode.npz")
    names = ", ".join(f"c{i}" for i in range(labels))
    (tmp_path / "model.yaml").write_text(
        "name: rfdetr\ntask: detect\nonnx: rfdetr.onnx\ninput: {name: input, size: [384, 384]}\n"
        "preprocess: {color: rgb, resize: stretch, mean: [123.675, 116.28, 103.53], std: [58.395, 57.12, 57.375]}\n"
        "postprocess: {outputs: [dets, labels], layout: detr, activation: sigmoid, threshold: 0.5}\n"
        f"labels: [{names}]\n")
    detector = adapter_for(load_card(tmp_path / "model.yaml"))
    h, w = (int(v) for v in golden["shape"])
    _, geometry = resize_for(np.zeros((h, w, 3), np.uint8), detector.card.preprocess, (384, 384))
    rows = np.concatenate([golden[f"{checkpoint}_dets"], golden[f"{checkpoint}_labels"]], axis=1)
    detector.check_output(rows)
    result = detector.postprocess(rows, geometry)
    assert len(result.scores) == len(golden[f"{checkpoint}_scores"]) >= 40
    assert np.array_equal(result.class_ids, golden[f"{checkpoint}_class_id"])
    assert np.allclose(result.scores, golden[f"{checkpoint}_scores"], atol=1e-6)
    assert np.abs(result.xyxy - golden[f"{checkpoint}_xyxy"]).max() < 1e-3
    assert result.names[0] == f"c{result.class_ids[0]}"
    assert len(set(golden[f"{checkpoint}_query"].tolist())) < len(result.scores)  # queries giving two boxes
    if checkpoint == "finetuned":  # the background slot scores over the threshold somewhere: still no box
        assert (golden["finetuned_labels"][:, 3] > 0).any() and result.class_ids.max() < 3
    wrong = dataclasses.replace(detector.card, labels=("a", "b"))
    with pytest.raises(ModelError, match=r"lists 2 labels.* has \d+ classes \(or one more, the last, read as the "
                                         r"background slot RF-DETR adds\)"):
        adapter_for(wrong).check_output(rows)
    plain = dataclasses.replace(detector.card, postprocess=dataclasses.replace(detector.card.postprocess,
                                                                               activation=None))
    with pytest.raises(ModelError, match=r"logits, as RF-DETR exports them\? postprocess.activation: sigmoid"):
        adapter_for(plain).check_output(rows)


def test_rfdetr_seg_masks_match_rfdetr_own(tmp_path: Path) -> None:
    """RF-DETR-Seg's outputs (tests/support/rfdetr_like.py's made-up 100 queries: boxes, logits of 3 classes and
    the background slot, 78x78 mask logits each) for a 427x640 photo, against what RF-DETR 1.11.2's own
    PostProcess (predict()'s) made of them (tests/data/make/rfdetr_masks.py): the same boxes, classes and
    scores; each box's mask its query's logits resized to the photo, not cropped to the box, painted
    worst first into one map: the same pixels. A query's second class gets what its first leaves: none."""
    from tests.support.rfdetr_like import made_up_seg
    from worker.models.card import load_card
    from worker.tasks import adapter_for
    from worker.tasks.preprocess import resize_for

    golden = np.load(ROOT / "tests" / "data" / "rfdetr_masks.npz")
    (tmp_path / "model.yaml").write_text(
        "name: rfdetr-seg\ntask: detect\nonnx: rfdetr-seg.onnx\ninput: {name: input, size: [312, 312]}\n"
        "preprocess: {color: rgb, resize: stretch, mean: [123.675, 116.28, 103.53], std: [58.395, 57.12, 57.375]}\n"
        "postprocess: {outputs: [dets, labels], masks: masks, layout: detr, activation: sigmoid, threshold: 0.5}\n"
        "labels: [a, b, c]\n")
    detector = adapter_for(load_card(tmp_path / "model.yaml"))
    h, w = (int(v) for v in golden["shape"])
    _, geometry = resize_for(np.zeros((h, w, 3), np.uint8), detector.card.preprocess, (312, 312))
    dets, labels, masks = made_up_seg()
    output = Paired(np.concatenate([dets, labels], axis=1), masks)
    detector.check_output(output)
    result = detector.postprocess(output, geometry)
    assert len(result.scores) == len(golden["scores"]) >= 30
    assert np.array_equal(result.class_ids, golden["class_id"])
    assert np.allclose(result.scores, golden["scores"], atol=1e-6)
    assert np.abs(result.xyxy - golden["xyxy"]).max() < 1e-3
    assert result.instances is not None
    assert np.array_equal(result.instances, golden["painted"])
    # RF-DETR's masks reach past their boxes (Ultralytics' would be cut at them)
    k = int(np.argmax(golden["pixels"]))
    ys, xs = np.nonzero(result.instances == k + 1)
    x1, y1, x2, y2 = result.xyxy[k]
    assert xs.min() < x1 - 1 or xs.max() > x2 + 1 or ys.min() < y1 - 1 or ys.max() > y2 + 1
    with pytest.raises(ModelError, match=r"output 'masks' \[99, 78, 78\] .* is not one mask per query of output "
                                         r"'dets, labels' \(100, 8\) \(100 queries\), as RF-DETR-Seg gives them"):
        detector.check_output(Paired(output.rows, masks[:99]))
