"""Golden RF-DETR-Seg masks from RF-DETR's own PostProcess, for tests/test_reference_detect.py (not a test).

    python -m venv /tmp/rft && /tmp/rft/bin/pip install torch==2.13.0
    /tmp/rft/bin/pip install --no-deps rfdetr==1.11.2
    PYTHONPATH=. /tmp/rft/bin/python tests/data/make/rfdetr_masks.py   # writes tests/data/rfdetr_masks.npz

RF-DETR-Seg's outputs for one image, made up by tests/support/rfdetr_like.py's `made_up_seg` (100 queries, 3
classes and the background slot, 78x78 mask logits per query), and what RF-DETR 1.11.2's
`PostProcess.forward` (rfdetr/models/postprocess.py, the postprocessing of `RFDETR.predict()`) makes
of them for a 427x640 photo with predict()'s threshold of 0.5: the best 100 query/class pairs, those
over 0.5, boxes scaled to the photo, each one's mask its query's logits resized to the photo
(F.interpolate, bilinear, align_corners=False) above 0. Stored: the boxes, classes and scores, and the
masks painted worst first into one map (k + 1 for box k, the better box's where they overlap), as the
worker gives them. RF-DETR's PostProcess keeps every slot (its ONNX helper leaves the last out): the
background slot is dropped here after it, as the worker drops it. torchvision (which box_ops imports
for one function) is stood in for; rfdetr's package __init__ files are not run.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import torch

from tests.data.make.rfdetr_decode import rfdetr_runtime
from tests.support.rfdetr_like import made_up_seg

H, W = 427, 640


def post_process() -> type:
    tv = types.ModuleType("torchvision")
    tv.ops = types.ModuleType("torchvision.ops")
    tv.ops.boxes = types.ModuleType("torchvision.ops.boxes")
    tv.ops.boxes.box_area = lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    sys.modules |= {"torchvision": tv, "torchvision.ops": tv.ops, "torchvision.ops.boxes": tv.ops.boxes}
    rfdetr_runtime()
    models = types.ModuleType("rfdetr.models")
    models.__path__ = [str(Path(sys.modules["rfdetr"].__path__[0]) / "models")]
    sys.modules["rfdetr.models"] = models
    from rfdetr.models.postprocess import PostProcess

    return PostProcess


def main() -> None:
    dets, labels, masks = made_up_seg()
    outputs = {"pred_boxes": torch.from_numpy(dets)[None], "pred_logits": torch.from_numpy(labels)[None],
               "pred_masks": torch.from_numpy(masks)[None]}
    (result,) = post_process()(num_select=len(dets))(outputs, torch.tensor([[H, W]]), score_threshold=0.5)
    foreground = (result["labels"] < labels.shape[1] - 1).numpy()  # the background slot, as the worker leaves it out
    scores, classes = result["scores"][foreground].numpy(), result["labels"][foreground].numpy()
    xyxy, drawn = result["boxes"][foreground].numpy(), result["masks"][foreground, 0].numpy()
    painted = np.zeros((H, W), np.uint16)
    for k in range(len(drawn) - 1, -1, -1):  # the worst first
        painted[drawn[k]] = k + 1
    out = Path(__file__).resolve().parents[1] / "rfdetr_masks.npz"
    np.savez_compressed(out, shape=np.array([H, W]), xyxy=xyxy, scores=scores, class_id=classes, painted=painted,
                        pixels=drawn.reshape(len(drawn), -1).sum(1))
    print(f"{out}: {len(scores)} boxes ({int(foreground.size - foreground.sum())} of the background slot left out), "
          f"{int((painted > 0).sum())} pixels masked, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
