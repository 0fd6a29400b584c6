"""`worker models check NAME --image IMG ...`: the parity check's steps and its report, in words."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from worker.errors import CheckInputError
from worker.models.card import ModelCard
from worker.models.mismatches import explain
from worker.models.parity import (Difference, align, compare_outputs, image_of, load_array, load_outputs, tensor_of,
                                  where)
from worker.runtime.engine import Engine


@dataclass(frozen=True)
class Verdict:
    lines: tuple[str, ...]
    ok: bool


def check_parity(card: ModelCard, engine: Engine, image: Path, expect_input: Path | None,
                 expect_output: Path | None, dump: Path | None, atol: float, rtol: float, max_pixels: int) -> Verdict:
    """Run IMG through the worker's decode and preprocessing (and with `expect_output` or `dump`, the session),
    hold each to what the user gave, and say where they part and why, most likely."""
    pixels = image_of(image, card, max_pixels)
    mine = tensor_of(pixels, card)
    lines = [f"parity of {image.name} (the decode and preprocessing `run` and `watch` use, card '{card.name}'):",
             f"  worker's tensor: {tuple(mine.shape)} float32, NCHW"]
    ok = True
    if expect_input is not None:
        theirs = load_array(expect_input, "expected input")
        aligned = align(theirs, mine, card, expect_input, _rect_hw(pixels, card))
        lines.append(f"  yours:           {tuple(theirs.shape)} {theirs.dtype} ({expect_input.name})")
        lines += [f"  note: {n}" for n in aligned.notes]
        d = Difference.of(mine, aligned.tensor)
        lines.append(f"  max abs diff {d.max_abs:.6g}, mean {d.mean_abs:.6g} (worst at {where(d.worst)}: worker "
                     f"{d.mine:.6g}, yours {d.theirs:.6g})")
        if d.max_abs <= atol:
            lines.append(f"  input: PASS (max diff {d.max_abs:.3g} <= --atol {atol:g})")
        else:
            ok = False
            lines.append(f"  input: FAIL (max diff {d.max_abs:.3g} > --atol {atol:g})")
            found = explain(image, card, aligned.tensor, max_pixels, atol)
            for i, e in enumerate(found):
                lead = "  most likely: " if i == 0 and e.max_abs <= atol else ("  closest:     " if i == 0 else
                                                                              "  then:        ")
                lines.append(f"{lead}{e.says}: max diff {e.max_abs:.4g} ({e.fix})")
            if not found or found[0].max_abs > atol:
                lines.append("  no single usual mismatch explains it: compare the two with --dump DIR")
    outputs: dict[str, np.ndarray] = {}
    if expect_output is not None or dump is not None:
        names = [o.name for o in engine.session.get_outputs()]  # every output, not only those the card reads
        outputs = dict(zip(names, engine.session.run(names, engine.feeds(mine))))
    if expect_output is not None:
        for c in compare_outputs(outputs, load_outputs(expect_output), expect_output):
            if c.difference is None:
                ok = False
                lines.append(f"  output {c.name}: FAIL (shape {c.shape}, yours {c.theirs_shape})")
                continue
            verdict = "PASS" if c.relative <= rtol else "FAIL"
            ok = ok and verdict == "PASS"
            lines.append(f"  output {c.name} {c.shape}: {verdict} (max abs diff {c.difference.max_abs:.4g}, "
                         f"{c.relative:.3g} of its largest value; --rtol {rtol:g})")
    if dump is not None:
        lines += _dump(dump, mine, outputs, expect_input)
    return Verdict(tuple(lines), ok)


def _rect_hw(image: np.ndarray, card: ModelCard) -> tuple[int, int] | None:
    """The (h, w) a rect letterbox would give the image, where the card letterboxes to its full size."""
    p = card.preprocess
    if p.resize != "letterbox" or p.rect:
        return None
    shape = tensor_of(image, dataclasses.replace(card, preprocess=dataclasses.replace(p, rect=True))).shape
    return shape[2], shape[3]


def _dump(folder: Path, mine: np.ndarray, outputs: dict[str, np.ndarray], expect_input: Path | None) -> list[str]:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "input.npy", mine)
        for name, array in outputs.items():
            np.save(folder / f"output_{_safe(name)}.npy", array)
    except OSError as e:
        raise CheckInputError(f"{folder}: cannot write the dump: {e.strerror or e}") from None
    yours = str(expect_input) if expect_input is not None else "YOUR_TENSOR.npy"
    return [f"  wrote {folder}/input.npy and {len(outputs)} output(s) (output_<name>.npy); to compare in Python:",
            "",
            "import numpy as np",
            f"worker = np.load({str(folder / 'input.npy')!r})  # (1, C, H, W) float32",
            f"yours = np.load({yours!r})",
            "diff = np.abs(worker - yours.reshape(worker.shape))  # transpose first if yours is NHWC",
            "print(diff.max(), np.unravel_index(diff.argmax(), diff.shape))",
            ""]


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
