"""A stand-in for the one onnxruntime session, for the tests of the pipeline's mechanics (next to the tests
on real models): its output is each image's mean, and it counts the batches it ran and the threads that
warmed it up."""

from __future__ import annotations

import threading

import numpy as np


class StandInEngine:
    """Stands in for onnxruntime only to test the pool: output = the batch's per-image mean."""

    providers = ["CPUExecutionProvider"]
    on_gpu = False
    device_id = 0

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []
        self.warm_ups: list[str] = []  # the names of the threads that warmed up
        self.lock = threading.Lock()

    def warm_up(self, batch_size: int, size_hw: tuple[int, int]) -> None:
        with self.lock:
            self.warm_ups.append(threading.current_thread().name)

    def run(self, batch: np.ndarray) -> np.ndarray:
        with self.lock:
            self.batch_sizes.append(len(batch))
        return np.repeat(batch.mean(axis=(1, 2, 3))[:, None], 3, axis=1).astype(np.float32)
