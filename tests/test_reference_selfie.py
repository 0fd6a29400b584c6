"""MediaPipe's selfie segmenter, built into ONNX from its .tflite by worker.models.build_tflite, through
the real pipeline, agrees with masks MediaPipe itself made (tests/data/reference/selfie.json)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.conftest import CACHE, REFERENCE, ROOT, run_on
from worker.errors import ModelError
from worker.models.build_tflite import build
from worker.models.tflite_graph import Op
from worker.models.card import Preprocess
from worker.models.lookup import find_card
from worker.models.fetch import download, extract
from worker.models.pull import pull
from worker.models.tflite_file import Table, read
from worker.tasks.preprocess import resize_for

REF = json.loads((REFERENCE / "selfie.json").read_text())


@pytest.fixture(scope="module")
def tflite_file(selfie_onnx: Path) -> Path:
    """The .tflite the ONNX file was built from, as `pull` left it in the cache."""
    return selfie_onnx.parent / "files" / "selfie_segmentation.tflite"


@pytest.fixture(scope="module")
def processed(tmp_path_factory, samples: Path, selfie_onnx: Path):
    return run_on(tmp_path_factory.mktemp("selfie"), samples, REF["images"], "selfie")


def test_all_reference_images_done(processed) -> None:
    _, summary = processed
    assert summary.figures["done"] == len(REF["images"]) and summary.figures["failed"] == 0


@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_mask_matches_mediapipes(processed, name: str) -> None:
    """Pixel for pixel, but for pixels within 0.01 of the threshold, which rounding may flip (there were
    none flipped here: the masks were identical)."""
    cfg, _ = processed
    ref = REF["images"][name]
    doc = json.loads((cfg.outbox / f"{name}.json").read_text())
    mine = cv2.imread(str(cfg.outbox / doc["mask"]), cv2.IMREAD_GRAYSCALE) > 0
    theirs = cv2.imread(str(REFERENCE / ref["mask_png"]), cv2.IMREAD_GRAYSCALE) > 0
    assert mine.shape == theirs.shape == tuple(ref["decoded_hw"])
    borderline = ref["borderline_fraction_abs_p_minus_0.5_lt_0.01"] * mine.size
    assert (mine != theirs).sum() <= borderline, name
    assert abs(doc["mask_pixels"] - ref["fg_pixels"]) <= borderline
    assert doc["label"] == "person"


def test_the_asymmetric_stretch_samples_at_x_times_w_over_256(samples: Path) -> None:
    """stretch-asymmetric against bilinear sampling written out in numpy at (x * W / w, y * H / h), black
    past the edges (OpenCV rounds its weights to 1/32: within 255/64, 4 levels); plain stretch, which
    samples at pixel centres, is far from it."""
    image = cv2.imread(str(samples / "chelsea.png"), cv2.IMREAD_COLOR)
    h, w = image.shape[:2]
    padded = np.zeros((h + 1, w + 1, 3), np.float64)
    padded[:h, :w] = image
    ys, xs = np.arange(256) * h / 256, np.arange(256) * w / 256
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    fy, fx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    want = ((1 - fy) * (1 - fx) * padded[y0][:, x0] + (1 - fy) * fx * padded[y0][:, x0 + 1]
            + fy * (1 - fx) * padded[y0 + 1][:, x0] + fy * fx * padded[y0 + 1][:, x0 + 1])
    got, geometry = resize_for(image, Preprocess(resize="stretch-asymmetric"), (256, 256))
    assert np.abs(got - want).max() <= 4 and np.abs(got - want).mean() < 0.5
    assert (geometry.scale_x, geometry.scale_y) == (256 / w, 256 / h)
    centred, _ = resize_for(image, Preprocess(resize="stretch"), (256, 256))
    assert np.abs(centred - want).max() > 20 and np.abs(centred - want).mean() > 1


def test_the_built_graph_keeps_the_tflite_names_and_layout(selfie_onnx: Path) -> None:
    import onnxruntime as ort

    session = ort.InferenceSession(str(selfie_onnx), providers=["CPUExecutionProvider"])
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, inp.shape, out.name, out.shape) == ("input_1", ["N", 256, 256, 3],
                                                           "activation_10", ["N", 256, 256, 1])
    probs = session.run(None, {"input_1": np.random.default_rng(0).random((2, 256, 256, 3), np.float32)})[0]
    assert probs.shape == (2, 256, 256, 1) and 0 <= probs.min() and probs.max() <= 1  # it ends in a sigmoid


def test_a_file_that_is_not_tflite_is_refused_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "model.tflite"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelError, match=r"model\.tflite: not a TensorFlow Lite model"):
        build({"model": bad}, tmp_path / "model.onnx")


def _patched(tflite_file: Path, dest: Path, patch) -> Path:
    """A copy of the real model with `patch(data, model_table, graph_table)` applied to its bytes."""
    data = bytearray(tflite_file.read_bytes())
    model = Table(bytes(data), struct.unpack_from("<I", data, 0)[0])
    (graph,) = model.tables(2)
    patch(data, model, graph)
    dest.write_bytes(bytes(data))
    return dest


@pytest.mark.parametrize(("code", "named"), [(37, "BATCH_TO_SPACE_ND"), (250, "builtin operator 250")])
def test_an_operator_the_builder_does_not_know_stops_the_build_naming_it(tmp_path: Path, tflite_file: Path,
                                                                         code: int, named: str) -> None:
    """The real model with its HARD_SWISH operator code changed to 37 (BATCH_TO_SPACE_ND), or to 250, which
    no schema yet names (codes over 127 are in the int32 field only, the int8 one says 127)."""
    def changed(data, model, graph) -> None:
        (entry,) = [c for c in model.tables(1) if c.scalar(3, "i") == Op.HARD_SWISH]
        struct.pack_into("<i", data, entry.field_at(3), code)
        struct.pack_into("<b", data, entry.field_at(0), min(code, 127))
    odd = _patched(tflite_file, tmp_path / "odd.tflite", changed)
    assert {op.code for op in read(odd).operators} >= {code}
    with pytest.raises(ModelError, match=rf"odd\.tflite: operator #3 \({named}\): not supported by "
                                         r"this builder \(supported: ADD, .*Convolution2DTransposeBias\)"):
        build({"model": odd}, tmp_path / "model.onnx")
    assert not (tmp_path / "model.onnx").exists()


def test_a_graph_that_does_not_hold_together_is_refused_naming_the_file(tmp_path: Path, tflite_file: Path) -> None:
    """An operator reading a tensor computed only later, then one reading a tensor that is not there."""
    def reads(index: int):
        def patch(data, model, graph) -> None:
            conv = graph.tables(3)[2]  # the first CONV_2D (after two DEQUANTIZEs)
            struct.pack_into("<i", data, conv.target(1) + 4, index)
        return patch
    odd = _patched(tflite_file, tmp_path / "late.tflite", reads(249))
    with pytest.raises(ModelError, match=r"late\.tflite: operator #2 \(CONV_2D\): input tensor 249 \(activation_10\) "
                                         r"is neither computed nor constant"):
        build({"model": odd}, tmp_path / "model.onnx")
    odd = _patched(tflite_file, tmp_path / "gone.tflite", reads(99999))
    with pytest.raises(ModelError, match=r"gone\.tflite: cannot convert it: IndexError"):
        build({"model": odd}, tmp_path / "model.onnx")


def test_a_model_that_is_not_float_is_refused_naming_why(tmp_path: Path, tflite_file: Path) -> None:
    """Its input pointed at a float16 tensor; a DEQUANTIZE's weights retyped int16 (as a quantised model's
    integer weights): neither can be read as the float32 the ONNX graph computes in."""
    def float16_input(data, model, graph) -> None:
        tensors = graph.tables(0)
        half = next(k for k, t in enumerate(tensors) if t.scalar(1, "b") == 1)  # TensorType FLOAT16
        struct.pack_into("<i", data, graph.target(1) + 4, half)
    odd = _patched(tflite_file, tmp_path / "half.tflite", float16_input)
    with pytest.raises(ModelError, match=r"half\.tflite: input .* is float16, not float32: this builder converts "
                                         r"float models only"):
        build({"model": odd}, tmp_path / "model.onnx")

    def int16_weights(data, model, graph) -> None:
        first = graph.tables(3)[0]  # a DEQUANTIZE of the first convolution's float16 weights
        weights = graph.tables(0)[first.vector(1, "i")[0]]
        struct.pack_into("<b", data, weights.field_at(1), 7)  # TensorType INT16: as many bytes per number
    odd = _patched(tflite_file, tmp_path / "int16.tflite", int16_weights)
    with pytest.raises(ModelError, match=r"int16\.tflite: operator #0 \(DEQUANTIZE\): only float16 weights"):
        build({"model": odd}, tmp_path / "model.onnx")


def test_a_wheel_for_another_python_is_fetched_by_its_tag(tmp_path: Path) -> None:
    """`source.python` and `platform` pick the wheel built for them, not for the Python running pip."""
    other = "3.13" if sys.version_info[:2] == (3, 12) else "3.12"
    archive = download("simplejpeg==1.8.2", "wheel", tmp_path, (other, "manylinux2014_x86_64"))
    tag = "cp" + other.replace(".", "")
    assert archive.name.startswith(f"simplejpeg-1.8.2-{tag}-{tag}-") and "manylinux" in archive.name
    assert archive.parent.name == f"simplejpeg-1.8.2-{other}-manylinux2014_x86_64"


def test_the_selfie_cards_tflite_is_the_references(selfie_onnx: Path) -> None:
    card = find_card(ROOT / "models", "selfie")
    assert card.source is not None and card.source.files[0].sha256 == REF["weight_sha256"]
    archive = download(card.source.package, "wheel", CACHE / "packages", card.source.wheel_tag)
    assert archive.name == REF["package"].split("(wheel ")[1].rstrip(")")


def test_a_card_takes_the_users_own_tflite_file_and_builds_it_again_when_it_changes(
        tmp_path: Path, samples: Path, tflite_file: Path) -> None:
    """`tflite:` in a card: built into ONNX in the cache at the first start, rebuilt when the file changes."""
    import dataclasses
    import shutil

    from worker.config import load
    from worker.models.card import SourceFile
    from worker.service import run_folder

    models = tmp_path / "models"
    (models / "mine").mkdir(parents=True)
    shutil.copy(tflite_file, models / "mine" / "person.tflite")
    card = (ROOT / "models" / "selfie" / "model.yaml").read_text()
    card = card[:card.index("source:")] + "tflite: person.tflite\n" + card[card.index("input:"):]
    (models / "mine" / "model.yaml").write_text(card.replace("name: selfie", "name: mine"))
    (tmp_path / "in").mkdir()
    shutil.copy(samples / "astronaut.png", tmp_path / "in")
    cfg = dataclasses.replace(load(ROOT / "config.yaml"), model="mine", models_dir=models, cache_dir=tmp_path / "cache",
                              outbox=tmp_path / "out", db=f"sqlite:///{tmp_path / 'w.db'}")
    assert run_folder(cfg, tmp_path / "in").figures["done"] == 1
    mine = cv2.imread(str(tmp_path / "out" / "astronaut.png.mask.png"), cv2.IMREAD_GRAYSCALE)
    theirs = cv2.imread(str(REFERENCE / REF["images"]["astronaut.png"]["mask_png"]), cv2.IMREAD_GRAYSCALE)
    assert np.array_equal(mine > 0, theirs > 0)

    own = find_card(models, "mine")
    built = own.onnx_path(cfg.cache_dir)
    assert pull(own, cfg.cache_dir) == built and built.stat().st_mtime_ns == (first := built.stat().st_mtime_ns)
    # the file replaced by MediaPipe's landscape model (144x256), from the same wheel
    archive = download("mediapipe==0.10.14", "wheel", CACHE / "packages", ("3.11", "manylinux2014_x86_64"))
    landscape = "mediapipe/modules/selfie_segmentation/selfie_segmentation_landscape.tflite"
    (path,) = extract(archive, (SourceFile("model", landscape),), tmp_path).values()
    path.replace(models / "mine" / "person.tflite")
    import onnxruntime as ort

    assert pull(own, cfg.cache_dir) == built and built.stat().st_mtime_ns != first
    assert ort.InferenceSession(str(built), providers=["CPUExecutionProvider"]).get_inputs()[0].shape == \
        ["N", 144, 256, 3]
    # and it runs (its MEAN operators, where the general model has AVERAGE_POOL_2D): a person is a person
    # to both models (astronaut.png: IoU 0.972 with the general model's mask from MediaPipe, measured)
    (models / "mine" / "model.yaml").write_text(card.replace("name: selfie", "name: mine")
                                                .replace("size: [256, 256]", "size: [144, 256]")
                                                .replace("output: activation_10", "output: segment_back"))
    cfg = dataclasses.replace(cfg, outbox=tmp_path / "out2", db=f"sqlite:///{tmp_path / 'w2.db'}")
    assert run_folder(cfg, tmp_path / "in").figures["done"] == 1
    landscape_mask = cv2.imread(str(tmp_path / "out2" / "astronaut.png.mask.png"), cv2.IMREAD_GRAYSCALE) > 0
    general = theirs > 0
    assert (landscape_mask & general).sum() / (landscape_mask | general).sum() >= 0.95
    (models / "mine" / "person.tflite").unlink()
    with pytest.raises(ModelError, match=r"TFLite file .*person\.tflite does not exist"):
        pull(own, cfg.cache_dir)
