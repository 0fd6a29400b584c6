"""worker/models/exported.py: a card held to what an Ultralytics export's metadata says the model is."""

from __future__ import annotations

import dataclasses
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
    import onnx

    from tests.test_own_models import _card_file, _rows_model
    from worker.service import run_folder

    rows = np.zeros((4 + 1 + 9, 21), np.float32)
    folder = _card_file(tmp_path / "models", "pose", "task: detect\ninput: {name: input, size: [32, 48]}\n"
                                                     "preprocess: {resize: letterbox}\n"
                                                     "postprocess: {output: output0, layout: yolov8}\nlabels: [a]")
    _rows_model(folder / "pose.onnx", rows[None], np.zeros_like(rows)[None])
    model = onnx.load(str(folder / "pose.onnx"))
    for key, value in {**ULTRALYTICS, "task": "pose", "kpt_shape": "[3, 3]"}.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(folder / "pose.onnx"))
    (images := tmp_path / "images").mkdir()
    (images / "a.png").write_bytes(b"")
    with pytest.raises(ModelError, match=r"pose.onnx is an Ultralytics pose model \(its metadata\), of keypoints "
                                         r"\[3, 3\], and the card names none: postprocess.keypoints: \[3, 3\]"):
        run_folder(dataclasses.replace(cfg, models_dir=tmp_path / "models", model="pose"), images)
    assert not (cfg.outbox / "a.png.error.json").exists()  # no image was taken
