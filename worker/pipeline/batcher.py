"""Micro-batching, Triton-style: a batch closes at `max_batch` items or `max_delay_s` after its
first item, whichever comes first. Items keep their queue order."""

from __future__ import annotations

import queue
import time
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Batcher(Generic[T]):
    def __init__(self, source: "queue.Queue[Any]", max_batch: int, max_delay_s: float, stop: object) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.source, self.max_batch, self.max_delay_s, self.stop = source, max_batch, max_delay_s, stop

    def next_batch(self) -> tuple[list[T], bool]:
        """Block for the first item, then gather more until full or the delay has passed.

        Returns (items, stopping): stopping is True once the stop token was taken from the queue
        (each consumer takes exactly one); items may then still hold a last partial batch."""
        first = self.source.get()
        if first is self.stop:
            return [], True
        batch = [first]
        deadline = time.monotonic() + self.max_delay_s
        while len(batch) < self.max_batch:
            try:
                remaining = deadline - time.monotonic()
                item = self.source.get_nowait() if remaining <= 0 else self.source.get(timeout=remaining)
            except queue.Empty:
                break
            if item is self.stop:
                return batch, True
            batch.append(item)
        return batch, False
