"""ppocr_det.json and ppocr_det_<image>.png: DBNet text segmentation (ch_PP-OCRv4_det), the ONNX file that
rapidocr_onnxruntime ships, run unchanged with onnxruntime. Needs: rapidocr_onnxruntime==1.4.4 and
scikit-image==0.26.0 downloaded; numpy, opencv-python-headless==4.10.0.84 and onnxruntime installed."""

from __future__ import annotations

import cv2
import numpy as np
import onnxruntime as ort

from common import (IMAGES, about, arguments, decode, image_files, mask_entry, package_file, sha256, versions,
                    write_json)

HEADER = {'model': 'ppocr_det',
 'task': 'text segmentation (DBNet probability map), ch_PP-OCRv4_det',
 'package': 'rapidocr_onnxruntime==1.4.4',
 'weight_file': 'rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx',
 'weight_sha256': 'd2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9',
 'reference_runtime': 'onnxruntime 1.32.0 CPUExecutionProvider on the ONNX file shipped in the package '
                      '(unmodified), default session options',
 'software_versions': None,  # measured when the file is made: common.versions()
 'inputs': [{'name': 'x',
             'shape': ['p2o.DynamicDimension.0', 3, 'p2o.DynamicDimension.1', 'p2o.DynamicDimension.2'],
             'dtype': 'tensor(float)'}],
 'outputs': [{'name': 'sigmoid_0.tmp_0',
              'shape': ['p2o.DynamicDimension.3', 1, 'p2o.DynamicDimension.4', 'p2o.DynamicDimension.5'],
              'dtype': 'tensor(float)'}],
 'input_shape_used': [1, 3, 640, 640],
 'output_shape_used': [1, 1, 640, 640],
 'preprocessing': 'decode with cv2.imread IMREAD_COLOR, keep BGR channel order; cv2.resize to exactly 640x640 '
                  '(aspect not kept) INTER_LINEAR; float32 (x/255-0.5)/0.5; NCHW',
 'postprocessing': 'take output[0,0] (640x640 float32 probabilities); cv2.resize to original (W,H) INTER_LINEAR; '
                   'mask = prob > 0.3 (strict); fg_fraction = mean(mask) rounded 4 dp',
 'mask_png': 'ppocr_det_<image stem>.png, 8-bit grayscale, original image size, 0 = background, 255 = text',
 'per_image_fields': 'source, file_sha256, decoded_hw, decoded_rgb_uint8_sha256, input_sha256_float32, '
                     'prob_640_stats, fg_fraction_640 (threshold applied before resizing back, for diagnosis), '
                     'fg_fraction, fg_pixels, borderline_fraction_abs_p_minus_0.3_lt_0.01 (share of pixels whose '
                     'resized prob is within 0.01 of the threshold: expected mask-disagreement scale), mask_png, '
                     'mask_uint8_sha256 (sha256 of the decoded HxW uint8 0/255 mask bytes, C order; independent of '
                     'the PNG encoder)',
 'image_set': 'public'}


def main() -> None:
    args = arguments(__doc__ or "")
    onnx = package_file(args.packages, "rapidocr_onnxruntime-1.4.4", HEADER["weight_file"])
    assert sha256(onnx) == HEADER["weight_sha256"], "not the weights the reference names"
    session = ort.InferenceSession(onnx, providers=["CPUExecutionProvider"])
    images = {}
    for name, path in image_files(args.packages, args.out, (*IMAGES, "page.png")).items():
        bgr = decode(path)
        h, w = bgr.shape[:2]
        x = ((cv2.resize(bgr, (640, 640), interpolation=cv2.INTER_LINEAR).astype(np.float32) / 255 - 0.5) / 0.5)
        x = np.ascontiguousarray(x.transpose(2, 0, 1)[None])
        prob640 = session.run(None, {"x": x})[0][0, 0]
        prob = cv2.resize(prob640, (w, h), interpolation=cv2.INTER_LINEAR)
        mask = prob > 0.3
        stem = name.rsplit(".", 1)[0]
        images[name] = {**about(name, path, bgr), "input_sha256_float32": sha256(x),
                        "prob_640_stats": {k: round(float(f(prob640)), 4) for k, f in
                                           (("min", np.min), ("max", np.max), ("mean", np.mean))},
                        "fg_fraction_640": round(float((prob640 > 0.3).mean()), 4),
                        "fg_fraction": round(float(mask.mean()), 4), "fg_pixels": int(mask.sum()),
                        "borderline_fraction_abs_p_minus_0.3_lt_0.01": round(float((np.abs(prob - 0.3) < 0.01).mean()), 4),
                        **mask_entry(args.out, f"ppocr_det_{stem}.png", mask)}
    write_json(args.out, "ppocr_det.json", {**HEADER, "software_versions": versions(onnxruntime=ort.__version__),
                                            "images": images})


if __name__ == "__main__":
    main()
