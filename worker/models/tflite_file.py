"""Read a TensorFlow Lite model file: its tensors, constant data and operators, as plain data.

A .tflite file is a FlatBuffer (schema: tensorflow/lite/schema/schema.fbs). This reads the few tables a
converter needs straight from the bytes with `struct`, so building an ONNX file from one needs neither
TensorFlow nor a FlatBuffers package. Field numbers below are the schema's, in its declaration order.

FlatBuffers in brief: a table starts with a signed offset back to its vtable; the vtable lists, per
field, where in the table the field is (0: absent, take the default). Offsets to tables, vectors and
strings are unsigned and relative to where they are stored; a vector is a u32 length, then its items.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from worker.errors import ModelError

# TensorType -> numpy dtype (the ones a float model carries; int8/uint8 ones are quantised models)
_DTYPES = {0: np.float32, 1: np.float16, 2: np.int32, 3: np.uint8, 4: np.int64, 7: np.int16, 9: np.int8,
           10: np.float64}
CUSTOM = 32  # BuiltinOperator.CUSTOM

# BuiltinOperator's names in code order (schema.fbs, as of LiteRT 2.3), for messages about operators
# this package does not convert; tests/test_build_tflite.py holds them to LiteRT's own schema code
_BUILTIN_NAMES = """
    ADD AVERAGE_POOL_2D CONCATENATION CONV_2D DEPTHWISE_CONV_2D DEPTH_TO_SPACE DEQUANTIZE EMBEDDING_LOOKUP
    FLOOR FULLY_CONNECTED HASHTABLE_LOOKUP L2_NORMALIZATION L2_POOL_2D LOCAL_RESPONSE_NORMALIZATION LOGISTIC
    LSH_PROJECTION LSTM MAX_POOL_2D MUL RELU RELU_N1_TO_1 RELU6 RESHAPE RESIZE_BILINEAR RNN SOFTMAX
    SPACE_TO_DEPTH SVDF TANH CONCAT_EMBEDDINGS SKIP_GRAM CALL CUSTOM EMBEDDING_LOOKUP_SPARSE PAD
    UNIDIRECTIONAL_SEQUENCE_RNN GATHER BATCH_TO_SPACE_ND SPACE_TO_BATCH_ND TRANSPOSE MEAN SUB DIV SQUEEZE
    UNIDIRECTIONAL_SEQUENCE_LSTM STRIDED_SLICE BIDIRECTIONAL_SEQUENCE_RNN EXP TOPK_V2 SPLIT LOG_SOFTMAX
    DELEGATE BIDIRECTIONAL_SEQUENCE_LSTM CAST PRELU MAXIMUM ARG_MAX MINIMUM LESS NEG PADV2 GREATER
    GREATER_EQUAL LESS_EQUAL SELECT SLICE SIN TRANSPOSE_CONV SPARSE_TO_DENSE TILE EXPAND_DIMS EQUAL NOT_EQUAL
    LOG SUM SQRT RSQRT SHAPE POW ARG_MIN FAKE_QUANT REDUCE_PROD REDUCE_MAX PACK LOGICAL_OR ONE_HOT LOGICAL_AND
    LOGICAL_NOT UNPACK REDUCE_MIN FLOOR_DIV REDUCE_ANY SQUARE ZEROS_LIKE FILL FLOOR_MOD RANGE
    RESIZE_NEAREST_NEIGHBOR LEAKY_RELU SQUARED_DIFFERENCE MIRROR_PAD ABS SPLIT_V UNIQUE CEIL REVERSE_V2 ADD_N
    GATHER_ND COS WHERE RANK ELU REVERSE_SEQUENCE MATRIX_DIAG QUANTIZE MATRIX_SET_DIAG ROUND HARD_SWISH IF
    WHILE NON_MAX_SUPPRESSION_V4 NON_MAX_SUPPRESSION_V5 SCATTER_ND SELECT_V2 DENSIFY SEGMENT_SUM BATCH_MATMUL
    PLACEHOLDER_FOR_GREATER_OP_CODES CUMSUM CALL_ONCE BROADCAST_TO RFFT2D CONV_3D IMAG REAL COMPLEX_ABS
    HASHTABLE HASHTABLE_FIND HASHTABLE_IMPORT HASHTABLE_SIZE REDUCE_ALL CONV_3D_TRANSPOSE VAR_HANDLE
    READ_VARIABLE ASSIGN_VARIABLE BROADCAST_ARGS RANDOM_STANDARD_NORMAL BUCKETIZE RANDOM_UNIFORM MULTINOMIAL
    GELU DYNAMIC_UPDATE_SLICE RELU_0_TO_1 UNSORTED_SEGMENT_PROD UNSORTED_SEGMENT_MAX UNSORTED_SEGMENT_SUM
    ATAN2 UNSORTED_SEGMENT_MIN SIGN BITCAST BITWISE_XOR RIGHT_SHIFT STABLEHLO_LOGISTIC STABLEHLO_ADD
    STABLEHLO_DIVIDE STABLEHLO_MULTIPLY STABLEHLO_MAXIMUM STABLEHLO_RESHAPE STABLEHLO_CLAMP
    STABLEHLO_CONCATENATE STABLEHLO_BROADCAST_IN_DIM STABLEHLO_CONVOLUTION STABLEHLO_SLICE
    STABLEHLO_CUSTOM_CALL STABLEHLO_REDUCE STABLEHLO_ABS STABLEHLO_AND STABLEHLO_COSINE STABLEHLO_EXPONENTIAL
    STABLEHLO_FLOOR STABLEHLO_LOG STABLEHLO_MINIMUM STABLEHLO_NEGATE STABLEHLO_OR STABLEHLO_POWER
    STABLEHLO_REMAINDER STABLEHLO_RSQRT STABLEHLO_SELECT STABLEHLO_SUBTRACT STABLEHLO_TANH STABLEHLO_SCATTER
    STABLEHLO_COMPARE STABLEHLO_CONVERT STABLEHLO_DYNAMIC_SLICE STABLEHLO_DYNAMIC_UPDATE_SLICE STABLEHLO_PAD
    STABLEHLO_IOTA STABLEHLO_DOT_GENERAL STABLEHLO_REDUCE_WINDOW STABLEHLO_SORT STABLEHLO_WHILE
    STABLEHLO_GATHER STABLEHLO_TRANSPOSE DILATE STABLEHLO_RNG_BIT_GENERATOR REDUCE_WINDOW STABLEHLO_COMPOSITE
    STABLEHLO_SHIFT_LEFT STABLEHLO_CBRT STABLEHLO_CASE
"""
BUILTIN_NAMES: tuple[str, ...] = tuple(_BUILTIN_NAMES.split())


def builtin_name(code: int) -> str:
    """The schema's name of a builtin operator code (a newer schema's code: its number)."""
    return BUILTIN_NAMES[code] if 0 <= code < len(BUILTIN_NAMES) else f"builtin operator {code}"


class Table:
    """One FlatBuffers table at `pos` in `buf`; fields are read by their number in the schema."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self.vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        self.vsize = struct.unpack_from("<H", buf, self.vtable)[0]

    def field_at(self, i: int) -> int:
        """Where field i is in the buffer, or 0 when absent."""
        slot = 4 + 2 * i
        if slot >= self.vsize:
            return 0
        off = struct.unpack_from("<H", self.buf, self.vtable + slot)[0]
        return self.pos + off if off else 0

    def scalar(self, i: int, fmt: str, default: Any = 0) -> Any:
        at = self.field_at(i)
        return struct.unpack_from("<" + fmt, self.buf, at)[0] if at else default

    def target(self, i: int) -> int:
        """Where the table, vector or string that field i refers to starts, or 0 when absent."""
        at = self.field_at(i)
        return at + struct.unpack_from("<I", self.buf, at)[0] if at else 0

    def table(self, i: int) -> Table | None:
        at = self.target(i)
        return Table(self.buf, at) if at else None

    def string(self, i: int) -> str:
        at = self.target(i)
        if not at:
            return ""
        n = struct.unpack_from("<I", self.buf, at)[0]
        return self.buf[at + 4:at + 4 + n].decode("utf-8", "replace")

    def vector(self, i: int, fmt: str) -> tuple[Any, ...]:
        at = self.target(i)
        if not at:
            return ()
        n = struct.unpack_from("<I", self.buf, at)[0]
        return struct.unpack_from(f"<{n}{fmt}", self.buf, at + 4)

    def raw(self, i: int) -> bytes:
        """A vector of bytes."""
        at = self.target(i)
        if not at:
            return b""
        n = struct.unpack_from("<I", self.buf, at)[0]
        return self.buf[at + 4:at + 4 + n]

    def tables(self, i: int) -> list[Table]:
        at = self.target(i)
        if not at:
            return []
        n = struct.unpack_from("<I", self.buf, at)[0]
        items = [at + 4 + 4 * k for k in range(n)]
        return [Table(self.buf, p + struct.unpack_from("<I", self.buf, p)[0]) for p in items]


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: Any  # numpy dtype
    data: np.ndarray | None  # constant data (weights), shaped; None for activations


@dataclass(frozen=True)
class Operator:
    index: int  # its place in the graph, for messages
    code: int  # BuiltinOperator (CUSTOM: see `custom`)
    custom: str  # a custom operator's name
    inputs: tuple[int, ...]  # tensor indices; -1: an optional input left out
    outputs: tuple[int, ...]
    options: Table | None = field(repr=False)  # the builtin options table (read with `option`)
    custom_options: bytes = b""

    def option(self, i: int, fmt: str, default: Any = 0) -> Any:
        """Field i of the operator's builtin options table (its schema's numbering)."""
        return self.options.scalar(i, fmt, default) if self.options is not None else default


@dataclass(frozen=True)
class TfliteModel:
    tensors: tuple[Tensor, ...]
    operators: tuple[Operator, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


def read(path: Path) -> TfliteModel:
    """The first subgraph of a .tflite file; a ModelError naming the file when it is not one."""
    buf = path.read_bytes()
    if len(buf) < 8 or buf[4:8] != b"TFL3":
        raise ModelError(f"{path}: not a TensorFlow Lite model (no 'TFL3' identifier)")
    try:
        return _read(buf)
    except (struct.error, ValueError, IndexError) as e:
        raise ModelError(f"{path}: cannot read it as a TensorFlow Lite model: {e}") from None


def _read(buf: bytes) -> TfliteModel:
    model = Table(buf, struct.unpack_from("<I", buf, 0)[0])
    # Model: 1 operator_codes, 2 subgraphs, 4 buffers
    codes = [(max(c.scalar(0, "b"), c.scalar(3, "i")), c.string(1)) for c in model.tables(1)]
    buffers = model.tables(4)
    (graph, *_) = model.tables(2)
    tensors = []
    for t in graph.tables(0):  # Tensor: 0 shape, 1 type, 2 buffer, 3 name, 6 sparsity
        dtype = _DTYPES.get(t.scalar(1, "b"))
        shape = tuple(t.vector(0, "i"))
        sparsity = t.table(6)  # its buffer then holds only the values kept, in the order it gives
        data = _data(buf, buffers[t.scalar(2, "I")], dtype, None if sparsity else shape) if t.scalar(2, "I") else None
        if sparsity is not None and data is not None:
            data = _densify(data, shape, sparsity, t.string(3))
        tensors.append(Tensor(t.string(3), shape, dtype, data))
    ops = []
    for k, o in enumerate(graph.tables(3)):  # Operator: 0 opcode_index, 1 inputs, 2 outputs, 4 options, 5 custom
        code, custom = codes[o.scalar(0, "I")]
        ops.append(Operator(k, code, custom, tuple(o.vector(1, "i")), tuple(o.vector(2, "i")), o.table(4),
                            o.raw(5)))
    # SubGraph: 1 inputs, 2 outputs
    return TfliteModel(tuple(tensors), tuple(ops), tuple(graph.vector(1, "i")), tuple(graph.vector(2, "i")))


def _densify(values: np.ndarray, shape: tuple[int, ...], sparsity: Table, name: str) -> np.ndarray:
    """A sparse constant made dense, as TFLite's DENSIFY does (its FormatConverter): the dimensions are
    walked in `traversal_order`, each either dense (every index up to its size) or compressed (CSR: the
    indices kept, `array_indices[array_segments[p]:array_segments[p + 1]]` for position p of the walk so
    far); `values` holds one value per complete walk, in order. Block-sparse tensors (a `block_map`)
    are refused."""
    # SparsityParameters: 0 traversal_order, 1 block_map, 2 dim_metadata
    order, blocks, dims = sparsity.vector(0, "i"), sparsity.vector(1, "i"), sparsity.tables(2)
    if blocks or sorted(order) != list(range(len(shape))) or len(dims) != len(shape):
        raise ValueError(f"tensor {name} is stored block-sparse (TFLite's sparsity format with a block map), "
                         f"which this reader does not expand")
    # level by level, every walk at once: each position's children stay together and in order, so the
    # walks come out in the order the values are stored (what a depth-first walk would visit)
    positions = np.zeros(1, dtype=np.int64)
    coords: list[np.ndarray] = []  # per level so far: each walk's index along that level's axis
    for level, axis in enumerate(order):
        # DimensionMetadata: 0 format (0 dense, 1 CSR), 1 dense_size, 3 array_segments, 5 array_indices
        # (the last two Int32Vector, Uint16Vector or Uint8Vector tables: 0 values)
        meta = dims[level]
        if meta.scalar(0, "b") == 0:
            size = meta.scalar(1, "i")
            counts = np.full(positions.size, size, dtype=np.int64)
            children = (positions[:, None] * size + np.arange(size)).reshape(-1)
            along = np.tile(np.arange(size), positions.size)
        else:
            kinds = {1: "i", 2: "H", 3: "B"}
            seg_table, idx_table = meta.table(3), meta.table(5)
            if seg_table is None or idx_table is None:
                raise ValueError(f"tensor {name}: a compressed dimension without its sparse index")
            segments = np.asarray(seg_table.vector(0, kinds[meta.scalar(2, "B")]), dtype=np.int64)
            indices = np.asarray(idx_table.vector(0, kinds[meta.scalar(4, "B")]), dtype=np.int64)
            if positions.size and positions.max() + 1 >= segments.size:
                raise ValueError(f"tensor {name}: its sparse index is shorter than its dimensions need")
            starts, counts = segments[positions], segments[positions + 1] - segments[positions]
            first = np.repeat(np.cumsum(counts) - counts, counts)  # where each parent's children begin
            children = np.arange(int(counts.sum()), dtype=np.int64) - first + np.repeat(starts, counts)
            if children.size and (children.max() >= indices.size or indices[children].max() >= shape[axis]):
                raise ValueError(f"tensor {name}: its sparse index points outside the tensor")
            along = indices[children]
        coords = [np.repeat(c, counts) for c in coords] + [along]
        positions = children
    flat = values.reshape(-1)
    if positions.size != flat.size:
        raise ValueError(f"tensor {name}: its sparse index covers {positions.size} values, "
                         f"its buffer holds {flat.size}")
    dense = np.zeros(shape, dtype=values.dtype)
    by_axis = [np.empty(0, dtype=np.int64)] * len(shape)
    for level, axis in enumerate(order):
        by_axis[axis] = coords[level]
    dense[tuple(by_axis)] = flat
    return dense


def _data(buf: bytes, b: Table, dtype: Any, shape: tuple[int, ...] | None) -> np.ndarray | None:
    """A buffer's bytes as an array (Buffer: 0 data; or 1 offset and 2 size into the file, for large models);
    `shape` None for a flat one."""
    raw = b.raw(0)
    if not raw and (size := b.scalar(2, "Q")):
        offset = b.scalar(1, "Q")
        raw = buf[offset:offset + size]
    if not raw:
        return None
    if dtype is None:
        raise ValueError("a constant tensor of a type this reader does not know")
    flat = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    return (flat if shape is None else flat.reshape(shape)).astype(dtype)
