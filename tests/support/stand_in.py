"""Stand-ins for the tests of the pipeline's mechanics (next to the tests on real models): an engine whose
output is each image's mean, counting the batches it ran and the threads that warmed it up; and a card
whose real ONNX model costs next to nothing (GlobalAveragePool + Flatten + MatMul to 1,000 logits)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from worker.models.onnx_graph import GraphBuilder


class StandInEngine:
    """Stands in for onnxruntime only to test the pool: output = the batch's per-image mean."""

    providers = ["CPUExecutionProvider"]
    on_gpu = False
    device_id = 0

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []
        self.warm_ups: list[str] = []  # the names of the threads that warmed up
        self.lock = threading.Lock()

    def warm_up(self, batch_size: int, size_hw: tuple[int, int]) -> None:
        with self.lock:
            self.warm_ups.append(threading.current_thread().name)

    def run(self, batch: np.ndarray) -> np.ndarray:
        with self.lock:
            self.batch_sizes.append(len(batch))
        return np.repeat(batch.mean(axis=(1, 2, 3))[:, None], 3, axis=1).astype(np.float32)


CARD = """name: stand-in
onnx: stand-in.onnx
task: classify
input: {name: input, size: [224, 224], dynamic_batch: true}
preprocess: {color: rgb, resize: shorter-crop, resize_shorter: 256, mean: [127, 127, 127], std: [128, 128, 128]}
postprocess: {output: logits, top_k: 5}
labels: [%s]
"""


def stand_in(models: Path) -> None:
    """models/stand-in/: the card and its ONNX file."""
    folder = models / "stand-in"
    folder.mkdir(parents=True, exist_ok=True)
    g = GraphBuilder()
    flat = g.node("Flatten", [g.node("GlobalAveragePool", ["input"])], axis=1)
    w = np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32)
    out = g.node("MatMul", [flat, g.const(w)], name="logits")
    g.save(folder / "stand-in.onnx", "input", ["N", 3, 224, 224], [(out, ["N", 1000])], "stand-in")
    (folder / "model.yaml").write_text(CARD % ", ".join(f"c{i}" for i in range(1000)))
