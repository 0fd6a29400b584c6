"""What flows through the stages and what they count: the settings, the per-image item, its
counts, and the sentinels that stop and wake the stage threads."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from worker.errors import OutboxFull
from worker.intake.jobs import Job
from worker.measure.metrics import LatencyWindow, percentiles
from worker.runtime.model_output import ModelOutput
from worker.tasks.results import Result
from worker.store.events import Commit
from worker.tasks.preprocess import Geometry

log = logging.getLogger("worker.pipeline")


STOP: Any = object()
WAKE: Any = object()  # wakes a decode thread waiting for a job: images wait to be retried (outbox full)


@dataclass(frozen=True)
class Settings:
    """What the stages need from the config, resolved once (no config lookups inside loops)."""

    decode_workers: int
    infer_workers: int
    max_batch: int
    max_delay_ms: float
    queue_size: int
    max_pixels: int
    max_attempts: int
    memory_sample_s: float
    # once an outcome is committed: "move" the input to <archive>/done|failed/<rel>; "delete" it (a failed
    # one is moved to <archive>/failed/<rel>); "keep" it where it is, remembered so that a rescan does
    # not read it again (`kept`); None: the pipeline never touches inputs nor waits for commits (`run`)
    inputs: Literal["move", "delete", "keep"] | None = None
    archive: Path | None = None  # needed by move and delete
    empty_folders_s: float = 0.0  # a subfolder emptied by moves is removed once unchanged this long (0: never)
    keep_image: bool = False  # carry the decoded image to the finish stage (overlays need it)
    replay: bool = False  # soak: process images again even when the ledger says done
    jpeg_reduce: bool = False  # decode big JPEGs at a reduced scale (never with keep_image)
    all_pages: bool = False  # every page of a multi-page file (pipeline.pages: all), not only its first
    # record memory samples (a prepare process does not: the inference process samples all of them)
    record_memory: bool = True
    # with inputs "keep", remember the inputs kept (a prepare process under `run` keeps them only to wait
    # for each commit: nothing asks it which were kept)
    remember_kept: bool = True


@dataclass
class Counts:
    done: int = 0
    failed: int = 0
    skipped: int = 0
    unread: int = 0  # of the skipped: known done by the file's size and stamp, not read again
    pages: int = 0  # pages of the done images (more than `done` only with pipeline.pages: all)
    taken: int = 0  # left to another live worker that claimed them first
    given_back: int = 0  # claimed, not yet inferred when the run was stopped: queued again, no attempt counted
    # done images that an earlier run had done with this model into another outbox, by that outbox
    earlier_outboxes: Counter[str] = field(default_factory=Counter)
    latencies_ms: LatencyWindow = field(default_factory=LatencyWindow)  # done images, total ms

    @property
    def processed(self) -> int:
        return self.done + self.failed


@dataclass
class Item:
    """One image on its way through the stages (mutable, private to the pipeline)."""

    job: Job
    sha256: str = ""
    size: int = 0
    tensor: np.ndarray | None = None
    image: np.ndarray | None = None
    geometry: Geometry | None = None
    output: ModelOutput | None = None
    data: bytes | None = None  # the file's bytes, from reading to decoding
    earlier_outbox: str | None = None  # done before into another outbox: being done again into this one
    # a multi-page TIFF read page by page (over the byte limit, or over PAGES_FROM_DISK_BYTES): the file,
    # open from its claim until its pages are decoded (release() closes it), and its pages as they are
    # decoded from disk
    source: BinaryIO | None = None
    rest: Generator[np.ndarray, None, None] | None = None
    identity: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) of the file as it was read
    committed: Commit | None = None  # set once the claim's transaction has ended
    error: str | None = None
    skipped: bool = False  # already done with the same content and model
    unread: bool = False  # skipped by its file's size and stamp, without reading it
    taken: bool = False  # in another live worker's hands (its claim came first): left to it
    timings: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what decoding recovered from (a damaged JPEG)
    batch_size: int = 0
    pages: int = 1  # pages or frames in the file (a multi-page TIFF, an animated GIF)
    page: int = 0  # which of them this item is (0: the first; with all_pages the others follow it as items)
    book: PageSet | None = None  # with all_pages, a multi-page file's: shared by its pages' items

    def model_input(self, card_hw: tuple[int, int]) -> dict[str, int]:
        """The network input's size this image (or page) was fed at: a rect letterbox's own, else the card's."""
        h, w = (self.geometry.input_hw if self.geometry is not None else None) or card_hw
        return {"width": w, "height": h}

    @property
    def held(self) -> int:
        """Bytes of the file held in memory between claim and decode."""
        return len(self.data) if self.data is not None else 0

    def release(self) -> None:
        """Close what a file read page by page keeps open (a no-op for any other)."""
        if self.rest is not None:
            self.rest.close()
            self.rest = None
        if self.source is not None:
            self.source.close()
            self.source = None


@dataclass
class PageSet:
    """A multi-page file's pages on their way to its one outcome (pipeline.pages: all). The prepare thread
    sends every page after the first as an item of its own; the finish thread postprocesses and writes
    each as it comes, in any order, and records the file once all have come (or, after a page failed,
    those before it: the rest are not sent)."""

    pages: int
    data: bytes | None  # the file's bytes, until every page is decoded
    expected: int  # items the finish thread waits for: `pages`, fewer once a page has failed
    source: BinaryIO | None = None  # or, for a file read page by page (Item.source), the file
    rest: Generator[np.ndarray, None, None] | None = None  # and its pages after the first
    arrived: int = 0
    first: Item | None = None  # page 0's item: the job, its claim, its first page's result
    first_result: Result | None = None
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)  # page -> its part of the JSON
    labels: dict[int, tuple[int, str, float]] = field(default_factory=dict)  # class id -> best of any page
    score: float = 0.0  # the best page's
    timings: dict[str, float] = field(default_factory=dict)  # summed over the pages after the first
    error: str | None = None  # why the first page that failed did (the lowest page number)
    error_page: int = 0
    full: OutboxFull | None = None  # a page's outputs found no room: the whole file waits for room


def summarize(counts: Counts, seconds: float) -> dict[str, Any]:
    return {"images": counts.processed + counts.skipped + counts.taken, "done": counts.done, "failed": counts.failed,
            "skipped": counts.skipped, "skipped_unread": counts.unread, "taken": counts.taken, "pages": counts.pages,
            "given_back": counts.given_back,
            "earlier_outboxes": dict(counts.earlier_outboxes.most_common()),
            "seconds": round(seconds, 3),
            "images_per_s": round(counts.processed / seconds, 2) if seconds > 0 else 0.0,
            **{k: round(v, 1) for k, v in percentiles(counts.latencies_ms.last()).items()}}
