"""The usual ways a training pipeline and a deployed one part, tried on the worker's own tensor to explain a
parity failure: each variant changes one thing (the colour order, the normalisation, the resize, its
interpolation or padding, the EXIF turn, a 16-bit image read as 8 bits, gray made before the resize) and
says which card key would make the worker do it."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import cv2
import numpy as np

from worker.models.card import ModelCard, Preprocess
from worker.models.parity import image_of, tensor_of

IMAGENET_MEAN, IMAGENET_STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)  # RGB, in pixel units


@dataclass(frozen=True)
class Variant:
    group: str  # one change per group, at most two groups at once
    says: str  # what the user's pipeline does, as tried
    fix: str  # the card key to change, or what to change on the training side
    spec: Callable[[Preprocess], Preprocess] | None = None
    interpolation: int | None = None
    source: str = ""  # the image as read another way (SOURCES); "": as the worker decodes it


@dataclass(frozen=True)
class Explanation:
    says: str
    fix: str
    max_abs: float


def _with(**changes: object) -> Callable[[Preprocess], Preprocess]:
    return lambda p: dataclasses.replace(p, **changes)  # type: ignore[arg-type]


def _in_order(values: tuple[float, ...], p: Preprocess) -> tuple[float, ...]:
    """Per-channel values given in RGB, in the card's colour order."""
    return values[::-1] if p.color == "bgr" else values


# the other ways of reading the image a variant may start from (`sources`)
UNTURNED, EIGHT_BIT, GRAY_FIRST, GRAY_DECODED = "unturned", "8-bit", "gray-first", "gray-decoded"
FULL_SCALE = {8: 255.0, 16: 65535.0}  # a pixel's largest level at the card's depth (32: the file's own values)


def variants(card: ModelCard) -> list[Variant]:
    p = card.preprocess
    out: list[Variant] = []
    if p.color in ("rgb", "bgr"):
        other = "bgr" if p.color == "rgb" else "rgb"
        out.append(Variant("color", f"channels reversed (your pipeline feeds {other.upper()})",
                           f"set preprocess.color: {other}", _with(color=other)))
    n = p.channels
    norms = [((0.0,) * n, (1.0,) * n, "mean/std not applied (raw pixel values)")]
    if (full := FULL_SCALE.get(p.depth)) is not None:
        half, k = full / 2, f"{full:g}"
        norms += [((0.0,) * n, (full,) * n, f"scaled to 0-1 only (/{k}, no mean/std)"),
                  ((half,) * n, (half,) * n, f"scaled to -1..1 ((x - {half:g}) / {half:g})")]
        if n == 3:
            scale = full / 255.0
            norms.append((_in_order(tuple(m * scale for m in IMAGENET_MEAN), p),
                          _in_order(tuple(s * scale for s in IMAGENET_STD), p), "ImageNet's mean and std"))
        norms.append((tuple(p.mean), tuple(s * full for s in p.std), f"divided by {k} twice"))
        norms.append((tuple(p.mean), tuple(s / full for s in p.std), f"scaled by {k} (the /{k} left out)"))
    for mean, std, says in norms:
        if (tuple(mean), tuple(std)) != (tuple(p.mean), tuple(p.std)):
            out.append(Variant("norm", says, f"set preprocess.mean: {_list(mean)} and preprocess.std: {_list(std)}",
                               _with(mean=tuple(mean), std=tuple(std))))
    for resize in ("stretch", "letterbox", "shorter-crop"):
        if resize != p.resize:
            out.append(Variant("resize", f"resized by {resize} instead of {p.resize}", f"set preprocess.resize: {resize}",
                               _with(resize=resize)))
    if p.resize == "letterbox":
        for pad in (0, 114, 127, 128):
            if pad != p.pad_value:
                out.append(Variant("pad", f"letterbox padded with {pad} instead of {p.pad_value:g}",
                                   f"set preprocess.pad_value: {pad}", _with(pad_value=pad)))
        other_at = "bottom-right" if p.pad_at == "center" else "center"
        placed = {"bottom-right": "past the image's bottom and right only (the image at the top-left)",
                  "center": "on both sides (the image centred)"}
        out.append(Variant("pad_at", f"letterbox padded {placed[other_at]} instead of {placed[p.pad_at]}",
                           f"set preprocess.pad_at: {other_at}", _with(pad_at=other_at)))
    out.append(Variant("float", f"resized {'with rounding' if p.float_resize else 'as floats, unrounded'}",
                       f"set preprocess.float_resize: {str(not p.float_resize).lower()}",
                       _with(float_resize=not p.float_resize)))
    for flag, name in ((cv2.INTER_AREA, "INTER_AREA"), (cv2.INTER_NEAREST, "INTER_NEAREST"),
                       (cv2.INTER_CUBIC, "INTER_CUBIC")):
        out.append(Variant("interp", f"resize: {name} instead of INTER_LINEAR",
                           "no card key: resize bilinearly in your pipeline (cv2.INTER_LINEAR, or PIL's BILINEAR "
                           "without antialias)", interpolation=flag))
    out.append(Variant("exif", "image rotated by EXIF on one side only",
                       "no card key: the worker turns images upright by their EXIF orientation (as PIL's "
                       "ImageOps.exif_transpose and OpenCV's imread do); do so in your pipeline", source=UNTURNED))
    if p.depth == 16:  # 8-bit levels in units of 0-255: the same mean and std at depth 8
        mean8, std8 = tuple(m * 255.0 / 65535.0 for m in p.mean), tuple(s * 255.0 / 65535.0 for s in p.std)
        out.append(Variant("depth", "read as 8 bits (cv2.imread without IMREAD_ANYDEPTH: the 16-bit levels lost)",
                           f"set preprocess.depth: 8, preprocess.mean: {_list(mean8)} and preprocess.std: "
                           f"{_list(std8)}, or read with cv2.IMREAD_UNCHANGED in your pipeline",
                           _with(depth=8, mean=mean8, std=std8), source=EIGHT_BIT))
    if p.color == "gray":
        after = ("no card key: the worker makes gray after the resize (the same luma within one level, "
                 f"{1 / p.std[0]:.3g} here); make it after resizing in your pipeline, or pass --atol {1 / p.std[0]:.3g}")
        out.append(Variant("gray", "made gray before the resize (cv2.cvtColor, then resized)", after, source=GRAY_FIRST))
        out.append(Variant("gray", "read as gray by the decoder (cv2.IMREAD_GRAYSCALE)", after, source=GRAY_DECODED))
    return out


def sources(path: Path, card: ModelCard, max_pixels: int, image: np.ndarray) -> dict[str, np.ndarray]:
    """The image as the worker decodes it (""), and read the other ways the card's variants start from, where
    they differ from it (an image without an EXIF turn has no `unturned`)."""
    out = {"": image}
    unturned = image_of(path, card, max_pixels, ignore_orientation=True)
    if unturned.shape != image.shape or not np.array_equal(unturned, image):
        out[UNTURNED] = unturned
    if card.preprocess.depth == 16:
        out[EIGHT_BIT] = image_of(path, dataclasses.replace(card, preprocess=_with(depth=8)(card.preprocess)),
                                  max_pixels)
    if card.preprocess.color == "gray":
        out[GRAY_FIRST] = cv2.cvtColor(cv2.cvtColor(image, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
        decoded = cv2.imdecode(np.frombuffer(path.read_bytes(), np.uint8), cv2.IMREAD_GRAYSCALE)
        if decoded is not None and decoded.shape == image.shape[:2]:
            out[GRAY_DECODED] = cv2.cvtColor(decoded, cv2.COLOR_GRAY2BGR)
    return out


def _list(values: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def explain(path: Path, card: ModelCard, theirs: np.ndarray, max_pixels: int, atol: float) -> list[Explanation]:
    """The variants (one, or two of different kinds) that bring the worker's tensor closest to the user's, best
    first: those within `atol` if any, else the three that come closest."""
    read = sources(path, card, max_pixels, image_of(path, card, max_pixels))
    single = [v for v in variants(card) if v.source in read]
    tried: list[Explanation] = []
    for combo in [(v,) for v in single] + [c for c in itertools.combinations(single, 2)
                                           if c[0].group != c[1].group and "" in (c[0].source, c[1].source)]:
        spec, interpolation, source = card.preprocess, cv2.INTER_LINEAR, read[""]
        for v in combo:
            spec = v.spec(spec) if v.spec is not None else spec
            interpolation = v.interpolation if v.interpolation is not None else interpolation
            source = read[v.source] if v.source else source
        try:
            mine = tensor_of(source, dataclasses.replace(card, preprocess=spec), interpolation)
        except (ValueError, cv2.error):  # a variant this image cannot take (a crop larger than it)
            continue
        if mine.shape != theirs.shape:
            continue
        d = float(np.abs(mine - theirs).max())
        tried.append(Explanation(" and ".join(v.says for v in combo), "; ".join(v.fix for v in combo), d))
    tried.sort(key=lambda e: (e.max_abs > atol, e.says.count(" and "), e.max_abs))
    close = [e for e in tried if e.max_abs <= atol]
    return close[:1] if close else tried[:3]
