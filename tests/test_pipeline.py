"""The pipeline's stages on a stand-in model (tests/support/stand_in.py): every job one outcome, batches
within their bounds, warm-ups before intake, the ledger's decision acted on, a broken file a failed
outcome with its reason. The same pipeline runs the real models in tests/test_service.py and the rest."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from tests.support.stand_in import StandInEngine


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
    engine = StandInEngine()
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
    engine = StandInEngine()
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


def _stand_in_pipeline(cfg, root: Path, engine: StandInEngine, outbox: Path | None = None):
    """A pipeline of the stand-in classifier over `root`, as open_pipeline assembles one (a context)."""
    import contextlib

    from worker.models.card import InputSpec, ModelCard, Postprocess, settings_digest
    from worker.outputs.outbox import Outbox
    from worker.pipeline import Pipeline, Settings
    from worker.store.db import open_db
    from worker.store.recorder import Recorder, RunInfo
    from worker.tasks import adapter_for

    card = ModelCard(name="stand-in", task="classify", onnx=Path("none.onnx"), input=InputSpec(size=(8, 8)),
                     postprocess=Postprocess(top_k=2), labels=("a", "b", "c"))
    box = outbox or cfg.outbox

    @contextlib.contextmanager
    def opened():
        db = open_db(cfg.db)
        recorder = Recorder(db, RunInfo("run", str(root), "stand-in", "0" * 64, "cpu", {"outbox": str(box)},
                                        card_sha256=settings_digest(card, False)))
        settings = Settings(decode_workers=2, infer_workers=1, max_batch=1, max_delay_ms=1, queue_size=8,
                            max_pixels=10**6, max_attempts=3, memory_sample_s=1.0)
        try:
            with Pipeline(card=card, engine=engine, adapter=adapter_for(card), recorder=recorder,  # type: ignore[arg-type]
                          outbox=Outbox(box), db=db, settings=settings) as pipeline:
                yield pipeline
        finally:
            recorder.close()
            db.dispose()

    return opened()


def _images(folder: Path, n: int) -> list[str]:
    import cv2

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        cv2.imwrite(str(folder / f"{i}.png"), np.full((10, 12, 3), i * 10, np.uint8))
    return [f"{i}.png" for i in range(n)]


def _submit_all(pipeline, folder: Path, rels: list[str]) -> None:
    from worker.intake.jobs import Job

    for rel in rels:
        pipeline.submit(Job.from_path(folder, folder / rel))
    assert pipeline.drain(60)


def test_a_broken_file_is_a_failed_outcome_and_the_rest_go_on(cfg, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    rels = _images(folder, 4)
    (folder / "broken.png").write_bytes(b"not a png")
    engine = StandInEngine()
    with _stand_in_pipeline(cfg, folder, engine) as pipeline:
        _submit_all(pipeline, folder, [*rels, "broken.png"])
        counts = pipeline.counts
    assert (counts.done, counts.failed) == (4, 1) and sum(engine.batch_sizes) == 4  # the broken one never ran
    import json

    said = json.loads((cfg.outbox / "broken.png.error.json").read_text())
    assert said["status"] == "failed" and "not an image" in said["error"]
    assert sorted(p.name for p in cfg.outbox.glob("*.json")) == sorted([*(f"{r}.json" for r in rels), "broken.png.error.json"])


def test_the_prepare_stage_acts_on_the_ledgers_decision(cfg, tmp_path: Path) -> None:
    """Done with this model into this outbox: skipped, never decoded nor run; into another outbox: done
    again there, the earlier outbox counted."""
    folder = tmp_path / "in"
    rels = _images(folder, 3)
    engine = StandInEngine()
    with _stand_in_pipeline(cfg, folder, engine) as pipeline:
        _submit_all(pipeline, folder, rels)
    with _stand_in_pipeline(cfg, folder, engine) as pipeline:
        _submit_all(pipeline, folder, rels)
        assert (pipeline.counts.done, pipeline.counts.skipped) == (0, 3)
    assert sum(engine.batch_sizes) == 3  # the second pass ran nothing
    elsewhere = tmp_path / "elsewhere"
    with _stand_in_pipeline(cfg, folder, engine, outbox=elsewhere) as pipeline:
        _submit_all(pipeline, folder, rels)
        assert pipeline.counts.done == 3 and pipeline.counts.earlier_outboxes == {str(cfg.outbox): 3}
    assert sorted(p.name for p in elsewhere.glob("*.json")) == [f"{r}.json" for r in rels]


def test_the_ledger_decides_claim_or_skip(cfg, tmp_path: Path) -> None:
    from worker.store.db import open_db
    from worker.store.ledger import Ledger, WhatDone

    folder = tmp_path / "in"
    rels = _images(folder, 1)
    with _stand_in_pipeline(cfg, folder, StandInEngine()) as pipeline:
        _submit_all(pipeline, folder, rels)
    import hashlib

    sha = hashlib.sha256((folder / rels[0]).read_bytes()).hexdigest()
    db = open_db(cfg.db)
    digests = frozenset({pipeline.recorder.card_sha256})  # the stand-in run's card settings

    def decide(done: WhatDone, one_page: bool = False):
        ledger = Ledger(db, "stand-in", str(folder), done)
        try:
            return ledger.decide(rels[0], sha, lambda: one_page)
        finally:
            ledger.close()

    here = WhatDone("0" * 64, digests, digests, str(cfg.outbox))
    assert decide(here).skip
    moved = decide(WhatDone("0" * 64, digests, digests, str(tmp_path / "new")))
    assert not moved.skip and moved.redo and moved.earlier_outbox == str(cfg.outbox)
    retrained = decide(WhatDone("1" * 64, digests, digests, str(cfg.outbox)))
    assert not retrained.skip and retrained.redo and retrained.earlier_outbox is None
    other_card = WhatDone("0" * 64, frozenset({"x"}), digests, str(cfg.outbox))
    assert not decide(other_card).skip and decide(other_card, one_page=True).skip  # one page: the same result
    assert not Ledger(db, "stand-in", str(folder), here).decide("new.png", sha, lambda: False).skip
    db.dispose()
