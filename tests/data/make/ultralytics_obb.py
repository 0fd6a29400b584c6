"""Golden oriented boxes from Ultralytics' own postprocessing, for tests/test_reference_detect.py (not a test).

    python -m venv /tmp/ul && /tmp/ul/bin/pip install torch==2.13.0 ultralytics==8.4.190
    PYTHONPATH=. /tmp/ul/bin/python tests/data/make/ultralytics_obb.py   # writes tests/data/ultralytics_obb.npz

A YOLOv8-obb output for one image made up here (2 classes, 400 anchors of a 320x320 input, each row
cx, cy, w, h, the class scores and the box's angle in radians, -pi/4 to 3pi/4: (1, 4 + 2 + 1, 400)),
and what Ultralytics' OBBPredictor makes of it for a 427x640 photo letterboxed into that input:
`non_max_suppression(rotated=True)` (conf 0.25, IoU 0.45: its fast NMS on the probabilistic IoU of
the boxes as Gaussians), then `scale_boxes(xywh=True)` back to the photo. The worker is held to the
same boxes, scores and classes; it needs neither Ultralytics nor PyTorch.
"""

from __future__ import annotations

import math
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

H, W, SIZE, C, A = 427, 640, 320, 2, 400


def main() -> None:
    rng = np.random.default_rng(38)
    top = (SIZE - round(H * SIZE / W)) // 2
    cx, cy = rng.uniform(0, SIZE, A), rng.uniform(top, SIZE - top, A)
    bw, bh = rng.uniform(8, 100, A), rng.uniform(4, 40, A)  # long and thin, as ships and parts are
    scores = rng.uniform(0, 1, (C, A)) ** 2
    angle = rng.uniform(-math.pi / 4, 3 * math.pi / 4, A)
    raw = np.concatenate([np.stack([cx, cy, bw, bh]), scores, angle[None]]).astype(np.float32)[None]
    (pred,) = nms.non_max_suppression(torch.from_numpy(raw.copy()), 0.25, 0.45, nc=C, max_det=300, rotated=True)
    rboxes = torch.cat([pred[:, :4], pred[:, -1:]], dim=-1)
    rboxes[:, :4] = ops.scale_boxes((SIZE, SIZE), rboxes[:, :4], (H, W), xywh=True)
    out = Path(__file__).resolve().parents[1] / "ultralytics_obb.npz"
    np.savez_compressed(out, raw=raw[0], shape=np.array([H, W]), input_size=SIZE, xywhr=rboxes.numpy(),
                        corners=ops.xywhr2xyxyxyxy(rboxes).numpy(), conf=pred[:, 4].numpy(), cls=pred[:, 5].numpy(),
                        ultralytics=ultralytics.__version__)
    print(f"{out}: {len(pred)} boxes of {A} anchors, Ultralytics {ultralytics.__version__}, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
