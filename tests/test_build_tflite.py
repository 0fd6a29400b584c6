"""worker.models.build_tflite against LiteRT, TensorFlow Lite's own interpreter (ai-edge-litert, a test
dependency): each graph runs both ways on the same input and the outputs must agree.

The graphs: MediaPipe's models from the selfie card's wheel (real weights, every operator the builder
converts but SOFTMAX and SUB among them), and small graphs written here with LiteRT's own schema code
(`schema_py_generated`) for what no shipped model uses: SOFTMAX with a beta, SUB, a grouped
convolution. tests/test_reference_selfie.py holds the selfie model to MediaPipe's masks."""

from __future__ import annotations

import zipfile
from pathlib import Path

import cv2
import flatbuffers
import numpy as np
import onnxruntime as ort
import pytest
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.interpreter import Interpreter

from tests.conftest import CACHE, ROOT
from worker.errors import ModelError
from worker.models.build_tflite import build
from worker.models.tflite_graph import Op
from worker.models.lookup import find_card
from worker.models.fetch import download
from worker.models.tflite_file import BUILTIN_NAMES, read

MODULES = "mediapipe/modules/"
# the wheel's float models the builder converts, and the operators each is here to check
CONVERTED = {
    "face_detection/face_detection_short_range": {Op.PAD, Op.RESHAPE, Op.CONCATENATION, Op.MAX_POOL_2D},
    # sparse weights (38 tensors, one axis compressed), made dense by the reader, and DENSIFY folded
    "face_detection/face_detection_full_range_sparse": {Op.DENSIFY, Op.DEQUANTIZE},
    "face_landmark/face_landmark": {Op.PRELU, Op.PAD},
    "hand_landmark/hand_landmark_lite": {Op.FULLY_CONNECTED, Op.MEAN, Op.LOGISTIC},
    "holistic_landmark/hand_recrop": {Op.STRIDED_SLICE, Op.PRELU, Op.PAD},
    "iris_landmark/iris_landmark": {Op.PRELU, Op.PAD, Op.RESHAPE},
    "palm_detection/palm_detection_lite": {Op.RESIZE_BILINEAR, Op.CONCATENATION, Op.RESHAPE},
    "pose_detection/pose_detection": {Op.DENSIFY, Op.DEPTH_TO_SPACE, Op.PAD},
    "pose_landmark/pose_landmark_full": {Op.RESHAPE, Op.RESIZE_BILINEAR, Op.LOGISTIC},
    "selfie_segmentation/selfie_segmentation_landscape": {Op.HARD_SWISH, Op.MEAN, Op.MUL},
}
# outputs agree within this fraction of their largest magnitude (LiteRT's XNNPACK kernels sum in
# another order; measured: at most 3e-4, pose_landmark_full's segmentation logits)
RTOL = 1e-3


@pytest.fixture(scope="module")
def wheel() -> Path:
    source = find_card(ROOT / "models", "selfie").source
    assert source is not None
    return download(source.package, source.distribution, CACHE / "packages", source.wheel_tag)


@pytest.fixture(scope="module")
def tflite(wheel: Path, tmp_path_factory) -> Path:
    """The wheel's .tflite files, extracted."""
    dest = tmp_path_factory.mktemp("mediapipe")
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(MODULES) and name.endswith(".tflite"):
                z.extract(name, dest)
    return dest / MODULES


def _litert(model: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    interpreter = Interpreter(model_path=str(model))
    (inp,) = interpreter.get_input_details()
    interpreter.resize_tensor_input(inp["index"], list(x.shape))
    interpreter.allocate_tensors()
    interpreter.set_tensor(inp["index"], x)
    interpreter.invoke()
    return {d["name"]: interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()}


def _onnx(model: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    outputs = session.get_outputs()
    names = [output.name for output in outputs]
    return dict(zip(names, session.run(names, {session.get_inputs()[0].name: x})))


def _agree(theirs: dict[str, np.ndarray], mine: dict[str, np.ndarray]) -> None:
    assert sorted(theirs) == sorted(mine)
    for name, want in theirs.items():
        assert mine[name].shape == want.shape, name
        scale = max(float(np.abs(want).max()), 1e-6)
        assert float(np.abs(mine[name] - want).max()) <= RTOL * scale, (name, np.abs(mine[name] - want).max(), scale)


def _image(samples: Path, name: str, hw: tuple[int, int]) -> np.ndarray:
    """A real picture at the model's input size, in MediaPipe's [-1, 1] range, NHWC."""
    rgb = cv2.cvtColor(cv2.imread(str(samples / name), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    return (cv2.resize(rgb, (hw[1], hw[0])).astype(np.float32) / 127.5 - 1.0)[None]


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_a_mediapipe_model_built_into_onnx_gives_litert_s_outputs(tflite: Path, samples: Path, tmp_path: Path,
                                                                 name: str) -> None:
    """On two real pictures, one at a time and as a batch of two (RESHAPE and FULLY_CONNECTED keep the
    batch axis the input's, though the file says 1)."""
    source = tflite / f"{name}.tflite"
    model = read(source)
    used = {op.code for op in model.operators}
    assert {int(o) for o in CONVERTED[name]} <= used
    build({"model": source}, tmp_path / "model.onnx")
    _, h, w, _ = model.tensors[model.inputs[0]].shape
    a, b = _image(samples, "astronaut.png", (h, w)), _image(samples, "coffee.png", (h, w))
    for x in (a, b):
        _agree(_litert(source, x), _onnx(tmp_path / "model.onnx", x))
    both = _onnx(tmp_path / "model.onnx", np.concatenate([a, b]))
    alone = _onnx(tmp_path / "model.onnx", b)
    for out, y in both.items():
        np.testing.assert_allclose(y[1:], alone[out], rtol=1e-4, atol=1e-4 * float(np.abs(y).max()))


def test_the_tested_models_use_every_builtin_operator_but_softmax_and_sub(tflite: Path) -> None:
    used = {op.code for name in CONVERTED for op in read(tflite / f"{name}.tflite").operators}
    assert {int(o) for o in Op} - used == {Op.SOFTMAX, Op.SUB, Op.AVERAGE_POOL_2D, Op.RELU6, Op.TANH}
    # AVERAGE_POOL_2D: the selfie model (test_reference_selfie.py); the rest: the small graphs below


def test_a_model_with_an_operator_the_builder_does_not_know_is_refused_naming_it(tflite: Path,
                                                                                 tmp_path: Path) -> None:
    """The face landmark model with attention ends in MediaPipe's own custom operators."""
    source = tflite / "face_landmark/face_landmark_with_attention.tflite"
    with pytest.raises(ModelError, match=r"^face_landmark_with_attention\.tflite: operator #192 "
                                         r"\(Landmarks2TransformMatrix\): not supported by this builder"):
        build({"model": source}, tmp_path / "model.onnx")
    assert not (tmp_path / "model.onnx").exists()


def test_operator_names_are_the_schemas() -> None:
    """The names messages give operators, and the builder's own, are those of LiteRT's schema code."""
    schema_names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    assert dict(enumerate(BUILTIN_NAMES)) == schema_names
    assert all(BUILTIN_NAMES[o] == o.name for o in Op)


# -- small graphs written here ----------------------------------------------------------------------

def _tiny(tensors: list[tuple[str, tuple[int, ...], np.ndarray | None]],
          ops: list[tuple[int, int, object, list[int], list[int]]], inputs: list[int], outputs: list[int],
          sparsity: dict[int, object] | None = None) -> bytes:
    """A .tflite file: tensors (name, shape, constant data or None; float32 unless the data is int32),
    operators (builtin code, BuiltinOptions type, options object, input and output tensor indices);
    `sparsity` gives a tensor (by index) its SparsityParametersT, its data then the values kept."""
    model = schema.ModelT()
    model.version = 3
    model.buffers = [schema.BufferT()]  # buffer 0: the empty one activations point at
    graph = schema.SubGraphT()
    graph.tensors = []
    for name, shape, data in tensors:
        t = schema.TensorT()
        t.name, t.shape, t.type = name, list(shape), schema.TensorType.FLOAT32
        t.buffer = 0
        if data is not None:
            if data.dtype == np.int32:
                t.type = schema.TensorType.INT32
            buffer = schema.BufferT()
            buffer.data = np.frombuffer(np.ascontiguousarray(data, data.dtype if data.dtype == np.int32
                                                             else np.float32).tobytes(), np.uint8)
            model.buffers.append(buffer)
            t.buffer = len(model.buffers) - 1
        t.sparsity = (sparsity or {}).get(len(graph.tensors))
        graph.tensors.append(t)
    codes = sorted({code for code, *_ in ops})
    model.operatorCodes = []
    for code in codes:
        c = schema.OperatorCodeT()
        c.builtinCode, c.deprecatedBuiltinCode, c.version = code, min(code, 127), 1
        model.operatorCodes.append(c)
    graph.operators = []
    for code, options_type, options, ins, outs in ops:
        o = schema.OperatorT()
        o.opcodeIndex, o.inputs, o.outputs = codes.index(code), ins, outs
        o.builtinOptionsType, o.builtinOptions = options_type, options
        graph.operators.append(o)
    graph.inputs, graph.outputs = inputs, outputs
    model.subgraphs = [graph]
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _options(cls: type, **fields: object) -> object:
    options = cls()
    for k, v in fields.items():
        setattr(options, k, v)
    return options


def _both_ways(tmp_path: Path, data: bytes, x: np.ndarray) -> None:
    (tmp_path / "tiny.tflite").write_bytes(data)
    build({"model": tmp_path / "tiny.tflite"}, tmp_path / "tiny.onnx")
    _agree(_litert(tmp_path / "tiny.tflite", x), _onnx(tmp_path / "tiny.onnx", x))


def test_a_grouped_convolution_then_sub_reshape_fully_connected_and_softmax(tmp_path: Path) -> None:
    """(1, 4, 4, 6) -> CONV_2D in 2 groups of 3 channels, SAME, RELU6 fused -> SUB a per-channel constant
    -> RESHAPE (1, 64), NHWC order -> FULLY_CONNECTED to 5, RELU_N1_TO_1 fused -> SOFTMAX with beta 0.5."""
    rng = np.random.default_rng(7)
    B = schema.BuiltinOptions
    data = _tiny(
        [("x", (1, 4, 4, 6), None), ("w", (4, 3, 3, 3), rng.normal(size=(4, 3, 3, 3))),
         ("b", (4,), rng.normal(size=4)), ("conv", (1, 4, 4, 4), None), ("k", (4,), rng.normal(size=4)),
         ("sub", (1, 4, 4, 4), None), ("flat", (1, 64), None), ("fw", (5, 64), rng.normal(size=(5, 64)) / 8),
         ("fb", (5,), rng.normal(size=5)), ("fc", (1, 5), None), ("y", (1, 5), None)],
        [(Op.CONV_2D, B.Conv2DOptions, _options(schema.Conv2DOptionsT, padding=schema.Padding.SAME, strideW=1,
                                                strideH=1, fusedActivationFunction=3), [0, 1, 2], [3]),
         (Op.SUB, B.SubOptions, schema.SubOptionsT(), [3, 4], [5]),
         (Op.RESHAPE, B.ReshapeOptions, _options(schema.ReshapeOptionsT, newShape=[1, 64]), [5], [6]),
         (Op.FULLY_CONNECTED, B.FullyConnectedOptions,
          _options(schema.FullyConnectedOptionsT, fusedActivationFunction=2), [6, 7, 8], [9]),
         (Op.SOFTMAX, B.SoftmaxOptions, _options(schema.SoftmaxOptionsT, beta=0.5), [9], [10])],
        [0], [10])
    _both_ways(tmp_path, data, rng.normal(size=(1, 4, 4, 6)).astype(np.float32))


def test_a_strided_slice_with_masks_a_step_and_a_reversed_axis(tmp_path: Path) -> None:
    """(1, 5, 6, 4) -> STRIDED_SLICE begin (0, 1, 4, 3), end (1, 5, -1, 0), strides (1, 2, 1, -1), the
    batch and width axes from their start whatever begin says (begin_mask) and the channels back to the
    first (end_mask): (1, 2, 5, 4)."""
    B = schema.BuiltinOptions
    data = _tiny(
        [("x", (1, 5, 6, 4), None), ("begin", (4,), np.array([0, 1, 4, 3], np.int32)),
         ("end", (4,), np.array([1, 5, -1, 0], np.int32)), ("strides", (4,), np.array([1, 2, 1, -1], np.int32)),
         ("y", (1, 2, 5, 4), None)],
        [(Op.STRIDED_SLICE, B.StridedSliceOptions,
          _options(schema.StridedSliceOptionsT, beginMask=0b0101, endMask=0b1000), [0, 1, 2, 3], [4])],
        [0], [4])
    x = np.random.default_rng(4).normal(size=(1, 5, 6, 4)).astype(np.float32)
    _both_ways(tmp_path, data, x)
    assert np.array_equal(_onnx(tmp_path / "tiny.onnx", x)["y"], x[:, 1:5:2, 0:-1, 3::-1])


def _csr_levels(dense: np.ndarray, order: list[int], compressed: set[int]) -> tuple[object, np.ndarray]:
    """TFLite's sparsity for `dense` walked in `order`, the levels in `compressed` CSR (kept: the indices
    under which anything is non-zero), the others dense; and the values kept, in walk order."""
    walked = dense.transpose(order)
    levels: list[dict[str, list[int]]] = [{"segments": [0], "indices": []} for _ in order]
    values: list[float] = []

    def walk(level: int, prefix: tuple[int, ...]) -> None:
        if level == len(order):
            values.append(float(walked[prefix]))
            return
        for i in range(walked.shape[level]):
            if level in compressed and not walked[prefix + (i,)].any():
                continue
            if level in compressed:
                levels[level]["indices"].append(i)
            walk(level + 1, prefix + (i,))
        if level in compressed:
            levels[level]["segments"].append(len(levels[level]["indices"]))

    walk(0, ())
    params = schema.SparsityParametersT()
    params.traversalOrder, params.blockMap, params.dimMetadata = order, [], []
    for level, axis in enumerate(order):
        meta = schema.DimensionMetadataT()
        if level in compressed:
            meta.format = schema.DimensionType.SPARSE_CSR
            meta.arraySegmentsType = meta.arrayIndicesType = schema.SparseIndexVector.Int32Vector
            meta.arraySegments, meta.arrayIndices = schema.Int32VectorT(), schema.Int32VectorT()
            meta.arraySegments.values, meta.arrayIndices.values = levels[level]["segments"], levels[level]["indices"]
        else:
            meta.format, meta.denseSize = schema.DimensionType.DENSE, dense.shape[axis]
        params.dimMetadata.append(meta)
    return params, np.array(values, np.float32)


def test_sparse_weights_in_any_traversal_order_are_made_dense_as_litert_does(tmp_path: Path) -> None:
    """A constant of shape (1, 3, 4, 5), two thirds zeros, stored walked in the order (0, 1, 3, 2) with the
    last two levels compressed (CSR within CSR), made dense by DENSIFY and added to the input: the same
    sums both ways; an index pointing past its axis is refused naming the tensor."""
    rng = np.random.default_rng(11)
    dense = rng.normal(size=(1, 3, 4, 5)).astype(np.float32) * (rng.random((1, 3, 4, 5)) < 0.33)
    dense[0, 1] = 0  # a whole slice empty: a position with no children at the first compressed level
    params, values = _csr_levels(dense, [0, 1, 3, 2], {2, 3})

    def graph() -> bytes:
        return _tiny([("x", (1, 3, 4, 5), None), ("w_sparse", (1, 3, 4, 5), values), ("w", (1, 3, 4, 5), None),
                      ("y", (1, 3, 4, 5), None)],
                     [(Op.DENSIFY, schema.BuiltinOptions.DensifyOptions, schema.DensifyOptionsT(), [1], [2]),
                      (Op.ADD, schema.BuiltinOptions.AddOptions, schema.AddOptionsT(), [0, 2], [3])],
                     [0], [3], sparsity={1: params})

    x = rng.normal(size=(1, 3, 4, 5)).astype(np.float32)
    _both_ways(tmp_path, graph(), x)
    assert np.allclose(_onnx(tmp_path / "tiny.onnx", x)["y"], x + dense)
    params.dimMetadata[3].arrayIndices.values[0] = 4  # axis 2 has 4 entries: 0-3
    (tmp_path / "tiny.tflite").write_bytes(graph())
    with pytest.raises(ModelError, match="tensor w_sparse: its sparse index points outside the tensor"):
        build({"model": tmp_path / "tiny.tflite"}, tmp_path / "bad.onnx")


def test_softmax_and_tanh_concatenated_then_relu6_and_padded(tmp_path: Path) -> None:
    """(1, 5, 6, 3) -> SOFTMAX over channels with beta 2, beside TANH -> CONCATENATION on axis -1 ->
    RELU6 -> PAD rows (1, 2) and columns (0, 1): channels-last axes mapped to NCHW."""
    B = schema.BuiltinOptions
    data = _tiny(
        [("x", (1, 5, 6, 3), None), ("soft", (1, 5, 6, 3), None), ("tanh", (1, 5, 6, 3), None),
         ("cat", (1, 5, 6, 6), None), ("relu6", (1, 5, 6, 6), None),
         ("pads", (4, 2), np.array([[0, 0], [1, 2], [0, 1], [0, 0]], np.int32)),
         ("y", (1, 8, 7, 6), None)],
        [(Op.SOFTMAX, B.SoftmaxOptions, _options(schema.SoftmaxOptionsT, beta=2.0), [0], [1]),
         (Op.TANH, B.NONE, None, [0], [2]),
         (Op.CONCATENATION, B.ConcatenationOptions, _options(schema.ConcatenationOptionsT, axis=-1), [1, 2], [3]),
         (Op.RELU6, B.NONE, None, [3], [4]),
         (Op.PAD, B.PadOptions, schema.PadOptionsT(), [4, 5], [6])],
        [0], [6])
    _both_ways(tmp_path, data, np.random.default_rng(3).normal(size=(1, 5, 6, 3)).astype(np.float32) * 3)
