"""Stage 3: postprocess, write the outputs, hand the outcome to the recorder."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import time
from typing import Any


from worker.errors import OutboxFull, WorkerError
from worker.intake.jobs import Job, JobStatus
from worker.tasks.results import labels_of, top_score
from worker.outputs.files import Staged, staged
from worker.store.events import LEASE_LOST, Commit, Finished, Settled
from worker.pipeline.items import Item, STOP, WAKE
from worker.pipeline.state import StageState

log = logging.getLogger("worker.pipeline")


JSON_TIMINGS = ("queue_wait_ms", "decode_ms", "preprocess_ms", "infer_ms", "postprocess_ms")


class FinishStage(StageState):
    """The finish thread: postprocess, write the outbox files, record the outcome; an image whose outputs
    find the outbox disk full waits for room."""

    def _finish_loop(self) -> None:
        while (item := self._inferred.get()) is not STOP:
            if item.book is not None and (item := self._gather_page(item)) is None:
                continue  # a page of a file whose other pages are still on their way
            if self._lease_lost(item) or item.taken:  # nothing recorded, nothing archived: the other worker does both
                self.counts.taken += 1
                if item.job.ticket is not None and item.taken:  # its content done by another: this claim ends
                    self.recorder.put(Settled(item.job.ticket))
                self._done(item.job, JobStatus.PROCESSING)
                continue
            try:
                status, committed = self._finish(item)
            except Exception:
                log.exception("finish %s", item.job.key)
                status, committed = JobStatus.FAILED, None
            if status is JobStatus.QUEUED:
                continue  # waits for room in the outbox: still pending, its input where it is
            if self.settings.inputs is None:
                self._done(item.job, status)
            else:
                self._to_archive.put((item.job, status, committed, item.identity))

    def _give_back(self, item: Item) -> None:
        """A claimed image not started when the run was stopped: queued again, the attempt not counted (its
        input stays where it is; the next start processes it as any other). Called by the decode and inference
        threads that hold it: not queued behind the finishing of what inference started."""
        item.release()
        job = item.job
        if item.committed is not None and item.committed.wait() and item.committed.taken_by is None:
            self.recorder.put(Finished(job.key, item.sha256, item.size, JobStatus.QUEUED,
                                       error="given back: the run was stopped before it was processed",
                                       undo_attempt=True, ticket=job.ticket))
            with self._idle:  # counted by several threads
                self.counts.given_back += 1
        self._done(job, JobStatus.QUEUED)

    def _lease_lost(self, item: Item) -> bool:
        """Fleet mode: whether the file's claim passed to another worker while this one processed it (the
        fence before any output is written; the recorder's fences the outcome)."""
        ticket = item.job.ticket
        if ticket is None or self.leases is None or self.leases.holds(ticket):
            return False
        item.taken = False  # (prepare's word for the same)
        log.warning("%s: its claim passed to another worker while it was processed here (this worker's lease ran "
                    "out): nothing written here, the other worker's outcome stands", item.job.key)
        return True

    def _done(self, job: Job, status: JobStatus) -> None:
        if job.ticket is not None and self.leases is not None:
            self.leases.settled(job.ticket)
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()
        if self.on_finished is not None:
            self.on_finished(job, status)

    def _finish(self, item: Item) -> tuple[JobStatus, Commit | None]:
        """Returns the outcome and, in watch mode, the event set once the recorder has committed it."""
        job = item.job
        if item.skipped:
            self.counts.skipped += 1
            self.counts.unread += item.unread
            if job.ticket is None:
                return JobStatus.DONE, None
            settled = Settled(job.ticket, committed=self._committed())
            self.recorder.put(settled)
            return JobStatus.DONE, settled.committed
        # fleet mode: the outputs are published only once the outcome's commit wins the claim's fence
        with staged() if job.ticket is not None else contextlib.nullcontext() as stage:
            event = self._outcome(item)
        if event is None:
            if stage is not None:
                stage.settle(False)
            return JobStatus.QUEUED, None  # waits for room in the outbox
        status, pages = event.status, item.book.pages if item.book is not None else 1
        if job.ticket is not None and stage is not None:
            def then(recorded: bool, stage: Staged = stage) -> None:  # on the recorder's thread, after the commit
                stage.settle(recorded)
                if not recorded:  # its claim passed to another worker (or the database refused it): not counted
                    self._uncount(status, pages, lost=commit.taken_by == LEASE_LOST)
            commit = Commit(then=then)
            event = dataclasses.replace(event, ticket=job.ticket, committed=commit)
        self.recorder.put(event)
        if self.metrics is not None:
            self.metrics.observe(event.timings)
        with self._idle:  # the recorder's thread may take it back (_uncount)
            if status is JobStatus.DONE:
                self.counts.done += 1
                self.counts.pages += pages
            else:
                self.counts.failed += 1
        if status is JobStatus.DONE:
            if item.earlier_outbox is not None:
                self.counts.earlier_outboxes[item.earlier_outbox] += 1
            self.counts.latencies_ms.add(event.timings["total_ms"] if event.timings else 0.0)
        return status, event.committed

    def _uncount(self, status: JobStatus, pages: int, lost: bool) -> None:
        """An outcome counted as done or failed that is not on record after all (fleet mode: the fence turned it
        away, its claim having passed to another worker): the summary says what the database holds."""
        with self._idle:
            if status is JobStatus.DONE:
                self.counts.done -= 1
                self.counts.pages -= pages
            else:
                self.counts.failed -= 1
            self.counts.taken += lost

    def _outcome(self, item: Item) -> Finished | None:
        """Write the image's outputs (or its error file) and make its outcome; None when the outbox has no room
        (the image waits for it)."""
        job = item.job
        t0 = time.perf_counter()
        if item.error is None and (item.book is not None or (item.output is not None and item.geometry is not None)):
            try:
                return self._succeed(item, t0) if item.book is None else self._succeed_pages(item, item.book)
            except OutboxFull as e:
                self._defer(item, e)
                return None
            except OSError as e:  # the outbox's disk, not the image (disk full, read-only): no traceback
                item.error = f"cannot write its outputs under {self.outbox.root}: {e.strerror or e}"
            except Exception as e:
                log.exception("postprocess/write %s", job.key)
                item.error = f"{type(e).__name__}: {e}"
        log.warning("failed: %s: %s", job.key, item.error)
        self._write_error(item)
        return Finished(job.key, item.sha256, item.size, JobStatus.FAILED, error=item.error,
                        timings=self._timings(item), committed=self._committed())

    def _document_head(self, item: Item, status: JobStatus) -> dict[str, Any]:
        """The keys every outbox JSON starts with, result or error file (docs/outputs.md)."""
        return {"input": item.job.key, "sha256": item.sha256 or None, "model": self.card.name,
                "task": self.card.task, "status": status.value}

    def _write_error(self, item: Item) -> None:
        """The outbox's word on a failed image, for whoever collects results from it (not the database's)."""
        document = {**self._document_head(item, JobStatus.FAILED), "error": item.error}
        try:
            self.outbox.write_error(item.job.rel, document, item.pages)
        except (OSError, WorkerError) as e:  # a full or read-only outbox: the failure is on record all the same
            log.debug("no error file for %s: %s", item.job.key, e)

    def _succeed(self, item: Item, t0: float) -> Finished:
        job = item.job
        result = self.adapter.postprocess(item.output, item.geometry)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        h, w = item.geometry.orig_hw  # type: ignore[union-attr]
        item.timings["postprocess_ms"] = (t1 - t0) * 1000
        image = {"width": w, "height": h, **({"pages": item.pages} if item.pages > 1 else {})}
        document = {**self._document_head(item, JobStatus.DONE), "image": image,
                    "model_input": item.model_input(self._size_hw),  # a rect letterbox's varies by image
                    **({"warnings": item.warnings} if item.warnings else {}), **result.summary(),
                    # up to the write (which is timed, with the total, in the database)
                    "timings_ms": {k[:-3]: round(item.timings.get(k, 0.0), 3) for k in JSON_TIMINGS}}
        json_path, outputs = self.outbox.write(job.rel, result, document, item.image, item.pages)
        item.image = None
        t2 = time.perf_counter()
        item.timings["write_ms"] = (t2 - t1) * 1000
        if outputs.overlay is not None:  # recorded with the result, as the JSON names it
            document = {**document, "overlay": outputs.overlay}
        if item.warnings:
            log.warning("%s: %s", job.key, "; ".join(item.warnings))
        return Finished(job.key, item.sha256, item.size, JobStatus.DONE, task=self.card.task,
                        error="; ".join(f"warning: {w}" for w in item.warnings) or None,
                        score=top_score(result), payload=document, json_path=json_path, mask_path=outputs.mask,
                        labels=tuple(labels_of(result)), timings=self._timings(item),
                        committed=self._committed())

    def _defer(self, item: Item, reason: OutboxFull) -> None:
        """The outbox's disk is full: no fault of the image's. It is recorded as queued (the attempt not
        counted), its input stays where it is, and it waits with intake paused until there is room."""
        job = item.job
        self.recorder.put(Finished(job.key, item.sha256, item.size, JobStatus.QUEUED,
                                   error=f"waiting for room in the outbox ({reason})", undo_attempt=True,
                                   ticket=job.ticket))
        self._outbox_pause.defer(job, reason)
        for _ in range(self.settings.decode_workers):  # a decode thread blocked on an empty queue
            try:
                self._jobs.put_nowait(WAKE)
            except queue.Full:
                break

    def _timings(self, item: Item) -> dict[str, float] | None:
        if item.sha256 == "":
            return None  # never read: nothing to time
        t = item.timings
        keys = ("queue_wait_ms", "decode_ms", "preprocess_ms", "infer_ms", "postprocess_ms", "write_ms")
        out: dict[str, float] = {k: round(t.get(k, 0.0), 3) for k in keys}
        out["total_ms"] = round((time.perf_counter() - item.job.enqueued_at) * 1000, 3)
        out["batch_size"] = item.batch_size
        return out

    def _committed(self) -> Commit | None:
        return Commit() if self.settings.inputs is not None else None
