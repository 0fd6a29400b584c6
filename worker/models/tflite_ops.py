"""Each TensorFlow Lite operator the builder supports, converted to its ONNX nodes (`_OPS`, and MediaPipe's
custom `Convolution2DTransposeBias`); float16 and sparse weights are folded into the constants."""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from worker.models.tflite_file import CUSTOM, Operator
from worker.models.tflite_graph import NHWC_TO_NCHW, TO_NCHW_AXIS, Op, TfliteGraph


class TfliteOperators(TfliteGraph):
    """The conversions, one method per kind of operator; `_convert` picks one for each operator."""

    def _convert(self, op: Operator) -> None:
        if op.code == Op.DENSIFY:  # sparse weights: the reader made them dense already
            if op.inputs[0] not in self.consts:
                raise self._fail(op, "an input that is not a constant")
            self.consts[op.outputs[0]] = self.consts[op.inputs[0]]
            return
        if op.code == Op.DEQUANTIZE:  # float16 weights: widened once, here
            if op.inputs[0] not in self.consts or self.consts[op.inputs[0]].dtype != np.float16:
                raise self._fail(op, "only float16 weights are widened here (int8 ones are a quantised model's)")
            self.consts[op.outputs[0]] = self.consts[op.inputs[0]].astype(np.float32)
            return
        convert = _OPS.get(op.code) if op.code != CUSTOM else _CUSTOM.get(op.custom)
        if convert is None:
            raise self._fail(op, f"not supported by this builder (supported: {', '.join(sorted(o.name for o in Op))}, "
                                 f"{', '.join(_CUSTOM)})")
        self.names[op.outputs[0]] = convert(self, op)

    def _conv(self, op: Operator) -> str:
        x, w, b = op.inputs[0], self.consts.get(op.inputs[1]), op.inputs[2] if len(op.inputs) > 2 else -1
        if w is None or w.dtype.kind != "f":
            raise self._fail(op, "weights that are not constant floats (int8 ones are a quantised model's)")
        depthwise = op.code == Op.DEPTHWISE_CONV_2D
        # CONV_2D: 0 padding, 1 stride_w, 2 stride_h, 3 activation, 4/5 dilation w/h; DEPTHWISE adds
        # 3 depth_multiplier, shifting activation to 4 and dilation to 5/6
        shift = 1 if depthwise else 0
        stride = (op.option(2, "i"), op.option(1, "i"))
        dilation = (op.option(5 + shift, "i", 1), op.option(4 + shift, "i", 1))
        channels = self._shape(x)[3]
        if depthwise:  # [1, kh, kw, C*m] -> [C*m, 1, kh, kw], one group per input channel
            weight, group = w.transpose(3, 0, 1, 2), channels
        else:  # OHWI -> OIHW
            weight, group = w.transpose(0, 3, 1, 2), 1
            if w.shape[3] != channels:
                group = channels // w.shape[3]  # grouped convolution
        kernel = (weight.shape[2], weight.shape[3])
        pads = self._pads(op, op.option(0, "b"), self._hw(x), kernel, stride, dilation)
        inputs = [self._value(x, op), self.g.const(weight.astype(np.float32))]
        if b >= 0:
            inputs.append(self.g.const(self.consts[b].astype(np.float32)))
        y = self.g.node("Conv", inputs, kernel_shape=list(kernel), strides=list(stride), pads=pads,
                        dilations=list(dilation), group=group)
        return self._activation(y, op.option(3 + shift, "b"), op)

    def _pool(self, op: Operator) -> str:
        # Pool2DOptions: 0 padding, 1 stride_w, 2 stride_h, 3 filter_w, 4 filter_h, 5 activation
        x = op.inputs[0]
        kernel, stride = (op.option(4, "i"), op.option(3, "i")), (op.option(2, "i"), op.option(1, "i"))
        pads = self._pads(op, op.option(0, "b"), self._hw(x), kernel, stride)
        if op.code == Op.AVERAGE_POOL_2D:  # TFLite averages the image's pixels only, never the padding
            y = self.g.node("AveragePool", [self._value(x, op)], kernel_shape=list(kernel), strides=list(stride),
                            pads=pads, count_include_pad=0)
        else:
            y = self.g.node("MaxPool", [self._value(x, op)], kernel_shape=list(kernel), strides=list(stride), pads=pads)
        return self._activation(y, op.option(5, "b"), op)

    def _binary(self, op: Operator) -> str:
        a, b = (self._value(i, op) for i in op.inputs[:2])
        y = self.g.node({Op.ADD: "Add", Op.SUB: "Sub", Op.MUL: "Mul"}[Op(op.code)], [a, b])
        return self._activation(y, op.option(0, "b"), op)  # Add/Sub/MulOptions: 0 activation

    def _prelu(self, op: Operator) -> str:
        return self.g.node("PRelu", [self._value(op.inputs[0], op), self._value(op.inputs[1], op)])

    def _pad(self, op: Operator) -> str:
        """PAD with zeros: paddings (rank, 2) of (before, after) per NHWC axis -> ONNX's begins, then ends."""
        x, paddings = op.inputs[0], self.consts.get(op.inputs[1])
        rank = len(self._shape(x))
        if paddings is None or paddings.shape != (rank, 2):
            raise self._fail(op, "paddings that are not a constant (rank, 2)")
        if rank == 4:
            paddings = paddings[list(NHWC_TO_NCHW)]
        pads = np.concatenate([paddings[:, 0], paddings[:, 1]]).astype(np.int64)
        return self.g.node("Pad", [self._value(x, op), self.g.const(pads, np.int64)], mode="constant")

    def _reshape(self, op: Operator) -> str:
        """To the output tensor's static shape, in NHWC order; the batch axis stays the input's."""
        x, shape_in, shape = op.inputs[0], self._shape(op.inputs[0]), list(self._shape(op.outputs[0]))
        if not shape or any(d <= 0 for d in shape):
            raise self._fail(op, f"an output shape that is not static: {tuple(shape)}")
        if shape_in and shape_in[0] == shape[0] == 1 and len(shape) > 1:
            shape[0] = 0  # ONNX: copy the input's dimension (a batch of any size)
        y = self.g.node("Reshape", [self._nhwc_value(x, op), self.g.const(np.array(shape, np.int64), np.int64)])
        return self._nchw(y, len(shape))

    def _concat(self, op: Operator) -> str:
        # ConcatenationOptions: 0 axis, 1 activation
        rank = len(self._shape(op.outputs[0]))
        axis = op.option(0, "i") % rank
        y = self.g.node("Concat", [self._value(i, op) for i in op.inputs],
                        axis=TO_NCHW_AXIS[axis] if rank == 4 else axis)
        return self._activation(y, op.option(1, "b"), op)

    def _fully_connected(self, op: Operator) -> str:
        """y = x W^T + b over the input's last axis, the input flattened to (-1, in) as TFLite does."""
        # FullyConnectedOptions: 0 activation, 1 weights_format, 2 keep_num_dims
        x, w = op.inputs[0], self.consts.get(op.inputs[1])
        b = op.inputs[2] if len(op.inputs) > 2 else -1
        if w is None or w.dtype.kind != "f" or w.ndim != 2:
            raise self._fail(op, "weights that are not a constant float matrix (int8 ones are a quantised model's)")
        if op.option(1, "b") != 0:
            raise self._fail(op, "a shuffled weights format")
        if op.option(2, "?", False) and len(self._shape(x)) != 2:
            raise self._fail(op, "keep_num_dims on an input that is not 2-D")
        flat = self.g.node("Reshape", [self._nhwc_value(x, op), self.g.const(np.array([-1, w.shape[1]]), np.int64)])
        inputs = [flat, self.g.const(w.astype(np.float32))]
        if b >= 0:
            inputs.append(self.g.const(self.consts[b].astype(np.float32)))
        return self._activation(self.g.node("Gemm", inputs, transB=1), op.option(0, "b"), op)

    def _strided_slice(self, op: Operator) -> str:
        """Constant begin, end and strides per NHWC axis, begin_mask and end_mask (a bit per axis: from the
        start, to the end); the axes it leaves whole are left out, so a batch of any size passes."""
        # StridedSliceOptions: 0 begin_mask, 1 end_mask, 2 ellipsis_mask, 3 new_axis_mask, 4 shrink_axis_mask,
        # 5 offset
        x, shape = op.inputs[0], self._shape(op.inputs[0])
        begin, end, strides = (self.consts.get(i) for i in op.inputs[1:4])
        if begin is None or end is None or strides is None or not len(begin) == len(end) == len(strides) == len(shape):
            raise self._fail(op, "begin, end and strides that are not constants, one per axis")
        if any(op.option(k, "i") for k in (2, 3, 4)) or op.option(5, "?", False):
            raise self._fail(op, "an ellipsis, new or shrunk axes, or offsets")
        begin_mask, end_mask = op.option(0, "i"), op.option(1, "i")
        starts, ends, axes, steps = [], [], [], []
        for a, n in enumerate(shape):
            step = int(strides[a])
            if step == 0:
                raise self._fail(op, "a stride of 0")
            lo = (0 if step > 0 else n - 1) if begin_mask >> a & 1 else int(begin[a])
            hi = (n if step > 0 else -n - 1) if end_mask >> a & 1 else int(end[a])
            if step == 1 and lo == 0 and hi >= n:
                continue  # the whole axis
            starts.append(lo)
            ends.append(hi)
            axes.append(TO_NCHW_AXIS[a] if len(shape) == 4 else a)
            steps.append(step)
        if not axes:
            return self._value(x, op)
        consts = [self.g.const(np.array(v, np.int64), np.int64) for v in (starts, ends, axes, steps)]
        return self.g.node("Slice", [self._value(x, op), *consts])

    def _depth_to_space(self, op: Operator) -> str:
        """TensorFlow's order, channel index (i * block + j) * C + c to pixel (i, j): ONNX's DCR mode."""
        block = op.option(0, "i")  # DepthToSpaceOptions: 0 block_size
        if block < 1 or len(self._shape(op.inputs[0])) != 4:
            raise self._fail(op, f"a block size of {block}, or an input that is not 4-D")
        return self.g.node("DepthToSpace", [self._value(op.inputs[0], op)], blocksize=block, mode="DCR")

    def _softmax(self, op: Operator) -> str:
        x, rank = self._value(op.inputs[0], op), len(self._shape(op.inputs[0]))
        beta = op.option(0, "f", 1.0)  # SoftmaxOptions: 0 beta
        if beta != 1.0:
            x = self.g.node("Mul", [x, self.g.const(beta)])
        return self.g.node("Softmax", [x], axis=1 if rank == 4 else -1)

    def _unary(self, op: Operator) -> str:
        x = self._value(op.inputs[0], op)
        if op.code == Op.RELU6:
            return self._activation(x, 3, op)
        onnx_op = {Op.LOGISTIC: "Sigmoid", Op.RELU: "Relu", Op.TANH: "Tanh", Op.HARD_SWISH: "HardSwish"}[Op(op.code)]
        return self.g.node(onnx_op, [x])

    def _mean(self, op: Operator) -> str:
        """MEAN over constant axes (MediaPipe's landscape segmenter pools this way): NHWC axes -> NCHW ones.
        Dropping axes keeps the rest in the same order in both layouts only when C goes, or H and W both go."""
        x, axes = op.inputs[0], self.consts.get(op.inputs[1])
        if axes is None or len(self._shape(x)) != 4:
            raise self._fail(op, "axes that are not constant, or an input that is not 4-D")
        nhwc = {int(a) % 4 for a in np.atleast_1d(axes)}
        keep = bool(op.option(0, "?", False))  # ReducerOptions: 0 keep_dims
        if not keep and 3 not in nhwc and not {1, 2} <= nhwc:
            raise self._fail(op, f"dropping axes {sorted(nhwc)} would reorder the rest in NCHW")
        return self.g.node("ReduceMean", [self._value(x, op)], axes=sorted(TO_NCHW_AXIS[a] for a in nhwc),
                           keepdims=int(keep))

    def _resize(self, op: Operator) -> str:
        x = op.inputs[0]
        size = self.consts.get(op.inputs[1])
        if size is None or size.shape != (2,):
            raise self._fail(op, "an output size that is not a constant (height, width)")
        h, w = self._hw(x)
        # ResizeBilinearOptions: 2 align_corners, 3 half_pixel_centers; neither: TF1's src = dst * in / out
        mode = "align_corners" if op.option(2, "?", False) else \
            "half_pixel" if op.option(3, "?", False) else "asymmetric"
        scales = self.g.const([1.0, 1.0, float(size[0]) / h, float(size[1]) / w])
        return self.g.node("Resize", [self._value(x, op), "", scales], mode="linear",
                           coordinate_transformation_mode=mode)

    def _transpose_conv_bias(self, op: Operator) -> str:
        """MediaPipe's Convolution2DTransposeBias: a transposed convolution plus bias; its options are a
        raw TfLiteTransposeConvParams (int32 padding: 1 SAME, 2 VALID; stride_w; stride_h)."""
        if len(op.custom_options) < 12:
            raise self._fail(op, "options cut short")
        padding, sw, sh = struct.unpack_from("<3i", op.custom_options)
        x, w, b = op.inputs[:3]
        if w not in self.consts or b not in self.consts:
            raise self._fail(op, "weights or bias that are not constant")
        weight = self.consts[w].transpose(3, 0, 1, 2).astype(np.float32)  # OHWI -> (I, O, kh, kw)
        (n_in_h, n_in_w), (n_out_h, n_out_w) = self._hw(x), self._hw(op.outputs[0])
        kh, kw = weight.shape[2:]
        pads, extra = [], []  # ONNX: out = s * (in - 1) + k - pads + output_padding
        for n, out, k, s in ((n_in_h, n_out_h, kh, sh), (n_in_w, n_out_w, kw, sw)):
            total = s * (n - 1) + k - out if padding == 1 else 0
            pads.append((max(total, 0) // 2, max(total, 0) - max(total, 0) // 2))
            extra.append(max(-total, 0))
        return self.g.node("ConvTranspose", [self._value(x, op), self.g.const(weight),
                                             self.g.const(self.consts[b].astype(np.float32))],
                           kernel_shape=[kh, kw], strides=[sh, sw], output_padding=extra,
                           pads=[pads[0][0], pads[1][0], pads[0][1], pads[1][1]])


_OPS: dict[int, Callable[[TfliteOperators, Operator], str]] = {
    Op.CONV_2D: TfliteOperators._conv, Op.DEPTHWISE_CONV_2D: TfliteOperators._conv,
    Op.AVERAGE_POOL_2D: TfliteOperators._pool, Op.MAX_POOL_2D: TfliteOperators._pool,
    Op.ADD: TfliteOperators._binary, Op.SUB: TfliteOperators._binary, Op.MUL: TfliteOperators._binary,
    Op.PRELU: TfliteOperators._prelu, Op.PAD: TfliteOperators._pad, Op.RESHAPE: TfliteOperators._reshape,
    Op.CONCATENATION: TfliteOperators._concat, Op.FULLY_CONNECTED: TfliteOperators._fully_connected,
    Op.SOFTMAX: TfliteOperators._softmax, Op.STRIDED_SLICE: TfliteOperators._strided_slice,
    Op.DEPTH_TO_SPACE: TfliteOperators._depth_to_space,
    Op.LOGISTIC: TfliteOperators._unary, Op.RELU: TfliteOperators._unary, Op.RELU6: TfliteOperators._unary,
    Op.TANH: TfliteOperators._unary, Op.HARD_SWISH: TfliteOperators._unary,
    Op.RESIZE_BILINEAR: TfliteOperators._resize, Op.MEAN: TfliteOperators._mean,
}  # and Op.DEQUANTIZE and Op.DENSIFY, folded into the weights in _convert
_CUSTOM: dict[str, Callable[[TfliteOperators, Operator], str]] = {
    "Convolution2DTransposeBias": TfliteOperators._transpose_conv_bias,
}
