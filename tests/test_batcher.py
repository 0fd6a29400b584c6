"""The batcher's semantics, without timing assertions, and the pool's mechanics on a fake model."""

from __future__ import annotations

import queue
import threading
from collections import Counter
from pathlib import Path

import numpy as np

from worker.pipeline.batcher import Batcher

STOP = object()


def _filled(items, stops: int = 1) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    for i in items:
        q.put(i)
    for _ in range(stops):
        q.put(STOP)
    return q


def test_size_limit_and_order() -> None:
    b = Batcher(_filled(range(10)), max_batch=4, max_delay_s=3600, stop=STOP)
    assert b.next_batch() == ([0, 1, 2, 3], False)
    assert b.next_batch() == ([4, 5, 6, 7], False)
    assert b.next_batch() == ([8, 9], True)  # the stop token closes the last partial batch


def test_delay_limit_closes_a_partial_batch() -> None:
    q = _filled([1], stops=0)
    b = Batcher(q, max_batch=8, max_delay_s=0.0, stop=STOP)
    assert b.next_batch() == ([1], False)  # nothing more within the delay: a batch of one, not a hang


def test_stop_alone() -> None:
    assert Batcher(_filled([]), 4, 1.0, STOP).next_batch() == ([], True)


def test_concurrent_submitters_lose_and_duplicate_nothing() -> None:
    q: queue.Queue = queue.Queue(maxsize=16)
    n_sub, per, n_cons = 4, 500, 2
    got: list[list[tuple[int, int]]] = []
    lock = threading.Lock()

    def submit(k: int) -> None:
        for i in range(per):
            q.put((k, i))

    def consume() -> None:
        b = Batcher(q, max_batch=5, max_delay_s=0.001, stop=STOP)
        stopping = False
        while not stopping:
            batch, stopping = b.next_batch()
            with lock:
                got.append(batch)

    subs = [threading.Thread(target=submit, args=(k,)) for k in range(n_sub)]
    cons = [threading.Thread(target=consume) for _ in range(n_cons)]
    for t in subs + cons:
        t.start()
    for t in subs:
        t.join()
    for _ in cons:
        q.put(STOP)
    for t in cons:
        t.join()
    items = [x for batch in got for x in batch]
    assert Counter(items) == Counter((k, i) for k in range(n_sub) for i in range(per))
    assert all(1 <= len(b) <= 5 for b in got if b)
    for batch in got:  # within a batch, each submitter's items keep their order
        for k in range(n_sub):
            seq = [i for kk, i in batch if kk == k]
            assert seq == sorted(seq)


class FakeEngine:
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


def test_pipeline_with_batches_finishes_every_job_once(cfg, tmp_path: Path, monkeypatch) -> None:
    import cv2

    from worker.intake.jobs import Job
    from worker.models.card import InputSpec, ModelCard, Postprocess
    from worker.outputs.outbox import Outbox
    from worker.pipeline import Pipeline, Settings
    from worker.store.db import open_db
    from worker.store.recorder import Recorder, RunInfo
    from worker.tasks import adapter_for

    card = ModelCard(name="fake", task="classify", onnx=Path("none.onnx"), input=InputSpec(size=(8, 8)),
                     postprocess=Postprocess(top_k=2), labels=("a", "b", "c"))
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(60):
        cv2.imwrite(str(folder / f"{i}.png"), np.full((10, 12, 3), i * 4, np.uint8))
    db = open_db(cfg.db)
    # the recorder gathers events for an hour: a decode thread that waits for a claim's commit without
    # hurrying the recorder would stall the run (at start, every claim is waited for)
    monkeypatch.setattr("worker.store.recorder.GROUP_S", 3600.0)
    engine = FakeEngine()
    recorder = Recorder(db, RunInfo("run", str(folder), "fake", "", "fake", {}))
    settings = Settings(decode_workers=3, infer_workers=2, max_batch=4, max_delay_ms=5, queue_size=4,
                        max_pixels=10**6, max_attempts=3, memory_sample_s=1.0)
    finished: list[str] = []
    with Pipeline(card=card, engine=engine, adapter=adapter_for(card), recorder=recorder,  # type: ignore[arg-type]
                  outbox=Outbox(cfg.outbox), db=db, settings=settings,
                  on_finished=lambda j, s: finished.append(j.rel)) as pipeline:
        # each decode thread opened its database connection before the constructor returned (intake
        # starts after it); on the CPU the inference threads need no warm-up of their own
        assert len(pipeline._ledger._conns) == 3 and engine.warm_ups == []
        subs = [threading.Thread(target=lambda k=k: [pipeline.submit(Job.from_path(folder, folder / f"{i}.png"))
                                                     for i in range(k, 60, 3)]) for k in range(3)]
        for t in subs:
            t.start()
        for t in subs:
            t.join()
        assert pipeline.drain(60)
    recorder.close()
    db.dispose()
    assert sorted(finished) == sorted(f"{i}.png" for i in range(60))
    assert sum(engine.batch_sizes) == 60 and max(engine.batch_sizes) <= 4
    assert pipeline.counts.done == 60 and pipeline.counts.failed == 0


def test_on_cuda_each_inference_thread_runs_once_before_the_pipeline_returns(cfg, tmp_path: Path,
                                                                             monkeypatch) -> None:
    """onnxruntime's CUDA provider sets up a thread's cuBLAS and cuDNN handles at its first run: on a GPU
    every inference thread warms up before intake starts (GPU memory sampling is left out here)."""
    from worker.models.card import InputSpec, ModelCard, Postprocess
    from worker.outputs.outbox import Outbox
    from worker.pipeline import Pipeline, Settings
    from worker.store.db import open_db
    from worker.store.recorder import Recorder, RunInfo
    from worker.tasks import adapter_for

    monkeypatch.setattr("worker.pipeline.GpuMemory", lambda device_id: None)  # where Pipeline makes it
    card = ModelCard(name="fake", task="classify", onnx=Path("none.onnx"), input=InputSpec(size=(8, 8)),
                     postprocess=Postprocess(top_k=2), labels=("a", "b", "c"))
    engine = FakeEngine()
    engine.on_gpu = True
    db = open_db(cfg.db)
    recorder = Recorder(db, RunInfo("run", str(tmp_path), "fake", "", "fake", {}))
    settings = Settings(decode_workers=1, infer_workers=3, max_batch=8, max_delay_ms=5, queue_size=4,
                        max_pixels=10**6, max_attempts=3, memory_sample_s=1.0)
    with Pipeline(card=card, engine=engine, adapter=adapter_for(card), recorder=recorder,  # type: ignore[arg-type]
                  outbox=Outbox(cfg.outbox), db=db, settings=settings):
        assert sorted(engine.warm_ups) == ["infer-0", "infer-1", "infer-2"]
    recorder.close()
    db.dispose()
