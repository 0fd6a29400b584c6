"""`worker models check NAME --images DIR --expect-results FILE`: the worker's final results for a folder held to
"your framework's": played by the independent reference runtimes' outputs kept in tests/data/reference/
(PyTorch's top-5 for EfficientNet-Lite0, Darknet's boxes for YOLOv3-tiny, MediaPipe's masks for the selfie
segmenter), written in each documented format; and the same with one result planted wrong."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import REFERENCE
from tests.support.cli import config_file, main_as_command

CLASSIFY = json.loads((REFERENCE / "efficientnet_lite0.json").read_text())["images"]
DETECT = json.loads((REFERENCE / "yolov3_tiny.json").read_text())["images"]
SEGMENT = json.loads((REFERENCE / "selfie.json").read_text())["images"]


def _check(tmp_path: Path, model: str, images: Path, expected: Path, *args: str) -> tuple[int, str]:
    out = CliRunner().invoke(main_as_command, ["--config", str(config_file(tmp_path)), "models", "check", model,
                                               "--images", str(images), "--expect-results", str(expected), *args])
    return out.exit_code, out.output


def _folder(tmp_path: Path, samples: Path, names) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    for name in names:
        shutil.copy(samples / name, folder / name)
    return folder


def test_a_classifier_s_top5_in_json_and_csv(tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    images = _folder(tmp_path, samples, CLASSIFY)
    by_name = tmp_path / "top5.json"  # names, best first
    by_name.write_text(json.dumps({k: [t["name"] for t in v["top5"]] for k, v in CLASSIFY.items()}))
    code, said = _check(tmp_path, "efficientnet-lite0", images, by_name)
    assert code == 0 and f"top-1 agreement {len(CLASSIFY)}/{len(CLASSIFY)} (100.0%), top-5 overlap 100.0%: PASS" in said
    with (tmp_path / "top5.csv").open("w", newline="") as f:  # class ids and scores, one row per label
        w = csv.writer(f)
        w.writerow(["image", "class_id", "score"])
        for k, v in CLASSIFY.items():
            w.writerows([Path(k).stem, t["index"], t["prob"]] for t in v["top5"])
    assert _check(tmp_path, "efficientnet-lite0", images, tmp_path / "top5.csv")[0] == 0
    wrong = {k: [t["name"] for t in v["top5"]] for k, v in CLASSIFY.items()}
    wrong["coffee.png"] = ["teapot", *wrong["coffee.png"][1:]]  # planted: another top-1
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    code, said = _check(tmp_path, "efficientnet-lite0", images, tmp_path / "wrong.json")
    assert code == 1 and f"top-1 agreement {len(CLASSIFY) - 1}/{len(CLASSIFY)}" in said and "FAIL (minimum 0.99)" in said
    assert said.split("image(s) disagree:")[1].split("\n")[2].startswith("coffee.png"), said


def _boxes(v: dict) -> list[dict]:
    return [{"name": d["name"], "box": d["box_xyxy"], "score": d["score"]} for d in v["detections"]]


def test_a_detector_s_boxes_in_json_yolo_txt_and_coco(tmp_path: Path, samples: Path, yolo_onnx: Path) -> None:
    images = _folder(tmp_path, samples, DETECT)
    n = sum(len(v["detections"]) for v in DETECT.values())
    (tmp_path / "boxes.json").write_text(json.dumps({k: _boxes(v) for k, v in DETECT.items()}))
    code, said = _check(tmp_path, "yolov3-tiny", images, tmp_path / "boxes.json")
    assert code == 0 and f"{n} of yours {n} and the worker's {n} (100.0%): PASS" in said, said
    txt = tmp_path / "labels"  # Ultralytics' save_txt: class cx cy w h score, fractions of the image
    txt.mkdir()
    for k, v in DETECT.items():
        h, w = v["decoded_hw"]
        (txt / f"{Path(k).stem}.txt").write_text("".join(
            f"{d['class_id']} {(d['box_xyxy'][0] + d['box_xyxy'][2]) / 2 / w} {(d['box_xyxy'][1] + d['box_xyxy'][3]) / 2 / h} "
            f"{(d['box_xyxy'][2] - d['box_xyxy'][0]) / w} {(d['box_xyxy'][3] - d['box_xyxy'][1]) / h} {d['score']}\n"
            for d in v["detections"]))
    assert _check(tmp_path, "yolov3-tiny", images, txt)[0] == 0
    coco = [{"image_id": Path(k).stem, "category_id": d["class_id"], "score": d["score"],
             "bbox": [d["box_xyxy"][0], d["box_xyxy"][1], d["box_xyxy"][2] - d["box_xyxy"][0],
                      d["box_xyxy"][3] - d["box_xyxy"][1]]} for k, v in DETECT.items() for d in v["detections"]]
    (tmp_path / "predictions.json").write_text(json.dumps(coco))
    assert _check(tmp_path, "yolov3-tiny", images, tmp_path / "predictions.json")[0] == 0
    moved = {k: _boxes(v) for k, v in DETECT.items()}
    (shifted,) = [k for k, v in moved.items() if v][:1]
    moved[shifted][0]["box"] = [c + 40 for c in moved[shifted][0]["box"]]  # planted: IoU well under 0.9
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    code, said = _check(tmp_path, "yolov3-tiny", images, tmp_path / "moved.json")
    assert code == 1 and "FAIL" in said and f"\n{shifted}" in said and "1 of yours missing, 1 extra" in said, said


def test_a_segmenter_s_masks_as_pngs(tmp_path: Path, samples: Path, selfie_onnx: Path) -> None:
    images = _folder(tmp_path, samples, SEGMENT)
    masks = tmp_path / "masks"
    masks.mkdir()
    for k in SEGMENT:
        shutil.copy(REFERENCE / f"selfie_{Path(k).stem}.png", masks / f"{Path(k).stem}.png")
    code, said = _check(tmp_path, "selfie", images, masks)
    assert code == 0 and "mean mask IoU" in said and "PASS" in said, said
    empty = masks / f"{Path(next(iter(SEGMENT))).stem}.png"
    import cv2
    import numpy as np

    cv2.imwrite(str(empty), np.zeros_like(cv2.imread(str(empty), cv2.IMREAD_UNCHANGED)))  # planted: nothing there
    code, said = _check(tmp_path, "selfie", images, masks, "--min-agreement", "0.99")
    assert code == 1 and "FAIL (minimum 0.99)" in said and f"\n{next(iter(SEGMENT))}" in said, said


@pytest.mark.parametrize("content, says", [
    ('{"nowhere.jpg": ["tabby"]}', "1 image name(s) not in the folder: nowhere.jpg"),
    ("not json", "not JSON"),
    ("image,score\na.jpg,1", "a CSV needs an `image` column"),
])
def test_results_that_cannot_be_used_exit_2(tmp_path: Path, samples: Path, effnet_onnx: Path, content: str,
                                            says: str) -> None:
    images = _folder(tmp_path, samples, ["chelsea.png"])
    given = tmp_path / ("results.csv" if content.startswith("image,") else "results.json")
    given.write_text(content)
    code, said = _check(tmp_path, "efficientnet-lite0", images, given)
    assert code == 2 and says in said, said
