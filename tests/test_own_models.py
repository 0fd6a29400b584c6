"""Users' own ONNX models through the whole pipeline: a multi-class segmenter (class-index mask,
per-class fractions), a one-map segmenter that outputs logits, a classifier ending in Softmax,
channels-last models in and out, one-channel (gray) and 16-bit inputs, a segmenter ending in
ArgMax, end-to-end detectors, a DETR, a detector that takes image sizes and gives its
boxes, scores and labels apart; and the cards that contradict their models, refused with the fix.

The models are tiny graphs written here with known arithmetic (a 1x1 convolution that copies the
colour channels, a global average then Softmax), so what each image must give is known exactly;
onnxruntime, the pipeline, the outbox and the database are the real ones."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.support.onnx_models import (card_file, channels_last_model, deploy_detector, gray_model, quadrant_segmenter,
                                      rows_model, save_model, seg_model)
from worker.errors import ConfigError, ModelError
from worker.outputs.coco import coco
from worker.models.card import load_card
from worker.models.onnx_graph import GraphBuilder
from worker.service import run_folder
from worker.store.db import open_db
from worker.store.queries import Filters, query_images


def _channels_model(path: Path, out_channels: int) -> None:
    """(N, 3, h, w) -> (N, out_channels, h, w): output channel k copies input channel k (out 1: G - R)."""
    g = GraphBuilder()
    if out_channels == 3:
        w = np.eye(3, dtype=np.float32).reshape(3, 3, 1, 1)
    else:  # one map of logits: green minus red, scaled
        w = np.array([[-8.0, 8.0, 0.0]], np.float32).reshape(1, 3, 1, 1)
    out = g.node("Conv", ["input", g.const(w)], name="logits", kernel_shape=[1, 1])
    g.save(path, "input", ["N", 3, 32, 48], [(out, ["N", out_channels, 32, 48])], "test")


def _softmax_classifier(path: Path) -> str:
    g = GraphBuilder()
    pooled = g.node("GlobalAveragePool", ["input"])
    flat = g.node("Flatten", [pooled], axis=1)
    out = g.node("Softmax", [g.node("Mul", [flat, g.const(np.float32(4.0))])], name="probs", axis=1)
    g.save(path, "input", ["N", 3, 32, 48], [(out, ["N", 3])], "test")
    return out


def _card(models: Path, name: str, body: str, resize: str = "stretch") -> None:
    card_file(models, name, "input: {name: input, size: [32, 48], dynamic_batch: true}\n"
                             f"preprocess: {{color: rgb, resize: {resize}, mean: [0, 0, 0], "
                             f"std: [255, 255, 255]}}\n{body}")


def _thirds(path: Path, colors_bgr: list[tuple[int, int, int]], h: int = 60, w: int = 90) -> None:
    """An image in three vertical bands of the given colours."""
    img = np.zeros((h, w, 3), np.uint8)
    for i, c in enumerate(colors_bgr):
        img[:, i * w // 3:(i + 1) * w // 3] = c
    cv2.imwrite(str(path), img)


@pytest.fixture
def own(tmp_path: Path, cfg):
    models, images = tmp_path / "models", tmp_path / "images"
    images.mkdir()
    return dataclasses.replace(cfg, models_dir=models), models, images


def test_a_multi_class_segmenter_writes_a_class_index_mask_and_per_class_fractions(own) -> None:
    cfg, models, images = own
    _card(models, "parts", "task: segment\npostprocess: {output: logits, activation: softmax}\n"
                           "labels: [background, leaf, sky]")
    _channels_model(models / "parts" / "parts.onnx", 3)
    _thirds(images / "bands.png", [(0, 0, 255), (0, 255, 0), (255, 0, 0)])  # red, green, blue (BGR)
    _thirds(images / "plain.png", [(0, 0, 200)] * 3)  # red only: all background
    cfg = dataclasses.replace(cfg, model="parts", outputs=dataclasses.replace(cfg.outputs, overlays=True))
    summary = run_folder(cfg, images)
    assert summary.figures["done"] == 2 and summary.figures["failed"] == 0

    classes = cv2.imread(str(cfg.outbox / "bands.png.mask.png"), cv2.IMREAD_UNCHANGED)
    assert classes.shape == (60, 90) and classes.dtype == np.uint8
    assert set(np.unique(classes)) == {0, 1, 2}
    # away from the band edges (the maps are resized before the argmax) each band is its class
    assert (classes[:, :28] == 0).all() and (classes[:, 32:58] == 1).all() and (classes[:, 62:] == 2).all()
    doc = json.loads((cfg.outbox / "bands.png.json").read_text())
    by_name = {c["name"]: c for c in doc["classes"]}
    assert set(by_name) == {"background", "leaf", "sky"} and doc["mask"] == "bands.png.mask.png"
    for name, cid in (("background", 0), ("leaf", 1), ("sky", 2)):
        assert by_name[name]["class_id"] == cid and by_name[name]["pixels"] == int((classes == cid).sum())
        assert by_name[name]["fraction"] == pytest.approx(1 / 3, abs=0.03)
    pure = float(np.exp(1) / (np.exp(1) + 2))  # softmax of (1, 0, 0): a pure band's probability
    assert by_name["leaf"]["score"] == pytest.approx(pure, abs=0.02)
    assert doc["mask_fraction"] == pytest.approx((classes > 0).mean(), abs=1e-6)
    assert (cfg.outbox / "bands.png.overlay.jpg").is_file()
    assert [(r["name"], r["xyxy"][0] in range(28, 33), r["xyxy"][2] in range(58, 63)) for r in doc["regions"]] == [
        ("leaf", True, True), ("sky", False, False)] and doc["regions"][1]["xyxy"][2] == 90
    assert set(doc["timings_ms"]) == {"queue_wait", "decode", "preprocess", "infer", "postprocess"}

    plain = cv2.imread(str(cfg.outbox / "plain.png.mask.png"), cv2.IMREAD_UNCHANGED)
    assert (plain == 0).all()
    assert json.loads((cfg.outbox / "plain.png.json").read_text())["mask_fraction"] == 0.0

    db = open_db(cfg.db)
    try:
        leaf = query_images(db, Filters(label="leaf"))
        assert [r["rel_path"] for r in leaf] == ["bands.png"]
        assert query_images(db, Filters(label="background")) == []  # the background is not a label
        exported = coco(db, Filters(model="parts"), ("background", "leaf", "sky"), "segment", cfg.outbox)
    finally:
        db.dispose()
    assert exported["categories"] == [{"id": 1, "name": "leaf"}, {"id": 2, "name": "sky"}]
    (leaf_ann, sky_ann) = sorted(exported["annotations"], key=lambda a: a["category_id"])
    x, y, w, h = sky_ann["bbox"]
    assert (x + w, y, h, sky_ann["area"]) == (90, 0, 60, w * 60) and leaf_ann["score"] == by_name["leaf"]["score"]
    (polygon,) = sky_ann["segmentation"]
    assert sorted(zip(polygon[0::2], polygon[1::2])) == [(x, 0), (x, 60), (90, 0), (90, 60)]  # its band's corners


def test_a_one_map_segmenter_that_outputs_logits_takes_a_sigmoid(own) -> None:
    cfg, models, images = own
    _card(models, "leafy", "task: segment\npostprocess: {output: logits, activation: sigmoid, threshold: 0.5}\n"
                           "labels: [leaf]")
    _channels_model(models / "leafy" / "leafy.onnx", 1)
    _thirds(images / "bands.png", [(0, 0, 255), (0, 255, 0), (255, 0, 0)])
    summary = run_folder(dataclasses.replace(cfg, model="leafy"), images)
    assert summary.figures["done"] == 1
    mask = cv2.imread(str(cfg.outbox / "bands.png.mask.png"), cv2.IMREAD_GRAYSCALE)
    assert (mask[:, 32:58] == 255).all() and (mask[:, :28] == 0).all() and (mask[:, 62:] == 0).all()
    doc = json.loads((cfg.outbox / "bands.png.json").read_text())
    assert doc["label"] == "leaf" and doc["mask_fraction"] == pytest.approx(1 / 3, abs=0.03)
    # a probability (a pure green pixel's is sigmoid(8); the band's edges, resized, a little less), not a logit
    assert 0.95 < doc["score"] <= 1 / (1 + np.exp(-8.0))


def test_a_classifier_ending_in_softmax_is_not_softmaxed_again(own) -> None:
    cfg, models, images = own
    _card(models, "tint", "task: classify\npostprocess: {output: probs, activation: none, top_k: 3}\n"
                          "labels: [red, green, blue]")
    _softmax_classifier(models / "tint" / "tint.onnx")
    cv2.imwrite(str(images / "green.png"), np.full((40, 40, 3), (0, 255, 0), np.uint8))
    run_folder(dataclasses.replace(cfg, model="tint"), images)
    doc = json.loads((cfg.outbox / "green.png.json").read_text())
    want = np.exp([0.0, 4.0, 0.0]) / np.exp([0.0, 4.0, 0.0]).sum()  # the graph's own Softmax
    assert [x["name"] for x in doc["labels"]] == ["green", "red", "blue"]
    assert doc["labels"][0]["score"] == pytest.approx(want[1], abs=1e-4)
    assert doc["uncertain"] is False


@pytest.mark.parametrize("body, error, message", [
    ("task: segment\npostprocess: {output: logits}\nlabels: [a, b]", ModelError,
     "the card lists 2 labels, but output 'logits' \\(3, 32, 48\\) has 3 classes"),
    ("task: segment\npreprocess: {resize: shorter-crop}\npostprocess: {output: logits}", ConfigError,
     "'preprocess.resize' must be stretch"),
])
def test_a_multi_class_card_that_contradicts_its_model_is_refused(own, body: str, error: type, message: str) -> None:
    cfg, models, images = own
    folder = models / "bad"
    folder.mkdir(parents=True)
    (folder / "model.yaml").write_text(f"name: bad\nonnx: bad.onnx\ninput: {{name: input, size: [32, 48]}}\n{body}\n")
    _channels_model(folder / "bad.onnx", 3)
    _thirds(images / "bands.png", [(0, 0, 255)] * 3)
    with pytest.raises(error, match=message):
        run_folder(dataclasses.replace(cfg, model="bad"), images)


def test_softmax_on_one_map_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text("name: x\nonnx: x.onnx\ntask: segment\npostprocess: {activation: softmax}\n")
    from worker.tasks import adapter_for

    with pytest.raises(ModelError, match="'activation: softmax' needs a map per class"):
        adapter_for(load_card(tmp_path / "model.yaml")).check_output(np.zeros((1, 8, 8), np.float32))


@pytest.mark.parametrize("elem, std", [("FLOAT16", 255), ("UINT8", 1)])
def test_a_channels_last_model_of_another_input_type_gets_its_layout_and_type(own, elem: str, std: int) -> None:
    from onnx import TensorProto

    cfg, models, images = own
    folder = card_file(models, "tf", "task: segment\ninput: {name: input, size: [32, 48], layout: nhwc}\n"
                        f"preprocess: {{color: rgb, resize: stretch, mean: [0, 0, 0], std: [{std}, {std}, {std}]}}\n"
                        "postprocess: {output: logits}\nlabels: [background, leaf, sky]")
    channels_last_model(folder / "tf.onnx", getattr(TensorProto, elem))
    _thirds(images / "bands.png", [(0, 0, 255), (0, 255, 0), (255, 0, 0)])
    assert run_folder(dataclasses.replace(cfg, model="tf"), images).figures["done"] == 1
    classes = cv2.imread(str(cfg.outbox / "bands.png.mask.png"), cv2.IMREAD_UNCHANGED)
    assert (classes[:, :28] == 0).all() and (classes[:, 32:58] == 1).all() and (classes[:, 62:] == 2).all()
    assert json.loads((cfg.outbox / "bands.png.json").read_text())["classes"][1]["score"] == pytest.approx(1.0, abs=0.01)


def test_a_channels_last_model_under_a_channels_first_card_is_refused_with_the_fix(own) -> None:
    from onnx import TensorProto

    cfg, models, images = own
    folder = models / "tf"
    folder.mkdir(parents=True)
    (folder / "model.yaml").write_text("name: tf\nonnx: tf.onnx\ntask: segment\ninput: {name: input, size: [32, 48]}\n"
                                       "postprocess: {output: logits}\n")
    channels_last_model(folder / "tf.onnx", TensorProto.FLOAT)
    _thirds(images / "bands.png", [(0, 0, 255)] * 3)
    with pytest.raises(ModelError, match=r"has 32 channels where the card's layout nchw puts them, not 3 "
                                         r"\(it looks NHWC: set input.layout: nhwc in the card\)"):
        run_folder(dataclasses.replace(cfg, model="tf"), images)


def _gray_card(models: Path, layout: str, pre: str = "{color: gray, resize: stretch, mean: [0], std: [255]}") -> None:
    folder = models / "xray"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.yaml").write_text(
        f"name: xray\nonnx: xray.onnx\ntask: segment\ninput: {{name: input, size: [32, 48], layout: {layout}}}\n"
        f"preprocess: {pre}\npostprocess: {{output: logits, activation: sigmoid}}\nlabels: [bright]\n")


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_a_one_channel_model_gets_the_gray_levels(own, layout: str) -> None:
    cfg, models, images = own
    _gray_card(models, layout)
    gray_model(models / "xray" / "xray.onnx", layout)
    # luma 0.299 R + 0.587 G + 0.114 B: pure red 76, green 150, blue 29 of 255; only green is above half
    _thirds(images / "bands.png", [(0, 0, 255), (0, 255, 0), (255, 0, 0)])
    scan = np.full((60, 90), 50, np.uint8)
    scan[:, :45] = 200
    cv2.imwrite(str(images / "scan.png"), scan)  # a one-channel file, as X-ray and line cameras write
    assert run_folder(dataclasses.replace(cfg, model="xray"), images).figures["done"] == 2
    bands = cv2.imread(str(cfg.outbox / "bands.png.mask.png"), cv2.IMREAD_GRAYSCALE)
    assert (bands[:, 32:58] == 255).all() and (bands[:, :28] == 0).all() and (bands[:, 62:] == 0).all()
    green = json.loads((cfg.outbox / "bands.png.json").read_text())["score"]
    assert green == pytest.approx(1 / (1 + np.exp(-(8 * 150 / 255 - 4))), abs=0.01)
    mask = cv2.imread(str(cfg.outbox / "scan.png.mask.png"), cv2.IMREAD_GRAYSCALE)
    assert (mask[:, :43] == 255).all() and (mask[:, 47:] == 0).all()
    doc = json.loads((cfg.outbox / "scan.png.json").read_text())
    assert doc["score"] == pytest.approx(1 / (1 + np.exp(-(8 * 200 / 255 - 4))), abs=0.01)


@pytest.mark.parametrize("pre, model_channels, message", [
    ("{color: rgb}", 1, r"has 1 channels where the card's layout nchw puts them, not 3 "
                        r"\(a one-channel model: set preprocess.color: gray in the card\)"),
    ("{color: gray}", 3, r"has 3 channels where the card's layout nchw puts them, not 1 "
                         r"\(a colour model: set preprocess.color: rgb or bgr in the card\)"),
])
def test_a_card_whose_colour_contradicts_the_models_channels_is_refused_with_the_fix(
        own, pre: str, model_channels: int, message: str) -> None:
    cfg, models, images = own
    _gray_card(models, "nchw", pre)
    if model_channels == 1:
        gray_model(models / "xray" / "xray.onnx", "nchw")
    else:
        _channels_model(models / "xray" / "xray.onnx", 1)
    _thirds(images / "bands.png", [(0, 0, 255)] * 3)
    with pytest.raises(ModelError, match=message):
        run_folder(dataclasses.replace(cfg, model="xray"), images)


def test_a_16_bit_card_gets_a_12_bit_scans_levels_unrounded(own) -> None:
    """depth 16: a 16-bit PNG or TIFF reaches the model with all its bits (at depth 8 a 12-bit scan would
    keep 16 levels of its 4,096), an 8-bit file widened (x 257); overlays are drawn at 8 bits."""
    cfg, models, images = own
    _gray_card(models, "nchw", "{color: gray, depth: 16, resize: stretch, mean: [0], std: [4095]}")
    gray_model(models / "xray" / "xray.onnx", "nchw")
    scan = np.full((60, 90), 1000, np.uint16)
    scan[:, :45] = 3000  # 12-bit levels: x = level / 4095, in the mask where x > 0.5
    cv2.imwrite(str(images / "scan.png"), scan)
    cv2.imwrite(str(images / "scan.tiff"), scan)
    small = np.full((60, 90), 5, np.uint8)
    small[:, :45] = 10  # widened: 2570 and 1285 of 4095
    cv2.imwrite(str(images / "eight.png"), small)
    cfg = dataclasses.replace(cfg, model="xray", outputs=dataclasses.replace(cfg.outputs, overlays=True))
    assert run_folder(cfg, images).figures["done"] == 3
    for name, level in (("scan.png", 3000), ("scan.tiff", 3000), ("eight.png", 2570)):
        mask = cv2.imread(str(cfg.outbox / f"{name}.mask.png"), cv2.IMREAD_GRAYSCALE)
        assert (mask[:, :43] == 255).all() and (mask[:, 47:] == 0).all(), name
        score = json.loads((cfg.outbox / f"{name}.json").read_text())["score"]
        # read at 8 bits, 3000 would be 11 of 255: sigmoid(8 * 11 * 257 / 4095 - 4) = 0.82, not 0.87
        assert score == pytest.approx(1 / (1 + np.exp(-(8 * level / 4095 - 4))), abs=0.01), name
    drawn = cv2.imread(str(cfg.outbox / "scan.png.overlay.jpg"))
    assert drawn.shape == (60, 90, 3) and drawn.dtype == np.uint8
    assert abs(int(drawn[30, 80, 1]) - 1000 // 256) <= 2  # outside the mask: the scan's top 8 bits


def test_a_32_bit_card_gets_a_float_tiffs_temperatures_as_they_are(own) -> None:
    """depth 32: a thermal camera's float TIFF (degrees) reaches the model as its values, normalised in
    those units (x = T / 100 here: the mask is where it is over 50 degrees); one with no-data samples
    fails naming them, and the overlay stretches the range to 8 bits. At depth 8 the same file failed."""
    cfg, models, images = own
    _gray_card(models, "nchw", "{color: gray, depth: 32, resize: stretch, mean: [0], std: [100]}")
    gray_model(models / "xray" / "xray.onnx", "nchw")
    temps = np.full((60, 90), 21.5, np.float32)
    temps[:, :45] = 80.25
    cv2.imwrite(str(images / "thermal.tiff"), temps)
    temps[10, 10] = np.nan
    cv2.imwrite(str(images / "gaps.tiff"), temps)
    cfg = dataclasses.replace(cfg, model="xray", outputs=dataclasses.replace(cfg.outputs, overlays=True))
    summary = run_folder(cfg, images)
    assert (summary.figures["done"], summary.figures["failed"]) == (1, 1)
    mask = cv2.imread(str(cfg.outbox / "thermal.tiff.mask.png"), cv2.IMREAD_GRAYSCALE)
    assert (mask[:, :43] == 255).all() and (mask[:, 47:] == 0).all()
    score = json.loads((cfg.outbox / "thermal.tiff.json").read_text())["score"]
    assert score == pytest.approx(1 / (1 + np.exp(-(8 * 0.8025 - 4))), abs=0.01)
    error = json.loads((cfg.outbox / "gaps.tiff.error.json").read_text())["error"]
    assert "1 of its 5400 samples are NaN or infinite" in error
    drawn = cv2.imread(str(cfg.outbox / "thermal.tiff.overlay.jpg"))
    assert drawn.shape == (60, 90, 3) and abs(int(drawn[30, 80, 1])) <= 2  # the coldest: 0 of 255


def _end2end_detector(path: Path) -> None:
    """(N, 3, 32, 48) -> (N, 3, 6) rows of x1, y1, x2, y2, score, class in input pixels: a fixed box of
    class 1 whose score is the image's mean level (0-1), one of class 5 at 0.6, and a padding row."""
    rows = np.array([[[8, 4, 24, 20, 0.0, 1], [30, 10, 46, 30, 0.6, 5], [0, 0, 0, 0, 0, 0]]], np.float32)
    gate = np.zeros((1, 3, 6), np.float32)
    gate[0, 0, 4] = 1.0  # the first row's score follows the image
    rows_model(path, rows, gate)


def test_an_end_to_end_detector_gives_its_own_boxes_in_the_originals_coordinates(own) -> None:
    cfg, models, images = own
    _card(models, "e2e", "task: detect\npostprocess: {output: output0, layout: end2end, threshold: 0.5}\n"
                         "labels: [person, cup, car]", resize="letterbox")  # padded with the default 114
    _end2end_detector(models / "e2e" / "e2e.onnx")
    cv2.imwrite(str(images / "white.png"), np.full((64, 96, 3), 255, np.uint8))  # twice the input: scale 1/2
    cv2.imwrite(str(images / "dark.png"), np.full((64, 96, 3), 20, np.uint8))
    assert run_folder(dataclasses.replace(cfg, model="e2e"), images).figures["done"] == 2
    white = json.loads((cfg.outbox / "white.png.json").read_text())["boxes"]
    # class 5 is past the card's three labels (an end-to-end output does not say how many there are)
    assert [(b["name"], b["xyxy"]) for b in white] == [("cup", [16, 8, 48, 40]), ("5", [60, 20, 92, 60])]
    assert white[0]["score"] == pytest.approx(1.0, abs=1e-3) and white[1]["score"] == pytest.approx(0.6, abs=1e-6)
    dark = json.loads((cfg.outbox / "dark.png.json").read_text())["boxes"]
    assert [b["name"] for b in dark] == ["5"]  # its cup scored 20/255, under the threshold
    db = open_db(cfg.db)
    try:
        assert [r["rel_path"] for r in query_images(db, Filters(label="cup"))] == ["white.png"]
        exported = coco(db, Filters(model="e2e"), ("person", "cup", "car"), "detect", cfg.outbox)
    finally:
        db.dispose()
    assert exported["categories"] == [{"id": 0, "name": "person"}, {"id": 1, "name": "cup"}, {"id": 2, "name": "car"},
                                      {"id": 5, "name": "5"}]  # every category an annotation refers to
    assert sorted(a["category_id"] for a in exported["annotations"]) == [1, 5, 5]


def _detr_detector(path: Path) -> None:
    """(N, 3, 32, 48) -> (N, 4, 7), as Ultralytics exports an RT-DETR: per query cx, cy, w, h as fractions
    of the input, then the probabilities of 3 classes. Query 0 is a cup whose score is the image's mean
    level (0-1); query 1 nearly the same box, a cup at 0.7; query 2 a car at 0.9; query 3 below any
    threshold."""
    rows = np.array([[[0.50, 0.50, 0.50, 0.50, 0.0, 0.0, 0.0], [0.52, 0.50, 0.50, 0.50, 0.0, 0.7, 0.0],
                      [0.25, 0.25, 0.25, 0.50, 0.0, 0.0, 0.9], [0.10, 0.10, 0.10, 0.10, 0.1, 0.1, 0.1]]], np.float32)
    gate = np.zeros((1, 4, 7), np.float32)
    gate[0, 0, 5] = 1.0  # query 0's cup follows the image
    rows_model(path, rows, gate)


def test_a_detr_gives_one_box_per_query_scaled_from_fractions_of_the_input(own) -> None:
    cfg, models, images = own
    _card(models, "detr", "task: detect\npostprocess: {output: output0, layout: detr, threshold: 0.5}\n"
                          "labels: [person, cup, car]")  # stretched, as Ultralytics' RT-DETR predictor does
    _detr_detector(models / "detr" / "detr.onnx")
    cv2.imwrite(str(images / "white.png"), np.full((64, 96, 3), 255, np.uint8))  # twice the input
    cv2.imwrite(str(images / "dark.png"), np.full((64, 96, 3), 20, np.uint8))
    assert run_folder(dataclasses.replace(cfg, model="detr"), images).figures["done"] == 2
    white = json.loads((cfg.outbox / "white.png.json").read_text())["boxes"]
    # query 0: cx 24, cy 16, w 24, h 16 input pixels -> 12, 8, 36, 24 -> x2 in the original; query 1
    # overlaps it (IoU 0.92): a NMS would drop it, a DETR's queries are one box each
    assert [(b["name"], b["xyxy"]) for b in white] == [("cup", [24, 16, 72, 48]), ("car", [12, 0, 36, 32]),
                                                      ("cup", [25.92, 16, 73.92, 48])]
    assert [b["score"] for b in white] == pytest.approx([1.0, 0.9, 0.7], abs=1e-3)
    dark = json.loads((cfg.outbox / "dark.png.json").read_text())["boxes"]
    assert [b["name"] for b in dark] == ["car", "cup"]  # its first cup scored 20/255, under the threshold


def test_an_end_to_end_detector_with_y_first_fractions_gets_its_boxes_mapped_back(own) -> None:
    """TensorFlow's Object Detection API gives y1, x1, y2, x2 as fractions of the input (and 1-based
    classes): `box_format: yxyx`, `box_units: fractions`; letterboxed, the padding is taken off too."""
    cfg, models, images = own
    _card(models, "tfod", "task: detect\npostprocess: {output: output0, layout: end2end, threshold: 0.5, "
                          "box_format: yxyx, box_units: fractions}\nlabels: [background, cup]", resize="letterbox")
    rows = np.array([[[0.25, 0.25, 0.75, 0.75, 0.0, 1], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]], np.float32)
    gate = np.zeros((1, 3, 6), np.float32)
    gate[0, 0, 4] = 1.0  # the cup's score is the image's mean level
    rows_model(models / "tfod" / "tfod.onnx", rows, gate)
    cv2.imwrite(str(images / "white.png"), np.full((64, 64, 3), 255, np.uint8))  # scale 1/2, 8 px of padding each side
    assert run_folder(dataclasses.replace(cfg, model="tfod"), images).figures["done"] == 1
    boxes = json.loads((cfg.outbox / "white.png.json").read_text())["boxes"]
    # x 0.25-0.75 of 48 = 12-36, less the 8 px of padding, x2; y 0.25-0.75 of 32 = 8-24, x2
    assert [(b["name"], b["xyxy"]) for b in boxes] == [("cup", [8, 16, 56, 48])]


def _keras_segmenter(path: Path, maps: int) -> None:
    """A Keras-style export, channels last in and out: (N, 32, 48, 3) -> (N, 32, 48, maps), map k a copy
    of colour channel k (maps 3), or one map of logits, green minus red (maps 1)."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.eye(3, dtype=np.float32).reshape(3, 3, 1, 1) if maps == 3 else \
        np.array([[-8.0, 8.0, 0.0]], np.float32).reshape(1, 3, 1, 1)
    nodes = [helper.make_node("Transpose", ["input"], ["nchw"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["nchw", "w"], ["conv"], kernel_shape=[1, 1]),
             helper.make_node("Transpose", ["conv"], ["maps"], perm=[0, 2, 3, 1])]
    image = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 32, 48, 3])
    graph = helper.make_graph(nodes, "keras", [image],
                              [helper.make_tensor_value_info("maps", TensorProto.FLOAT, ["N", 32, 48, maps])],
                              initializer=[numpy_helper.from_array(w, "w")])
    save_model(graph, path)


def _keras_card(models: Path, post: str, labels: str) -> None:
    folder = models / "keras"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.yaml").write_text(
        "name: keras\nonnx: keras.onnx\ntask: segment\ninput: {name: input, size: [32, 48], layout: nhwc}\n"
        f"preprocess: {{color: rgb, resize: stretch, mean: [0, 0, 0], std: [255, 255, 255]}}\n"
        f"postprocess: {post}\nlabels: {labels}\n")


@pytest.mark.parametrize("maps", [1, 3])
def test_a_channels_last_segmenter_gets_its_maps_read_channels_last(own, maps: int) -> None:
    cfg, models, images = own
    post = "{output: maps, output_layout: nhwc, activation: sigmoid}" if maps == 1 else \
        "{output: maps, output_layout: nhwc}"
    _keras_card(models, post, "[leaf]" if maps == 1 else "[background, leaf, sky]")
    _keras_segmenter(models / "keras" / "keras.onnx", maps)
    _thirds(images / "bands.png", [(0, 0, 255), (0, 255, 0), (255, 0, 0)])  # red, green, blue
    assert run_folder(dataclasses.replace(cfg, model="keras"), images).figures["done"] == 1
    mask = cv2.imread(str(cfg.outbox / "bands.png.mask.png"), cv2.IMREAD_UNCHANGED)
    assert mask.shape == (60, 90)
    if maps == 1:  # green minus red: the middle band
        assert (mask[:, 32:58] == 255).all() and (mask[:, :28] == 0).all() and (mask[:, 62:] == 0).all()
    else:  # each band its colour's class
        assert (mask[:, :28] == 0).all() and (mask[:, 32:58] == 1).all() and (mask[:, 62:] == 2).all()


@pytest.mark.parametrize("maps, post, looks", [
    (1, "{output: maps, activation: sigmoid}", "NHWC"), (3, "{output: maps}", "NHWC"),
    (None, "{output: logits, output_layout: nhwc}", "NCHW"),
])
def test_a_segmenter_whose_output_layout_is_the_other_one_is_refused_with_the_fix(
        own, maps: int | None, post: str, looks: str) -> None:
    cfg, models, images = own
    _keras_card(models, post, "[leaf]" if maps == 1 else "[background, leaf, sky]")
    if maps is None:  # channels first, (N, 3, 32, 48), under a card that says nhwc
        (models / "keras" / "model.yaml").write_text(
            (models / "keras" / "model.yaml").read_text().replace(", layout: nhwc", ""))
        _channels_model(models / "keras" / "keras.onnx", 3)
    else:
        _keras_segmenter(models / "keras" / "keras.onnx", maps)
    _thirds(images / "bands.png", [(0, 0, 255)] * 3)
    with pytest.raises(ModelError, match=rf"which looks {looks}: set postprocess.output_layout: {looks.lower()}"):
        run_folder(dataclasses.replace(cfg, model="keras"), images)


@pytest.mark.parametrize("shape, looks", [
    ((150, 64, 32), "nchw"), ((64, 32, 150), "nhwc"),  # 150 classes at a quarter of 256x128
    ((1, 64, 32), "nchw"), ((64, 32, 1), "nhwc"), ((63, 33, 2), "nhwc"),  # strided sizes, rounded
    ((64, 32), None), ((5, 5, 5), None),  # one plain map; no axis pair with the input's shape
])
def test_the_output_layout_is_told_by_the_axes_that_have_the_inputs_aspect(tmp_path: Path, shape, looks) -> None:
    from worker.tasks import adapter_for

    (tmp_path / "model.yaml").write_text("name: x\nonnx: x.onnx\ntask: segment\ninput: {size: [256, 128]}\n")
    assert adapter_for(load_card(tmp_path / "model.yaml"))._looks(np.zeros(shape, np.float32)) == looks


def _two_input_model(path: Path) -> None:
    """Inputs `input` (N, 3, 32, 48) and `sizes` (N, 3) float: the colour means times `sizes`."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("ReduceMean", ["input"], ["m"], axes=[2, 3], keepdims=0),
             helper.make_node("Mul", ["m", "sizes"], ["out"])]
    feeds = [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 32, 48]),
             helper.make_tensor_value_info("sizes", TensorProto.FLOAT, ["N", 3])]
    save_model(helper.make_graph(nodes, "two", feeds, [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 3])]),
          path)


@pytest.mark.parametrize("sizes, message", [
    # RT-DETR-style models also take the image sizes: onnxruntime would refuse each run for the input left out
    ("", r"two.onnx: the model has 2 inputs \('input' \['N', 3, 32, 48\], 'sizes' \['N', 3\]\); the worker feeds "
         r"the image tensor and, when the card names it, an input of image sizes \(.*name it in input.sizes\)"),
    # named, but not an input the worker can fill with (width, height)
    ("sizes", r"two.onnx: input 'sizes' \(the card's input.sizes\) is tensor\(float\) \['N', 3\]; the worker "
              r"gives image sizes as \(N, 2\) width and height"),
])
def test_a_model_with_a_second_input_the_worker_cannot_fill_is_refused_at_start(own, sizes: str, message: str) -> None:
    cfg, models, images = own
    card_file(models, "two", f"task: classify\ninput: {{name: input, size: [32, 48], sizes: '{sizes}'}}\n"
                              "labels: [a, b, c]")
    _two_input_model(models / "two" / "two.onnx")
    _thirds(images / "bands.png", [(0, 0, 255)] * 3)
    with pytest.raises(ModelError, match=message):
        run_folder(dataclasses.replace(cfg, model="two"), images)


def test_a_detector_that_takes_sizes_and_gives_boxes_scores_and_labels_apart(own) -> None:
    """The sizes input gets the network input's (width, height), so the boxes come in input pixels
    and map back to the original as any detector's; the three outputs make end2end's rows."""
    cfg, models, images = own
    folder = card_file(models, "deploy", "task: detect\n"
                        "input: {name: images, size: [32, 48], sizes: orig_target_sizes}\n"
                        "preprocess: {color: rgb, resize: stretch, mean: [0, 0, 0], std: [255, 255, 255]}\n"
                        "postprocess: {outputs: [boxes, scores, labels], layout: end2end, threshold: 0.5}\n"
                        "labels: [person, cup, car]")
    deploy_detector(folder / "deploy.onnx")
    cv2.imwrite(str(images / "white.png"), np.full((64, 96, 3), 255, np.uint8))  # twice the input
    cv2.imwrite(str(images / "dark.png"), np.full((64, 96, 3), 20, np.uint8))
    assert run_folder(dataclasses.replace(cfg, model="deploy"), images).figures["done"] == 2
    white = json.loads((cfg.outbox / "white.png.json").read_text())["boxes"]
    # the cup: 0.25-0.75 of (48, 32) = 12, 8, 36, 24 input pixels, x2 in the original; width and
    # height swapped would give 8, 12, 24, 36
    assert [(b["name"], b["xyxy"]) for b in white] == [("cup", [24, 16, 72, 48]), ("car", [0, 0, 48, 32])]
    assert [b["score"] for b in white] == pytest.approx([1.0, 0.9], abs=1e-3)
    dark = json.loads((cfg.outbox / "dark.png.json").read_text())["boxes"]
    assert [b["name"] for b in dark] == ["car"]


@pytest.mark.parametrize("outputs, message", [
    ("[boxes, sizes, labels]", r"no output named 'sizes' \(has \['labels', 'boxes', 'scores', 'whwh'\]\)"),
    ("[boxes, whwh]", r"outputs 'boxes' \[1, 3, 4\], 'whwh' \[1, 4\] cannot be joined: each must be \(N, K\) or "
                      r"\(N, K, d\) with the same N and K"),
])
def test_outputs_that_cannot_be_joined_stop_the_worker_at_start(own, outputs: str, message: str) -> None:
    cfg, models, images = own
    folder = card_file(models, "deploy", "task: detect\n"
                        "input: {name: images, size: [32, 48], sizes: orig_target_sizes}\n"
                        f"postprocess: {{outputs: {outputs}, layout: end2end}}")
    deploy_detector(folder / "deploy.onnx")
    _thirds(images / "bands.png", [(0, 0, 255)] * 3)
    with pytest.raises(ModelError, match=message):
        run_folder(dataclasses.replace(cfg, model="deploy"), images)
    assert not cfg.outbox.exists() or not list(cfg.outbox.rglob("*.json"))


def _instance_segmenter(path: Path, shape: tuple[int, int], coefficients: int) -> None:
    """output0 (N, *shape) and output1 (N, coefficients, 8, 12), as a YOLOv8-seg export gives its boxes'
    values (4 box values, the class scores, the mask coefficients: (N, values, 84) for 84 anchors;
    YOLOv5-seg's (N, 84, values)) and its prototype masks; the values are the image's mean level times
    fixed noise."""
    rng = np.random.default_rng(0)
    seg_model(path, np.zeros(shape, np.float32), rng.random(shape, dtype=np.float32),
               rng.random((coefficients, 8, 12), dtype=np.float32))


@pytest.mark.parametrize("layout, classes, coefficients, labels, said", [
    ("yolov8", 3, 32, "[a, b, c]", "holds 4 box values, 3 class scores and 32 mask coefficients"),
    ("yolov8", 3, 32, "[]", "holds 4 box values, then class scores and 32 mask coefficients"),
    ("yolov5", 2, 16, "[a, b]", "holds 5 box values, 2 class scores and 16 mask coefficients"),
])
def test_an_instance_segmenter_under_a_detector_s_card_without_masks_is_refused_saying_what_it_is(
        own, layout: str, classes: int, coefficients: int, labels: str, said: str) -> None:
    """A YOLOv8-seg export (boxes' rows of class scores and mask coefficients, and prototype masks) under
    a detector's card that does not name its prototype masks: before, `the card lists 3 labels, but
    output 'output0' (39, 84) has 35 classes`, and without labels its coefficients were read as 32 more
    classes."""
    cfg, models, images = own
    folder = card_file(models, "seg", "task: detect\ninput: {name: images, size: [32, 48]}\n"
                                       "preprocess: {color: rgb, resize: letterbox, mean: [0, 0, 0], "
                                       "std: [255, 255, 255]}\n"
                                       f"postprocess: {{output: output0, layout: {layout}}}\nlabels: {labels}")
    values = (5 if layout == "yolov5" else 4) + classes + coefficients
    shape = (84, values) if layout == "yolov5" else (values, 84)
    _instance_segmenter(folder / "seg.onnx", shape, coefficients)
    _thirds(images / "bands.png", [(0, 0, 255)] * 3)
    with pytest.raises(ModelError) as refused:
        run_folder(dataclasses.replace(cfg, model="seg"), images)
    assert str(refused.value) == (
        f"model 'seg': output 'output0' {shape} {said} for output 'output1' ['N', {coefficients}, 8, 12]: an "
        f"instance segmenter (as YOLOv8-seg exports); name that output in the card, postprocess.masks: output1, "
        f"for each box's mask")
    assert not cfg.outbox.exists() or not list(cfg.outbox.rglob("*.json"))

def _pose_rows() -> np.ndarray:
    """(56, 84) rows as a YOLOv8-pose export gives them: 4 box values, one class score (0-1), then 17
    keypoints of x, y (input pixels) and visibility (0-1), for 84 anchors, at random."""
    rng = np.random.default_rng(0)
    return np.concatenate([rng.uniform(4, 28, (4, 84)), rng.uniform(0, 1, (1, 84)),
                           *[np.concatenate([rng.uniform(0, 48, (1, 84)), rng.uniform(0, 32, (1, 84)),
                                             rng.uniform(0, 1, (1, 84))]) for _ in range(17)]]).astype(np.float32)


@pytest.mark.parametrize("labels, said", [
    ("[person]", "holds 4 box values, then the card's 1 class score and 51 more values, from [\\d.]+ to "
                 "4\\d\\.\\d+: keypoints, "
                 "as a pose model such as YOLOv8-pose gives them\\? Name their shape in the card \\(the model's "
                 "kpt_shape\\), postprocess.keypoints: \\[17, 3\\]"),
    ("[]", "holds 4 box values, then values from [\\d.]+ to 4\\d\\.\\d+ where class scores \\(0 to 1\\) should be: "
           "not a detector's rows as layout yolov8 reads them \\(a pose model's keypoints\\? postprocess.keypoints: "
           "\\[K, D\\] names them; an oriented box's angle\\? postprocess.obb: true; or scores before their "
           "sigmoid\\)"),
])
def test_a_pose_model_under_a_card_without_keypoints_is_refused_at_start_saying_what_to_add(
        own, labels: str, said: str) -> None:
    """A YOLOv8-pose export's rows read as a plain detector's: without labels, its
    keypoints' pixels would be taken for 52 classes' scores (an untrained yolov8n-pose export: 106 boxes on
    a photo, scored up to 314), and with its one label refused only as `has 52 classes`."""
    cfg, models, images = own
    folder = card_file(models, "pose", "task: detect\ninput: {name: input, size: [32, 48]}\n"
                                        "preprocess: {color: rgb, resize: letterbox, mean: [0, 0, 0], "
                                        "std: [255, 255, 255]}\n"
                                        f"postprocess: {{output: output0, layout: yolov8}}\nlabels: {labels}")
    rows = _pose_rows()
    rows_model(folder / "pose.onnx", rows[None], np.zeros_like(rows)[None])
    _thirds(images / "bands.png", [(0, 0, 255)] * 3)
    with pytest.raises(ModelError, match=rf"^model 'pose': output 'output0' \(56, 84\) {said}$"):
        run_folder(dataclasses.replace(cfg, model="pose"), images)
    assert not cfg.outbox.exists() or not list(cfg.outbox.rglob("*.json"))


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")  # pycocotools'
def test_a_pose_model_gives_each_box_its_keypoints(own) -> None:
    """A YOLOv8-pose export under a card naming its keypoints ([3, 3] here): each box gets its points in
    the original's pixels (twice the input here) with their visibility, in the JSON, Ultralytics' pose
    line, the overlay (the points seen, from 0.5) and COCO's keypoints; a card whose [K, D] does not fit
    the model is refused at start."""
    from pycocotools.coco import COCO

    cfg, models, images = own
    body = ("task: detect\ninput: {name: input, size: [32, 48]}\npreprocess: {color: rgb, resize: letterbox, "
            "mean: [0, 0, 0], std: [255, 255, 255]}\npostprocess: {output: output0, layout: yolov8, threshold: 0.5, "
            "keypoints: [3, 3]}\nlabels: [part]")
    folder = card_file(models, "pose", body)
    # anchor 0: a box on the top-left quadrant scored by the image's level, its 3 points (x, y, seen);
    # anchor 1: the bottom-right quadrant at 0.1, under the threshold
    anchors = np.array([[12, 8, 24, 16, 0.0, 6, 4, 0.9, 18, 12, 0.2, 30, 20, 0.95],
                        *[[36, 24, 24, 16, 0.1, 40, 30, 1.0, 41, 30, 1.0, 42, 30, 1.0]] * 20], np.float32)
    gate = np.zeros_like(anchors)
    gate[0, 4] = 1.0
    rows_model(folder / "pose.onnx", anchors.T[None], gate.T[None])
    cv2.imwrite(str(images / "white.png"), np.full((64, 96, 3), 255, np.uint8))  # twice the input: no padding
    cfg = dataclasses.replace(cfg, model="pose", outputs=dataclasses.replace(cfg.outputs, overlays=True,
                                                                              yolo_txt=True))
    assert run_folder(cfg, images).figures["done"] == 1

    (box,) = json.loads((cfg.outbox / "white.png.json").read_text())["boxes"]
    assert (box["name"], box["xyxy"]) == ("part", [0, 0, 48, 32])
    assert box["keypoints"] == [[12.0, 8.0, 0.9], [36.0, 24.0, 0.2], [60.0, 40.0, 0.95]]
    (line,) = (cfg.outbox / "white.png.txt").read_text().splitlines()
    assert line == ("0 0.250000 0.250000 0.500000 0.500000 0.125000 0.125000 0.900000 0.375000 0.375000 "
                    "0.200000 0.625000 0.625000 0.950000 1.0000")
    overlay = cv2.imread(str(cfg.outbox / "white.png.overlay.jpg")).astype(int)
    assert np.abs(overlay[40, 60] - 255).max() > 60  # a dot where a point is seen (0.95)
    assert np.abs(overlay[24, 36] - 255).max() < 30  # none at the one seen at 0.2

    db = open_db(cfg.db)
    try:
        exported = coco(db, Filters(model="pose"), ("part",), "detect", cfg.outbox)
    finally:
        db.dispose()
    (ann,) = exported["annotations"]
    assert ann["keypoints"] == [12.0, 8.0, 2, 36.0, 24.0, 1, 60.0, 40.0, 2] and ann["num_keypoints"] == 3
    assert ann["keypoint_scores"] == [0.9, 0.2, 0.95] and exported["categories"][0]["keypoints"] == ["1", "2", "3"]
    path = cfg.outbox / "coco.json"
    path.write_text(json.dumps(exported))
    assert COCO(str(path)).loadAnns(COCO(str(path)).getAnnIds())[0]["keypoints"][:3] == [12.0, 8.0, 2]

    # a card whose [K, D] is not the model's: a point too few leaves its values over, where a class
    # score would be; two values a point read visibilities as coordinates, and the reverse
    for shape, said in (("[2, 3]", r"the card's 1 class score and 3 more values, from 0.1 to 40, before the 6 that "
                                   r"postprocess.keypoints \[2, 3\] reads: the card's keypoints are not the model's"),
                        ("[4, 2]", r"the card's 1 class score and 1 more value, from 0.1 to 40, before the 8 that "),
                        ("[2, 2]", r"to 41, before the 4 that postprocess.keypoints \[2, 2\] reads"),
                        ("[1, 3]", r"to 41, before the 3 that postprocess.keypoints \[1, 3\] reads")):
        (folder / "model.yaml").write_text(f"name: pose\nonnx: pose.onnx\n{body.replace('[3, 3]', shape)}\n")
        with pytest.raises(ModelError, match=said):
            run_folder(cfg, images)


@pytest.mark.parametrize("layout", ["yolov8", "end2end"])
def test_an_oriented_box_detector_gives_each_box_its_angle_and_corners(own, layout: str) -> None:
    """A YOLOv8-obb export (or YOLO26-obb's NMS-free rows) under a card with `obb: true`: each box its
    centre, sides and angle in the original's pixels (twice the input here), its corners, and its bounding
    box as `xyxy`; the overlay draws it as it lies, `<rel>.txt` has Ultralytics' corner line, COCO its
    outline as segmentation. A plain detector's card on a YOLOv8-obb is refused, and so is `obb` on a
    model whose last value is no angle."""
    cfg, models, images = own
    body = ("task: detect\ninput: {name: input, size: [32, 48]}\npreprocess: {color: rgb, resize: letterbox, "
            f"mean: [0, 0, 0], std: [255, 255, 255]}}\npostprocess: {{output: output0, layout: {layout}, "
            "threshold: 0.5, obb: true}\nlabels: [part]")
    folder = card_file(models, "obb", body)
    # anchor 0: a 20x8 box at the input's centre turned by pi/6, scored by the image's level; the others
    # a box at 0.1, under the threshold
    anchors = np.array([[24, 16, 20, 8, 0.0, math.pi / 6], *[[10, 10, 8, 8, 0.1, -0.5]] * 20], np.float32)
    gate = np.zeros_like(anchors)
    gate[0, 4] = 1.0
    if layout == "end2end":  # YOLO26-obb's rows: cx, cy, w, h, score, class, angle
        anchors, gate = np.insert(anchors, 5, 0.0, axis=1), np.insert(gate, 5, 0.0, axis=1)
    rows, gate = (anchors.T, gate.T) if layout == "yolov8" else (anchors, gate)
    rows_model(folder / "obb.onnx", rows[None], gate[None])
    cv2.imwrite(str(images / "white.png"), np.full((64, 96, 3), 255, np.uint8))
    cfg = dataclasses.replace(cfg, model="obb", outputs=dataclasses.replace(cfg.outputs, overlays=True, yolo_txt=True))
    assert run_folder(cfg, images).figures["done"] == 1

    (box,) = json.loads((cfg.outbox / "white.png.json").read_text())["boxes"]
    c, s = math.cos(math.pi / 6), math.sin(math.pi / 6)
    corners = [[48 + sx * 20 * c - sy * 8 * s, 32 + sx * 20 * s + sy * 8 * c] for sx, sy in
               ((1, 1), (1, -1), (-1, -1), (-1, 1))]  # half sides 20 along the angle, 8 across it
    assert box["xywhr"] == [48.0, 32.0, 40.0, 16.0, round(math.pi / 6, 6)]
    assert np.allclose(box["corners"], corners, atol=0.01)
    assert np.allclose(box["xyxy"], [min(x for x, _ in corners), min(y for _, y in corners),
                                     max(x for x, _ in corners), max(y for _, y in corners)], atol=0.01)
    (line,) = (cfg.outbox / "white.png.txt").read_text().splitlines()
    values = [float(v) for v in line.split()]
    assert values[0] == 0 and values[-1] == 1.0
    assert np.allclose(np.reshape(values[1:-1], (4, 2)) * (96, 64), corners, atol=1e-3)
    overlay = cv2.imread(str(cfg.outbox / "white.png.overlay.jpg")).astype(int)
    on_edge = np.rint(np.mean(corners[:2], axis=0)).astype(int)  # the middle of its first side
    assert np.abs(overlay[on_edge[1], on_edge[0]] - 255).max() > 60
    assert np.abs(overlay[int(corners[0][1]) - 1, int(box["xyxy"][0]) + 1] - 255).max() < 30  # not its bounding box

    db = open_db(cfg.db)
    try:
        (ann,) = coco(db, Filters(model="obb"), ("part",), "detect", cfg.outbox)["annotations"]
    finally:
        db.dispose()
    assert np.allclose(np.reshape(ann["segmentation"], (4, 2)), corners, atol=0.01)
    assert ann["area"] == 640.0 and ann["xywhr"] == box["xywhr"]

    if layout == "end2end":
        return
    # the same model under a plain detector's card: its angle read as a class score
    (folder / "model.yaml").write_text(f"name: obb\nonnx: obb.onnx\n{body.replace(', obb: true', '')}\n")
    with pytest.raises(ModelError, match=r"the card's 1 class score and 1 more value, from -0.5 to 0.5236: an oriented "
                                         r"box's angle, as YOLOv8-obb gives it\? postprocess.obb: true reads it"):
        run_folder(cfg, images)
    anchors[1:, 5] = 3.0  # no angle: past 3pi/4
    rows_model(folder / "obb.onnx", anchors.T[None], gate[None])
    (folder / "model.yaml").write_text(f"name: obb\nonnx: obb.onnx\n{body}\n")
    with pytest.raises(ModelError, match=r"postprocess.obb reads each row's last value as its box's angle, -pi/4 to "
                                         r"3pi/4 radians as YOLOv8-obb gives it, but output 'output0' gives 0.5236 to "
                                         r"3 there"):
        run_folder(cfg, images)


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")  # pycocotools'
@pytest.mark.parametrize("layout", ["yolov8", "yolov5", "end2end"])
def test_an_instance_segmenter_gives_each_box_its_mask(own, layout: str) -> None:
    """A YOLOv8-seg (or YOLOv5-seg) export under a card naming its prototype masks: each box gets its mask,
    the coefficients' sum of the prototypes within the box, at the original size (twice the input here):
    one instance mask PNG (box k's pixels hold k + 1), each box's pixels in the JSON, the overlay, the
    database's mask path, and COCO's segmentation from it (polygons or RLE)."""
    from pycocotools import mask as coco_mask

    from tests.support.coco import rasterise

    cfg, models, images = own
    folder = card_file(models, "quad", "task: detect\ninput: {name: images, size: [32, 48]}\n"
                                        "preprocess: {color: rgb, resize: letterbox, mean: [0, 0, 0], "
                                        "std: [255, 255, 255]}\n"
                                        f"postprocess: {{output: output0, masks: output1, layout: {layout}, "
                                        f"threshold: 0.5}}\nlabels: [part, scratch]")
    quadrant_segmenter(folder / "quad.onnx", layout)
    cv2.imwrite(str(images / "white.png"), np.full((64, 96, 3), 255, np.uint8))  # twice the input: no padding
    cv2.imwrite(str(images / "dark.png"), np.full((64, 96, 3), 20, np.uint8))  # its part scores 20/255
    cfg = dataclasses.replace(cfg, model="quad", outputs=dataclasses.replace(cfg.outputs, overlays=True, yolo_txt=True))
    assert run_folder(cfg, images).figures["done"] == 2

    white = json.loads((cfg.outbox / "white.png.json").read_text())
    assert [(b["name"], b["xyxy"], b["mask_pixels"]) for b in white["boxes"]] == [
        ("part", [0, 0, 48, 32], 48 * 32), ("scratch", [48, 32, 96, 64], 48 * 32)]
    assert white["mask"] == "white.png.mask.png"
    instances = cv2.imread(str(cfg.outbox / "white.png.mask.png"), cv2.IMREAD_UNCHANGED)
    expected = np.zeros((64, 96), np.uint8)
    expected[:32, :48], expected[32:, 48:] = 1, 2  # each box's prototype, cropped to the box
    assert instances.dtype == np.uint8 and np.array_equal(instances, expected)
    # Ultralytics' segment lines: each mask's outline through its edge pixels' centres, normalised
    lines = [[float(v) for v in line.split()] for line in (cfg.outbox / "white.png.txt").read_text().splitlines()]
    corners = [[(0, 0), (0, 31), (47, 31), (47, 0)], [(48, 32), (48, 63), (95, 63), (95, 32)]]
    assert [(line[0], line[-1]) for line in lines] == [(0, 1.0), (1, 0.8)]
    for line, points in zip(lines, corners):
        assert np.allclose(np.reshape(line[1:-1], (-1, 2)) * (96, 64), points, atol=1e-4)
    dark = json.loads((cfg.outbox / "dark.png.json").read_text())
    assert [(b["name"], b["mask_pixels"]) for b in dark["boxes"]] == [("scratch", 48 * 32)]
    dark_mask = cv2.imread(str(cfg.outbox / "dark.png.mask.png"), cv2.IMREAD_UNCHANGED)
    assert np.array_equal(dark_mask, (expected == 2).astype(np.uint8))  # the one box is 1 there
    overlay = cv2.imread(str(cfg.outbox / "white.png.overlay.jpg"))
    assert overlay.shape == (64, 96, 3) and not np.array_equal(overlay[40, 80], overlay[10, 80])  # tinted, not

    db = open_db(cfg.db)
    try:
        rows = {r["rel_path"]: r for r in query_images(db, Filters(model="quad"))}
        assert rows["white.png"]["mask_path"] == "white.png.mask.png"
        exported = coco(db, Filters(model="quad"), ("part", "scratch"), "detect", cfg.outbox)
        as_rle = coco(db, Filters(model="quad"), ("part", "scratch"), "detect", cfg.outbox, rle=True)
    finally:
        db.dispose()
    white_id = rows["white.png"]["id"]
    shapes = [(a["category_id"], a["segmentation"], a["area"]) for a in exported["annotations"]
              if a["image_id"] == white_id]
    assert [(c, area) for c, _, area in shapes] == [(0, 48 * 32), (1, 48 * 32)]
    # what a COCO consumer reads back: pycocotools' rasterisation of the polygons, and of the RLE
    for k, (_, polygons, _) in enumerate(shapes):
        assert np.array_equal(rasterise(polygons, 64, 96), expected == k + 1)
    rles = [a["segmentation"] for a in as_rle["annotations"] if a["image_id"] == white_id]
    for k, rle in enumerate(rles):
        assert np.array_equal(coco_mask.decode(coco_mask.frPyObjects(rle, 64, 96)).astype(bool), expected == k + 1)


def test_overlapping_instance_masks_keep_the_better_box_s_pixels_and_follow_a_letterbox() -> None:
    """Where two boxes' masks overlap, the better box's holds; a letterboxed input's padding is left
    out when the masks are brought to the original (a 20x60 image in a 32x48 input: scale 0.8, 8 px
    of padding above and below)."""
    from worker.tasks.detect.masks import instance_masks
    from worker.tasks.preprocess import Geometry

    protos = np.full((1, 8, 12), 10.0, np.float32)  # one prototype, positive everywhere
    protos[0, :2] = -10.0  # but over the input's top 8 px: the padding
    geometry = Geometry(orig_hw=(20, 60), scale_x=0.8, scale_y=0.8, left=0.0, top=8.0)
    boxes = np.array([[10, 0, 40, 20], [0, 0, 30, 20]], np.float32)  # best first; they share x 10-30
    out = instance_masks(np.ones((2, 1), np.float32), protos, boxes, geometry, (32, 48))
    assert out.dtype == np.uint16 and out.shape == (20, 60)
    assert (out[:, 10:40] == 1).all() and (out[:, :10] == 2).all() and (out[:, 40:] == 0).all()
    # negative over the input's top 12 px: the padding and the image's first 4 px there, its first 5 rows
    protos[0, :3] = -10.0
    top = instance_masks(np.ones((1, 1), np.float32), protos, boxes[:1], geometry, (32, 48))
    assert top[:5].max() == 0 and (top[5:, 10:40] == 1).all() and top[:, :10].max() == 0


def test_a_card_s_prototype_masks_are_held_to_the_task_and_the_model(own, tmp_path: Path) -> None:
    cfg, models, images = own
    for body, message in (
            ("task: segment\npostprocess: {masks: output1}", "'postprocess.masks' names an instance segmenter's"),
            ("task: detect\npostprocess: {layout: detr, masks: output1}", "for a detector's layout yolov5, yolov8 "
                                                                          "or end2end"),
            ("task: detect\npostprocess: {output: output1, layout: yolov8, masks: output1}",
             "'postprocess.masks' names the prototype masks, a second output")):
        (tmp_path / "model.yaml").write_text(f"name: x\nonnx: x.onnx\n{body}\n")
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_card(tmp_path / "model.yaml")
    folder = card_file(models, "quad", "task: detect\ninput: {name: images, size: [32, 48]}\n"
                                        "postprocess: {output: output0, masks: protos, layout: yolov8}")
    quadrant_segmenter(folder / "quad.onnx", "yolov8")
    _thirds(images / "bands.png", [(0, 0, 255)] * 3)
    with pytest.raises(ModelError, match=re.escape("no output named 'protos' (has ['output0', 'output1'])")):
        run_folder(dataclasses.replace(cfg, model="quad"), images)


def _argmax_segmenter(path: Path, keepdims: int) -> None:
    """The 1x1 channel copy, then ArgMax over the channels: int64 class indices, (N, 1, 32, 48) or
    (N, 32, 48), as an export that ends in ArgMax gives them."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(3, dtype=np.float32).reshape(3, 3, 1, 1), "w")
    nodes = [helper.make_node("Conv", ["input", "w"], ["maps"], kernel_shape=[1, 1]),
             helper.make_node("ArgMax", ["maps"], ["classes"], axis=1, keepdims=keepdims)]
    shape = ["N", 1, 32, 48] if keepdims else ["N", 32, 48]
    graph = helper.make_graph(nodes, "argmax", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                              ["N", 3, 32, 48])],
                              [helper.make_tensor_value_info("classes", TensorProto.INT64, shape)], initializer=[w])
    save_model(graph, path)


@pytest.mark.parametrize("keepdims", [0, 1])
def test_a_segmenter_that_ends_in_argmax_gives_its_class_indices(own, keepdims: int) -> None:
    cfg, models, images = own
    _card(models, "idx", "task: segment\npostprocess: {output: classes}\nlabels: [background, leaf, sky]")
    _argmax_segmenter(models / "idx" / "idx.onnx", keepdims)
    _thirds(images / "bands.png", [(0, 0, 255), (0, 255, 0), (255, 0, 0)])  # red, green, blue: 0, 1, 2
    assert run_folder(dataclasses.replace(cfg, model="idx"), images).figures["done"] == 1
    classes = cv2.imread(str(cfg.outbox / "bands.png.mask.png"), cv2.IMREAD_UNCHANGED)
    assert classes.shape == (60, 90) and set(np.unique(classes)) == {0, 1, 2}
    assert (classes[:, :29] == 0).all() and (classes[:, 31:59] == 1).all() and (classes[:, 61:] == 2).all()
    doc = json.loads((cfg.outbox / "bands.png.json").read_text())
    assert [(c["name"], c["score"]) for c in doc["classes"]] == [("background", 1.0), ("leaf", 1.0), ("sky", 1.0)]
    assert doc["mask_fraction"] == pytest.approx(2 / 3, abs=0.03)


def test_an_activation_on_class_indices_is_refused(own) -> None:
    cfg, models, images = own
    _card(models, "idx", "task: segment\npostprocess: {output: classes, activation: softmax}")
    _argmax_segmenter(models / "idx" / "idx.onnx", 0)
    _thirds(images / "bands.png", [(0, 0, 255)] * 3)
    with pytest.raises(ModelError, match=r"output 'classes' is integer class indices \(int64\): 'activation: "
                                         r"softmax' cannot apply"):
        run_folder(dataclasses.replace(cfg, model="idx"), images)


def test_a_class_index_past_a_class_mask_fails_that_image_with_the_reason(tmp_path: Path) -> None:
    from worker.tasks import adapter_for
    from worker.tasks.preprocess import Geometry

    (tmp_path / "model.yaml").write_text("name: x\nonnx: x.onnx\ntask: segment\npostprocess: {output: classes}\n")
    seg = adapter_for(load_card(tmp_path / "model.yaml"))
    out = np.zeros((8, 8), np.int64)
    out[2, 2] = 300
    with pytest.raises(ValueError, match="class index 300 in output 'classes' is outside 0-255"):
        seg.postprocess(out, Geometry((16, 16), 0.5, 0.5))
    out[2, 2] = 7  # past the (absent) labels: named by number
    assert seg.postprocess(out, Geometry((16, 16), 0.5, 0.5)).names[7] == "7"


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_model_exported_with_a_fixed_batch_gets_padded_batches(own, dynamic: bool) -> None:
    """Exported with a batch of 4 (no dynamic axis): each image, even alone, gets its own result; the
    card's dynamic_batch cannot make batches the model refuses."""
    from onnx import TensorProto, helper

    cfg, models, images = own
    _card(models, "four", "task: classify\npostprocess: {output: probs, activation: none}\n"
                          "labels: [red, green, blue]")
    (models / "four" / "model.yaml").write_text((models / "four" / "model.yaml").read_text().replace(
        "dynamic_batch: true", f"dynamic_batch: {str(dynamic).lower()}"))
    nodes = [helper.make_node("GlobalAveragePool", ["input"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["probs"], axis=1)]
    image = helper.make_tensor_value_info("input", TensorProto.FLOAT, [4, 3, 32, 48])
    probs = helper.make_tensor_value_info("probs", TensorProto.FLOAT, [4, 3])
    graph = helper.make_graph(nodes, "four", [image], [probs])
    save_model(graph, models / "four" / "four.onnx")
    for name, bgr in (("r.png", (0, 0, 255)), ("g.png", (0, 255, 0)), ("b.png", (255, 0, 0))):
        cv2.imwrite(str(images / name), np.full((20, 30, 3), bgr, np.uint8))
    cfg = dataclasses.replace(cfg, model="four", pipeline=dataclasses.replace(cfg.pipeline, max_batch=8))
    assert run_folder(cfg, images).figures["done"] == 3
    for name, label in (("r.png", "red"), ("g.png", "green"), ("b.png", "blue")):
        assert json.loads((cfg.outbox / f"{name}.json").read_text())["labels"][0]["name"] == label


def test_a_keypoint_card_whose_visibilities_are_coordinates_is_refused(tmp_path: Path) -> None:
    """[K, 3] on a model whose points are [K', 2] with K x 3 = K' x 2 values: every third value read as a
    visibility is a coordinate (pixels); refused, or every point would be seen, at visibilities of
    hundreds. A card's [K, D] and where it applies are held to at load."""
    from worker.tasks import adapter_for

    card = tmp_path / "model.yaml"
    card.write_text("name: p\ntask: detect\nonnx: p.onnx\ninput: {name: images, size: [32, 48]}\n"
                    "preprocess: {resize: letterbox}\npostprocess: {layout: yolov8, keypoints: [2, 3]}\nlabels: [a]\n")
    rows = np.zeros((4 + 1 + 6, 50), np.float32)
    rows[5:] = 30.0  # three points of x and y at 30 px, where the card reads two of x, y and visibility
    with pytest.raises(ModelError, match=r"postprocess.keypoints \[2, 3\] reads every third keypoint value as a "
                                         r"visibility \(0 to 1\), but output '' gives up to 30 there"):
        adapter_for(load_card(card)).check_output(rows)
    rows[[7, 10]] = 0.5  # visibilities: the card fits
    adapter_for(load_card(card)).check_output(rows)
    for bad, said in (("keypoints: [17, 4]", r"'postprocess.keypoints' is \[K, D\]"),
                      ("keypoints: [17]", r"'postprocess.keypoints' is \[K, D\]"),
                      ("layout: detr, keypoints: [17, 3]", "for a detector's layout yolov5, yolov8 or end2end")):
        card.write_text(card.read_text().replace("layout: yolov8, keypoints: [2, 3]", bad))
        with pytest.raises(ConfigError, match=said):
            load_card(card)
        card.write_text(card.read_text().replace(bad, "layout: yolov8, keypoints: [2, 3]"))


@pytest.mark.parametrize("transposed", [False, True])
def test_an_end_to_end_pose_model_s_keypoints_follow_its_boxes(tmp_path: Path, transposed: bool) -> None:
    """YOLO26-pose's NMS-free rows: x1, y1, x2, y2, score, class, then the keypoints ((K, 6 + K x D), or
    its transpose): each kept box's points mapped back through the letterbox as its box is."""
    from worker.tasks import adapter_for
    from worker.tasks.preprocess import resize_for

    card_file = tmp_path / "model.yaml"
    card_file.write_text("name: p\ntask: detect\nonnx: p.onnx\ninput: {name: images, size: [32, 48]}\n"
                         "preprocess: {resize: letterbox}\npostprocess: {layout: end2end, threshold: 0.5, "
                         "keypoints: [2, 3]}\nlabels: [a, b]\n")
    card = load_card(card_file)
    rows = np.array([[8, 8, 24, 16, 0.9, 1, 10, 10, 0.8, 20, 14, 0.3],
                     [0, 8, 48, 24, 0.2, 0, 1, 9, 1.0, 2, 9, 1.0]], np.float32)  # the second under 0.5
    detector = adapter_for(card)
    output = rows.T.copy() if transposed else rows
    detector.check_output(output)
    _, geometry = resize_for(np.zeros((16, 48, 3), np.uint8), card.preprocess, (32, 48))  # 8 px above and below
    result = detector.postprocess(output, geometry)
    assert result.class_ids.tolist() == [1] and result.xyxy.tolist() == [[8, 0, 24, 8]]
    assert result.keypoints is not None and result.keypoints.tolist() == [[[10, 2, 0.800000011920929],
                                                                           [20, 6, 0.30000001192092896]]]


@pytest.mark.parametrize("float_resize", [True, False])
def test_an_rfdetr_export_gives_what_rfdetrs_own_inference_gives(own, samples: Path, float_resize: bool) -> None:
    """A model with RF-DETR's inputs and outputs (tests/support/rfdetr_like.py: `dets` and `labels`, 3 classes and
    the background slot) under the card docs/own-models.md gives for an RF-DETR, on four sample photos, against
    RF-DETR 1.11.2's own ONNX inference on the same model file (tests/data/make/rfdetr_reference.py): the same
    boxes, classes and scores, every query/class pair over 0.5, several queries giving two boxes, never one
    of the background slot. With `float_resize: true` (the card's) the image is resized as floats, as
    RF-DETR does, and every box is there to float32's noise; without it, OpenCV's 8-bit bilinear runs about
    0.1 of a level darker, which moves this untrained model's scores by up to 0.007: a pair that close to
    the threshold may fall either side of it."""
    import shutil

    from tests.support.rfdetr_like import IMAGES
    from tests.support.rfdetr_like import CARD, build

    cfg, models, images = own
    (models / "rfdetr-like").mkdir(parents=True)
    card = CARD.replace("float_resize: true", f"float_resize: {str(float_resize).lower()}")
    (models / "rfdetr-like" / "model.yaml").write_text(card)
    build(models / "rfdetr-like" / "rfdetr-like.onnx")
    for name in IMAGES:
        shutil.copy(samples / name, images / name)
    assert run_folder(dataclasses.replace(cfg, model="rfdetr-like"), images).figures["done"] == len(IMAGES)
    golden = np.load(Path(__file__).parent / "data" / "rfdetr_like.npz")
    score_tol, xy_tol = (1e-4, 0.01) if float_resize else (0.01, 1.0)  # the JSON's boxes are rounded to 0.01
    twice, score_off = 0, 0.0
    for name in IMAGES:
        boxes = json.loads((cfg.outbox / f"{name}.json").read_text())["boxes"]
        got = [(b["class_id"], b["score"], np.array(b["xyxy"])) for b in boxes]
        assert [s for _, s, _ in got] == sorted((s for _, s, _ in got), reverse=True)  # best first
        assert {b["name"] for b in boxes} <= {"a", "b", "c"}  # no background slot
        xyxys = [tuple(b["xyxy"]) for b in boxes]
        twice += len(xyxys) - len(set(xyxys))  # one query's box, given for two classes
        wanted = list(zip(golden[f"{name}/class_id"].tolist(), golden[f"{name}/score"].tolist(),
                          golden[f"{name}/xyxy"]))
        for c, s, xyxy in wanted:
            near = [g for g in got if g[0] == c and np.abs(g[2] - xyxy).max() <= xy_tol and abs(g[1] - s) <= score_tol]
            if not near:
                assert not float_resize and abs(s - 0.5) < 0.01, \
                    f"{name}: RF-DETR's class {c} box {xyxy} at {s:.4f} is missing"
                continue
            score_off = max(score_off, abs(near[0][1] - s))
            got.remove(near[0])
        assert not float_resize and all(abs(s - 0.5) < 0.01 for _, s, _ in got) or not got, \
            f"{name}: boxes RF-DETR does not give: {got}"
    assert twice >= 5
    assert (score_off < 1e-5) == float_resize  # the 8-bit resize is what moved the scores


def test_an_rfdetr_seg_export_gives_each_box_its_querys_mask(own, samples: Path) -> None:
    """RF-DETR-Seg's three outputs (`dets`, `labels`, `masks`: each query's mask logits) through `worker run`:
    each box gets its query's mask, resized to the photo, in the mask PNG and as its `mask_pixels`; a query
    giving two boxes paints its mask once, for its better class."""
    import shutil

    from tests.support.rfdetr_like import CARD, build

    cfg, models, images = own
    (models / "rfdetr-like").mkdir(parents=True)
    (models / "rfdetr-like" / "model.yaml").write_text(
        CARD.replace("layout: detr", "masks: masks, layout: detr"))
    build(models / "rfdetr-like" / "rfdetr-like.onnx", masks=True)
    shutil.copy(samples / "coffee.png", images / "coffee.png")
    assert run_folder(dataclasses.replace(cfg, model="rfdetr-like"), images).figures["done"] == 1
    document = json.loads((cfg.outbox / "coffee.png.json").read_text())
    painted = cv2.imread(str(cfg.outbox / document["mask"]), cv2.IMREAD_UNCHANGED)
    assert painted.shape == (400, 600)
    boxes = document["boxes"]
    assert len(boxes) == 48 and sum(b["mask_pixels"] > 0 for b in boxes) >= 40
    for k, b in enumerate(boxes):
        assert b["mask_pixels"] == int((painted == k + 1).sum())
    first: dict[tuple[float, ...], int] = {}
    for k, b in enumerate(boxes):  # the worse of a query's two boxes has nothing left to paint
        if tuple(b["xyxy"]) in first:
            assert b["mask_pixels"] == 0 and boxes[first[tuple(b["xyxy"])]]["mask_pixels"] > 0
        first.setdefault(tuple(b["xyxy"]), k)
    assert len(first) < len(boxes)
