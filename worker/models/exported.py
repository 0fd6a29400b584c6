"""What an Ultralytics export says of itself, held against the card.

Ultralytics writes into every ONNX file it exports the model's task (detect, segment, pose, obb,
classify), a pose model's keypoint shape (`kpt_shape`), whether its boxes come suppressed already
(`end2end`), its class names (`names`) and a pose model's keypoint names (`kpt_names`, when its
dataset named them). A card that contradicts them would read the rows wrongly, or be refused later
with a message about shapes; here it is refused at start with the line to write. A card without
labels takes the export's class names, and one without keypoint names the export's.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

from worker.errors import ModelError
from worker.models.card import ModelCard

# Ultralytics' task -> the card's task that reads it
_CARD_TASK = {"classify": "classify", "detect": "detect", "segment": "detect", "pose": "detect", "obb": "detect"}


def check_exported(card: ModelCard, metadata: Mapping[str, str], onnx: Path) -> None:
    """Raise ModelError when `card` contradicts what an Ultralytics export's `metadata` says; nothing for
    another exporter's file (no `task`, or not Ultralytics')."""
    task = metadata.get("task")
    if metadata.get("author") != "Ultralytics" or task not in _CARD_TASK:
        return
    pp, what = card.postprocess, f"model '{card.name}': {onnx.name} is an Ultralytics {task} model (its metadata)"
    if card.task != _CARD_TASK[task]:
        raise ModelError(f"{what}; the card says task: {card.task}, where task: {_CARD_TASK[task]} reads it")
    if card.task != "detect":
        return
    shape = _kpt_shape(metadata.get("kpt_shape", ""))
    if task == "pose" and shape and tuple(pp.keypoints) != shape:
        have = f"its postprocess.keypoints are {list(pp.keypoints)}" if pp.keypoints else "the card names none"
        raise ModelError(f"{what}, of keypoints {list(shape)}, and {have}: postprocess.keypoints: {list(shape)}")
    if task != "pose" and pp.keypoints:
        raise ModelError(f"{what}, without keypoints: the card's postprocess.keypoints reads what is not there")
    if (task == "obb") != pp.obb:
        fix = "postprocess.obb: true reads its boxes' angles" if not pp.obb else \
            "postprocess.obb is an oriented-box model's: leave it out"
        raise ModelError(f"{what}: {fix}")
    if metadata.get("end2end") == "True" and pp.layout != "end2end":
        raise ModelError(f"{what}, whose boxes come suppressed already (end2end): layout: end2end reads them, "
                         f"not {pp.layout}")
    if metadata.get("end2end") != "True" and pp.layout == "yolov5":  # the card's default: most likely left out
        raise ModelError(f"{what}, whose rows are YOLOv8's (4 box values then each class's score, no objectness): "
                         f"postprocess.layout: yolov8 reads them (layout: detr for an RT-DETR), not yolov5's")


def exported_warnings(card: ModelCard, metadata: Mapping[str, str], dynamic_hw: bool = False) -> list[str]:
    """Where the card's preprocessing parts from what an Ultralytics export was trained and exported with (its
    imgsz; its predict()'s letterbox, rect for an export of dynamic height and width (`dynamic_hw`), RGB and
    /255): the results would differ, not fail, so said, not refused."""
    if metadata.get("author") != "Ultralytics" or metadata.get("task") not in _CARD_TASK:
        return []
    out, p = [], card.preprocess
    said = f"model '{card.name}': its Ultralytics export"
    imgsz = _kpt_shape(metadata.get("imgsz", ""))  # "[320, 320]" -> (320, 320)
    if len(imgsz) == 2 and tuple(card.input.size[:2]) != imgsz:
        out.append(f"{said} says imgsz {list(imgsz)}, the card input.size {list(card.input.size)}: set input.size: "
                   f"{list(imgsz)} (at another size its scores and boxes differ from training's)")
    if metadata.get("task") != "classify" and p.resize != "letterbox":
        out.append(f"{said} letterboxes its input (predict()), the card's preprocess.resize is {p.resize}: set "
                   f"preprocess.resize: letterbox and pad_value: 114")
    if metadata.get("task") != "classify" and p.resize == "letterbox" and dynamic_hw and not p.rect:
        out.append(f"{said} is of dynamic height and width, which predict() letterboxes to a multiple of its stride "
                   f"({metadata.get('stride', '32')}), not to a square: set preprocess.rect: true")
    if p.color == "bgr":
        out.append(f"{said} takes RGB, the card's preprocess.color is bgr: set preprocess.color: rgb")
    if tuple(p.mean) != (0, 0, 0) or tuple(p.std) != (255, 255, 255):
        out.append(f"{said} takes pixels / 255, the card's mean {list(p.mean)} and std {list(p.std)} do otherwise: "
                   f"set preprocess.mean: [0, 0, 0] and preprocess.std: [255, 255, 255]")
    return out


def _kpt_shape(text: str) -> tuple[int, ...]:
    """'[17, 3]' -> (17, 3); () for anything else."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return ()
    return tuple(value) if isinstance(value, list) and all(isinstance(v, int) for v in value) else ()


def exported_keypoint_names(metadata: Mapping[str, str], k: int) -> tuple[str, ...]:
    """An Ultralytics pose export's names of its `k` keypoints ("{0: ['nose', 'left_eye', ...]}", each
    class's, as a dataset's kpt_names gives them); () when it has none, or its classes name them
    differently, or not `k` of them."""
    lists = [list(v) if isinstance(v, (list, tuple)) else None for v in _metadata_dict(metadata, "kpt_names").values()]
    first = lists[0] if lists else None
    if first is None or len(first) != k or any(v != first for v in lists):
        return ()
    return tuple(str(n) for n in first)


def exported_labels(metadata: Mapping[str, str]) -> tuple[str, ...]:
    """An Ultralytics export's class names, in class order ("{0: 'person', 1: 'bicycle'}"); () when it
    has none, or they are not one name for each class from 0."""
    names = _metadata_dict(metadata, "names")
    if set(names) != set(range(len(names))):  # one name for each class from 0, whatever the keys' order
        return ()
    return tuple(str(names[i]) for i in range(len(names)))


def _metadata_dict(metadata: Mapping[str, str], key: str) -> dict[object, object]:
    """An Ultralytics export's metadata entry that holds a dict (Python's repr of it), read without
    running anything; {} when it is not there, not Ultralytics' or not a dict."""
    if metadata.get("author") != "Ultralytics":
        return {}
    try:
        value = ast.literal_eval(metadata.get(key, ""))
    except (ValueError, SyntaxError):
        return {}
    return value if isinstance(value, dict) else {}
