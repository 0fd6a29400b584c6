"""Small ONNX models built for a test, in the shapes users export theirs (a stand-in for a real model where
only the pipeline's mechanics or a card's reading is under test), and the card folder beside them."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def card_file(models: Path, name: str, body: str) -> Path:
    """models/<name>/model.yaml naming <name>.onnx, with `body` (the rest of the card); returns the folder."""
    folder = models / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.yaml").write_text(f"name: {name}\nonnx: {name}.onnx\n{body}\n")
    return folder


def save_model(graph, path: Path) -> None:
    """A graph written with onnx.helper, as a checked opset-17 model file."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def channels_last_model(path: Path, elem: int) -> None:
    """A TensorFlow-style export: input (N, 32, 48, 3) of `elem` type (raw 0-255 pixels when uint8), the
    same 1x1 channel copy as `_channels_model`, output (N, 3, 32, 48) float16."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Cast", ["input"], ["x"], to=TensorProto.FLOAT),
             helper.make_node("Transpose", ["x"], ["nchw"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["nchw", "w"], ["conv"], kernel_shape=[1, 1]),
             helper.make_node("Cast", ["conv"], ["logits"], to=TensorProto.FLOAT16)]
    scale = 1 / 255 if elem == TensorProto.UINT8 else 1.0  # the card passes raw pixels for uint8
    w = numpy_helper.from_array((np.eye(3, dtype=np.float32) * scale).reshape(3, 3, 1, 1), "w")
    graph = helper.make_graph(nodes, "nhwc", [helper.make_tensor_value_info("input", elem, ["N", 32, 48, 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, ["N", 3, 32, 48])],
                              initializer=[w])
    save_model(graph, path)


def rows_model(path: Path, rows: np.ndarray, gate: np.ndarray) -> None:
    """(N, 3, 32, 48) -> output0 (N, K, d): the fixed `rows` (1, K, d) plus the image's mean level (0-1)
    wherever `gate` (1, K, d) is 1, so that one score follows the image."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("ReduceMean", ["input"], ["level"], axes=[1, 2, 3], keepdims=1),  # (N, 1, 1, 1)
             helper.make_node("Squeeze", ["level", "axis"], ["level2"]),  # (N, 1, 1)
             helper.make_node("Mul", ["level2", "gate"], ["scored"]),
             helper.make_node("Add", ["scored", "rows"], ["output0"])]
    inits = [numpy_helper.from_array(rows, "rows"), numpy_helper.from_array(gate, "gate"),
             numpy_helper.from_array(np.array([3], np.int64), "axis")]
    image = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 32, 48])
    graph = helper.make_graph(nodes, "rows", [image],
                              [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["N", *rows.shape[1:]])],
                              initializer=inits)
    save_model(graph, path)


def deploy_detector(path: Path) -> None:
    """As the RT-DETR, D-FINE and DEIM repositories export them: inputs `images` (N, 3, 32, 48) and
    `orig_target_sizes` (N, 2) int64 (width, height); outputs `labels` (N, 3) int64, `boxes` (N, 3, 4)
    x1, y1, x2, y2 in the pixels of those sizes, and `scores` (N, 3). Query 0 is a cup over the middle
    quarter whose score is the image's mean level, query 1 a car at 0.9 over the top-left quarter,
    query 2 padding."""
    from onnx import TensorProto, helper, numpy_helper

    unit = np.array([[[0.25, 0.25, 0.75, 0.75], [0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]], np.float32)
    inits = [numpy_helper.from_array(unit, "unit"), numpy_helper.from_array(np.array([[0.0, 0.9, 0.0]], np.float32),
                                                                            "base"),
             numpy_helper.from_array(np.array([[1.0, 0.0, 0.0]], np.float32), "gate"),
             numpy_helper.from_array(np.array([[1, 2, 0]], np.int64), "ids"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    nodes = [helper.make_node("Cast", ["orig_target_sizes"], ["wh"], to=TensorProto.FLOAT),  # (N, 2)
             helper.make_node("Concat", ["wh", "wh"], ["whwh"], axis=1),  # (N, 4)
             helper.make_node("Unsqueeze", ["whwh", "one"], ["whwh3"]),  # (N, 1, 4)
             helper.make_node("Mul", ["unit", "whwh3"], ["boxes"]),  # (N, 3, 4)
             helper.make_node("ReduceMean", ["images"], ["level"], axes=[1, 2, 3], keepdims=0),  # (N,)
             helper.make_node("Unsqueeze", ["level", "one"], ["level2"]),  # (N, 1)
             helper.make_node("Mul", ["level2", "gate"], ["lit"]),
             helper.make_node("Add", ["lit", "base"], ["scores"]),  # (N, 3)
             helper.make_node("Cast", ["level2"], ["level_ids"], to=TensorProto.INT64),
             helper.make_node("Mul", ["level_ids", "zero"], ["nothing"]),  # (N, 1) zeros: the batch's rows
             helper.make_node("Add", ["nothing", "ids"], ["labels"])]  # (N, 3)
    inits.append(numpy_helper.from_array(np.array([[0]], np.int64), "zero"))
    feeds = [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 32, 48]),
             helper.make_tensor_value_info("orig_target_sizes", TensorProto.INT64, ["N", 2])]
    outs = [helper.make_tensor_value_info("labels", TensorProto.INT64, ["N", 3]),
            helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["N", 3, 4]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("whwh", TensorProto.FLOAT, ["N", 4])]  # not for joining: 4 rows, not 3
    save_model(helper.make_graph(nodes, "deploy", feeds, outs, initializer=inits), path)


def seg_model(path: Path, rows: np.ndarray, gate: np.ndarray, protos: np.ndarray) -> None:
    """(N, 3, 32, 48) -> an instance segmenter's two outputs, as a YOLOv8-seg export names them: output0,
    the boxes' `rows` plus the image's mean level (0-1) wherever `gate` is 1, and output1, the prototype
    masks `protos` (M, h, w) as they are."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("ReduceMean", ["images"], ["level"], axes=[1, 2, 3], keepdims=1),  # (N, 1, 1, 1)
             helper.make_node("Squeeze", ["level", "axis"], ["level3"]),  # (N, 1, 1)
             helper.make_node("Mul", ["level3", "gate"], ["scored"]),
             helper.make_node("Add", ["scored", "rows"], ["output0"]),
             helper.make_node("Mul", ["level", "zeros"], ["nothing"]),  # (N, M, h, w) of zeros
             helper.make_node("Add", ["nothing", "protos"], ["output1"])]
    inits = [numpy_helper.from_array(rows[None], "rows"), numpy_helper.from_array(gate[None], "gate"),
             numpy_helper.from_array(protos[None], "protos"),
             numpy_helper.from_array(np.zeros_like(protos[None]), "zeros"),
             numpy_helper.from_array(np.array([3], np.int64), "axis")]
    image = helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 32, 48])
    outs = [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["N", *rows.shape]),
            helper.make_tensor_value_info("output1", TensorProto.FLOAT, ["N", *protos.shape])]
    save_model(helper.make_graph(nodes, "seg", [image], outs, initializer=inits), path)


def quadrant_segmenter(path: Path, layout: str) -> None:
    """(N, 3, 32, 48) -> an instance segmenter's two outputs, as YOLOv8-seg (or YOLOv5-seg, YOLO26-seg) gives
    them: output0, 3 anchors' rows (yolov8: (N, 4+2+2, 3); yolov5: (N, 3, 5+2+2); end2end: (N, 3, 6+2),
    the same boxes as corners, score and class), and output1, 2 prototype
    masks (N, 2, 8, 12), a quarter of the input. Prototype 0 is +10 over the input's top-left 36x24
    and -10 elsewhere, prototype 1 over the bottom-right 36x24: each covers its box (a quadrant) and
    reaches into the other's, which the boxes crop. Anchor 0: a box on the top-left
    quadrant, class 0 scored by the image's mean level (0-1), coefficients (1, 0); anchor 1: the
    bottom-right quadrant, class 1 at 0.8, coefficients (0, 1); anchor 2: a box on the whole input at
    0.1, under any threshold."""
    yolov5 = layout == "yolov5"
    anchors = np.array([[12, 8, 24, 16, 0.0, 0.0, 1, 0], [36, 24, 24, 16, 0.0, 0.8, 0, 1],
                        [24, 16, 48, 32, 0.1, 0.0, 0, 0]], np.float32)  # cx, cy, w, h, classes, coefficients
    gate = np.zeros_like(anchors)
    gate[0, 4] = 1.0
    if layout == "end2end":  # YOLO26-seg's rows: x1, y1, x2, y2, score, class, coefficients: (N, 3, 6+2)
        anchors = np.array([[0, 0, 24, 16, 0.0, 0, 1, 0], [24, 16, 48, 32, 0.8, 1, 0, 1],
                            [0, 0, 48, 32, 0.1, 0, 0, 0]], np.float32)
    if yolov5:  # an objectness of 1 before the classes
        anchors, gate = np.insert(anchors, 4, 1.0, axis=1), np.insert(gate, 4, 0.0, axis=1)
    rows, gate = (anchors, gate) if layout != "yolov8" else (anchors.T, gate.T)
    protos = np.full((2, 8, 12), -10.0, np.float32)
    protos[0, :6, :9] = 10.0
    protos[1, 2:, 3:] = 10.0
    seg_model(path, rows, gate, protos)


def gray_model(path: Path, layout: str) -> None:
    """A one-channel segmenter, (N, 1, 32, 48) or (N, 32, 48, 1) -> logits (N, 1, 32, 48) = 8 x - 4: a
    pixel is in the mask where its normalised gray level x is above one half."""
    from onnx import TensorProto, helper, numpy_helper

    shape = ["N", 1, 32, 48] if layout == "nchw" else ["N", 32, 48, 1]
    nodes = [helper.make_node("Transpose", ["input"], ["x"], perm=[0, 3, 1, 2])] if layout == "nhwc" else []
    nodes.append(helper.make_node("Conv", ["x" if nodes else "input", "w", "b"], ["logits"], kernel_shape=[1, 1]))
    graph = helper.make_graph(nodes, "gray", [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 1, 32, 48])],
                              initializer=[numpy_helper.from_array(np.full((1, 1, 1, 1), 8.0, np.float32), "w"),
                                           numpy_helper.from_array(np.array([-4.0], np.float32), "b")])
    save_model(graph, path)


RECT_BOXES = 12  # the rect detector's boxes (anchors), 2 classes


def rect_detector(path: Path) -> None:
    """A YOLOv8-layout detector of dynamic height and width, as `yolo export dynamic=True` gives one, with
    Ultralytics' metadata: images (N, 3, H, W) -> output0 (N, 4 + 2, 12). Its boxes sit at fixed fractions
    of the input it is given (cx, cy, w, h = f * W, f * H, ...), so where they land in the image depends on
    the input's own size and padding; each class score is a fixed value plus the image's mean level."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    k = RECT_BOXES
    unit = np.stack([rng.uniform(0.2, 0.8, k), rng.uniform(0.2, 0.8, k), rng.uniform(0.1, 0.4, k),
                     rng.uniform(0.1, 0.4, k)])[None].astype(np.float32)  # (1, 4, K): cx, cy, w, h
    base = rng.uniform(0.0, 0.6, (1, 2, k)).astype(np.float32)
    gate = rng.uniform(0.2, 0.6, (1, 2, k)).astype(np.float32)
    inits = [numpy_helper.from_array(unit, "unit"), numpy_helper.from_array(base, "base"),
             numpy_helper.from_array(gate, "gate"), numpy_helper.from_array(np.array([2], np.int64), "two"),
             numpy_helper.from_array(np.array([4], np.int64), "four"),
             numpy_helper.from_array(np.array([1, 4, 1], np.int64), "column"),
             numpy_helper.from_array(np.array([-1, 1, 1], np.int64), "per_image"),
             numpy_helper.from_array(np.array([1, 0, 1, 0], np.int64), "wh_order")]
    nodes = [helper.make_node("Shape", ["images"], ["shape"]),
             helper.make_node("Slice", ["shape", "two", "four"], ["hw"]),  # [H, W]
             helper.make_node("Cast", ["hw"], ["hw_f"], to=TensorProto.FLOAT),
             helper.make_node("Gather", ["hw_f", "wh_order"], ["whwh"], axis=0),  # [W, H, W, H]
             helper.make_node("Reshape", ["whwh", "column"], ["whwh3"]),  # (1, 4, 1)
             helper.make_node("Mul", ["unit", "whwh3"], ["boxes1"]),  # (1, 4, K) in input pixels
             helper.make_node("ReduceMean", ["images"], ["level"], axes=[1, 2, 3], keepdims=0),  # (N,)
             helper.make_node("Reshape", ["level", "per_image"], ["level3"]),  # (N, 1, 1)
             helper.make_node("Mul", ["level3", "gate"], ["lit"]),
             helper.make_node("Add", ["lit", "base"], ["scores"]),  # (N, 2, K)
             helper.make_node("Sub", ["level3", "level3"], ["zero"]),
             helper.make_node("Add", ["zero", "boxes1"], ["boxes"]),  # (N, 4, K)
             helper.make_node("Concat", ["boxes", "scores"], ["output0"], axis=1)]
    graph = helper.make_graph(nodes, "rect", [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                                                             ["batch", 3, "height", "width"])],
                              [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 6, k])],
                              initializer=inits)
    import onnx

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for key, value in {"author": "Ultralytics", "task": "detect", "stride": "32", "batch": "1",
                       "imgsz": "[320, 320]", "names": "{0: 'square', 1: 'round'}",
                       "args": "{'batch': 1, 'half': False, 'dynamic': True, 'nms': False}"}.items():
        model.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
