"""`preprocess.rect`: Ultralytics' rectangular letterbox (each side padded to a multiple of the stride, not to
a square) for models of dynamic height and width, held to Ultralytics' own predict() on such an export
(tests/data/ultralytics_rect.npz, made by tests/data/make/ultralytics_rect.py): the same network input size
for each image and the same boxes, scores and classes, in one process and with prepare processes, in
batches that mix image shapes."""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from tests.conftest import ROOT
from tests.support.cli import config_file, main_as_command
from tests.support.onnx_models import card_file, rect_detector, rows_model
from worker.config import Config
from worker.errors import ConfigError, ModelError
from worker.models.card import load_card
from worker.service import run_folder
from worker.tasks.preprocess import prepare

GOLDEN = np.load(ROOT / "tests" / "data" / "ultralytics_rect.npz")
CARD = ("task: detect\ninput: {name: images, size: [320, 320], dynamic_batch: true}\n"
        "preprocess: {resize: letterbox, rect: %s}\n"
        "postprocess: {output: output0, layout: yolov8, threshold: 0.25, iou: 0.7}\nlabels: [square, round]")


def _read(samples: Path, name: str) -> np.ndarray:
    if name == "portrait.png":  # as the golden's maker turns it
        return cv2.rotate(cv2.imread(str(samples / "chelsea.png")), cv2.ROTATE_90_CLOCKWISE)
    return cv2.imread(str(samples / name))


@pytest.fixture
def rect(tmp_path: Path, cfg: Config, samples: Path) -> tuple[Config, Path]:
    models = tmp_path / "models"
    rect_detector(card_file(models, "rect", CARD % "true") / "rect.onnx")
    rect_detector(card_file(models, "square", CARD % "false") / "square.onnx")
    images = tmp_path / "images"
    images.mkdir()
    for name in GOLDEN["images"]:
        cv2.imwrite(str(images / str(name)), _read(samples, str(name)))  # PNGs: the pixels Ultralytics read
    return dataclasses.replace(cfg, models_dir=models, model="rect"), images


def _boxes(outbox: Path, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    boxes = json.loads((outbox / f"{name}.json").read_text())["boxes"]
    return (np.array([b["xyxy"] for b in boxes], np.float64).reshape(-1, 4), np.array([b["score"] for b in boxes]),
            np.array([b["class_id"] for b in boxes]))


def _assert_as_ultralytics(outbox: Path) -> None:
    for name in map(str, GOLDEN["images"]):
        stem = Path(name).stem
        xyxy, scores, classes = _boxes(outbox, name)
        assert len(xyxy) == len(GOLDEN[f"{stem}_xyxy"]), name
        order = np.argsort(-GOLDEN[f"{stem}_conf"], kind="stable")  # the worker's boxes come best first
        np.testing.assert_allclose(xyxy, GOLDEN[f"{stem}_xyxy"][order], atol=0.01, err_msg=name)
        np.testing.assert_allclose(scores, GOLDEN[f"{stem}_conf"][order], atol=1e-4, err_msg=name)
        assert classes.tolist() == GOLDEN[f"{stem}_cls"][order].astype(int).tolist(), name


def test_each_image_gets_the_input_size_ultralytics_gives_it(samples: Path) -> None:
    card = load_card(ROOT / "models" / "yolov3-tiny" / "model.yaml")
    spec = dataclasses.replace(card.preprocess, rect=True)
    for name in map(str, GOLDEN["images"]):
        x, geo = prepare(_read(samples, name), spec, (320, 320))
        want = tuple(GOLDEN[f"{Path(name).stem}_input_hw"])
        assert x.shape[1:] == want and geo.input_hw == want, name


@pytest.mark.parametrize("processes, max_batch", [(1, 1), (1, 6), (2, 6)])
def test_boxes_match_ultralytics_predict(rect: tuple[Config, Path], processes: int, max_batch: int) -> None:
    cfg, images = rect
    # one inference thread, whose batches close at 6 images or after 3 s: in one process, the six images go
    # as one batch of three shapes
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, processes=processes,
                                                                max_batch=max_batch, max_delay_ms=3000,
                                                                infer_workers=1))
    assert run_folder(cfg, images).figures["done"] == len(GOLDEN["images"])
    _assert_as_ultralytics(cfg.outbox)
    with sqlite3.connect(cfg.db.removeprefix("sqlite:///")) as db:
        sizes = sorted(n for (n,) in db.execute("SELECT batch_size FROM timings"))
    if (processes, max_batch) == (1, 6):  # run in groups of one shape: 4 wide, 1 square, 1 tall
        assert sizes == [1, 1, 4, 4, 4, 4]


def test_a_square_letterbox_gives_other_boxes_on_the_same_export(rect: tuple[Config, Path]) -> None:
    cfg, images = rect
    cfg = dataclasses.replace(cfg, model="square")
    assert run_folder(cfg, images).figures["done"] == len(GOLDEN["images"])
    with pytest.raises(AssertionError):
        _assert_as_ultralytics(cfg.outbox)
    xyxy, _, _ = _boxes(cfg.outbox, "astronaut.png")  # a square image is boxed the same either way
    np.testing.assert_allclose(xyxy, GOLDEN["astronaut_xyxy"][np.argsort(-GOLDEN["astronaut_conf"])], atol=0.01)


def test_rect_is_refused_for_a_model_of_fixed_size_and_without_a_letterbox(tmp_path: Path, cfg: Config) -> None:
    models = tmp_path / "models"
    folder = card_file(models, "fixed", "task: detect\ninput: {name: input, size: [32, 48]}\n"
                                        "preprocess: {resize: letterbox, rect: true}\n"
                                        "postprocess: {output: output0, layout: yolov8}\nlabels: [a, b]")
    rows_model(folder / "fixed.onnx", np.zeros((1, 6, 4), np.float32), np.zeros((1, 6, 4), np.float32))
    (tmp_path / "images").mkdir()
    with pytest.raises(ModelError, match=r"preprocess.rect gives each image an input of its own aspect, but input "
                                         r"'input' \['N', 3, 32, 48\] takes 32x48 only: leave rect out"):
        run_folder(dataclasses.replace(cfg, models_dir=models, model="fixed"), tmp_path / "images")
    stretched = card_file(models, "stretched", CARD.replace("resize: letterbox", "resize: stretch") % "true")
    with pytest.raises(ConfigError, match="'preprocess.rect' pads a letterbox to a multiple of the stride: it needs "
                                          "'preprocess.resize: letterbox', got stretch"):
        load_card(stretched / "model.yaml")


def test_models_init_writes_rect_for_a_dynamic_export_and_its_card_matches_ultralytics(
        rect: tuple[Config, Path], tmp_path: Path) -> None:
    cfg, images = rect
    conf = config_file(tmp_path, cfg.models_dir)
    out = CliRunner().invoke(main_as_command, ["--config", str(conf), "models", "init", "mine", "--onnx",
                                               str(cfg.models_dir / "rect" / "rect.onnx")])
    assert out.exit_code == 0, out.output
    card = yaml.safe_load((cfg.models_dir / "mine" / "model.yaml").read_text())
    assert card["preprocess"]["rect"] is True and card["preprocess"]["stride"] == 32
    assert card["postprocess"]["iou"] == 0.7 and card["postprocess"]["threshold"] == 0.25  # predict()'s defaults
    assert run_folder(dataclasses.replace(cfg, model="mine"), images).figures["done"] == len(GOLDEN["images"])
    _assert_as_ultralytics(cfg.outbox)


def test_a_square_letterbox_on_a_dynamic_ultralytics_export_is_warned(rect: tuple[Config, Path],
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    cfg, images = rect
    with caplog.at_level(logging.WARNING, logger="worker"):
        run_folder(dataclasses.replace(cfg, model="square"), images)
    assert "model 'square': its Ultralytics export is of dynamic height and width, which predict() letterboxes to " \
           "a multiple of its stride (32), not to a square: set preprocess.rect: true" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="worker"):
        run_folder(cfg, images)
    assert "preprocess.rect" not in caplog.text


def test_the_parity_check_names_rect_for_a_tensor_of_ultralytics_rect_shape(rect: tuple[Config, Path],
                                                                              tmp_path: Path) -> None:
    """What Ultralytics' LetterBox(auto=True) feeds a dynamic export, as a user saves it, against each card."""
    cfg, images = rect
    conf = config_file(tmp_path, cfg.models_dir)
    image = cv2.imread(str(images / "chelsea.png"))
    h, w = image.shape[:2]
    s = min(320 / h, 320 / w)
    nh, nw = round(h * s), round(w * s)
    th, tw = nh + (320 - nh) % 32, nw + (320 - nw) % 32
    boxed = np.full((th, tw, 3), 114, np.uint8)  # Ultralytics' LetterBox(auto=True, stride=32), centred
    top, left = (th - nh) // 2, (tw - nw) // 2
    boxed[top:top + nh, left:left + nw] = cv2.resize(image, (nw, nh), interpolation=cv2.INTER_LINEAR)
    x = boxed[..., ::-1].transpose(2, 0, 1)[None].astype(np.float32) / 255
    assert x.shape[2:] == tuple(GOLDEN["chelsea_input_hw"])
    np.save(tmp_path / "yours.npy", x)
    for model, code, said in (("rect", 0, "input: PASS"),
                              ("square", 2, "shape (1, 3, 224, 320) is a letterbox padded to a multiple of 32, not "
                                            "to [320, 320] (Ultralytics' rect, for an export of dynamic height and "
                                            "width): set preprocess.rect: true")):
        out = CliRunner().invoke(main_as_command, ["--config", str(conf), "models", "check", model, "--image",
                                                   str(images / "chelsea.png"), "--expect-input",
                                                   str(tmp_path / "yours.npy")])
        assert out.exit_code == code and said in out.output, out.output
    # a square image: its rect letterbox is the square card's own size, which holds (it was refused, told to set
    # preprocess.rect, which the start then refuses for this card)
    square = cv2.resize(cv2.imread(str(images / "astronaut.png")), (320, 320), interpolation=cv2.INTER_AREA)
    cv2.imwrite(str(tmp_path / "square.png"), square)
    np.save(tmp_path / "square.npy", square[..., ::-1].transpose(2, 0, 1)[None].astype(np.float32) / 255)
    out = CliRunner().invoke(main_as_command, ["--config", str(conf), "models", "check", "square", "--image",
                                               str(tmp_path / "square.png"), "--expect-input",
                                               str(tmp_path / "square.npy")])
    assert out.exit_code == 0 and "input: PASS" in out.output, out.output
