"""selfie.json and selfie_<image>.png: MediaPipe's selfie segmentation (general model), run by mediapipe's
own legacy Python solution, a fresh instance per image. Needs: mediapipe==0.10.14 (its wheel for the weight
and graph files' digests) and scikit-image==0.26.0 downloaded; mediapipe==0.10.14, numpy==1.26.4 and
opencv-python-headless==4.10.0.84 installed (mediapipe 0.10.14 needs numpy 1)."""

from __future__ import annotations

from importlib.metadata import version

import cv2
import mediapipe as mp
import numpy as np

from common import about, arguments, decode, image_files, mask_entry, package_file, sha256, versions, write_json

HEADER = {'model': 'selfie',
 'task': 'person/background segmentation, MediaPipe selfie segmentation general model (256x256)',
 'package': 'mediapipe==0.10.14 (wheel '
            'mediapipe-0.10.14-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl)',
 'weight_file': 'mediapipe/modules/selfie_segmentation/selfie_segmentation.tflite',
 'weight_sha256': '9ee168ec7c8f2a16c56fe8e1cfbc514974cbbb7e434051b455635f1bd1462f5c',
 'graph_file': 'mediapipe/modules/selfie_segmentation/selfie_segmentation_cpu.binarypb',
 'graph_sha256': 'df9f291eadc2ad77a4a0fabd83d4f2c0c2b4d8626c8f44fb0d14efc2fc81f46d',
 'reference_runtime': 'mediapipe 0.10.14 legacy Python solution '
                      'mp.solutions.selfie_segmentation.SelfieSegmentation(model_selection=0), CPU graph (TFLite '
                      'InferenceCalculator with XNNPACK delegate); a fresh instance per image; '
                      '.process(rgb_uint8).segmentation_mask',
 'software_versions': {'python': '3.11.7',
                       'numpy': '1.26.4',
                       'mediapipe': '0.10.14',
                       'opencv-python-headless': '4.10.0.84 (used only for decoding / PNG writing)',
                       'image_decoding': 'cv2.imread(path, cv2.IMREAD_COLOR) from opencv-python-headless 4.10.0.84 '
                                         'then BGR->RGB; alpha channel of RGBA PNGs dropped without compositing'},
 'inputs': [{'name': 'input_1', 'shape': [1, 256, 256, 3], 'dtype': 'float32', 'layout': 'NHWC, RGB, 0..1'}],
 'outputs': [{'name': 'activation_10',
              'shape': [1, 256, 256, 1],
              'dtype': 'float32',
              'meaning': 'person probability (sigmoid already applied in the model)'}],
 'preprocessing': 'decode with cv2.imread IMREAD_COLOR, BGR->RGB uint8, passed to mediapipe. Inside the graph '
                  '(ImageToTensorCalculator, options from the binarypb: 256x256, keep_aspect_ratio=false, float '
                  'range [0,1], BORDER_ZERO) the whole image is stretched to 256x256 by OpenCV warpPerspective on '
                  'the uint8 RGB image, INTER_LINEAR, BORDER_CONSTANT 0, with the matrix that maps the image '
                  'corners (0,0),(W,0),(W,H),(0,H) to (0,0),(256,0),(256,256),(0,256), i.e. dst(x,y)=src(x*W/256, '
                  'y*H/256) (NOT the half-pixel-centre mapping of cv2.resize); then float32 /255; NHWC',
 'postprocessing': 'TensorsToSegmentationCalculator (activation NONE): the 256x256 output is resized to the '
                   'original (W,H) with bilinear interpolation -> segmentation_mask float32 HxW; mask = '
                   'segmentation_mask > 0.5 (strict); fg_fraction = mean(mask) rounded 4 dp',
 'mask_png': 'selfie_<image stem>.png, 8-bit grayscale, original image size, 0 = background, 255 = person',
 'per_image_fields': 'source, file_sha256, decoded_hw, decoded_rgb_uint8_sha256, mask_stats (of the float mask at '
                     'original size), fg_fraction, fg_pixels, borderline_fraction_abs_p_minus_0.5_lt_0.01 (share '
                     'of pixels within 0.01 of the threshold), mask_png, mask_uint8_sha256 (sha256 of the decoded '
                     'HxW uint8 0/255 mask bytes, C order; independent of the PNG encoder)',
 'image_set': 'public',
 'reproduction_check': {'what': 'verification only, not part of the reference: the same network (tflite converted '
                                'to ONNX, run with onnxruntime 1.32.0) wrapped in the pre/post-processing '
                                'described above, rebuilt with cv2 4.10 (warpPerspective of the uint8 RGB image '
                                'with the corner-to-corner matrix, INTER_LINEAR, BORDER_CONSTANT 0; /255; '
                                'cv2.resize INTER_LINEAR of the 256x256 output to (W,H); > 0.5)',
                        'differing_mask_pixels_vs_reference': {'astronaut.png': 0,
                                                               'chelsea.png': 0,
                                                               'coffee.png': 0,
                                                               'rocket.jpg': 0,
                                                               'motorcycle_left.png': 0},
                        'differing_mask_fraction_if_input_resized_with_cv2_resize_INTER_LINEAR_instead': {'astronaut.png': 0.0043,
                                                                                                          'chelsea.png': 0.009,
                                                                                                          'coffee.png': 0.0221,
                                                                                                          'rocket.jpg': 0.0,
                                                                                                          'motorcycle_left.png': 0.0192}}}


def main() -> None:
    args = arguments(__doc__ or "")
    for key, digest in (("weight_file", "weight_sha256"), ("graph_file", "graph_sha256")):
        shipped = package_file(args.packages, "mediapipe-0.10.14", HEADER[key])
        assert sha256(shipped) == HEADER[digest], f"not the {key} the reference names"
    images = {}
    for name, path in image_files(args.packages, args.out).items():
        bgr = decode(path)
        with mp.solutions.selfie_segmentation.SelfieSegmentation(model_selection=0) as selfie:
            prob = selfie.process(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)).segmentation_mask
        mask = prob > 0.5
        stem = name.rsplit(".", 1)[0]
        images[name] = {**about(name, path, bgr),
                        "mask_stats": {k: round(float(f(prob)), 4) for k, f in
                                       (("min", np.min), ("max", np.max), ("mean", np.mean))},
                        "fg_fraction": round(float(mask.mean()), 4), "fg_pixels": int(mask.sum()),
                        "borderline_fraction_abs_p_minus_0.5_lt_0.01": round(float((np.abs(prob - 0.5) < 0.01).mean()), 4),
                        **mask_entry(args.out, f"selfie_{stem}.png", mask)}
    found = versions()
    found = {"python": found["python"], "numpy": found["numpy"], "mediapipe": version("mediapipe"),
             "opencv-python-headless": f"{version('opencv-python-headless')} (used only for decoding / PNG writing)",
             "image_decoding": HEADER["software_versions"]["image_decoding"]}
    head = {k: v for k, v in HEADER.items() if k != "reproduction_check"}  # written after the images
    write_json(args.out, "selfie.json", {**head, "software_versions": found, "images": images,
                                         "reproduction_check": HEADER["reproduction_check"]})


if __name__ == "__main__":
    main()
