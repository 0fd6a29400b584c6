"""`worker export coco` of a segmenter's results: its regions, with polygons traced from the masks."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import cv2
import numpy as np

from tests.test_cli import cli_run
from worker.cli import cli


def test_a_segmenters_regions_export_as_coco_polygons_that_redraw_its_mask(tmp_path: Path, samples: Path,
                                                                            ppocr_onnx: Path) -> None:
    conf, r = cli_run(tmp_path, samples, ("page.png", "text.png", "coffee.png"), "model: ppocr-det\n")
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "-o", str(tmp_path / "coco.json")])
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "coco.json").read_text())
    assert doc["categories"] == [{"id": 0, "name": "text"}] and len(doc["images"]) == 3
    outbox = tmp_path / "outbox"
    for image in doc["images"]:
        result = json.loads((outbox / f"{image['file_name']}.json").read_text())
        anns = [a for a in doc["annotations"] if a["image_id"] == image["id"]]
        assert len(anns) == len(result["regions"]) and sum(a["area"] for a in anns) == result["mask_pixels"]
        mask = cv2.imread(str(outbox / result["mask"]), cv2.IMREAD_GRAYSCALE) > 0
        drawn = np.zeros(mask.shape, np.uint8)
        for a in anns:
            x, y, w, h = a["bbox"]
            assert a["segmentation"] and all(len(p) >= 6 for p in a["segmentation"])
            for p in a["segmentation"]:
                xs, ys = p[0::2], p[1::2]
                assert x <= min(xs) and max(xs) < x + w and y <= min(ys) and max(ys) < y + h
                cv2.fillPoly(drawn, [np.array(p, np.int32).reshape(-1, 2)], 1)
        union = (mask | (drawn > 0)).sum()
        iou = (mask & (drawn > 0)).sum() / union if union else 1.0
        assert iou >= 0.95, f"{image['file_name']}: polygons redraw the mask at IoU {iou:.3f}"

    mask = outbox / "text.png.mask.png"
    kept = mask.read_bytes()
    mask.unlink()  # a mask deleted since: its recorded regions come as boxes only
    boxes = json.loads(r.invoke(cli, ["--config", str(conf), "export", "coco", "--path", "text.png"]).stdout)
    assert boxes["annotations"] and all("segmentation" not in a for a in boxes["annotations"])
    mask.write_bytes(kept)

    # results recorded before regions were (no "regions" in their payload), and before the JSON's `image`
    # object (a `size` list): traced from the masks, sized as before
    con = sqlite3.connect(tmp_path / "worker.db")
    size = "json_array(json_extract(payload, '$.image.width'), json_extract(payload, '$.image.height'))"
    con.execute(f"UPDATE results SET payload = json_remove(json_set(payload, '$.size', {size}), '$.regions', '$.image')")
    con.commit()
    assert con.execute("SELECT count(*) FROM results WHERE json_extract(payload, '$.regions') IS NULL").fetchone() == (3,)
    con.close()
    again = json.loads(r.invoke(cli, ["--config", str(conf), "export", "coco"]).stdout)
    assert again["images"] == doc["images"] and all(i["width"] > 0 for i in doc["images"])
    assert [(a["bbox"], a["area"], a["segmentation"]) for a in again["annotations"]] == [
        (a["bbox"], a["area"], a["segmentation"]) for a in doc["annotations"]]

    (outbox / "page.png.mask.png").unlink()  # a mask deleted since: nothing to trace, nothing recorded
    doc = json.loads(r.invoke(cli, ["--config", str(conf), "export", "coco", "--path", "page.png"]).stdout)
    assert len(doc["images"]) == 1 and doc["annotations"] == []
