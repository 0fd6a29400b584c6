"""COCO-format export of detection and segmentation results from the database."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from sqlalchemy import Engine

from worker.host.names import on_disk
from worker.tasks.results import instance_part, region_dicts
from worker.store.queries import Filters, query_images
from worker.tasks.segment import regions

log = logging.getLogger(__name__)


def coco(db: Engine, filters: Filters, categories: tuple[str, ...] = (), task: str = "detect",
         outbox: Path | None = None, rle: bool = False, default_outbox: Path | None = None) -> dict[str, Any]:
    """{images, categories, annotations} for the done results of one `task` (detect or segment) matching
    `filters`; an instance segmenter's boxes each with its mask's segmentation and area, a pose model's
    with its keypoints, an oriented box with its corners as its segmentation (and its `xywhr`).

    Category ids are the model's 0-based class ids; `categories` (the card's labels) names them, else the
    names seen in the results are used. bbox is [x, y, width, height] in pixels. A segmenter's annotations
    are its mask's regions, each with its polygons traced from the mask PNG in `outbox` (None: the outbox
    its run wrote into, else `default_outbox`; a bbox only when that file is gone, said once per file); a multi-class segmenter's background (class 0) is no category. `rle`: each region
    as a run-length encoding of its pixels instead (uncompressed COCO RLE: exact, holes included).
    """
    rows = [r for r in query_images(db, filters) if r["status"] == "done" and r["task"] == task]
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    seen: dict[int, str] = {}  # class id -> name, as the results name it
    keypoints = 0  # a pose model's points per box
    point_names: list[str] = []  # and their names, as the results give them
    multi_class = False
    # a multi-page file's pages (pipeline.pages: all) are images of their own: its first keeps the row's
    # id, the others get ids past every row's, and each says its page
    next_id = max((r["id"] for r in rows), default=0) + 1
    # id, result, the mask's path in its outbox, COCO image
    parts: list[tuple[int, dict[str, Any], Path | None, dict[str, Any]]] = []
    for r in rows:
        doc = r["result"]
        box = outbox or (Path(r["outbox"]) if r.get("outbox") else default_outbox)
        if not isinstance(doc.get("pages"), list):
            w, h = _size(doc)
            parts.append((r["id"], doc, _in(box, r["mask_path"]), {"id": r["id"], "file_name": r["rel_path"],
                                                                   "width": w, "height": h}))
            continue
        for page in doc["pages"]:
            image_id = r["id"] if page["page"] == 1 else next_id
            next_id += image_id != r["id"]
            w, h = _size(page)
            parts.append((image_id, page, _in(box, page.get("mask")), {"id": image_id, "file_name": r["rel_path"],
                                                                        "page": page["page"], "width": w, "height": h}))
    for image_id, doc, mask_path, image in parts:
        images.append(image)
        if task == "detect":
            # an instance segmenter's: box k's mask is where its instance mask holds k + 1
            instances = _read_mask(mask_path) if mask_path is not None else None
            for k, box in enumerate(doc.get("boxes", [])):
                x1, y1, x2, y2 = box["xyxy"]
                seen[box["class_id"]] = box["name"]
                ann = {"id": len(annotations) + 1, "image_id": image_id, "category_id": box["class_id"],
                       "bbox": [x1, y1, round(x2 - x1, 2), round(y2 - y1, 2)],
                       "area": round((x2 - x1) * (y2 - y1), 2), "score": box["score"], "iscrowd": 0}
                if instances is not None:
                    ann.update(_instance_shape(instances, k + 1, box["xyxy"], rle))
                if "corners" in box:  # an oriented box: its outline, and the area within it
                    bw, bh = box["xywhr"][2:4]
                    ann.update(segmentation=[[v for corner in box["corners"] for v in corner]],
                               area=round(bw * bh, 2), xywhr=box["xywhr"])
                if "keypoints" in box:
                    ann.update(_keypoints(box["keypoints"]))
                    keypoints = max(keypoints, len(box["keypoints"]))
                    point_names = point_names or doc.get("keypoint_names", [])
                annotations.append(ann)
            continue
        multi_class = multi_class or "classes" in doc
        scores = {c["class_id"]: c["score"] for c in doc.get("classes", [])}
        mask = _read_mask(mask_path) if mask_path is not None else None
        found = doc.get("regions")
        if found is None and mask is not None and "classes" not in doc:  # recorded before regions were
            found = region_dicts(regions((mask > 0).view(np.uint8)))
        found = found or []
        shapes = _region_shapes(mask, found, rle) if mask is not None else {}
        for i, region in enumerate(found):
            cid, name = region.get("class_id", 0), region.get("name", doc.get("label", "0"))
            seen[cid] = name
            x1, y1, x2, y2 = region["xyxy"]
            ann = {"id": len(annotations) + 1, "image_id": image_id, "category_id": cid,
                   "bbox": [x1, y1, x2 - x1, y2 - y1], "area": region["pixels"],
                   "score": scores.get(cid, doc.get("score", 0.0)), "iscrowd": 0}
            if i in shapes:
                ann["segmentation"] = shapes[i]
            annotations.append(ann)
    # every category an annotation refers to: an end-to-end detector's class past the labels too (named by number)
    names = {**seen, **dict(enumerate(categories))}
    if multi_class:
        names.pop(0, None)
    what = "detections" if task == "detect" else "segmentation regions"
    # a pose model's categories name their points as its results do (the card's keypoint_names, or its
    # export's), else by number
    named = point_names if len(point_names) == keypoints else [str(i + 1) for i in range(keypoints)]
    points = {"keypoints": named} if keypoints else {}
    return {"info": {"description": f"worker {what}"}, "images": images,
            "categories": [{"id": i, "name": n, **points} for i, n in sorted(names.items())],
            "annotations": annotations}


def _keypoints(points: list[list[float]]) -> dict[str, Any]:
    """A box's keypoints ([x, y] or [x, y, visibility] each) as COCO's: [x, y, v, ...] with v = 2 (seen)
    where the visibility is 0.5 or more, or there is none, else 1 (placed, not seen); num_keypoints
    those placed; and each point's visibility as the model gave it (`keypoint_scores`)."""
    flat: list[float] = []
    for x, y, *rest in points:
        flat += [x, y, 2 if not rest or rest[0] >= 0.5 else 1]
    return {"keypoints": flat, "num_keypoints": len(points),
            **({"keypoint_scores": [p[2] for p in points]} if points and len(points[0]) == 3 else {})}


def _size(doc: dict[str, Any]) -> tuple[int, int]:
    """(width, height) from a result's JSON; results recorded before the JSON's `image` object have `size`."""
    image = doc.get("image")
    if isinstance(image, dict):
        return image.get("width", 0), image.get("height", 0)
    w, h = doc.get("size", [0, 0])
    return w, h


def _instance_shape(instances: np.ndarray, index: int, xyxy: list[float], rle: bool) -> dict[str, Any]:
    """A box's instance mask (its pixels equal to `index`, within the box) as COCO's segmentation
    (polygons, or `rle`) and area (its pixels)."""
    part, at = instance_part(instances, index, xyxy)
    shape = rle_of(part, at, instances.shape[:2]) if rle else edge_polygons(part, at)
    return {"segmentation": shape, "area": int(part.sum())}


def _in(outbox: Path | None, mask_path: str | None) -> Path | None:
    """A mask's file: its path in the result, under the outbox it was written into."""
    return None if outbox is None or not mask_path else outbox / on_disk(outbox, mask_path)


def _read_mask(path: Path) -> np.ndarray | None:
    """A mask PNG, or None (said in one line) when it is gone or unreadable. Decoded from its bytes:
    OpenCV's imread prints lines of its own on stderr for every file it cannot open."""
    try:
        data = np.fromfile(path, np.uint8)
    except OSError as e:
        log.warning("%s: mask not readable (%s): its regions are exported as boxes only", path, e.strerror or e)
        return None
    mask = cv2.imdecode(data, cv2.IMREAD_UNCHANGED) if data.size else None
    if mask is None:
        log.warning("%s: mask not a PNG: its regions are exported as boxes only", path)
    return mask


def _region_shapes(mask: np.ndarray, regions: list[dict[str, Any]], rle: bool = False) -> dict[int, Any]:
    """Region index -> COCO polygons ([x, y, x, y, ...] lists) traced around it in the written mask, or
    (`rle`) its run-length encoding.

    The mask's connected parts are labelled again (as when the regions were found) and each region is
    matched to its part by box and pixel count, so a part lying inside another's box is not mixed in."""
    shapes: dict[int, Any] = {}  # COCO polygons, or an RLE dict
    by_class: dict[int | None, tuple[Any, dict[tuple[int, ...], int]]] = {}  # class (None: one-map mask) -> parts
    for i, region in enumerate(regions):
        cid = region.get("class_id")
        if cid not in by_class:
            binary = ((mask > 0) if cid is None else (mask == cid)).view(np.uint8)
            _, labels, stats, _ = cv2.connectedComponentsWithStats(binary, connectivity=8, ltype=cv2.CV_32S)
            index: dict[tuple[int, ...], int] = {(int(x), int(y), int(x + w), int(y + h), int(n)): k
                                                 for k, (x, y, w, h, n) in enumerate(stats) if k}
            by_class[cid] = (labels, index)
        labels, index = by_class[cid]
        x1, y1, x2, y2 = region["xyxy"]
        k = index.get((x1, y1, x2, y2, region["pixels"]))
        if k is None:
            continue
        part = (labels[y1:y2, x1:x2] == k).view(np.uint8)
        shapes[i] = rle_of(part, (x1, y1), mask.shape[:2]) if rle else edge_polygons(part, (x1, y1))
    return shapes


def rle_of(part: np.ndarray, offset: tuple[int, int], size_hw: tuple[int, int]) -> dict[str, Any]:
    """COCO's uncompressed RLE of a 0/1 (h, w) part placed at `offset` in an image of `size_hw`:
    {"size": [H, W], "counts": [...]}, run lengths in column-major order starting with a run of 0s."""
    (x1, y1), (h, w) = offset, size_hw
    strip = np.zeros((h, part.shape[1]), np.uint8)  # the part's columns at full height
    strip[y1:y1 + part.shape[0]] = part
    flat = np.concatenate([np.zeros(x1 * h, np.uint8), strip.ravel(order="F"),
                           np.zeros((w - x1 - part.shape[1]) * h, np.uint8)])
    edges = np.flatnonzero(np.diff(flat)) + 1  # where a run ends and the next begins
    bounds = np.concatenate([[0], edges, [flat.size]])
    counts = np.diff(bounds).tolist()
    return {"size": [h, w], "counts": ([0] + counts) if flat[0] else counts}


def edge_polygons(part: np.ndarray, offset: tuple[int, int] = (0, 0)) -> list[list[int]]:
    """COCO polygons ([x, y, x, y, ...]) of a 0/1 uint8 (h, w) mask's outlines, along pixel edges.

    COCO's coordinates are continuous, pixel (x, y) covering [x, x+1) x [y, y+1) (bbox, and how
    pycocotools rasterises a polygon); OpenCV traces the centres of the boundary pixels, which read as
    COCO shrink every region by half a pixel all round (a 10x10 square came back as 81 pixels, a line
    one pixel thin as none). Traced at twice the size, a boundary's centres sit at 2a (its first pixel's
    left or top half) and 2b+1 (its last pixel's right or bottom half): (c + 1) // 2 maps both to the
    pixel edges a and b+1. Holes are not polygons in COCO: an outline comes back filled."""
    big = cv2.resize(part, None, fx=2, fy=2, interpolation=cv2.INTER_NEAREST)
    contours, _ = cv2.findContours(big, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    polygons = []
    for c in contours:
        p = (c.reshape(-1, 2) + 1) // 2
        p = p[np.any(p != np.roll(p, 1, axis=0), axis=1)]  # the doubled trace's one-step corners collapse
        before, after = np.roll(p, 1, axis=0), np.roll(p, -1, axis=0)
        d1, d2 = p - before, after - p
        straight = (d1[:, 0] * d2[:, 1] - d1[:, 1] * d2[:, 0] == 0) & ((d1 * d2).sum(axis=1) > 0)
        p = p[~straight] + np.asarray(offset)  # mid-edge points go; corners, and turns back, stay
        if len(p) >= 3:
            polygons.append(p.reshape(-1).tolist())
    return polygons
