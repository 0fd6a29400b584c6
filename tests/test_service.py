"""`worker run` end to end on real files: results, failures, resumability, database rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sqlalchemy import func, select

from worker.service import run_folder
from worker.store.db import open_db
from worker.store.schema import ImageRow, LabelRow, MemorySample, ResultRow, Run, TimingRow


def _folder(tmp_path: Path, samples: Path) -> Path:
    folder = tmp_path / "in"
    (folder / "sub" / "deeper").mkdir(parents=True)
    shutil.copy(samples / "page.png", folder / "page.png")
    shutil.copy(samples / "coffee.png", folder / "sub" / "coffee.png")
    shutil.copy(samples / "rocket.jpg", folder / "sub" / "deeper" / "rocket with space.jpg")
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg")
    (folder / "notes.txt").write_text("not an image, not a candidate")
    return folder


def test_run_processes_records_and_resumes(cfg, tmp_path: Path, samples: Path) -> None:
    folder = _folder(tmp_path, samples)
    first = run_folder(cfg, folder)
    assert (first.figures["done"], first.figures["failed"], first.figures["skipped"]) == (3, 1, 0)

    doc = json.loads((cfg.outbox / "page.png.json").read_text())
    assert doc["task"] == "segment" and doc["fg_fraction"] > 0.1 and doc["mask_path"] == "page.png.mask.png"
    assert (cfg.outbox / "sub/deeper/rocket with space.jpg.json").exists()
    assert not list(cfg.outbox.rglob(".tmp-*"))

    db = open_db(cfg.db)
    with db.connect() as c:
        rows = {r.rel_path: r for r in c.execute(select(ImageRow))}
        assert rows["broken.jpg"].status == "failed" and "Truncated" in rows["broken.jpg"].error
        assert rows["page.png"].status == "done" and rows["page.png"].attempts == 1
        assert c.scalar(select(func.count()).select_from(ResultRow)) == 3
        assert c.scalar(select(func.count()).select_from(TimingRow)) == 4
        assert c.scalar(select(func.count()).select_from(LabelRow).where(LabelRow.name == "text")) >= 2
        assert c.scalar(select(func.count()).select_from(MemorySample)) >= 2
        run = c.execute(select(Run).where(Run.id == first.run_id)).one()
        assert run.providers == "CPUExecutionProvider" and run.finished_at is not None and len(run.model_sha256) == 64

    second = run_folder(cfg, folder)  # resumable: done images are skipped, the failed one is retried
    assert (second.figures["done"], second.figures["failed"], second.figures["skipped"]) == (0, 1, 3)
    with db.connect() as c:
        assert c.scalar(select(ImageRow.attempts).where(ImageRow.rel_path == "broken.jpg")) == 2
        assert c.scalar(select(func.count()).select_from(ImageRow)) == 4

    (folder / "page.png").write_bytes((samples / "text.png").read_bytes())  # new content, same name
    third = run_folder(cfg, folder)
    assert third.figures["done"] == 1 and third.figures["skipped"] == 2
    db.dispose()


def test_quarantine_after_max_attempts(cfg, tmp_path: Path) -> None:
    import dataclasses

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "bad.png").write_text("a text file named .png")
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, max_attempts=2))
    for _ in range(3):
        run_folder(cfg, folder)
    db = open_db(cfg.db)
    with db.connect() as c:
        row = c.execute(select(ImageRow)).one()
    db.dispose()
    assert row.status == "failed" and row.attempts == 2 and "quarantined after 2 attempts" in row.error
