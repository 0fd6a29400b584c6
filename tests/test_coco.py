"""`worker export coco` of a segmenter's results: its regions, with polygons traced from the masks."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import cv2
import numpy as np
import pytest
from pycocotools import mask as coco_mask
from pycocotools.coco import COCO

from tests.support.cli import cli_run
from tests.support.coco import rasterise
from worker.cli import cli
from worker.outputs.coco import edge_polygons, rle_of

# pycocotools' decode predates numpy 2's copy keyword; it works, and says so on every call
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")


def filled(part: np.ndarray) -> np.ndarray:
    """A 0/1 mask with its holes filled: what an outline (COCO has no holes in polygons) stands for."""
    contours, _ = cv2.findContours(part.astype(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    out = np.zeros(part.shape, np.uint8)
    cv2.drawContours(out, contours, -1, 1, -1)
    return out.astype(bool)


def test_edge_polygons_rasterise_back_to_their_pixels_exactly_thin_and_diagonal_parts_too() -> None:
    # pixel centres (OpenCV's trace) read by pycocotools lose half a pixel all round: 81 of a 10x10
    # square, nothing of a one-pixel line
    assert rasterise([[10, 10, 19, 10, 19, 19, 10, 19]], 40, 40).sum() == 81
    assert edge_polygons(np.ones((10, 10), np.uint8), (10, 10)) == [[10, 10, 10, 20, 20, 20, 20, 10]]
    assert edge_polygons(np.ones((1, 1), np.uint8), (5, 5)) == [[5, 5, 5, 6, 6, 6, 6, 5]]
    rng = np.random.default_rng(0)
    parts = 0
    for trial in range(150):
        h, w = (int(v) for v in rng.integers(1, 40, 2))
        mask = (rng.random((h, w)) < rng.uniform(0.1, 0.9)).astype(np.uint8)
        if trial % 3 == 0:
            mask = cv2.dilate(mask, np.ones((3, 3), np.uint8))
        n, labels = cv2.connectedComponents(mask, connectivity=8)  # as regions are found: diagonals join
        for k in range(1, n):
            part = labels == k
            ys, xs = np.nonzero(part)
            polygons = edge_polygons(part[ys.min():ys.max() + 1, xs.min():xs.max() + 1].view(np.uint8),
                                     (int(xs.min()), int(ys.min())))
            assert all(len(p) >= 6 for p in polygons)
            assert np.array_equal(rasterise(polygons, h, w), filled(part)), (trial, k)
            parts += 1
    assert parts > 1000


def test_a_ring_keeps_its_hole_as_rle_and_comes_back_filled_as_polygons() -> None:
    ring = np.zeros((30, 40), np.uint8)
    ring[5:25, 10:30] = 1
    ring[10:20, 15:25] = 0  # the hole
    part = ring[5:25, 10:30]
    rle = rle_of(part, (10, 5), ring.shape)
    assert rle["size"] == [30, 40] and sum(rle["counts"]) == 30 * 40
    assert np.array_equal(coco_mask.decode(coco_mask.frPyObjects(rle, 30, 40)).astype(bool), ring > 0)
    assert np.array_equal(rasterise(edge_polygons(part, (10, 5)), 30, 40), filled(ring))


def test_a_segmenters_regions_export_as_coco_polygons_that_pycocotools_reads_back_as_its_mask(
        tmp_path: Path, samples: Path, ppocr_onnx: Path) -> None:
    conf, r = cli_run(tmp_path, samples, ("page.png", "text.png", "coffee.png"), "model: ppocr-det\n")
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "-o", str(tmp_path / "coco.json")])
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "coco.json").read_text())
    assert doc["categories"] == [{"id": 0, "name": "text"}] and len(doc["images"]) == 3
    outbox = tmp_path / "outbox"
    api = COCO(str(tmp_path / "coco.json"))  # the file as COCO tools load it
    for image in doc["images"]:
        result = json.loads((outbox / f"{image['file_name']}.json").read_text())
        anns = [a for a in doc["annotations"] if a["image_id"] == image["id"]]
        assert len(anns) == len(result["regions"]) and sum(a["area"] for a in anns) == result["mask_pixels"]
        mask = cv2.imread(str(outbox / result["mask"]), cv2.IMREAD_GRAYSCALE) > 0
        h, w = mask.shape
        assert (image["width"], image["height"]) == (w, h)
        drawn = np.zeros(mask.shape, bool)
        for a in anns:
            x, y, bw, bh = a["bbox"]
            assert a["segmentation"] and all(len(p) >= 6 for p in a["segmentation"])
            for p in a["segmentation"]:
                xs, ys = p[0::2], p[1::2]
                assert (min(xs), min(ys), max(xs), max(ys)) == (x, y, x + bw, y + bh)  # the outline spans the box
            region = api.annToMask(a).astype(bool)
            assert region.sum() >= a["area"] and not (drawn & region).any()  # holes filled; regions apart
            drawn |= region
        assert np.array_equal(drawn, filled(mask)), image["file_name"]  # every pixel, nothing more

    # --rle: each region as its run-length encoding: the mask back exactly, holes and all
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "--rle", "-o", str(tmp_path / "rle.json")])
    assert out.exit_code == 0, out.output
    api = COCO(str(tmp_path / "rle.json"))
    for image in api.dataset["images"]:
        mask = cv2.imread(str(outbox / f"{image['file_name']}.mask.png"), cv2.IMREAD_GRAYSCALE) > 0
        anns = api.loadAnns(api.getAnnIds(imgIds=[image["id"]]))
        assert all(a["segmentation"]["size"] == list(mask.shape) for a in anns)
        regions = [api.annToMask(a).astype(bool) for a in anns]
        assert [int(m.sum()) for m in regions] == [a["area"] for a in anns]  # each region's own pixels
        assert np.array_equal(np.logical_or.reduce(regions), mask), image["file_name"]

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
    con.execute(f"UPDATE results SET payload = "
                f"json_remove(json_set(payload, '$.size', {size}), '$.regions', '$.image')")
    con.commit()
    unregioned = "SELECT count(*) FROM results WHERE json_extract(payload, '$.regions') IS NULL"
    assert con.execute(unregioned).fetchone() == (3,)
    con.close()
    again = json.loads(r.invoke(cli, ["--config", str(conf), "export", "coco"]).stdout)
    assert again["images"] == doc["images"] and all(i["width"] > 0 for i in doc["images"])
    assert [(a["bbox"], a["area"], a["segmentation"]) for a in again["annotations"]] == [
        (a["bbox"], a["area"], a["segmentation"]) for a in doc["annotations"]]

    (outbox / "page.png.mask.png").unlink()  # a mask deleted since: nothing to trace, nothing recorded
    doc = json.loads(r.invoke(cli, ["--config", str(conf), "export", "coco", "--path", "page.png"]).stdout)
    assert len(doc["images"]) == 1 and doc["annotations"] == []


def test_export_to_a_terminal_asks_for_a_file_and_a_pipe_gets_the_json(tmp_path: Path, samples: Path,
                                                                       ppocr_onnx: Path) -> None:
    """Without -o on a terminal: one line asking for a file (before: the whole JSON scrolled past, 54,000 lines
    for a real run); redirected, the JSON as before."""
    import subprocess
    import sys

    from tests.support.terminal import on_a_terminal

    conf, _ = cli_run(tmp_path, samples, ("page.png", "text.png"), "model: ppocr-det\n")
    code, said = on_a_terminal([sys.executable, "-m", "worker", "--config", str(conf), "export", "coco"])
    assert code == 2 and said.strip().startswith("error: the COCO JSON of 2 images and ") and \
        "annotations is for a file: -o FILE" in said and said.count("\n") == 1, said
    piped = subprocess.run([sys.executable, "-m", "worker", "--config", str(conf), "export", "coco"],
                           capture_output=True, text=True)
    assert piped.returncode == 0 and len(json.loads(piped.stdout)["images"]) == 2, piped.stderr
