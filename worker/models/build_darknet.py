"""YOLOv3-tiny (or any Darknet cfg with convolutional, maxpool, route, upsample and yolo layers)
as ONNX, built from the .cfg and .weights with numpy and onnx only.

The yolo layers' box decoding is in the graph, so the model emits one output [N, A, 5 + C] in the
YOLOv5 layout: cx, cy, w, h in input pixels, objectness, then C class probabilities (sigmoids).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from worker.errors import ModelError
from worker.models.onnx_graph import GraphBuilder, fold_batchnorm

BN_EPS = 1e-6  # darknet normalises with 1e-6 next to the variance


def parse_cfg(text: str) -> list[dict[str, str]]:
    sections: list[dict[str, str]] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"\[(\w+)\]", line)
        if m:
            sections.append({"type": m.group(1)})
        elif "=" in line and sections:
            k, v = line.split("=", 1)
            sections[-1][k.strip()] = v.strip()
    if not sections or sections[0]["type"] not in ("net", "network"):
        raise ModelError("darknet cfg must start with a [net] section")
    return sections


class _Weights:
    def __init__(self, path: Path) -> None:
        raw = path.read_bytes()
        major, minor, _rev = np.frombuffer(raw[:12], dtype=np.int32)
        header = 12 + (8 if major * 10 + minor >= 2 else 4)  # images seen: int64 from version 0.2 on
        self.data = np.frombuffer(raw[header:], dtype=np.float32)
        self.pos = 0
        self.path = path

    def take(self, n: int) -> np.ndarray:
        if self.pos + n > self.data.size:
            raise ModelError(f"{self.path}: weights end early (cfg and weights do not match)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out


def build(files: dict[str, Path], dest: Path) -> None:
    sections = parse_cfg(files["cfg"].read_text())
    net, layers = sections[0], sections[1:]
    height, width, channels = int(net["height"]), int(net["width"]), int(net.get("channels", 3))
    weights = _Weights(files["weights"])
    g = GraphBuilder()
    outs: list[str] = []  # output name of each layer
    chans: list[int] = []  # output channels of each layer
    sizes: list[tuple[int, int]] = []  # output (h, w) of each layer
    heads: list[str] = []
    x, c, hw = "input", channels, (height, width)
    for i, L in enumerate(layers):
        kind = L["type"]
        if kind == "convolutional":
            filters, k, stride = int(L["filters"]), int(L["size"]), int(L.get("stride", 1))
            pad = k // 2 if int(L.get("pad", 0)) else int(L.get("padding", 0))
            bn = int(L.get("batch_normalize", 0))
            if bn:
                beta, gamma, mean, var = (weights.take(filters) for _ in range(4))
                w = weights.take(filters * c * k * k).reshape(filters, c, k, k)
                w, b = fold_batchnorm(w, gamma, beta, mean, var, BN_EPS)
            else:
                b = weights.take(filters).copy()
                w = weights.take(filters * c * k * k).reshape(filters, c, k, k).copy()
            x = g.conv(x, w, b, stride, [pad] * 4)
            act = L.get("activation", "linear")
            if act == "leaky":
                x = g.node("LeakyRelu", [x], alpha=0.1)
            elif act != "linear":
                raise ModelError(f"{files['cfg']}: layer {i}: activation {act} is not supported")
            c = filters
            hw = ((hw[0] + 2 * pad - k) // stride + 1, (hw[1] + 2 * pad - k) // stride + 1)
        elif kind == "maxpool":
            k, stride = int(L["size"]), int(L["stride"])
            if stride == 1:  # darknet keeps the size: pad right and bottom with k - 1
                x = g.node("MaxPool", [x], kernel_shape=[k, k], strides=[1, 1], pads=[0, 0, k - 1, k - 1])
            else:
                x = g.node("MaxPool", [x], kernel_shape=[k, k], strides=[stride, stride])
                hw = (hw[0] // stride, hw[1] // stride)
        elif kind == "upsample":
            s = int(L.get("stride", 2))
            x = g.node("Resize", [x, "", g.const([1, 1, s, s])], mode="nearest",
                       coordinate_transformation_mode="asymmetric", nearest_mode="floor")
            hw = (hw[0] * s, hw[1] * s)
        elif kind == "route":
            refs = [int(v) for v in L["layers"].split(",")]
            idx = [r if r >= 0 else i + r for r in refs]
            x = outs[idx[0]] if len(idx) == 1 else g.node("Concat", [outs[j] for j in idx], axis=1)
            c, hw = sum(chans[j] for j in idx), sizes[idx[0]]
        elif kind == "yolo":
            heads.append(_decode(g, x, L, hw, (height, width)))
        else:
            raise ModelError(f"{files['cfg']}: layer {i}: [{kind}] is not supported")
        outs.append(x)
        chans.append(c)
        sizes.append(hw)
    if weights.pos != weights.data.size:
        raise ModelError(f"{files['weights']}: {weights.data.size - weights.pos} floats left over (cfg mismatch)")
    classes = int(layers[-1].get("classes", 80))
    out = g.node("Concat", heads, name="detections", axis=1)
    rows = sum(3 * s[0] * s[1] for s, L in zip(sizes, layers) if L["type"] == "yolo")
    g.save(dest, "input", ["N", channels, height, width], [(out, ["N", rows, 5 + classes])],
           "Darknet model built by worker; output rows: cx, cy, w, h (input px), objectness, class probabilities")


def _decode(g: GraphBuilder, x: str, L: dict[str, str], hw: tuple[int, int], input_hw: tuple[int, int]) -> str:
    """[N, A*(5+C), H, W] raw -> [N, A*H*W, 5+C] decoded (boxes in input pixels, sigmoids applied)."""
    mask = [int(v) for v in L["mask"].split(",")]
    anchors = np.array([float(v) for v in L["anchors"].split(",")], dtype=np.float32).reshape(-1, 2)[mask]
    na, nc = len(mask), int(L["classes"])
    h, w = hw
    t = g.node("Reshape", [x, g.const([0, na, 5 + nc, h, w], np.int64)])
    t = g.node("Transpose", [t], perm=[0, 1, 3, 4, 2])  # [N, A, H, W, 5+C]

    def part(start: int, end: int) -> str:
        return g.node("Slice", [t, g.const([start], np.int64), g.const([end], np.int64), g.const([4], np.int64)])

    gy, gx = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32), indexing="ij")
    grid = np.stack([gx, gy], axis=-1)[None, None]  # [1, 1, H, W, 2] as (cx, cy)
    stride = np.array([input_hw[1] / w, input_hw[0] / h], dtype=np.float32)
    xy = g.node("Mul", [g.node("Add", [g.node("Sigmoid", [part(0, 2)]), g.const(grid)]), g.const(stride)])
    wh = g.node("Mul", [g.node("Exp", [part(2, 4)]), g.const(anchors.reshape(1, na, 1, 1, 2))])
    rest = g.node("Sigmoid", [part(4, 5 + nc)])
    t = g.node("Concat", [xy, wh, rest], axis=4)
    return g.node("Reshape", [t, g.const([0, -1, 5 + nc], np.int64)])
