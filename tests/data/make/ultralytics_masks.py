"""Golden instance masks from Ultralytics' own code, for tests/test_reference_detect.py (not a test).

    python -m venv /tmp/ul && /tmp/ul/bin/pip install torch==2.13.0 ultralytics==8.4.190
    PYTHONPATH=. /tmp/ul/bin/python tests/data/make/ultralytics_masks.py   # writes tests/data/ultralytics_masks.npz

Smooth random prototype masks (32 of 40x40, a 160x160 input; two sets, 12 boxes each), random
coefficients and boxes on a
240x480 image letterboxed into the input (40 px of padding above and below), and each box's mask as
`ultralytics.utils.ops.process_mask_native` makes it: what a YOLOv8-seg prediction with
`retina_masks=True` gives, the logits brought to the original size, cropped to the box, above 0. The
worker's masks are held to them (`worker.tasks.detect.instance_masks`); the worker does not need
Ultralytics or PyTorch. The padding here is a whole number of prototype pixels (10), as a 640x480 or
1920x1080 photo's is in a 640x640 input. For a 270x480 image (`boxes_270`, `masks_270`: 35 px of
padding, 8.75 prototype pixels) Ultralytics upsamples the logits 4 times, crops the padding and
resizes; the worker composes the same two steps (sampled once, those masks differ at their edges:
IoU 0.98-1.0, median 0.998).
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import torch
import ultralytics
from ultralytics.engine.results import Results
from ultralytics.utils import ops

H, W, SIZE, M, TRIALS, BOXES = 240, 480, 160, 32, 2, 12
H2 = 270  # a second image, whose padding is not a whole number of prototype pixels


def main() -> None:
    rng = np.random.default_rng(36)
    scale = SIZE / W
    top = (SIZE - H * scale) / 2
    protos = np.stack([np.stack([cv2.GaussianBlur(rng.normal(0, 1, (SIZE // 4, SIZE // 4)).astype(np.float32),
                                                  (0, 0), 2) * 8 for _ in range(M)]) for _ in range(TRIALS)])
    protos = protos.astype(np.float16).astype(np.float32)  # stored as float16: the values both are given
    coefficients = rng.normal(0, 1, (TRIALS, BOXES, M)).astype(np.float32)
    cx, cy = rng.uniform(10, W - 10, (TRIALS, BOXES)), rng.uniform(10, H - 10, (TRIALS, BOXES))
    bw, bh = rng.uniform(8, W / 2, (TRIALS, BOXES)), rng.uniform(8, H / 2, (TRIALS, BOXES))
    boxes = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1).clip(0, [W, H, W, H]).astype(np.float32)
    masks = np.stack([ops.process_mask_native(torch.from_numpy(protos[t]), torch.from_numpy(coefficients[t]),
                                              torch.from_numpy(boxes[t]), (H, W)).numpy() > 0 for t in range(TRIALS)])
    scores = rng.uniform(0.25, 1, (TRIALS, BOXES)).astype(np.float32)
    classes = rng.integers(0, 80, (TRIALS, BOXES))
    # the same prototypes for a 270x480 image: 35 px of padding above, 8.75 prototype pixels, where
    # Ultralytics upsamples 4 times before it crops and resizes
    cx, cy = rng.uniform(10, W - 10, (TRIALS, BOXES)), rng.uniform(10, H2 - 10, (TRIALS, BOXES))
    bw, bh = rng.uniform(8, W / 2, (TRIALS, BOXES)), rng.uniform(8, H2 / 2, (TRIALS, BOXES))
    boxes2 = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1).clip(0, [W, H2, W, H2])
    boxes2 = boxes2.astype(np.float32)
    masks2 = np.stack([ops.process_mask_native(torch.from_numpy(protos[t]), torch.from_numpy(coefficients[t]),
                                               torch.from_numpy(boxes2[t]), (H2, W)).numpy() > 0 for t in range(TRIALS)])
    out = Path(__file__).resolve().parents[1] / "ultralytics_masks.npz"
    out.parent.mkdir(exist_ok=True)
    np.savez_compressed(out, protos=protos.astype(np.float16), coefficients=coefficients, boxes=boxes, masks=np.packbits(masks, axis=-1),
                        scores=scores, classes=classes, boxes_270=boxes2, masks_270=np.packbits(masks2, axis=-1),
                        txt=np.array([[_txt_line(boxes[t, k], scores[t, k], classes[t, k], masks[t, k],
                                                 out.parent / "txt") for k in range(BOXES)] for t in range(TRIALS)]),
                        shape=np.array([H, W]), input_size=SIZE, top=top, scale=scale,
                        ultralytics=ultralytics.__version__)
    print(f"{out}: {TRIALS * BOXES} masks, Ultralytics {ultralytics.__version__}, {out.stat().st_size} bytes")


def _txt_line(box: np.ndarray, score: float, cls: int, mask: np.ndarray, folder: Path) -> str:
    """The line `Results.save_txt(save_conf=True)` writes for this box alone with its mask ('' for none)."""
    result = Results(np.zeros((H, W, 3), np.uint8), "golden.png", {i: str(i) for i in range(80)},
                     boxes=torch.tensor([[*box, score, cls]]), masks=torch.from_numpy(mask[None].astype(np.float32)))
    folder.mkdir(exist_ok=True)
    path = folder / "line.txt"
    path.unlink(missing_ok=True)
    result.save_txt(path, save_conf=True)
    text = path.read_text().strip() if path.exists() else ""
    path.unlink(missing_ok=True)
    folder.rmdir()
    return text


if __name__ == "__main__":
    main()
