"""A small model with RF-DETR's inputs and outputs, for tests (not a test).

RF-DETR's ONNX export takes `input` (1, 3, H, W), the image resized to H x W and normalised with
ImageNet's mean and std, and gives `dets` (1, 300, 4): each query's box as cx, cy, w, h, fractions of
the input, and `labels` (1, 300, C): each query's class logits (a model fine-tuned on N classes has
C = N + 1, the last its background). This one has the same contract and no training: each query looks
at one 16x16 patch of a 384x384 input through two small random layers, so its boxes and scores follow
the picture and any difference in reading, resizing or normalising the image shows in them.
`tests/data/make/rfdetr_reference.py` runs it through RF-DETR's own ONNX inference helper.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SIZE, PATCH, QUERIES, SLOTS = 384, 16, 300, 4  # 3 classes and the background slot
LABELS = ("a", "b", "c")


def build(path: Path, seed: int = 38, masks: bool = False) -> None:
    """The model at `path`; `masks`: RF-DETR-Seg's third output too, `masks` (1, 300, 24, 24), each query's
    mask logits: a disc about its patch, shifted by the picture's mean level."""
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
    outputs: list[tuple[str, list[int]]] = [(dets, [1, QUERIES, 4]), (logits, [1, QUERIES, SLOTS])]
    if masks:
        y, x = np.mgrid[0:grid, 0:grid] + 0.5
        disc = 3.0 - ((x[None] - (cell % grid + 0.5)[:, None, None]) ** 2
                      + (y[None] - (cell // grid + 0.5)[:, None, None]) ** 2)  # (300, 24, 24): above 0 within ~1.7
        level = g.node("ReduceMean", ["input"], axes=[1, 2, 3], keepdims=1)  # (1, 1, 1, 1)
        outputs.append((g.node("Add", [g.const(disc[None]), level], name="masks"), [1, QUERIES, grid, grid]))
    g.save(path, "input", [1, 3, SIZE, SIZE], outputs, "RF-DETR's inputs and outputs, untrained (tests/support/rfdetr_like.py)")


CARD = f"""name: rfdetr-like
task: detect
onnx: rfdetr-like.onnx
input: {{name: input, size: [{SIZE}, {SIZE}], dynamic_batch: false}}
preprocess: {{color: rgb, resize: stretch, float_resize: true,
             mean: [123.675, 116.28, 103.53], std: [58.395, 57.12, 57.375]}}
postprocess: {{outputs: [dets, labels], layout: detr, activation: sigmoid, threshold: 0.5}}
labels: [{", ".join(LABELS)}]
"""


def made_up_seg(queries: int = 100, slots: int = 4, mask_hw: tuple[int, int] = (78, 78),
                seed: int = 38) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One image's RF-DETR-Seg outputs, made up (uniform draws only, the same under any NumPy): `dets`
    (Q, 4) cx, cy, w, h fractions, `labels` (Q, slots) logits (some queries over 0.5 on two classes, some
    on the background slot), `masks` (Q, h, w) logits: a blob about each query's box, above 0 roughly
    within it, with a ripple that gives it ragged, sometimes broken, edges (RF-DETR-Seg Nano: 100
    queries, 78x78 masks at 312 px)."""
    rng = np.random.default_rng(seed)
    cx, cy = rng.uniform(0.1, 0.9, queries), rng.uniform(0.1, 0.9, queries)
    bw, bh = rng.uniform(0.05, 0.4, queries), rng.uniform(0.05, 0.4, queries)
    labels = rng.uniform(-8.0, 1.0, (queries, slots))
    two = rng.choice(queries, 6, replace=False)
    labels[two, :2] = rng.uniform(0.2, 3.0, (6, 2))
    mh, mw = mask_hw
    y, x = (np.arange(mh) + 0.5) / mh, (np.arange(mw) + 0.5) / mw
    dy = (y[None, :, None] - cy[:, None, None]) / (bh[:, None, None] / 2)
    dx = (x[None, None, :] - cx[:, None, None]) / (bw[:, None, None] / 2)
    phase = rng.uniform(0, 2 * np.pi, (queries, 1, 1))
    masks = 4.0 * (1.0 - dx ** 2 - dy ** 2) + 1.5 * np.sin(9 * x[None, None, :] + 7 * y[None, :, None] + phase)
    dets = np.stack([cx, cy, bw, bh], 1)
    return dets.astype(np.float32), labels.astype(np.float32), masks.astype(np.float32)


# the sample photos the golden RF-DETR outputs were made on (tests/data/make/rfdetr_reference.py)
IMAGES = ("coffee.png", "rocket.jpg", "chelsea.png", "motorcycle_left.png")
