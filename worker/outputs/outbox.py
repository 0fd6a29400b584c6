"""The outbox: the only writer of output files, each named after its input and written atomically
(worker/outputs/files.py, which also holds the one mover of input files); a disk without room is said
as OutboxFull, no fault of the image's."""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import cv2
import numpy as np

from worker.outputs.overlays import overlay
from worker.errors import OutboxFull
from worker.outputs.maskpng import encode_class_png, encode_mask_png
from worker.host.mounts import network_filesystem
from worker.host.names import as_text
from worker.tasks.results import ClassMask, Detections, Mask, Result
from worker.outputs.yolo_txt import yolo_txt
from worker.outputs.files import FULL, TMP_PREFIX, _owner_suffix, fit_name, inside, remove_output, write_atomic


ROOM_PROBE_BYTES = 1 << 16
# what an image's outcome leaves in the outbox: its results, or the reason it failed
RESULT_SUFFIXES = (".json", ".mask.png", ".txt", ".overlay.jpg")
ERROR_SUFFIX = ".error.json"
PAGES_SUFFIX = ".pages"  # a multi-page file's folder of its later pages' outputs (pipeline.pages: all)
# what _page_outputs names a page's outputs in that folder: the only names _drop_pages removes there
_PAGE_OUTPUT = re.compile(r"(\d+)(?:\.mask\.png|\.txt|\.overlay\.jpg)")
_LONGEST_SUFFIX = max(len(s) for s in (*RESULT_SUFFIXES, ERROR_SUFFIX))


def output_rel(rel: str) -> str:
    """The name an image's outputs are written under, before their suffixes: `rel`, or with its file
    name cut short (fit_name) where the longest suffix would not fit. The database and the JSON keep
    `rel`; the returned paths (json_path, mask_path) say where its outputs are."""
    folder, name = posixpath.split(rel)
    return posixpath.join(folder, fit_name(name, _LONGEST_SUFFIX))


@dataclass(frozen=True)
class PageOutputs:
    """Where one image's (or page's) mask and overlay were written, relative to the outbox; None: not written."""

    mask: str | None = None
    overlay: str | None = None

    def named(self) -> dict[str, str]:
        """The written ones as the result document names them: {"mask": ..., "overlay": ...}."""
        return {k: v for k, v in (("mask", self.mask), ("overlay", self.overlay)) if v is not None}


class Outbox:
    """Writes <outbox>/<rel>.json and, as configured, .mask.png, .txt (YOLO) and .overlay.jpg; or, for a
    failed image, <rel>.error.json (with a name too long for that cut short: output_rel). The outbox
    holds each name's latest outcome: results or an error.

    Under pipeline.pages: all (`pages`), a multi-page file's first page has those outputs, its page k
    (from 2) them in <rel>.pages/<k>.mask.png (.txt, .overlay.jpg), and its one JSON lists every page.
    Whatever an earlier outcome under the name left there beyond the new page count is removed: for every
    outcome under `all`, or on a local disk (a file done under `all`, then under `first`, keeps no masks of
    pages its JSON no longer lists; a failed lookup costs microseconds there), and on a network share under
    `first` for a file of several pages only (a lookup for every image would be a round trip each)."""

    def __init__(self, root: Path, write_json: bool = True, write_masks: bool = True, write_yolo_txt: bool = False,
                 write_overlays: bool = False, write_errors: bool = True, pages: bool = False) -> None:
        self.root = root
        self.write_json = write_json
        self.write_masks = write_masks
        self.write_yolo_txt = write_yolo_txt
        self.write_overlays = write_overlays
        self.write_errors = write_errors
        self.pages = pages
        root.mkdir(parents=True, exist_ok=True)
        self._every_outcome_drops_pages = pages or network_filesystem(root) is None

    def _inside(self, rel: str) -> Path:
        return inside(self.root, rel)

    def write(self, rel: str, result: Result, document: dict[str, Any], image: np.ndarray | None = None,
              frames: int = 1) -> tuple[str | None, PageOutputs]:
        """Write one image's outputs; returns the JSON's path and the other outputs' (PageOutputs), relative
        to the outbox, as text (worker.host.names: a name that is not UTF-8 is written under its real bytes,
        returned escaped). The JSON names the mask and the overlay it goes with.

        `image` (uint8 BGR) is needed only for overlays; `frames`: the file's pages, of which only the
        first was processed. Raises OutboxFull when the filesystem has no room (the outputs already
        written are complete files, overwritten on the retry)."""
        with _full_as_outbox_full(self.root):
            out = output_rel(rel)
            outputs = self._page_outputs(out, 0, result, image)
            return self._document(out, {**document, **outputs.named()}, 1, frames), outputs

    def write_page(self, rel: str, page: int, result: Result, image: np.ndarray | None = None) -> PageOutputs:
        """Write the outputs of page `page` (0 the first) of a multi-page file but its JSON (write_document);
        returns their paths relative to the outbox. Raises OutboxFull as write does."""
        with _full_as_outbox_full(self.root):
            return self._page_outputs(output_rel(rel), page, result, image)

    def write_document(self, rel: str, document: dict[str, Any], pages: int) -> str | None:
        """Write a multi-page file's JSON once its pages' outputs are written; returns its path as text."""
        with _full_as_outbox_full(self.root):
            return self._document(output_rel(rel), document, pages, pages)

    def write_error(self, rel: str, document: dict[str, Any], frames: int = 1) -> str | None:
        """Write <rel>.error.json (the reason an image failed) and remove the results an earlier content
        under this name left (they are not this file's; the database keeps them); `frames`: its pages
        if known. Returns its path relative to the outbox, None when not configured."""
        if not self.write_errors:
            return None
        out = output_rel(rel)
        error_rel = out + ERROR_SUFFIX
        write_atomic(self._inside(error_rel), json.dumps(document, ensure_ascii=False).encode())
        for suffix in RESULT_SUFFIXES:
            remove_output(self._inside(out + suffix))
        if self._every_outcome_drops_pages or frames > 1:
            self._drop_pages(out, 0)
        return error_rel

    def has_room(self, nbytes: int = ROOM_PROBE_BYTES) -> bool:
        """Whether a file of `nbytes` can be written under the root now (written, then removed)."""
        probe = self.root / f"{TMP_PREFIX}room{_owner_suffix()}"
        try:
            with open(probe, "wb") as f:
                f.write(bytes(nbytes))
            return True
        except OSError as e:
            return e.errno not in FULL  # another error is not a lack of room: the real write will say
        finally:
            probe.unlink(missing_ok=True)

    def _page_outputs(self, out: str, page: int, result: Result, image: np.ndarray | None) -> PageOutputs:
        """A page's .txt, .overlay.jpg and .mask.png, as configured; the mask's and overlay's paths."""
        rel = out if page == 0 else f"{out}{PAGES_SUFFIX}/{page + 1}"
        if isinstance(result, Detections) and self.write_yolo_txt:
            write_atomic(self._inside(rel + ".txt"), yolo_txt(result).encode())
        drawn = None
        if self.write_overlays and image is not None:
            ok, jpg = cv2.imencode(".jpg", overlay(image, result), [cv2.IMWRITE_JPEG_QUALITY, 90])
            if ok:
                write_atomic(self._inside(rel + ".overlay.jpg"), jpg.tobytes())
                drawn = as_text(rel + ".overlay.jpg")
        return PageOutputs(mask=self._mask(rel, result), overlay=drawn)

    def _mask(self, rel: str, result: Result) -> str | None:
        """A page's .mask.png, as configured; its path as text, or None."""
        if not self.write_masks:
            return None
        if isinstance(result, Mask):
            png = encode_mask_png(result.mask)
        elif isinstance(result, ClassMask):
            png = encode_class_png(result.classes)
        elif isinstance(result, Detections) and result.instances is not None:  # 8-bit while it fits
            few = len(result.names) < 256
            png = encode_class_png(result.instances.astype(np.uint8) if few else result.instances)
        else:
            return None
        write_atomic(self._inside(rel + ".mask.png"), png)
        return as_text(rel + ".mask.png")

    def _document(self, out: str, document: dict[str, Any], pages: int, frames: int) -> str | None:
        json_rel = None
        if self.write_json:
            json_rel = out + ".json"
            write_atomic(self._inside(json_rel), json.dumps(document, ensure_ascii=False).encode())
        if self.write_errors:  # an earlier failure of this name (retried, or dropped again) is over
            remove_output(self._inside(out + ERROR_SUFFIX))
        if self._every_outcome_drops_pages or frames > 1:
            self._drop_pages(out, pages)
        return None if json_rel is None else as_text(json_rel)

    def _drop_pages(self, out: str, keep: int) -> None:
        """Remove what an earlier outcome under this name left in <out>.pages/ for its pages past `keep`.
        Only page outputs' names: a folder of inputs that happens to be named so keeps its own outputs."""
        folder = self._inside(out + PAGES_SUFFIX)
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            named = _PAGE_OUTPUT.fullmatch(entry.name)
            if named is not None and int(named[1]) > keep and not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
        if keep <= 1:
            with contextlib.suppress(OSError):  # not empty: something of someone else's is in it
                folder.rmdir()


@contextlib.contextmanager
def _full_as_outbox_full(root: Path) -> Iterator[None]:
    """An OSError for lack of room (disk full, quota) as OutboxFull: no fault of the image's."""
    try:
        yield
    except OSError as e:
        if e.errno in FULL:
            raise OutboxFull(f"{root}: {e.strerror}") from e
        raise
