"""Multi-page files (pipeline.pages: all): the page set that gathers a file's pages, sent one item each,
into its one outcome."""

from __future__ import annotations

import logging
import time
from typing import Any


from worker.errors import ImageError, OutboxFull
from worker.images import later_pages
from worker.intake.jobs import JobStatus
from worker.tasks.results import labels_of, top_score
from worker.store.events import Finished
from worker.pipeline.finish import JSON_TIMINGS
from worker.pipeline.items import Item, PageSet
from worker.pipeline.prepare import unchanged_since_claim
from worker.pipeline.state import StageState

log = logging.getLogger("worker.pipeline")


class PagesStage(StageState):
    """The multi-page assembly: the prepare stage sends a file's later pages, the finish stage binds
    each page to its file's page set and records the file once every page has come."""

    def _send_pages(self, first: Item) -> None:
        """Decode and preprocess a multi-page file's other pages in order, each into the queue after its
        first (a full queue holds this thread: a file of a thousand pages is never all in memory). After a
        page that fails, the rest are not sent: the file fails naming that page."""
        book = first.book
        assert book is not None and (book.data is not None or book.rest is not None)
        pages = book.rest or later_pages(book.data or b"", first.job.key, self.settings.max_pixels, self._depth)
        try:
            for page in range(1, book.pages):
                part = Item(first.job, sha256=first.sha256, size=first.size, pages=book.pages, page=page, book=book)
                t0 = time.perf_counter()
                try:
                    image = next(pages, None)
                    if image is None:
                        raise ImageError(first.job.key, "not in the file (it ended early)")
                    if book.source is not None:
                        unchanged_since_claim(first.job, book.source, first.identity)
                    t1 = time.perf_counter()
                    part.tensor, part.geometry = self.adapter.preprocess(image)
                    if self.settings.keep_image:
                        part.image = image
                    part.timings.update(decode_ms=(t1 - t0) * 1000, preprocess_ms=(time.perf_counter() - t1) * 1000)
                except Exception as e:
                    if not isinstance(e, ImageError):
                        log.exception("prepare %s, page %d", first.job.key, page + 1)
                    part.error = e.reason if isinstance(e, ImageError) else f"{type(e).__name__}: {e}"
                    book.expected = page + 1  # before the item is queued: the finish thread counts up to it
                    self._inferred.put(part)
                    return
                self._prepared.put(part)
        finally:
            pages.close()
            if book.source is not None:
                book.source.close()
            book.data, book.rest, book.source = None, None, None

    def _gather_page(self, item: Item) -> Item | None:
        """Take one page of a multi-page file: postprocess it and write its outputs (the first page's wait
        for the file's JSON). Returns the file's first item once every expected page has come, else None."""
        book = item.book
        assert book is not None
        if item.page == 0:
            book.first = item
        if item.error is None and item.output is not None and item.geometry is not None and book.error is None:
            try:
                self._page_done(item, book)
            except OutboxFull as e:
                book.full = e
            except Exception as e:
                if not isinstance(e, OSError):
                    log.exception("postprocess/write %s, page %d", item.job.key, item.page + 1)
                item.error = (f"cannot write its outputs under {self.outbox.root}: {e.strerror or e}"
                              if isinstance(e, OSError) else f"{type(e).__name__}: {e}")
        if item.error is not None and (book.error is None or item.page < book.error_page):
            book.error, book.error_page = item.error, item.page
        item.output = None
        if item.page:
            item.image = None  # the first page's is drawn on with the file's JSON
        book.arrived += 1
        if book.arrived < book.expected:
            return None
        first = book.first
        assert first is not None
        if book.error is not None and first.error is None:
            first.error = book.error if book.error_page == 0 else \
                f"page {book.error_page + 1} of {book.pages}: {book.error}"
        return first

    def _page_done(self, item: Item, book: PageSet) -> None:
        """Postprocess one page; write its outputs now unless it is the first (written with the JSON)."""
        t0 = time.perf_counter()
        result = self.adapter.postprocess(item.output, item.geometry)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        h, w = item.geometry.orig_hw  # type: ignore[union-attr]
        entry: dict[str, Any] = {"page": item.page + 1, "image": {"width": w, "height": h},
                                 "model_input": item.model_input(self._size_hw), **result.summary()}
        if item.page == 0:
            book.first_result = result
            item.timings["postprocess_ms"] = (t1 - t0) * 1000
        else:
            entry.update(self.outbox.write_page(item.job.rel, item.page, result, item.image).named())
            for k in ("decode_ms", "preprocess_ms", "infer_ms"):
                book.timings[k] = book.timings.get(k, 0.0) + item.timings.get(k, 0.0)
            book.timings["postprocess_ms"] = book.timings.get("postprocess_ms", 0.0) + (t1 - t0) * 1000
            book.timings["write_ms"] = book.timings.get("write_ms", 0.0) + (time.perf_counter() - t1) * 1000
        book.entries[item.page] = entry
        book.score = max(book.score, top_score(result))
        for cid, name, score in labels_of(result):
            if cid not in book.labels or score > book.labels[cid][2]:
                book.labels[cid] = (cid, name, score)

    def _succeed_pages(self, item: Item, book: PageSet) -> Finished:
        """A multi-page file whose pages are all postprocessed and but the first written: the first page's
        outputs, then the JSON listing every page."""
        if book.full is not None:
            raise book.full
        assert book.first_result is not None and item.geometry is not None
        job = item.job
        t0 = time.perf_counter()
        first = self.outbox.write_page(job.rel, 0, book.first_result, item.image)
        book.entries[0].update(first.named())
        item.image = None
        for k, v in book.timings.items():
            item.timings[k] = item.timings.get(k, 0.0) + v
        h, w = item.geometry.orig_hw
        document = {**self._document_head(item, JobStatus.DONE), "image": {"width": w, "height": h, "pages": book.pages},
                    "pages": [book.entries[k] for k in sorted(book.entries)],
                    "timings_ms": {k[:-3]: round(item.timings.get(k, 0.0), 3) for k in JSON_TIMINGS}}
        json_path = self.outbox.write_document(job.rel, document, book.pages)
        item.timings["write_ms"] = item.timings.get("write_ms", 0.0) + (time.perf_counter() - t0) * 1000
        return Finished(job.key, item.sha256, item.size, JobStatus.DONE, task=self.card.task, score=book.score,
                        payload=document, json_path=json_path, mask_path=first.mask, labels=tuple(book.labels.values()),
                        timings=self._timings(item), committed=self._committed())
