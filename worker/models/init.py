"""`worker models init NAME --onnx FILE`: a card written from what an export says of itself: Ultralytics'
metadata (task, imgsz, names, kpt_shape, end2end), else the input's shape; every value it inferred is
commented so, and what it could not know is said, for the user to check (`worker models check`)."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

from worker.errors import CheckInputError
from worker.models.lookup import bundled_cards, card_name
from worker.models.exported import _CARD_TASK, _kpt_shape, exported_labels

TASKS = ("classify", "detect", "segment")


@dataclass(frozen=True)
class Export:
    """What an ONNX file says of itself."""

    input_name: str
    input_dims: tuple[int | str, ...]  # a number, or the name of a symbolic dimension
    outputs: tuple[str, ...]
    metadata: dict[str, str]


def read_export(path: Path) -> Export:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except FileNotFoundError:
        raise CheckInputError(f"{path}: no such file") from None
    except Exception as e:
        raise CheckInputError(f"{path}: not an ONNX model ({type(e).__name__})") from None
    graph = model.graph
    weights = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in weights]
    if not inputs:
        raise CheckInputError(f"{path}: the model has no input")
    dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                 for d in inputs[0].type.tensor_type.shape.dim)
    return Export(inputs[0].name, dims, tuple(o.name for o in graph.output),
                  {p.key: p.value for p in model.metadata_props})


def _size(export: Export, layout: str) -> tuple[list[int] | None, str]:
    """The input size (H, W) and where it came from."""
    imgsz = export.metadata.get("imgsz")
    if imgsz:
        try:
            value = ast.literal_eval(imgsz)
            if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value):
                return value, f"the export's metadata: imgsz {value}"
        except (ValueError, SyntaxError):
            pass
    dims = export.input_dims
    if (hw := _fixed_hw(dims, layout)) is not None:
        return list(hw), f"the input's shape {list(dims)}"
    return None, "neither in its metadata nor in its input's shape (dynamic): set it to what it was trained at"


def _fixed_hw(dims: tuple[int | str, ...], layout: str) -> tuple[int, int] | None:
    """The input's (height, width) where the export fixes both; None where either is dynamic."""
    h, w = (dims[2], dims[3]) if layout == "nchw" else (dims[1], dims[2])
    return (h, w) if isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0 else None


def card_text(name: str, onnx: Path, task: str | None) -> str:
    """model.yaml for `onnx`: what its export says, commented as inferred; refused where the task cannot be told."""
    export = read_export(onnx)
    meta = export.metadata
    ultra = meta.get("author") == "Ultralytics" and meta.get("task") in _CARD_TASK
    ultra_task = meta.get("task", "") if ultra else ""
    if task is None:
        if not ultra:
            raise CheckInputError(f"{onnx}: its metadata does not say what it does: give --task ({', '.join(TASKS)})")
        task = _CARD_TASK[ultra_task]
    dims = export.input_dims
    if len(dims) != 4:
        raise CheckInputError(f"{onnx}: input '{export.input_name}' {list(dims)} is not an image batch (N, C, H, W)")
    layout = "nhwc" if dims[3] in (1, 3) and dims[1] not in (1, 3) else "nchw"
    size, size_from = _size(export, layout)
    channels = dims[1] if layout == "nchw" else dims[3]
    dynamic = not isinstance(dims[0], int) or dims[0] <= 0
    said = f"Ultralytics {ultra_task} export" + (f" ({meta.get('version')})" if meta.get("version") else "") \
        if ultra else "export without Ultralytics' metadata"
    lines = [f"# Written by `worker models init` from {onnx.name}, an {said}. Every value marked `inferred` comes",
             "# from the file; the rest is a guess to check: worker models check " + name + " --image IMG --expect-input X.npy",
             f"name: {name}", f"task: {task}", f"onnx: {os.path.abspath(onnx)}",
             f"input: {{name: {export.input_name}, size: {size or [640, 640]}, dynamic_batch: {str(dynamic).lower()}"
             + (f", layout: {layout}" if layout != "nchw" else "") + "}"
             + f"  # inferred: name, layout and batch from the input {list(dims)}; size from {size_from}"]
    gray = "gray" if channels == 1 else "rgb"
    if ultra and task == "detect":
        if _fixed_hw(dims, layout) is not None:
            lines.append(f"preprocess: {{color: {gray}, resize: letterbox, pad_value: 114, mean: [0, 0, 0], "
                         "std: [255, 255, 255]}  # inferred: Ultralytics' predict() letterboxes to a square, pads "
                         "with 114, RGB, /255")
        else:  # exported with dynamic=True: predict() pads each side only to a multiple of the stride
            stride = meta.get("stride", "32")
            lines.append(f"preprocess: {{color: {gray}, resize: letterbox, rect: true, stride: {stride}, pad_value: 114, "
                         "mean: [0, 0, 0], std: [255, 255, 255]}  # inferred: Ultralytics' predict() letterboxes a "
                         "dynamic export to a multiple of its stride (rect), pads with 114, RGB, /255")
        post = [f"output: {export.outputs[0]}", "layout: " + ("end2end" if meta.get("end2end") == "True" else "yolov8"),
                "threshold: 0.25", "iou: 0.7"]
        if ultra_task == "segment" and len(export.outputs) > 1:
            post.append(f"masks: {export.outputs[1]}")
        if ultra_task == "pose" and (shape := _kpt_shape(meta.get("kpt_shape", ""))):
            post.append(f"keypoints: {list(shape)}")
        if ultra_task == "obb":
            post.append("obb: true")
        lines.append("postprocess: {" + ", ".join(post) + "}  # inferred: its task, outputs and metadata; predict()'s "
                     "conf and iou")
    elif ultra and task == "classify":
        lines.append(f"preprocess: {{color: {gray}, resize: shorter-crop, resize_shorter: {(size or [224])[0]}, "
                     "mean: [0, 0, 0], std: [255, 255, 255]}  # inferred: Ultralytics' classify_transforms, /255")
        lines.append(f"postprocess: {{output: {export.outputs[0]}, top_k: 5, activation: none}}  # inferred: its output "
                     "holds probabilities")
    else:
        lines.append(f"preprocess: {{color: {gray}, resize: stretch, mean: [0, 0, 0], std: [255, 255, 255]}}"
                     "  # NOT inferred: the export does not say; set what training did (docs/parity.md)")
        lines.append(f"postprocess: {{output: {export.outputs[0]}}}  # NOT inferred beyond the output's name: see docs/own-models.md for "
                     f"{task}")
    names = exported_labels(meta)
    if names:
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        lines.append(f"# labels: the export's own {len(names)} class names (its metadata), read at start: {shown}")
    else:
        lines.append("# labels: [...]  # NOT in the export: list the class names, in the model's order")
    return "\n".join(lines) + "\n"


def write_card(models_dir: Path, name: str, onnx: Path, task: str | None, force: bool) -> Path:
    """The card, written as <models_dir>/NAME/model.yaml: never among worker's own cards (an upgrade replaces
    those, and a checkout's would carry it into the next wheel)."""
    card_name(name)
    if models_dir.resolve() == bundled_cards().resolve():
        raise CheckInputError(f"{models_dir} holds the cards that come with worker: write yours elsewhere "
                              f"(--models-dir DIR, or models_dir in the config)")
    text = card_text(name, onnx, task)
    path = models_dir / name / "model.yaml"
    if path.exists() and not force:
        raise CheckInputError(f"{path} exists: --force writes over it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise CheckInputError(f"{path}: cannot write the card: {e.strerror or e}") from None
    return path
