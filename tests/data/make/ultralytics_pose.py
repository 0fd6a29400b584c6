"""Golden pose results from Ultralytics' own postprocessing, for tests/test_reference_detect.py (not a test).

    python -m venv /tmp/ul && /tmp/ul/bin/pip install torch==2.13.0 ultralytics==8.4.190
    PYTHONPATH=. /tmp/ul/bin/python tests/data/make/ultralytics_pose.py   # writes tests/data/ultralytics_pose.npz

A YOLOv8-pose output for one image made up here (2 classes, 17 keypoints of x, y and visibility, 300
anchors of a 320x320 input: (1, 4 + 2 + 51, 300)), and what Ultralytics' PosePredictor makes of it
for a 427x640 photo letterboxed into that input: `non_max_suppression` (conf 0.25, IoU 0.45), then
`scale_boxes` and `scale_coords` back to the photo (each side's own scale since 8.4: 213 of 427 rows).
The worker is held to the same boxes, scores, classes and keypoints; it needs neither Ultralytics nor
PyTorch. An untrained yolov8n-pose export (its scores set apart per anchor) run through both whole gave
the same 58 boxes with their keypoints within the JSON's rounding.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import torch

tv = types.ModuleType("torchvision")  # Ultralytics imports torchvision for its NMS; PyTorch's own is used
tv.__version__, tv.ops = "0.28.0", types.ModuleType("torchvision.ops")
sys.modules["torchvision"], sys.modules["torchvision.ops"] = tv, tv.ops
from ultralytics.utils.nms import TorchNMS  # noqa: E402

tv.ops.nms = TorchNMS.nms
import ultralytics  # noqa: E402
from ultralytics.utils import nms, ops  # noqa: E402

H, W, SIZE, C, K, A = 427, 640, 320, 2, 17, 300


def main() -> None:
    rng = np.random.default_rng(37)
    top = (SIZE - round(H * SIZE / W)) // 2  # the image's rows in the input: 53 to 266
    cx, cy = rng.uniform(0, SIZE, A), rng.uniform(top, SIZE - top, A)
    bw, bh = rng.uniform(10, 120, A), rng.uniform(10, 120, A)
    scores = rng.uniform(0, 1, (C, A)) ** 2  # most under the threshold
    kx = cx + rng.uniform(-0.6, 0.6, (K, A)) * bw  # keypoints about the box, some past the image
    ky = cy + rng.uniform(-0.6, 0.6, (K, A)) * bh
    vis = rng.uniform(0, 1, (K, A))
    keypoints = np.stack([kx, ky, vis], axis=1).reshape(K * 3, A)  # x, y, v for each point, as exported
    raw = np.concatenate([np.stack([cx, cy, bw, bh]), scores, keypoints]).astype(np.float32)[None]
    (pred,) = nms.non_max_suppression(torch.from_numpy(raw.copy()), 0.25, 0.45, nc=C, max_det=300)
    boxes = ops.scale_boxes((SIZE, SIZE), pred[:, :4].clone(), (H, W))
    kpts = ops.scale_coords((SIZE, SIZE), pred[:, 6:].view(len(pred), K, 3).clone(), (H, W))
    out = Path(__file__).resolve().parents[1] / "ultralytics_pose.npz"
    np.savez_compressed(out, raw=raw[0], shape=np.array([H, W]), input_size=SIZE, xyxy=boxes.numpy(),
                        conf=pred[:, 4].numpy(), cls=pred[:, 5].numpy(), keypoints=kpts.numpy(),
                        ultralytics=ultralytics.__version__)
    print(f"{out}: {len(pred)} boxes of {A} anchors, Ultralytics {ultralytics.__version__}, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
