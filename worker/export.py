"""COCO-format export of detection results from the database."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, select

from worker.store.queries import Filters, query_images
from worker.store.schema import ResultRow


def coco(db: Engine, filters: Filters, categories: tuple[str, ...] = ()) -> dict[str, Any]:
    """{images, categories, annotations} for the done detection results matching `filters`.

    Category ids are the model's 0-based class ids; `categories` (the card's labels) names them,
    else the names seen in the results are used. bbox is [x, y, width, height] in pixels.
    """
    rows = [r for r in query_images(db, filters) if r["status"] == "done" and r["task"] == "detect"]
    payloads: dict[int, dict[str, Any]] = {}
    if rows:
        with db.connect() as c:
            for image_id, payload in c.execute(select(ResultRow.image_id, ResultRow.payload)
                                               .where(ResultRow.image_id.in_([r["id"] for r in rows]))):
                payloads[image_id] = payload
    images, annotations, seen = [], [], {}
    for r in rows:
        doc = payloads.get(r["id"], {})
        w, h = doc.get("size", [0, 0])
        images.append({"id": r["id"], "file_name": r["rel_path"], "width": w, "height": h})
        for box in doc.get("boxes", []):
            x1, y1, x2, y2 = box["xyxy"]
            seen[box["class_id"]] = box["name"]
            annotations.append({"id": len(annotations) + 1, "image_id": r["id"], "category_id": box["class_id"],
                                "bbox": [x1, y1, round(x2 - x1, 2), round(y2 - y1, 2)],
                                "area": round((x2 - x1) * (y2 - y1), 2), "score": box["score"], "iscrowd": 0})
    names = dict(enumerate(categories)) if categories else seen
    return {"info": {"description": "worker detections"}, "images": images,
            "categories": [{"id": i, "name": n} for i, n in sorted(names.items())], "annotations": annotations}
