"""`worker models check --image --expect-input/--expect-output` for every card feature beyond the bundled
models' (tests/test_parity.py has those): one gray channel, 16-bit depth, a float TIFF's own values (depth
32), channels last, raw uint8 pixels, and a model taking the images' sizes as a second input. "Your pipeline" is plain OpenCV and NumPy here,
right once, then wrong in one usual way that the check must name with the card key to change."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto

from tests.support.cli import config_file, main_as_command
from tests.support.onnx_models import card_file, channels_last_model, deploy_detector, gray_model

SIZE_WH = (48, 32)  # every model here takes 32 x 48


@pytest.fixture
def models(tmp_path: Path) -> Path:
    return tmp_path / "models"


def _check(tmp_path: Path, models: Path, name: str, image: Path, *args: str) -> tuple[int, str]:
    conf = config_file(tmp_path, models)
    out = CliRunner().invoke(main_as_command, ["--config", str(conf), "models", "check", name, "--image", str(image),
                                               *args])
    return out.exit_code, out.output


def _photo(path: Path, bits: int = 8, gray: bool = False) -> np.ndarray:
    """A smooth picture of 90 x 60 (levels that a resize and a gray conversion round differently), written
    to `path`; returns its pixels as written."""
    rng = np.random.default_rng(5)
    top = 255 if bits == 8 else 65535
    base = cv2.resize(rng.uniform(0, top, (6, 9, 3)).astype(np.float32), (90, 60), interpolation=cv2.INTER_CUBIC)
    pixels = np.clip(base, 0, top).astype(np.uint8 if bits == 8 else np.uint16)
    if gray:
        pixels = cv2.cvtColor(pixels, cv2.COLOR_BGR2GRAY)
    assert cv2.imwrite(str(path), pixels, [cv2.IMWRITE_JPEG_QUALITY, 95])
    return pixels


def _save(tmp_path: Path, tensor: np.ndarray, name: str = "yours.npy") -> str:
    np.save(tmp_path / name, np.ascontiguousarray(tensor))
    return str(tmp_path / name)


def _most_likely(said: str) -> str:
    (line,) = [x for x in said.splitlines() if x.startswith("  most likely: ")]
    assert float(line.split("max diff ")[1].split()[0]) <= 1e-4, line
    return line


def _gray_card(models: Path, pre: str) -> None:
    folder = card_file(models, "xray", f"task: segment\ninput: {{name: input, size: [32, 48]}}\npreprocess: {pre}\n"
                                       "postprocess: {output: logits, activation: sigmoid}\nlabels: [bright]")
    gray_model(folder / "xray.onnx", "nchw")


def test_a_gray_card_passes_with_gray_made_after_the_resize_and_names_the_other_orders(tmp_path: Path,
                                                                                         models: Path) -> None:
    _gray_card(models, "{color: gray, resize: stretch, mean: [0], std: [255]}")
    image = tmp_path / "scan.jpg"
    _photo(image)
    bgr = cv2.imread(str(image))
    right = cv2.cvtColor(cv2.resize(bgr, SIZE_WH), cv2.COLOR_BGR2GRAY).astype(np.float32)[None, None] / 255
    logits = ort.InferenceSession(str(models / "xray" / "xray.onnx")).run(None, {"input": right})[0]
    code, said = _check(tmp_path, models, "xray", image, "--expect-input", _save(tmp_path, right),
                        "--expect-output", _save(tmp_path, logits, "logits.npy"))
    assert code == 0 and "input: PASS" in said and "output logits (1, 1, 32, 48): PASS" in said, said

    first = cv2.resize(cv2.cvtColor(bgr, cv2.COLOR_BGR2GRAY), SIZE_WH).astype(np.float32)[None, None] / 255
    decoded = cv2.imread(str(image), cv2.IMREAD_GRAYSCALE)
    by_decoder = cv2.resize(decoded, SIZE_WH).astype(np.float32)[None, None] / 255
    for wrong, says, fix in ((first, "made gray before the resize", "or pass --atol 0.00392"),
                             (by_decoder, "read as gray by the decoder", "or pass --atol 0.00392"),
                             (right * 255, "mean/std not applied", "set preprocess.mean: [0] and preprocess.std: [1]")):
        code, said = _check(tmp_path, models, "xray", image, "--expect-input", _save(tmp_path, wrong))
        assert code == 1 and "input: FAIL" in said, said
        line = _most_likely(said)
        assert says in line and fix in line, line


def test_a_16_bit_card_passes_with_all_its_levels_and_names_an_8_bit_read(tmp_path: Path, models: Path) -> None:
    _gray_card(models, "{color: gray, depth: 16, resize: stretch, mean: [0], std: [65535]}")
    image = tmp_path / "scan.png"
    pixels = _photo(image, bits=16, gray=True)
    assert pixels.dtype == np.uint16 and cv2.imread(str(image), cv2.IMREAD_UNCHANGED).dtype == np.uint16
    right = cv2.resize(cv2.imread(str(image), cv2.IMREAD_UNCHANGED), SIZE_WH).astype(np.float32)[None, None] / 65535
    code, said = _check(tmp_path, models, "xray", image, "--expect-input", _save(tmp_path, right))
    assert code == 0 and "input: PASS" in said, said

    eight = cv2.imread(str(image), cv2.IMREAD_GRAYSCALE)  # OpenCV's default read: 8 bits
    assert eight.dtype == np.uint8
    wrong = cv2.resize(eight, SIZE_WH).astype(np.float32)[None, None] / 255
    code, said = _check(tmp_path, models, "xray", image, "--expect-input", _save(tmp_path, wrong))
    assert code == 1, said
    line = _most_likely(said)
    assert "read as 8 bits" in line and "set preprocess.depth: 8" in line, line

    code, said = _check(tmp_path, models, "xray", image, "--expect-input", _save(tmp_path, right * 65535))
    assert code == 1 and "mean/std not applied" in _most_likely(said), said


def test_a_32_bit_card_compares_a_float_tiff_s_own_values(tmp_path: Path, models: Path) -> None:
    """depth 32: a thermal camera's temperatures (float TIFF, degrees), normalised in their own units."""
    _gray_card(models, "{color: gray, depth: 32, resize: stretch, mean: [0], std: [100]}")
    rng = np.random.default_rng(3)
    temps = cv2.resize(rng.uniform(-20, 120, (6, 9)).astype(np.float32), (90, 60), interpolation=cv2.INTER_CUBIC)
    image = tmp_path / "thermal.tiff"
    assert cv2.imwrite(str(image), temps)
    read = cv2.imread(str(image), cv2.IMREAD_UNCHANGED)
    assert read.dtype == np.float32 and np.array_equal(read, temps)
    right = cv2.resize(read, SIZE_WH)[None, None] / 100
    code, said = _check(tmp_path, models, "xray", image, "--expect-input", _save(tmp_path, right))
    assert code == 0 and "input: PASS" in said, said
    code, said = _check(tmp_path, models, "xray", image, "--expect-input", _save(tmp_path, right * 100))
    assert code == 1 and "mean/std not applied" in _most_likely(said), said


def _channels_last(tmp_path: Path, models: Path, name: str, elem: int, std: float) -> tuple[Path, np.ndarray]:
    """A TensorFlow-style export (NHWC in, `elem` typed) under card `name` (stretch, RGB, /std), a photo, and
    the photo as a plain OpenCV pipeline feeds such a model: (1, 32, 48, 3) uint8 RGB, before any scaling."""
    folder = card_file(models, name, "task: segment\ninput: {name: input, size: [32, 48], layout: nhwc}\n"
                                     f"preprocess: {{color: rgb, resize: stretch, mean: [0, 0, 0], std: [{std}, {std}, "
                                     f"{std}]}}\npostprocess: {{output: logits}}")
    channels_last_model(folder / f"{name}.onnx", elem)
    image = tmp_path / "photo.png"
    _photo(image)
    return image, cv2.cvtColor(cv2.resize(cv2.imread(str(image)), SIZE_WH), cv2.COLOR_BGR2RGB)[None]


def test_a_channels_last_card_takes_your_nhwc_tensor_as_it_is(tmp_path: Path, models: Path) -> None:
    image, pixels = _channels_last(tmp_path, models, "tf", TensorProto.FLOAT, 255)
    rgb = pixels[0].astype(np.float32) / 255
    code, said = _check(tmp_path, models, "tf", image, "--expect-input", _save(tmp_path, rgb[None]))
    assert code == 0 and "input: PASS" in said, said
    assert "the card says" not in said  # NHWC is what this card's model takes: nothing to say about it

    code, said = _check(tmp_path, models, "tf", image, "--expect-input", _save(tmp_path, rgb[None, :, :, ::-1]))
    assert code == 1 and "channels reversed (your pipeline feeds BGR)" in _most_likely(said), said


def test_raw_uint8_pixels_in_and_the_model_s_outputs_compared(tmp_path: Path, models: Path) -> None:
    image, rgb = _channels_last(tmp_path, models, "raw", TensorProto.UINT8, 1)  # uint8, as the model is fed
    logits = ort.InferenceSession(str(models / "raw" / "raw.onnx")).run(None, {"input": rgb})[0]
    code, said = _check(tmp_path, models, "raw", image, "--expect-input", _save(tmp_path, rgb),
                        "--expect-output", _save(tmp_path, logits, "logits.npy"))
    assert code == 0 and "input: PASS" in said and "output logits (1, 3, 32, 48): PASS" in said, said
    assert "yours is uint8, the worker's float32: compared as numbers" in said


def test_a_model_given_the_sizes_gets_them_in_the_check_too(tmp_path: Path, models: Path) -> None:
    """An RT-DETR-style export: its boxes are in the pixels of the sizes input, which the check feeds as `run` does."""
    folder = card_file(models, "deploy", "task: detect\ninput: {name: images, size: [32, 48], sizes: orig_target_sizes}\n"
                                         "preprocess: {color: rgb, resize: stretch, mean: [0, 0, 0], "
                                         "std: [255, 255, 255]}\n"
                                         "postprocess: {outputs: [boxes, scores, labels], layout: end2end}\n"
                                         "labels: [person, cup, car]")
    deploy_detector(folder / "deploy.onnx")
    image = tmp_path / "photo.png"
    _photo(image)
    x = cv2.cvtColor(cv2.resize(cv2.imread(str(image)), SIZE_WH), cv2.COLOR_BGR2RGB).astype(np.float32) / 255
    x = x.transpose(2, 0, 1)[None]
    session = ort.InferenceSession(str(folder / "deploy.onnx"))
    names = ["boxes", "scores", "labels"]
    outs = session.run(names, {"images": x, "orig_target_sizes": np.array([list(SIZE_WH)], np.int64)})
    np.savez(tmp_path / "outputs.npz", **dict(zip(names, outs)))
    code, said = _check(tmp_path, models, "deploy", image, "--expect-input", _save(tmp_path, x),
                        "--expect-output", str(tmp_path / "outputs.npz"))
    assert code == 0, said
    for line in ("input: PASS", "output boxes (1, 3, 4): PASS", "output scores (1, 3): PASS",
                 "output labels (1, 3): PASS"):
        assert line in said, said

    np.savez(tmp_path / "elsewhere.npz", boxes=outs[0] * 2)  # boxes in the pixels of an image twice the size
    code, said = _check(tmp_path, models, "deploy", image, "--expect-output", str(tmp_path / "elsewhere.npz"))
    assert code == 1 and "output boxes (1, 3, 4): FAIL" in said, said
