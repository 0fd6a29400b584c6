"""Golden detections from Ultralytics' own predict() with its rectangular letterbox, for tests/test_rect.py
(not a test).

    python -m venv /tmp/ul && /tmp/ul/bin/pip install torch==2.13.0 ultralytics==8.4.190 onnx onnxruntime
    PYTHONPATH=. /tmp/ul/bin/python tests/data/make/ultralytics_rect.py   # writes tests/data/ultralytics_rect.npz

The model is tests/support/onnx_models.py's `rect_detector`: a YOLOv8-layout export of dynamic height and
width with Ultralytics' metadata, whose boxes sit at fixed fractions of the input it is given, so that
where they land depends on the input's own size and padding. `YOLO(onnx).predict(image, imgsz=320)` runs it
as Ultralytics runs any dynamic export: LetterBox(auto=True) pads each side to a multiple of the stride
(32), not to 320 x 320; non_max_suppression (conf 0.25, IoU 0.7); scale_boxes back to the image. For each
sample image this keeps the network input's (h, w) and the boxes, scores and classes it gave.
"""

from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path

import cv2
import numpy as np

tv = types.ModuleType("torchvision")  # Ultralytics imports torchvision for its NMS; PyTorch's own is used
tv.__version__, tv.ops = "0.28.0", types.ModuleType("torchvision.ops")
sys.modules["torchvision"], sys.modules["torchvision.ops"] = tv, tv.ops
from ultralytics.utils.nms import TorchNMS  # noqa: E402

tv.ops.nms = TorchNMS.nms
import ultralytics  # noqa: E402
from ultralytics import YOLO  # noqa: E402
from ultralytics.data.augment import LetterBox  # noqa: E402

from tests.support.onnx_models import rect_detector  # noqa: E402
from worker.config import default_cache_dir  # noqa: E402
from worker.measure.samples import fetch_samples  # noqa: E402

IMAGES = ("chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "astronaut.png", "portrait.png")
SIZE = 320


def read(samples: Path, name: str) -> np.ndarray:
    """A sample image; portrait.png is chelsea.png turned a quarter clockwise (300 x 451, taller than wide)."""
    if name == "portrait.png":
        return cv2.rotate(cv2.imread(str(samples / "chelsea.png")), cv2.ROTATE_90_CLOCKWISE)
    return cv2.imread(str(samples / name))


def main() -> None:
    samples = fetch_samples(default_cache_dir())
    onnx = Path(tempfile.mkdtemp()) / "rect.onnx"
    rect_detector(onnx)
    model = YOLO(str(onnx), task="detect")
    found: dict[str, np.ndarray] = {}
    for name in IMAGES:
        image = read(samples, name)
        boxed = LetterBox((SIZE, SIZE), auto=True, stride=32)(image=image)
        (result,) = model.predict(image, imgsz=SIZE, conf=0.25, iou=0.7, device="cpu", verbose=False)
        b = result.boxes
        stem = Path(name).stem
        found[f"{stem}_input_hw"] = np.array(boxed.shape[:2])
        found[f"{stem}_xyxy"] = b.xyxy.numpy()
        found[f"{stem}_conf"] = b.conf.numpy()
        found[f"{stem}_cls"] = b.cls.numpy()
        print(f"{name} {image.shape[:2]} -> input {boxed.shape[:2]}: {len(b)} boxes")
    out = Path(__file__).resolve().parents[1] / "ultralytics_rect.npz"
    np.savez_compressed(out, images=np.array(IMAGES), size=SIZE, ultralytics=ultralytics.__version__, **found)
    print(f"{out}: Ultralytics {ultralytics.__version__}, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
