"""`worker models check NAME --images DIR --expect-results FILE`: the worker's final results for a folder held to
the user's own (worker.models.expected reads them): top-1 agreement and top-5 overlap for a classifier, boxes
matched by class and IoU for a detector, mask IoU for a segmenter; the images that disagree, worst first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from worker.errors import CheckInputError, ImageError
from worker.images import decode
from worker.models.card import ModelCard
from worker.models.expected import Box, Expected, Label, boxes_of, load_expected, mask_of
from worker.runtime.engine import Engine
from worker.tasks import TaskAdapter
from worker.tasks.results import ClassMask, Classification, Detections, Mask, Result

SHOWN = 10  # disagreeing images listed
DEFAULT_MIN = {"classify": 0.99, "detect": 0.95, "segment": 0.95}  # top-1 agreement, boxes matched, mean mask IoU


@dataclass(frozen=True)
class Row:
    image: str
    agreement: float  # 1: the same result
    worker: str
    yours: str
    detail: str


@dataclass(frozen=True)
class Agreement:
    lines: tuple[str, ...]
    rows: tuple[Row, ...]  # the disagreeing images, worst first
    ok: bool


def _same(label: Label, class_id: int, name: str) -> bool:
    return label == class_id if isinstance(label, int) else label.strip().lower() == name.lower()


def _iou(a: tuple[float, ...] | np.ndarray, b: tuple[float, ...] | np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


def classify_row(name: str, mine: Classification, yours: Expected) -> tuple[Row, bool, float]:
    """(the row, whether the top-1 labels agree, the top-5 overlap)."""
    if not yours.labels:
        raise CheckInputError(f"{name}: no labels in the expected results for a classifier")
    top1 = _same(yours.labels[0], int(mine.class_ids[0]), mine.names[0])
    k = min(5, len(yours.labels), len(mine.names))
    overlap = sum(any(_same(t, int(c), n) for c, n in zip(mine.class_ids[:5], mine.names[:5]))
                  for t in yours.labels[:k]) / max(k, 1)
    return Row(name, (float(top1) + overlap) / 2, f"{mine.names[0]} ({mine.scores[0]:.3f})", str(yours.labels[0]),
               f"top-5 overlap {overlap:.2f}"), top1, overlap


def detect_row(name: str, mine: Detections, yours: tuple[Box, ...], iou_min: float) -> tuple[Row, int, int, int]:
    """(the row, matched, worker's boxes, yours): boxes matched greedily, the best IoU first, within a class."""
    pairs = sorted(((_iou(mine.xyxy[i], b.xyxy), i, j) for i in range(len(mine.names)) for j, b in enumerate(yours)
                    if _same(b.label, int(mine.class_ids[i]), mine.names[i])), reverse=True)
    used_w: set[int] = set()
    used_t: set[int] = set()
    score_diffs = []
    for iou, i, j in pairs:
        if iou < iou_min or i in used_w or j in used_t:
            continue
        used_w.add(i)
        used_t.add(j)
        if yours[j].score is not None:
            score_diffs.append(abs(float(mine.scores[i]) - float(yours[j].score)))  # type: ignore[arg-type]
    n, w, t = len(used_w), len(mine.names), len(yours)
    agreement = 1.0 if w + t == 0 else 2 * n / (w + t)
    detail = f"{n} matched, {t - n} of yours missing, {w - n} extra" + \
        (f", scores differ by up to {max(score_diffs):.3g}" if score_diffs else "")
    return Row(name, agreement, f"{w} boxes", f"{t} boxes", detail), n, w, t


def segment_row(name: str, mine: Result, yours: Expected) -> Row:
    fg = mine.mask if isinstance(mine, Mask) else mine.classes > 0 if isinstance(mine, ClassMask) else None
    if fg is None:
        raise CheckInputError(f"{name}: masks are compared for segmenters")
    theirs = mask_of(yours, fg.shape)
    union = int(np.logical_or(fg, theirs).sum())
    iou = 1.0 if union == 0 else int(np.logical_and(fg, theirs).sum()) / union
    return Row(name, iou, f"{int(fg.sum())} px", f"{int(theirs.sum())} px", f"mask IoU {iou:.3f}")


def _names(rels: Iterable[str]) -> dict[str, str]:
    """Every way a results file may name an image (path, path without extension, file name, stem) -> its path."""
    keys: dict[str, str | None] = {}
    for rel in rels:
        p = Path(rel)
        for key in dict.fromkeys((rel, p.with_suffix("").as_posix(), p.name, p.stem)):
            keys[key] = rel if key not in keys or keys[key] == rel else None  # ambiguous: not used
    return {k: v for k, v in keys.items() if v is not None}


def check_results(card: ModelCard, engine: Engine, adapter: TaskAdapter, images: list[tuple[str, Path]],
                  expected_path: Path, max_pixels: int, minimum: float | None, iou_min: float) -> Agreement:
    """Run each image the way `run` does and compare with the expected results (`images`: (rel, path) pairs)."""
    expected = load_expected(expected_path)
    index = _names(rel for rel, _ in images)
    unknown = [k for k in expected if k not in index]
    if unknown:
        raise CheckInputError(f"{expected_path}: {len(unknown)} image name(s) not in the folder: "
                              f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    by_rel = {index[k]: v for k, v in expected.items()}
    paths = dict(images)
    rows: list[Row] = []
    overlaps: list[float] = []
    top1 = 0
    matched = mine_n = yours_n = 0
    for rel in sorted(by_rel):
        yours = by_rel[rel]
        try:
            image = decode(paths[rel].read_bytes(), rel, max_pixels, card.preprocess.depth)
        except (ImageError, OSError) as e:
            rows.append(Row(rel, 0.0, "failed", "-", getattr(e, "reason", str(e))))
            continue
        x, geometry = adapter.preprocess(image)
        result = adapter.postprocess(engine.run(x[None])[0], geometry)
        if isinstance(result, Classification):
            row, agrees, overlap = classify_row(rel, result, yours)
            top1, overlaps = top1 + agrees, [*overlaps, overlap]
        elif isinstance(result, Detections):
            row, n, w, t = detect_row(rel, result, boxes_of(yours, result.image_size), iou_min)
            matched, mine_n, yours_n = matched + n, mine_n + w, yours_n + t
        else:
            row = segment_row(rel, result, yours)
        rows.append(row)
    need = DEFAULT_MIN[card.task] if minimum is None else minimum
    n = len(rows)
    if card.task == "classify":
        value = top1 / max(n, 1)
        said = (f"top-1 agreement {top1}/{n} ({value:.1%}), top-5 overlap "
                f"{(sum(overlaps) / len(overlaps) if overlaps else 0):.1%}")
    elif card.task == "detect":
        value = 1.0 if mine_n + yours_n == 0 else 2 * matched / (mine_n + yours_n)
        said = (f"boxes matched (same class, IoU >= {iou_min:g}): {matched} of yours {yours_n} and the worker's "
                f"{mine_n} ({value:.1%})")
    else:
        value = sum(r.agreement for r in rows) / max(n, 1)
        said = f"mean mask IoU {value:.3f} over {n} images"
    ok = value >= need
    lines = [f"results of {n} image(s) against {expected_path.name} ({card.task}, card '{card.name}'):",
             f"  {said}: {'PASS' if ok else 'FAIL'} (minimum {need:g})"]
    worst = tuple(sorted((r for r in rows if r.agreement < 1.0), key=lambda r: (r.agreement, r.image)))
    if worst:
        lines.append(f"  {len(worst)} image(s) disagree" + (f"; the {SHOWN} worst:" if len(worst) > SHOWN else ":"))
    return Agreement(tuple(lines), worst[:SHOWN], ok)

