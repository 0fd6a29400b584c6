"""The usual ways a training pipeline and a deployed one part, tried on the worker's own tensor to explain a
parity failure: each variant changes one thing (the colour order, the normalisation, the resize, its
interpolation or padding, the EXIF turn) and says which card key would make the worker do it."""

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
    unturned: bool = False  # the image read without its EXIF orientation


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


def variants(card: ModelCard) -> list[Variant]:
    p = card.preprocess
    out: list[Variant] = []
    if p.color in ("rgb", "bgr"):
        other = "bgr" if p.color == "rgb" else "rgb"
        out.append(Variant("color", f"channels reversed (your pipeline feeds {other.upper()})",
                           f"set preprocess.color: {other}", _with(color=other)))
    n = p.channels
    norms = [((0.0,) * n, (1.0,) * n, "mean/std not applied (raw pixel values)"),
             ((0.0,) * n, (255.0,) * n, "scaled to 0-1 only (/255, no mean/std)"),
             ((127.5,) * n, (127.5,) * n, "scaled to -1..1 ((x - 127.5) / 127.5)")]
    if n == 3:
        norms.append((_in_order(IMAGENET_MEAN, p), _in_order(IMAGENET_STD, p), "ImageNet's mean and std"))
    norms.append((tuple(p.mean), tuple(s * 255.0 for s in p.std), "divided by 255 twice"))
    norms.append((tuple(p.mean), tuple(s / 255.0 for s in p.std), "scaled by 255 (the /255 left out)"))
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
                       "ImageOps.exif_transpose and OpenCV's imread do); do so in your pipeline", unturned=True))
    return out


def _list(values: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def explain(path: Path, card: ModelCard, theirs: np.ndarray, max_pixels: int, atol: float) -> list[Explanation]:
    """The variants (one, or two of different kinds) that bring the worker's tensor closest to the user's, best
    first: those within `atol` if any, else the three that come closest."""
    image = image_of(path, card, max_pixels)
    unturned = image_of(path, card, max_pixels, ignore_orientation=True)
    turned = unturned.shape != image.shape or not np.array_equal(unturned, image)
    single = [v for v in variants(card) if turned or not v.unturned]
    tried: list[Explanation] = []
    for combo in [(v,) for v in single] + [c for c in itertools.combinations(single, 2) if c[0].group != c[1].group]:
        spec, interpolation, source = card.preprocess, cv2.INTER_LINEAR, image
        for v in combo:
            spec = v.spec(spec) if v.spec is not None else spec
            interpolation = v.interpolation if v.interpolation is not None else interpolation
            source = unturned if v.unturned else source
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
