"""Stage 2: micro-batches run on the one shared onnxruntime session."""

from __future__ import annotations

import logging
import time

import numpy as np

from worker.pipeline.batcher import Batcher
from worker.pipeline.items import Item, STOP
from worker.pipeline.state import StageState

log = logging.getLogger("worker.pipeline")


class InferStage(StageState):
    """The inference threads: gather a micro-batch, run it, hand each image on."""

    def _infer_loop(self) -> None:
        s = self.settings
        buf = np.empty((s.max_batch, self._channels, *self._size_hw), dtype=np.float32)  # reused every batch
        batcher: Batcher[Item] = Batcher(self._prepared, s.max_batch, s.max_delay_ms / 1000, STOP)
        stopping = False
        while not stopping:
            batch, stopping = batcher.next_batch()
            if self._giving_back.is_set():  # the run was stopped: a file's first or only page is not started
                for item in [i for i in batch if i.book is None]:
                    item.tensor = None
                    self._give_back(item)
                batch = [i for i in batch if i.book is not None]
            if batch:
                self._infer(batch, buf)

    def _infer(self, batch: list[Item], buf: np.ndarray) -> None:
        """Run the batch, in groups of one tensor shape where a rect letterbox sized them apart."""
        shapes: dict[tuple[int, ...], list[Item]] = {}
        for item in batch:
            shapes.setdefault(item.tensor.shape if item.tensor is not None else (), []).append(item)
        for group in shapes.values():
            self._run(group, buf)

    def _run(self, batch: list[Item], buf: np.ndarray) -> None:
        n = len(batch)
        if n == 1 and batch[0].tensor is not None:  # a batch of one runs on its own tensor: no copy
            x = batch[0].tensor[None]
        else:
            x = within(buf, n, batch[0].tensor.shape if batch[0].tensor is not None else buf.shape[1:])
            for i, item in enumerate(batch):
                x[i] = item.tensor
        for item in batch:
            item.tensor = None  # release the per-image input early
        t0 = time.perf_counter()
        try:
            out = self.engine.run(x)
        except Exception as e:
            log.exception("inference failed for a batch of %d", n)
            for item in batch:
                item.error = f"inference failed: {e}"
        else:
            ms = (time.perf_counter() - t0) * 1000
            for i, item in enumerate(batch):
                item.output = out[i]
                item.batch_size = n
                item.timings["infer_ms"] = ms
        for item in batch:
            self._inferred.put(item)


def within(buf: np.ndarray, n: int, shape: tuple[int, ...]) -> np.ndarray:
    """The first n tensors of `shape` laid out from the start of `buf` (a view; `shape` no larger than
    buf's tensors: the card's size, or a rect letterbox's smaller one)."""
    if tuple(shape) == buf.shape[1:]:
        return buf[:n]
    return buf.reshape(-1)[:n * int(np.prod(shape))].reshape(n, *shape)
