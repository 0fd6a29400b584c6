"""EfficientNet-Lite0, built here without PyTorch, against the PyTorch reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tests.conftest import CACHE, REFERENCE, ROOT, run_on
from worker.images import decode
from worker.models.lookup import find_card
from worker.tasks import adapter_for

REF = json.loads((REFERENCE / "efficientnet_lite0.json").read_text())


@pytest.fixture(scope="module")
def processed(tmp_path_factory, samples: Path, effnet_onnx: Path):
    return run_on(tmp_path_factory.mktemp("effnet"), samples, REF["images"], "efficientnet-lite0")


def test_preprocessed_tensor_and_logits(samples: Path, effnet_onnx: Path) -> None:
    card = find_card(ROOT / "models", "efficientnet-lite0")
    x, _ = adapter_for(card).preprocess(decode((samples / "astronaut.png").read_bytes(), "a", 10**9))
    ref_x = np.load(REFERENCE / "efficientnet_lite0_astronaut_input.npy")
    assert np.abs(x[None] - ref_x).max() <= 1e-4
    session = ort.InferenceSession(str(effnet_onnx), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input": ref_x})[0]
    assert np.abs(logits - np.load(REFERENCE / "efficientnet_lite0_astronaut_logits.npy")).max() <= 1e-3


@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_top5_matches_reference(processed, name: str) -> None:
    cfg, summary = processed
    assert summary.figures["failed"] == 0
    doc = json.loads((cfg.outbox / f"{name}.json").read_text())
    ref = REF["images"][name]["top5"]
    assert [x["class_id"] for x in doc["labels"]] == [r["index"] for r in ref]
    assert [x["name"] for x in doc["labels"]] == [r["name"] for r in ref]
    for mine, theirs in zip(doc["labels"], ref):
        assert abs(mine["score"] - theirs["prob"]) <= 0.01


def test_labels_come_from_torchvision_data(effnet_onnx: Path) -> None:
    from worker.models.pull import with_labels

    card = with_labels(find_card(ROOT / "models", "efficientnet-lite0"), CACHE)
    assert len(card.labels) == 1000 and card.labels[0] == "tench" and card.labels[967] == "espresso"


def test_uncertain_below_threshold(processed) -> None:
    cfg, _ = processed
    # astronaut's top-1 is 0.1885 < the card's 0.2: recorded as uncertain, not as a confident label
    assert json.loads((cfg.outbox / "astronaut.png.json").read_text())["uncertain"] is True
    assert json.loads((cfg.outbox / "coffee.png.json").read_text())["uncertain"] is False


def test_matches_pytorch_architecture_on_random_inputs(effnet_onnx: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")  # pip install torch==2.13.0 (local CPU build) to run this
    import sys
    import zipfile

    from worker.models.fetch import download
    from worker.models.torch_weights import load_state_dict

    # the original model code, from its own wheel, put on sys.path only for this test
    wheel = download("efficientnet-lite-pytorch==0.1.0", "wheel", CACHE / "packages")
    zipfile.ZipFile(wheel).extractall(tmp_path / "src")
    sys.path.insert(0, str(tmp_path / "src"))
    try:
        from efficientnet_lite_pytorch import EfficientNet
    finally:
        sys.path.pop(0)
    model = EfficientNet.from_name("efficientnet-lite0")
    sd = load_state_dict(CACHE / "models" / "efficientnet-lite0" / "files" / "efficientnet-lite0-57934424.pth")
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sd.items()}, strict=True)
    model.eval()
    x = np.random.default_rng(0).standard_normal((3, 3, 224, 224)).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    got = ort.InferenceSession(str(effnet_onnx), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    assert np.abs(got - expected).max() <= 1e-3
