"""A small model with RF-DETR's inputs and outputs, for tests (not a test).

RF-DETR's ONNX export takes `input` (1, 3, H, W), the image resized to H x W and normalised with
ImageNet's mean and std, and gives `dets` (1, 300, 4): each query's box as cx, cy, w, h, fractions of
the input, and `labels` (1, 300, C): each query's class logits (a model fine-tuned on N classes has
C = N + 1, the last its background). This one has the same contract and no training: each query looks
at one 16x16 patch of a 384x384 input through two small random layers, so its boxes and scores follow
the picture and any difference in reading, resizing or normalising the image shows in them.
`tests/make_rfdetr_reference.py` runs it through RF-DETR's own ONNX inference helper.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SIZE, PATCH, QUERIES, SLOTS = 384, 16, 300, 4  # 3 classes and the background slot
LABELS = ("a", "b", "c")


def build(path: Path, seed: int = 38) -> None:
    from worker.models.onnx_graph import GraphBuilder

    rng = np.random.default_rng(seed)
    grid = SIZE // PATCH  # 24 x 24 patches, the first 300 of them queries
    g = GraphBuilder()
    pooled = g.node("AveragePool", ["input"], kernel_shape=[PATCH, PATCH], strides=[PATCH, PATCH])  # (1, 3, 24, 24)
    flat = g.node("Reshape", [pooled, g.const([1, 3, grid * grid], np.int64)])
    first = g.node("Slice", [flat, g.const([0], np.int64), g.const([QUERIES], np.int64), g.const([2], np.int64)])
    colours = g.node("Transpose", [first], perm=[0, 2, 1])  # (1, 300, 3): each query's patch colour
    hidden = g.node("Tanh", [g.node("Add", [g.node("MatMul", [colours, g.const(rng.normal(0, 1.5, (3, 8)))]),
                                            g.const(rng.normal(0, 0.5, (QUERIES, 8)))])])  # (1, 300, 8)
    # boxes about each query's own patch, moved and sized by what it sees
    cell = np.arange(QUERIES)
    centre = np.stack([(cell % grid + 0.5) / grid, (cell // grid + 0.5) / grid], 1)
    bias = np.concatenate([np.log(centre / (1 - centre)), np.full((QUERIES, 2), -1.5)], 1)  # sigmoid back to them
    dets = g.node("Sigmoid", [g.node("Add", [g.node("MatMul", [hidden, g.const(rng.normal(0, 0.4, (8, 4)))]),
                                             g.const(bias)])], name="dets")
    logits = g.node("Add", [g.node("MatMul", [hidden, g.const(rng.normal(0, 2.0, (8, SLOTS)))]),
                            g.const(rng.normal(-3.0, 1.0, (QUERIES, SLOTS)))], name="labels")
    g.save(path, "input", [1, 3, SIZE, SIZE], [(dets, [1, QUERIES, 4]), (logits, [1, QUERIES, SLOTS])],
           "RF-DETR's inputs and outputs, untrained (tests/rfdetr_like.py)")


CARD = f"""name: rfdetr-like
task: detect
onnx: rfdetr-like.onnx
input: {{name: input, size: [{SIZE}, {SIZE}], dynamic_batch: false}}
preprocess: {{color: rgb, resize: stretch, mean: [123.675, 116.28, 103.53], std: [58.395, 57.12, 57.375]}}
postprocess: {{outputs: [dets, labels], layout: detr, activation: sigmoid, threshold: 0.5}}
labels: [{", ".join(LABELS)}]
"""
