"""The state of a TensorFlow Lite model's conversion to ONNX: the ONNX graph being built, each tensor's
value in it (4-D activations in NCHW), the constants, and the helpers every operator's conversion uses."""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path

import numpy as np

from worker.errors import ModelError
from worker.models.onnx_graph import GraphBuilder
from worker.models.tflite_file import CUSTOM, Operator, TfliteModel, builtin_name


class Op(IntEnum):
    """The BuiltinOperator codes (schema.fbs) this builder reads; their names are the schema's."""

    ADD = 0
    AVERAGE_POOL_2D = 1
    CONCATENATION = 2
    CONV_2D = 3
    DEPTHWISE_CONV_2D = 4
    DEPTH_TO_SPACE = 5
    DEQUANTIZE = 6
    FULLY_CONNECTED = 9
    LOGISTIC = 14
    MAX_POOL_2D = 17
    MUL = 18
    RELU = 19
    RELU6 = 21
    RESHAPE = 22
    RESIZE_BILINEAR = 23
    SOFTMAX = 25
    TANH = 28
    PAD = 34
    MEAN = 40
    SUB = 41
    STRIDED_SLICE = 45
    PRELU = 54
    HARD_SWISH = 117
    DENSIFY = 124


SAME = 0  # Padding enum of the builtin options (VALID = 1)
NHWC_TO_NCHW = (0, 3, 1, 2)  # the permutation: NCHW's axis k is NHWC's axis NHWC_TO_NCHW[k]
TO_NCHW_AXIS = {0: 0, 1: 2, 2: 3, 3: 1}  # where NHWC's axis a lands in NCHW


class TfliteGraph:
    """A model's inputs taken into the graph; `save` writes the graph once its operators are converted."""

    def __init__(self, model: TfliteModel, source: str) -> None:
        self.m, self.source = model, source
        self.g = GraphBuilder()
        self.names: dict[int, str] = {}  # tensor index -> ONNX value of an activation (NCHW when 4-D)
        self.const_names: dict[tuple[int, bool], str] = {}  # (tensor index, beside a 4-D activation) -> value
        self.consts: dict[int, np.ndarray] = {i: t.data for i, t in enumerate(model.tensors) if t.data is not None}
        for i in model.inputs:
            t = self.m.tensors[i]
            if t.dtype is not np.float32:
                kind = np.dtype(t.dtype).name if t.dtype else "of a type this reader does not know"
                raise ModelError(f"{source}: input {t.name} is {kind}, not float32: this builder converts float "
                                 f"models only (a quantised model's inputs are int8 or uint8)")
            self.names[i] = self._nchw(t.name, len(t.shape))

    def _fail(self, op: Operator, why: str) -> ModelError:
        what = op.custom if op.code == CUSTOM else builtin_name(op.code)
        return ModelError(f"{self.source}: operator #{op.index} ({what}): {why}")

    def _nchw(self, name: str, rank: int) -> str:
        return self.g.node("Transpose", [name], perm=[0, 3, 1, 2]) if rank == 4 else name

    def _shape(self, i: int) -> tuple[int, ...]:
        return self.m.tensors[i].shape

    def _hw(self, i: int) -> tuple[int, int]:
        """An NHWC tensor's height and width."""
        shape = self._shape(i)
        if len(shape) != 4:
            raise ModelError(f"{self.source}: tensor {self.m.tensors[i].name} is not 4-D (N, H, W, C): {shape}")
        return shape[1], shape[2]

    def _value(self, i: int, op: Operator) -> str:
        """An operator's input as an ONNX value: an activation, or a constant, made NCHW-broadcastable when
        the operator's output is 4-D (TFLite broadcasts from the last axis, channels)."""
        if i in self.names:
            return self.names[i]
        if i not in self.consts:
            raise self._fail(op, f"input tensor {i} ({self.m.tensors[i].name}) is neither computed nor constant")
        beside_4d = len(self._shape(op.outputs[0])) == 4
        if (i, beside_4d) in self.const_names:
            return self.const_names[(i, beside_4d)]
        c = self.consts[i].astype(np.float32)
        if beside_4d and c.ndim == 4:
            c = c.transpose(*NHWC_TO_NCHW)
        elif beside_4d and c.ndim == 3:  # (H, W, C) -> (C, H, W)
            c = c.transpose(2, 0, 1)
        elif beside_4d and c.ndim == 2:
            raise self._fail(op, f"a constant of shape {c.shape} cannot be broadcast here")
        elif beside_4d and c.ndim == 1 and c.size > 1:  # broadcast over NHWC's last axis = NCHW's channel axis
            c = c.reshape(-1, 1, 1)
        self.const_names[(i, beside_4d)] = self.g.const(c)
        return self.const_names[(i, beside_4d)]

    def _nhwc_value(self, i: int, op: Operator) -> str:
        """An activation in TFLite's own layout: a 4-D one back in NHWC (for operators that depend on the
        order of the elements)."""
        x = self._value(i, op)
        return self.g.node("Transpose", [x], perm=[0, 2, 3, 1]) if len(self._shape(i)) == 4 else x

    def _activation(self, x: str, fused: int, op: Operator) -> str:
        """TFLite's fused activation (ActivationFunctionType) after an operator."""
        if fused == 0:
            return x
        if fused == 1:
            return self.g.node("Relu", [x])
        if fused in (2, 3):  # RELU_N1_TO_1, RELU6
            lo, hi = (-1.0, 1.0) if fused == 2 else (0.0, 6.0)
            return self.g.node("Clip", [x, self.g.const(lo), self.g.const(hi)])
        if fused == 4:
            return self.g.node("Tanh", [x])
        raise self._fail(op, f"fused activation {fused} is not supported")

    def _pads(self, op: Operator, padding: int, in_hw: tuple[int, int], kernel: tuple[int, int],
              stride: tuple[int, int], dilation: tuple[int, int] = (1, 1)) -> list[int]:
        """ONNX pads [top, left, bottom, right] for TensorFlow's SAME or VALID padding."""
        if padding != SAME:
            return [0, 0, 0, 0]
        before, after = [], []
        for n, k, s, d in zip(in_hw, kernel, stride, dilation):
            if s <= 0:
                raise self._fail(op, f"stride {s}")
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            before.append(total // 2)
            after.append(total - total // 2)
        return before + after

    def save(self, dest: Path) -> None:
        outputs: list[tuple[str, list[int | str]]] = []
        for i in self.m.outputs:
            t = self.m.tensors[i]
            if i not in self.names:
                raise ModelError(f"{self.source}: output {t.name} is not computed by any operator")
            nhwc = len(t.shape) == 4
            self.g.node("Transpose" if nhwc else "Identity", [self.names[i]], name=t.name,
                        **({"perm": [0, 2, 3, 1]} if nhwc else {}))
            outputs.append((t.name, ["N", *t.shape[1:]]))
        (i,) = self.m.inputs  # GraphBuilder.save writes one input
        t = self.m.tensors[i]
        self.g.save(dest, t.name, ["N", *t.shape[1:]], outputs,
                    doc=f"converted from {self.source} by worker.models.build_tflite")
