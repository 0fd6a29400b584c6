"""Results a user's own framework gave for a folder of images, read from the formats docs/parity.md lists:
a JSON or CSV of per-image labels or boxes, a COCO results JSON, a folder of Ultralytics' YOLO .txt files,
or a folder of PNG masks. Each becomes an `Expected` per image name (its path under the folder, as given)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from worker.errors import CheckInputError

Label = str | int  # a class name, or a class id


@dataclass(frozen=True)
class Box:
    label: Label
    xyxy: tuple[float, float, float, float]  # original image pixels
    score: float | None = None


@dataclass(frozen=True)
class Expected:
    """One image's expected result: top-k labels (best first), boxes, or a mask file (nonzero: foreground)."""

    labels: tuple[Label, ...] = ()
    boxes: tuple[Box, ...] = ()
    mask: Path | None = None
    normalized: tuple[tuple[Label, float, float, float, float, float | None], ...] = field(default=())
    # YOLO txt: class, cx, cy, w, h (fractions of the image), score; made boxes once the image's size is known


def _label(value: Any, path: Path) -> Label:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise CheckInputError(f"{path}: a label must be a class name or id, not {value!r}")
    if isinstance(value, float):
        return int(value)
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def _entry(item: Any, path: Path) -> tuple[Label, Box | None]:
    """A JSON entry: a label alone, or {"label" | "name" | "class_id" | "class": ..., "score": ..., "box" | "xyxy": ...}."""
    if not isinstance(item, dict):
        return _label(item, path), None
    key = next((k for k in ("label", "name", "class_id", "class", "category_id") if k in item), None)
    if key is None:
        raise CheckInputError(f"{path}: an entry without a label (label, name or class_id): {item!r}")
    label = _label(item[key], path)
    box = item.get("box", item.get("xyxy"))
    if box is None and "bbox" in item:  # COCO's x, y, width, height
        x, y, w, h = item["bbox"]
        box = (x, y, x + w, y + h)
    if box is None:
        return label, None
    if len(box) != 4:
        raise CheckInputError(f"{path}: a box is x1, y1, x2, y2: {box!r}")
    score = item.get("score")
    return label, Box(label, tuple(float(v) for v in box), None if score is None else float(score))  # type: ignore[arg-type]


def load_expected(path: Path) -> dict[str, Expected]:
    """Expected results by image name, from any of the documented formats (chosen by what `path` is)."""
    if path.is_dir():
        return _folder(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise CheckInputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckInputError(f"{path}: cannot read it as text: {e}") from None
    if path.suffix.lower() == ".csv":
        return _csv(text, path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckInputError(f"{path}: not JSON ({e.msg} at line {e.lineno}) nor a .csv") from None
    if isinstance(doc, list):
        return _coco(doc, path)
    if not isinstance(doc, dict):
        raise CheckInputError(f"{path}: JSON must map image names to results, or be a COCO results list")
    out: dict[str, Expected] = {}
    for name, value in doc.items():
        if isinstance(value, dict):  # {"labels": [...]} or {"boxes": [...]}, as the worker's own JSON
            value = value.get("boxes", value.get("labels"))
        if not isinstance(value, list):
            raise CheckInputError(f"{path}: {name}: expected a list of labels or boxes")
        entries = [_entry(item, path) for item in value]
        boxes = tuple(b for _, b in entries if b is not None)
        out[str(name)] = Expected(labels=() if boxes else tuple(lb for lb, _ in entries), boxes=boxes)
    return out


def _csv(text: str, path: Path) -> dict[str, Expected]:
    rows = list(csv.DictReader(text.splitlines()))
    if not rows or "image" not in rows[0] or not ({"label", "class_id", "name"} & set(rows[0])):
        raise CheckInputError(f"{path}: a CSV needs an `image` column and a `label` (or class_id) column, one row "
                              f"per label or box, best first")
    grouped: dict[str, list[tuple[Label, Box | None]]] = {}
    for row in rows:
        item: dict[str, Any] = {k: v for k, v in row.items() if v not in (None, "")}
        if {"x1", "y1", "x2", "y2"} <= set(item):
            item["box"] = [float(item[k]) for k in ("x1", "y1", "x2", "y2")]
        if "score" in item:
            item["score"] = float(item["score"])
        grouped.setdefault(row["image"], []).append(_entry(item, path))
    return {name: Expected(labels=tuple(lb for lb, b in entries if b is None),
                           boxes=tuple(b for _, b in entries if b is not None)) for name, entries in grouped.items()}


def _coco(doc: list[Any], path: Path) -> dict[str, Expected]:
    """A COCO results list: `image_id` is the image's file name without its extension (as Ultralytics writes
    it, a number where the stem is one), `category_id` the class id."""
    out: dict[str, list[Box]] = {}
    for item in doc:
        if not isinstance(item, dict) or "image_id" not in item or "bbox" not in item:
            raise CheckInputError(f"{path}: a COCO result needs image_id, category_id and bbox: {item!r}")
        label, box = _entry({"class_id": item.get("category_id", 0), **item}, path)
        assert box is not None
        out.setdefault(str(item["image_id"]), []).append(box)
    return {name: Expected(boxes=tuple(boxes)) for name, boxes in out.items()}


def _folder(folder: Path) -> dict[str, Expected]:
    """Ultralytics' YOLO txt files (class cx cy w h [score], fractions of the image), or PNG masks."""
    out: dict[str, Expected] = {}
    for txt in sorted(folder.rglob("*.txt")):
        rows = []
        for n, line in enumerate(txt.read_text().splitlines(), 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) not in (5, 6):
                raise CheckInputError(f"{txt}:{n}: a YOLO line is class cx cy w h [score], not {line!r}")
            c, *v = parts
            rows.append((int(c), *(float(x) for x in v[:4]), float(v[4]) if len(v) == 5 else None))
        out[txt.relative_to(folder).with_suffix("").as_posix()] = Expected(normalized=tuple(rows))  # type: ignore[arg-type]
    for png in sorted(folder.rglob("*.png")):
        out.setdefault(png.relative_to(folder).with_suffix("").as_posix(), Expected(mask=png))
    if not out:
        raise CheckInputError(f"{folder}: neither YOLO .txt files nor .png masks in it")
    return out


def boxes_of(expected: Expected, image_size: tuple[int, int]) -> tuple[Box, ...]:
    """The expected boxes in pixels of an image of `image_size` (W, H) (YOLO txt gives fractions)."""
    w, h = image_size
    made = tuple(Box(c, (float((cx - bw / 2) * w), float((cy - bh / 2) * h), float((cx + bw / 2) * w),
                         float((cy + bh / 2) * h)), s) for c, cx, cy, bw, bh, s in expected.normalized)
    return expected.boxes + made


def mask_of(expected: Expected, hw: tuple[int, int]) -> np.ndarray:
    """The expected mask as (H, W) bool (nonzero: foreground)."""
    assert expected.mask is not None
    found = cv2.imread(str(expected.mask), cv2.IMREAD_UNCHANGED)
    if found is None:
        raise CheckInputError(f"{expected.mask}: not an image")
    if found.ndim == 3:
        found = found.max(axis=2)
    if found.shape[:2] != hw:
        raise CheckInputError(f"{expected.mask}: {found.shape[1]}x{found.shape[0]}, the image is {hw[1]}x{hw[0]}")
    return np.asarray(found > 0)
