"""`worker models check NAME --image IMG --expect-input/--expect-output/--dump`: the worker's tensor and outputs
held to the ones "your training pipeline" saved. That side is played by the PyTorch reference tensor and
logits kept in tests/data/reference/, and by tensors made here with plain NumPy and OpenCV, each wrong in
one usual way, for which the check must name the cause and the card key."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from PIL import Image

from tests.conftest import REFERENCE, ROOT
from tests.support.cli import config_file, main_as_command
from worker.cli import cli

ASTRONAUT_INPUT = REFERENCE / "efficientnet_lite0_astronaut_input.npy"
ASTRONAUT_LOGITS = REFERENCE / "efficientnet_lite0_astronaut_logits.npy"


def _check(tmp_path: Path, model: str, image: Path, *args: str) -> tuple[int, str]:
    """`worker models check` as `main` runs it (errors as `error: ...` lines and their exit codes)."""
    out = CliRunner().invoke(main_as_command, ["--config", str(config_file(tmp_path)), "models", "check", model,
                                               "--image", str(image), *args])
    return out.exit_code, out.output


def _effnet_tensor(image: np.ndarray, interpolation: int = cv2.INTER_LINEAR) -> np.ndarray:
    """EfficientNet-Lite0's preprocessing as a user's OpenCV pipeline writes it: shorter side to 256, centre
    crop 224, RGB, (x - 127) / 128 (the card's values), NCHW."""
    card = yaml.safe_load((ROOT / "models" / "efficientnet-lite0" / "model.yaml").read_text())["preprocess"]
    h, w = image.shape[:2]
    s = 256 / min(h, w)
    nw, nh = round(w * s), round(h * s)
    top, left = (nh - 224) // 2, (nw - 224) // 2
    x = cv2.resize(image, (nw, nh), interpolation=interpolation)[top:top + 224, left:left + 224]
    x = cv2.cvtColor(x, cv2.COLOR_BGR2RGB).astype(np.float32).transpose(2, 0, 1)[None]
    mean, std = (np.array(card[k], np.float32)[None, :, None, None] for k in ("mean", "std"))
    return ((x - mean) / std).astype(np.float32)


def test_the_reference_tensor_and_logits_pass(tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    dump = tmp_path / "dump"
    code, said = _check(tmp_path, "efficientnet-lite0", samples / "astronaut.png", "--expect-input",
                        str(ASTRONAUT_INPUT), "--expect-output", str(ASTRONAUT_LOGITS), "--dump", str(dump))
    assert code == 0, said
    assert "input: PASS" in said and "output logits (1, 1000): PASS" in said
    mine = np.load(dump / "input.npy")
    assert mine.shape == (1, 3, 224, 224) and np.abs(mine - np.load(ASTRONAUT_INPUT)).max() <= 1e-4
    assert np.abs(np.load(dump / "output_logits.npy") - np.load(ASTRONAUT_LOGITS)).max() <= 1e-3
    snippet = said[said.index("import numpy as np"):]
    scope: dict = {}
    exec(snippet.split("\n\n")[0], scope)  # the snippet printed runs as printed
    assert scope["diff"].max() <= 1e-4


def _planted(tmp_path: Path, samples: Path) -> dict[str, tuple[Path, np.ndarray]]:
    ref = np.load(ASTRONAUT_INPUT)
    chelsea = cv2.imread(str(samples / "chelsea.png"))  # 451 x 300: a resize that no interpolation shares
    im = Image.open(samples / "rocket.jpg")
    exif = im.getexif()
    exif[0x0112] = 6  # "turn 90 degrees to be upright"
    im.save(tmp_path / "turned.jpg", exif=exif, quality=95)
    unturned = cv2.imread(str(tmp_path / "turned.jpg"), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    return {
        "bgr": (samples / "astronaut.png", ref[:, ::-1]),
        "raw": (samples / "astronaut.png", ref * 128 + 127),  # the card's std and mean taken off again
        "double_255": (samples / "astronaut.png", ref / 255),
        "area": (samples / "chelsea.png", _effnet_tensor(chelsea, cv2.INTER_AREA)),
        "exif": (tmp_path / "turned.jpg", _effnet_tensor(unturned)),
    }


@pytest.mark.parametrize("kind, cause, key", [
    ("bgr", "channels reversed (your pipeline feeds BGR)", "set preprocess.color: bgr"),
    ("raw", "mean/std not applied (raw pixel values)", "set preprocess.mean: [0, 0, 0] and preprocess.std: [1, 1, 1]"),
    ("double_255", "divided by 255 twice", "preprocess.std: [32640, 32640, 32640]"),
    ("area", "resize: INTER_AREA instead of INTER_LINEAR", "resize bilinearly in your pipeline"),
    ("exif", "image rotated by EXIF on one side only", "turns images upright by their EXIF orientation"),
])
def test_each_usual_mismatch_is_named_with_its_fix(tmp_path: Path, samples: Path, effnet_onnx: Path, kind: str,
                                                   cause: str, key: str) -> None:
    image, tensor = _planted(tmp_path, samples)[kind]
    np.save(tmp_path / "yours.npy", np.ascontiguousarray(tensor, dtype=np.float32))
    code, said = _check(tmp_path, "efficientnet-lite0", image, "--expect-input", str(tmp_path / "yours.npy"))
    assert code == 1 and "input: FAIL" in said, said
    (line,) = [x for x in said.splitlines() if x.startswith("  most likely: ")]
    assert line.startswith(f"  most likely: {cause}: max diff ") and key in line, line
    assert float(line.split("max diff ")[1].split()[0]) <= 1e-4


def test_a_letterbox_padded_with_0_names_pad_value(tmp_path: Path, samples: Path, yolo_onnx: Path) -> None:
    img = cv2.imread(str(samples / "chelsea.png"))
    h, w = img.shape[:2]
    s = min(416 / h, 416 / w)
    nw, nh = round(w * s), round(h * s)
    canvas = np.zeros((416, 416, 3), np.uint8)  # padded with 0 where the card says 114
    top, left = (416 - nh) // 2, (416 - nw) // 2
    canvas[top:top + nh, left:left + nw] = cv2.resize(img, (nw, nh), interpolation=cv2.INTER_LINEAR)
    x = cv2.cvtColor(canvas, cv2.COLOR_BGR2RGB).astype(np.float32).transpose(2, 0, 1)[None] / 255
    np.save(tmp_path / "yours.npy", x)
    code, said = _check(tmp_path, "yolov3-tiny", samples / "chelsea.png", "--expect-input", str(tmp_path / "yours.npy"))
    assert code == 1 and "most likely: letterbox padded with 0 instead of 114: max diff " in said, said
    assert "set preprocess.pad_value: 0" in said


def test_nhwc_and_a_missing_batch_axis_are_said_and_compared(tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    np.save(tmp_path / "nhwc.npy", np.load(ASTRONAUT_INPUT)[0].transpose(1, 2, 0))
    code, said = _check(tmp_path, "efficientnet-lite0", samples / "astronaut.png", "--expect-input",
                        str(tmp_path / "nhwc.npy"))
    assert code == 0 and "input: PASS" in said, said
    assert "no batch axis" in said and "yours is NHWC (1, 224, 224, 3), the card says nchw" in said


def test_files_that_cannot_be_used_get_one_line_and_exit_2(tmp_path: Path, samples: Path,
                                                            effnet_onnx: Path) -> None:
    (tmp_path / "text.npy").write_text("not an array")
    np.save(tmp_path / "wrong.npy", np.zeros((1, 3, 100, 100), np.float32))
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    np.save(tmp_path / "ok.npy", np.load(ASTRONAUT_INPUT))
    cases = [(samples / "astronaut.png", "text.npy", "not a NumPy .npy file"),
             (samples / "astronaut.png", "wrong.npy", "shape (1, 3, 100, 100) cannot be matched"),
             (tmp_path / "broken.jpg", "ok.npy", "broken.jpg"),
             (samples / "astronaut.png", "missing.npy", "no such file")]
    for image, given, says in cases:
        code, said = _check(tmp_path, "efficientnet-lite0", image, "--expect-input", str(tmp_path / given))
        assert code == 2 and says in said, (given, said)
    out = CliRunner().invoke(cli, ["--config", str(config_file(tmp_path)), "models", "check", "efficientnet-lite0",
                                   "--expect-input", str(tmp_path / "ok.npy")])
    assert out.exit_code == 2 and "need --image" in out.output


def test_a_letterbox_padded_at_the_bottom_right_with_0_names_pad_at_and_pad_value(tmp_path: Path, samples: Path,
                                                                                  yolo_onnx: Path) -> None:
    """An export that puts the image at the top-left and pads the rest with zeros (NudeNet's): no card key said
    so before. The check names both keys; a card that sets them holds to the tensor exactly."""
    import shutil

    img = cv2.imread(str(samples / "chelsea.png"))
    h, w = img.shape[:2]
    s = min(416 / h, 416 / w)
    nw, nh = round(w * s), round(h * s)
    canvas = np.zeros((416, 416, 3), np.uint8)
    canvas[:nh, :nw] = cv2.resize(img, (nw, nh), interpolation=cv2.INTER_LINEAR)  # padded below and right only
    x = cv2.cvtColor(canvas, cv2.COLOR_BGR2RGB).astype(np.float32).transpose(2, 0, 1)[None] / 255
    np.save(tmp_path / "yours.npy", x)
    code, said = _check(tmp_path, "yolov3-tiny", samples / "chelsea.png", "--expect-input", str(tmp_path / "yours.npy"))
    assert code == 1 and "most likely: letterbox padded with 0 instead of 114" in said and \
        "letterbox padded past the image's bottom and right only (the image at the top-left)" in said, said
    assert "set preprocess.pad_value: 0" in said and "set preprocess.pad_at: bottom-right" in said, said
    models = tmp_path / "models"
    shutil.copytree(ROOT / "models" / "yolov3-tiny", models / "bottom-right")
    card = yaml.safe_load((models / "bottom-right" / "model.yaml").read_text())
    card["name"] = "bottom-right"
    card["preprocess"].update(pad_value=0, pad_at="bottom-right")
    (models / "bottom-right" / "model.yaml").write_text(yaml.safe_dump(card))
    out = CliRunner().invoke(main_as_command, ["--config", str(config_file(tmp_path, models)), "models", "check",
                                               "bottom-right", "--image", str(samples / "chelsea.png"),
                                               "--expect-input", str(tmp_path / "yours.npy")])
    assert out.exit_code == 0 and "input: PASS" in out.output, out.output
