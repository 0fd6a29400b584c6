"""A small helper to write ONNX graphs with numpy weights, shared by the model builders."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def fold_batchnorm(weight: np.ndarray, gamma: np.ndarray, beta: np.ndarray, mean: np.ndarray, var: np.ndarray,
                   eps: float, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Conv(W, b) then BatchNorm -> one Conv(W', b'), computed in float64 for accuracy."""
    scale = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + eps)
    w = weight.astype(np.float64) * scale.reshape(-1, *([1] * (weight.ndim - 1)))
    b0 = np.zeros_like(mean, dtype=np.float64) if bias is None else bias.astype(np.float64)
    b = (b0 - mean.astype(np.float64)) * scale + beta.astype(np.float64)
    return w.astype(np.float32), b.astype(np.float32)


class GraphBuilder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._n = 0

    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def const(self, value: Any, dtype: Any = np.float32, name: str | None = None) -> str:
        name = name or self._name("c")
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(self, op: str, inputs: Sequence[str], name: str | None = None, **attrs: Any) -> str:
        out = name or self._name(op.lower())
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=out, **attrs))
        return out

    def conv(self, x: str, w: np.ndarray, b: np.ndarray | None, stride: int, pads: Sequence[int],
             group: int = 1) -> str:
        inputs = [x, self.const(w)] + ([self.const(b)] if b is not None else [])
        k = w.shape[2:]
        return self.node("Conv", inputs, kernel_shape=list(k), strides=[stride, stride], pads=list(pads), group=group)

    def save(self, path: Path, input_name: str, input_shape: Sequence[int | str],
             outputs: Sequence[tuple[str, Sequence[int | str]]], doc: str) -> None:
        graph = helper.make_graph(
            self.nodes, "worker",
            [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, list(input_shape))],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in outputs],
            initializer=self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="worker", doc_string=doc)
        model.ir_version = 8
        onnx.checker.check_model(model)
        onnx.save(model, str(path))
