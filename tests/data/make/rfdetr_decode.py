"""Golden RF-DETR detections from RF-DETR's own decoder, for tests/test_reference_detect.py (not a test).

    python -m venv /tmp/rf && /tmp/rf/bin/pip install --no-deps rfdetr==1.11.2
    /tmp/rf/bin/pip install supervision onnxruntime pillow
    PYTHONPATH=. /tmp/rf/bin/python tests/data/make/rfdetr_decode.py   # writes tests/data/rfdetr_decode.npz

Two RF-DETR outputs for one image made up here, 300 queries each: `dets` (cx, cy, w, h as fractions of
the input) and `labels` (class logits), once for a model fine-tuned on 3 classes (4 slots, the last
its background) and once for a COCO checkpoint (91 slots, none left out), and what RF-DETR's
torch-free decoder (`rfdetr.export._runtime.decode.decode_detections`, the one its ONNX and TFLite
helpers use, said there to mirror `PostProcess.forward`) makes of them for a 427x640 photo: each
logit's sigmoid, the best 300 query/class pairs, those over 0.5, boxes scaled to the photo and clipped.
Some queries score over the threshold on two classes: each such pair is a box of its own. The worker
is held to the same boxes, classes and scores; it needs neither RF-DETR nor PyTorch. `rfdetr`'s package
__init__ imports PyTorch; its decoder does not, so its modules are loaded without the package's.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np

H, W, Q = 427, 640, 300


def rfdetr_runtime() -> types.ModuleType:
    """rfdetr.export._runtime.decode, imported without running rfdetr's package __init__ files."""
    spec = importlib.util.find_spec("rfdetr")  # finds the folder without importing it
    assert spec is not None and spec.submodule_search_locations, "rfdetr is not installed"
    root = Path(next(iter(spec.submodule_search_locations)))
    for name in ("rfdetr", "rfdetr.export", "rfdetr.export._runtime", "rfdetr.export._onnx", "rfdetr.utilities"):
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = package
    from rfdetr.export._runtime import decode

    return decode


def made_up(rng: np.random.Generator, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(Q, 4) boxes and (Q, slots) logits: most pairs well under 0.5, a few dozen over, 8 queries over on two."""
    cx, cy = rng.uniform(0.05, 0.95, Q), rng.uniform(0.05, 0.95, Q)
    bw, bh = rng.uniform(0.02, 0.5, Q), rng.uniform(0.02, 0.5, Q)  # some reach past the image: clipped
    logits = rng.normal(-4.0, 2.0, (Q, slots))
    rows = rng.choice(Q, 8, replace=False)
    logits[rows, :2] = rng.uniform(0.5, 4.0, (8, 2))  # two classes each
    return np.stack([cx, cy, bw, bh], 1).astype(np.float32), logits.astype(np.float32)


def main() -> None:
    decode = rfdetr_runtime()
    rng = np.random.default_rng(38)
    arrays: dict[str, np.ndarray] = {"shape": np.array([H, W])}
    for key, slots, background in (("finetuned", 4, -1), ("coco", 91, None)):
        boxes, logits = made_up(rng, slots)
        got = decode.decode_detections(boxes, logits, (W, H), threshold=0.5, background_class_id=background)
        arrays |= {f"{key}_dets": boxes, f"{key}_labels": logits, f"{key}_xyxy": got.xyxy,
                   f"{key}_scores": got.confidence, f"{key}_class_id": got.class_id, f"{key}_query": got.query_index}
        twice = np.unique(got.query_index, return_counts=True)[1]
        print(f"{key}: {len(got.xyxy)} boxes from {len(set(got.query_index.tolist()))} queries "
              f"({(twice > 1).sum()} with two classes)")
    out = Path(__file__).resolve().parents[1] / "rfdetr_decode.npz"
    np.savez_compressed(out, **arrays)
    print(f"{out}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
