"""worker/models/exported.py: a card held to what an Ultralytics export's metadata says the model is."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from worker.errors import ModelError
from worker.models.card import load_card
from worker.models.exported import check_exported

ULTRALYTICS = {"author": "Ultralytics", "version": "8.4.190", "end2end": "False", "stride": "32"}


def _card(tmp_path: Path, postprocess: str, task: str = "detect"):
    (tmp_path / "model.yaml").write_text(f"name: m\ntask: {task}\nonnx: m.onnx\ninput: {{name: images, size: [32, 48]}}\n"
                                         f"postprocess: {{{postprocess}}}\n")
    return load_card(tmp_path / "model.yaml")


@pytest.mark.parametrize("meta, postprocess, said", [
    ({"task": "detect"}, "output: output0",  # no layout: the card's default, yolov5's, would misread every row
     "m.onnx is an Ultralytics detect model (its metadata), whose rows are YOLOv8's (4 box values then each "
     "class's score, no objectness): postprocess.layout: yolov8 reads them (layout: detr for an RT-DETR)"),
    ({"task": "pose", "kpt_shape": "[17, 3]"}, "layout: yolov8",
     "m.onnx is an Ultralytics pose model (its metadata), of keypoints [17, 3], and the card names none: "
     "postprocess.keypoints: [17, 3]"),
    ({"task": "pose", "kpt_shape": "[17, 3]"}, "layout: yolov8, keypoints: [17, 2]",
     "of keypoints [17, 3], and its postprocess.keypoints are [17, 2]: postprocess.keypoints: [17, 3]"),
    ({"task": "detect"}, "layout: yolov8, keypoints: [17, 3]",
     "an Ultralytics detect model (its metadata), without keypoints: the card's postprocess.keypoints reads what "
     "is not there"),
    ({"task": "obb"}, "layout: yolov8", "an Ultralytics obb model (its metadata): postprocess.obb: true reads its "
                                        "boxes' angles"),
    ({"task": "detect"}, "layout: yolov8, obb: true", "postprocess.obb is an oriented-box model's: leave it out"),
    ({"task": "detect", "end2end": "True"}, "layout: yolov8",
     "whose boxes come suppressed already (end2end): layout: end2end reads them, not yolov8"),
    ({"task": "classify"}, "layout: yolov8", "the card says task: detect, where task: classify reads it"),
])
def test_a_card_that_contradicts_its_ultralytics_export_is_refused_with_the_line_to_write(
        tmp_path: Path, meta: dict, postprocess: str, said: str) -> None:
    with pytest.raises(ModelError, match=re.escape(said)) as refused:
        check_exported(_card(tmp_path, postprocess), {**ULTRALYTICS, **meta}, tmp_path / "m.onnx")
    assert str(refused.value).startswith("model 'm': m.onnx is an Ultralytics ")


@pytest.mark.parametrize("meta, postprocess, task", [
    ({"task": "pose", "kpt_shape": "[17, 3]"}, "layout: yolov8, keypoints: [17, 3]", "detect"),
    ({"task": "obb"}, "layout: yolov8, obb: true", "detect"),
    ({"task": "segment"}, "layout: yolov8, masks: output1", "detect"),
    ({"task": "detect", "end2end": "True"}, "layout: end2end", "detect"),
    ({"task": "detect"}, "layout: detr", "detect"),  # an RT-DETR export: its own layout
    ({"task": "classify"}, "top_k: 3", "classify"),
    ({"task": "semantic"}, "threshold: 0.5", "segment"),  # a task this worker does not know: not judged
    ({"task": "pose", "author": "someone else"}, "layout: yolov8", "detect"),  # not Ultralytics' metadata
    ({}, "layout: yolov8", "detect"),
])
def test_a_card_that_fits_its_export_or_another_exporter_s_file_passes(tmp_path: Path, meta: dict, postprocess: str,
                                                                       task: str) -> None:
    check_exported(_card(tmp_path, postprocess, task), {**ULTRALYTICS, **meta}, tmp_path / "m.onnx")


def test_a_real_export_s_metadata_stops_the_worker_at_start(cfg, tmp_path: Path) -> None:
    """The metadata read from the ONNX file itself: a hand-built pose model that says what Ultralytics
    writes (task pose, kpt_shape [3, 3]), under a card without keypoints, is refused before any image."""
    from worker.service import run_folder

    _own_export(tmp_path / "models", "pose", np.zeros((4 + 1 + 9, 21), np.float32), "\nlabels: [a]",
                {"task": "pose", "kpt_shape": "[3, 3]"})
    (images := tmp_path / "images").mkdir()
    (images / "a.png").write_bytes(b"")
    with pytest.raises(ModelError, match=r"pose.onnx is an Ultralytics pose model \(its metadata\), of keypoints "
                                         r"\[3, 3\], and the card names none: postprocess.keypoints: \[3, 3\]"):
        run_folder(dataclasses.replace(cfg, models_dir=tmp_path / "models", model="pose"), images)
    assert not (cfg.outbox / "a.png.error.json").exists()  # no image was taken


def test_an_export_s_class_names_are_read_in_class_order_or_not_at_all() -> None:
    from worker.models.exported import exported_labels

    assert exported_labels({**ULTRALYTICS, "names": "{1: 'scratch', 0: 'dent', 2: \"o'ring\"}"}) == (
        "dent", "scratch", "o'ring")
    for names in ("{0: 'a', 2: 'c'}", "['a', 'b']", "{0: 'a'", "__import__('os')", ""):  # not one per class
        assert exported_labels({**ULTRALYTICS, "names": names}) == ()
    assert exported_labels({"names": "{0: 'a'}"}) == ()  # another exporter's: not Ultralytics' format


def test_an_export_s_keypoint_names_are_read_when_every_class_names_the_k_points_alike() -> None:
    from worker.models.exported import exported_keypoint_names

    assert exported_keypoint_names({**ULTRALYTICS, "kpt_names": "{0: ['nose', 'left_eye']}"}, 2) == ("nose", "left_eye")
    assert exported_keypoint_names({**ULTRALYTICS, "kpt_names": "{0: ['a', 'b'], 1: ['a', 'b']}"}, 2) == ("a", "b")
    for names in ("{0: ['a', 'b'], 1: ['b', 'a']}", "{0: ['a']}", "{0: 'ab'}", "{}", "['a', 'b']", "{0: ['a'",
                  "__import__('os')", ""):  # classes that differ, not K names, not Ultralytics' format
        assert exported_keypoint_names({**ULTRALYTICS, "kpt_names": names}, 2) == (), names
    assert exported_keypoint_names({"kpt_names": "{0: ['a', 'b']}"}, 2) == ()  # another exporter's


def test_a_pose_export_s_keypoint_names_name_its_points_in_the_results_and_coco(cfg, tmp_path: Path) -> None:
    """A card of one's own YOLOv8-pose export without keypoint names: the result document names the
    points as the export's metadata does (kpt_names, from its dataset's yaml), once for all boxes, and
    COCO export's category lists them (not numbered "1", "2", "3"), as `models check`
    does; the card's own keypoint_names win over the export's."""
    import cv2
    from click.testing import CliRunner

    from worker.cli import cli
    from worker.outputs.coco import coco
    from worker.service import run_folder
    from worker.store.db import open_db
    from worker.store.queries import Filters

    rows = np.zeros((4 + 1 + 9, 21), np.float32)  # anchor 0: a box at 0.9 with its 3 points; the rest nothing
    rows[:, 0] = [24, 16, 20, 10, 0.9, 20, 12, 0.9, 24, 16, 0.8, 28, 20, 0.7]
    models = tmp_path / "models"
    _own_export(models, "pose", rows, "\nlabels: [part]",
                {"task": "pose", "kpt_shape": "[3, 3]", "kpt_names": "{0: ['tip', 'joint', 'base']}"})
    card = models / "pose" / "model.yaml"
    card.write_text(card.read_text().replace("layout: yolov8}", "layout: yolov8, keypoints: [3, 3]}"))
    (images := tmp_path / "images").mkdir()
    cv2.imwrite(str(images / "a.png"), np.zeros((32, 48, 3), np.uint8))
    c = dataclasses.replace(cfg, models_dir=models, model="pose")
    for names in (["tip", "joint", "base"], ["a", "b", "c"]):
        assert run_folder(c, images).figures["done"] == 1
        doc = json.loads((c.outbox / "a.png.json").read_text())
        assert doc["keypoint_names"] == names and len(doc["boxes"][0]["keypoints"]) == 3
        db = open_db(c.db)
        try:
            (category,) = coco(db, Filters(model="pose"), ("part",), "detect", c.outbox)["categories"]
        finally:
            db.dispose()
        assert category == {"id": 0, "name": "part", "keypoints": names}
        conf = tmp_path / "config.yaml"
        conf.write_text(f"models_dir: {models}\ncache_dir: {c.cache_dir}\ndb: {c.db}\n")
        checked = CliRunner().invoke(cli, ["--config", str(conf), "models", "check", "pose"])
        assert f"its 3 keypoints of x, y and visibility, named {', '.join(names)}\n" in checked.output, checked.output
        card.write_text(card.read_text().replace("keypoints: [3, 3]}", "keypoints: [3, 3], keypoint_names: [a, b, c]}"))


def test_a_card_without_labels_takes_the_export_s_class_names(cfg, tmp_path: Path) -> None:
    """A card of one's own YOLOv8 export with no labels: the boxes are named as the model's metadata
    names its classes (not by number: "1"), in the JSON and the database's label index."""
    import cv2

    from worker.service import run_folder
    from worker.store.db import open_db
    from worker.store.queries import Filters, query_images

    rows = np.zeros((4 + 2, 21), np.float32)  # anchor 0: a box of class 1 at 0.9; the rest nothing
    rows[:, 0] = [24, 16, 20, 10, 0.0, 0.9]
    _own_export(tmp_path / "models", "own", rows, "", {"task": "detect", "names": "{0: 'dent', 1: 'scratch'}"})
    (images := tmp_path / "images").mkdir()
    cv2.imwrite(str(images / "a.png"), np.zeros((32, 48, 3), np.uint8))
    c = dataclasses.replace(cfg, models_dir=tmp_path / "models", model="own")
    assert run_folder(c, images).figures["done"] == 1
    (box,) = json.loads((c.outbox / "a.png.json").read_text())["boxes"]
    assert (box["class_id"], box["name"]) == (1, "scratch")
    db = open_db(c.db)
    try:
        assert [r["rel_path"] for r in query_images(db, Filters(label="scratch"))] == ["a.png"]
    finally:
        db.dispose()


def _own_export(models: Path, name: str, rows: np.ndarray, more: str, metadata: dict[str, str]) -> None:
    """models/<name>: a card of a YOLOv8 detector on a 32x48 letterboxed input (`more` added to it) and
    a model giving the fixed `rows` (values, anchors) whose file carries Ultralytics' `metadata`."""
    from tests.support.onnx_models import card_file, rows_model

    folder = card_file(models, name, "task: detect\ninput: {name: input, size: [32, 48]}\npreprocess: "
                                      f"{{resize: letterbox}}\npostprocess: {{output: output0, layout: yolov8}}{more}")
    rows_model(folder / f"{name}.onnx", rows[None], np.zeros_like(rows)[None])
    _add_metadata(folder / f"{name}.onnx", {**ULTRALYTICS, **metadata})


def _add_metadata(path: Path, metadata: dict[str, str]) -> None:
    """Write `metadata` into an ONNX file's metadata_props, as an exporter does."""
    import onnx

    model = onnx.load(str(path))
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(path))


def test_a_card_s_preprocessing_that_parts_from_its_export_is_said(tmp_path: Path) -> None:
    """Results that would differ, not fail: imgsz, the letterbox, RGB and /255 of an Ultralytics export."""
    from worker.models.exported import exported_warnings

    meta = {**ULTRALYTICS, "task": "detect", "imgsz": "[320, 320]"}
    (tmp_path / "model.yaml").write_text(
        "name: m\ntask: detect\nonnx: m.onnx\ninput: {name: images, size: [224, 224]}\n"
        "preprocess: {color: bgr, resize: stretch, mean: [0, 0, 0], std: [255, 255, 255]}\n"
        "postprocess: {layout: yolov8}\n")
    said = exported_warnings(load_card(tmp_path / "model.yaml"), meta)
    assert [w.split(": set ")[-1] for w in said] == ["input.size: [320, 320] (at another size its scores and boxes "
                                                     "differ from training's)",
                                                     "preprocess.resize: letterbox and pad_value: 114",
                                                     "preprocess.color: rgb"]
    (tmp_path / "model.yaml").write_text(
        "name: m\ntask: detect\nonnx: m.onnx\ninput: {name: images, size: [320, 320]}\n"
        "preprocess: {resize: letterbox, mean: [0, 0, 0], std: [255, 255, 255]}\npostprocess: {layout: yolov8}\n")
    assert exported_warnings(load_card(tmp_path / "model.yaml"), meta) == []
    assert exported_warnings(load_card(tmp_path / "model.yaml"), {"task": "detect"}) == []  # not Ultralytics'
