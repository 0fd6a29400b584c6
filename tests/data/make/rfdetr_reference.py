"""Golden detections of an RF-DETR-shaped model through RF-DETR's own ONNX inference, for
tests/test_own_models.py (not a test).

    python -m venv /tmp/rf && /tmp/rf/bin/pip install --no-deps rfdetr==1.11.2
    /tmp/rf/bin/pip install supervision onnxruntime onnx pillow
    PYTHONPATH=. /tmp/rf/bin/python tests/data/make/rfdetr_reference.py SAMPLES   # writes tests/data/rfdetr_like.npz

Builds tests/support/rfdetr_like.py's model (RF-DETR's `input`, `dets` and `labels`, untrained) and runs it on
the sample photos with `rfdetr.export._onnx.inference._run_inference` (RF-DETR 1.11.2), which reads
the image with Pillow, resizes it as `RFDETR.predict()` does (bilinear, half-pixel centres, no
antialiasing: its NumPy path, torchvision being absent), normalises it with ImageNet's statistics
and decodes the outputs as RF-DETR's postprocessing does (each logit's sigmoid, every query/class
pair over the threshold, the last slot left out as the background). SAMPLES is the worker's sample
folder (`worker models` fetches it: .cache/worker/samples).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.data.make.rfdetr_decode import rfdetr_runtime
from tests.support.rfdetr_like import IMAGES, build



def main() -> None:
    samples = Path(sys.argv[1])
    rfdetr_runtime()  # the stand-in packages, so that the helper's own imports need no PyTorch
    from rfdetr.export._onnx.inference import _create_onnx_session, _run_inference

    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "rfdetr-like.onnx"
        build(model)
        session = _create_onnx_session(model, ["CPUExecutionProvider"])
        for name in IMAGES:
            detections, _ = _run_inference(session, samples / name, threshold=0.5, background_class_id=-1)
            arrays |= {f"{name}/xyxy": detections.xyxy.astype(np.float32), f"{name}/class_id": detections.class_id,
                       f"{name}/score": detections.confidence.astype(np.float32)}
            print(f"{name}: {len(detections.xyxy)} boxes")
    out = Path(__file__).resolve().parents[1] / "rfdetr_like.npz"
    np.savez_compressed(out, **arrays)
    print(f"{out}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
