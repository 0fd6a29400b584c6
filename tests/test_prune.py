"""`worker db prune`: old images, samples and runs go; images in flight and what refers to them stay."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sqlite3
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

from click.testing import CliRunner
from sqlalchemy import func, select, update

from tests.support.terminal import on_a_terminal
from tests.support.cli import config_file
from worker.cli import cli
from worker.service import run_folder
from worker.store.db import open_db
from worker.store.prune import prune, would_prune
from worker.store.schema import ImageRow, LabelRow, MemorySample, ResultRow, Run, TimingRow


def _folder(root: Path, samples: Path, names: tuple[str, ...], bad: int = 0) -> Path:
    root.mkdir(parents=True)
    for name in names:
        shutil.copy(samples / name, root / name)
    for i in range(bad):
        (root / f"bad{i}.jpg").write_bytes(b"not a jpeg")
    return root


def test_prune_forgets_old_images_samples_and_runs(cfg, tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    cfg = dataclasses.replace(cfg, model="efficientnet-lite0")
    a = _folder(tmp_path / "a", samples, ("coffee.png", "chelsea.png"), bad=1)
    b = _folder(tmp_path / "b", samples, ("rocket.jpg",))
    c = _folder(tmp_path / "c", samples, ("astronaut.png",))
    runs = [run_folder(cfg, folder).run_id for folder in (a, b, c)]
    db = open_db(cfg.db)
    old = datetime.now(timezone.utc) - timedelta(days=100)
    with db.begin() as conn:  # runs a and b ended 100 days ago; b's image was in flight when it died
        for run_id in runs[:2]:
            conn.execute(update(ImageRow).where(ImageRow.run_id == run_id).values(updated_at=old))
            conn.execute(update(MemorySample).where(MemorySample.run_id == run_id).values(at=old))
            conn.execute(update(Run).where(Run.id == run_id).values(started_at=old, finished_at=old))
        conn.execute(update(ImageRow).where(ImageRow.run_id == runs[1]).values(status="processing"))

    def count(table) -> int:
        with db.connect() as conn:
            return conn.scalar(select(func.count()).select_from(table))

    before = {t: count(t) for t in (ImageRow, ResultRow, LabelRow, TimingRow, Run)}
    assert before[ImageRow] == 5 and before[Run] == 3
    cutoff = datetime.now(timezone.utc) - timedelta(days=90)
    counted = would_prune(db, cutoff)  # `--dry-run`: counted, nothing deleted
    assert {t: count(t) for t in before} == before
    pruned = prune(db, cutoff, batch=2)  # batches of 2: two and one
    assert (pruned.images, pruned.runs) == (3, 1) and pruned.samples >= 2 and counted == pruned
    with db.connect() as conn:
        assert sorted(conn.scalars(select(ImageRow.rel_path))) == ["astronaut.png", "rocket.jpg"]
        assert sorted(conn.scalars(select(Run.id))) == runs[1:]  # b: its image in flight refers to it
        assert conn.scalar(select(func.count()).select_from(MemorySample).where(MemorySample.run_id != runs[2])) == 0
    assert count(ResultRow) == before[ResultRow] - 2 and count(TimingRow) == before[TimingRow] - 3
    assert count(LabelRow) == before[LabelRow] - 2 * 5
    db.dispose()

    again = run_folder(cfg, a)  # forgotten: processed again
    assert (again.figures["done"], again.figures["failed"], again.figures["skipped"]) == (2, 1, 0)


def test_prune_command(tmp_path: Path, samples: Path, ppocr_onnx: Path) -> None:
    conf = config_file(tmp_path)
    folder = _folder(tmp_path / "in", samples, ("page.png",))
    r = CliRunner()
    assert r.invoke(cli, ["--config", str(conf), "run", str(folder), "--no-progress"]).exit_code == 0
    out = r.invoke(cli, ["--config", str(conf), "db", "prune", "--before", "90d"])
    assert out.exit_code == 0 and out.output.startswith("pruned 0 images (with their results, labels and timings)")
    assert "freed pages are reused" in out.output
    with contextlib.closing(sqlite3.connect(tmp_path / "worker.db")) as c:  # a day of a run's heartbeat: pages to free
        with c:
            c.executemany("INSERT INTO memory_samples (run_id, at, rss_bytes, fds, threads, queue_depth, images_done) "
                          "SELECT id, started_at, 1, 1, 1, 0, ? FROM runs", [(i,) for i in range(17_280)])
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    was = (tmp_path / "worker.db").stat().st_size
    out = r.invoke(cli, ["--config", str(conf), "db", "prune", "--before", "2999-01-01", "--vacuum"])
    assert out.exit_code == 0 and out.output.startswith("pruned 1 images") and "1 runs" in out.output, out.output
    assert (tmp_path / "worker.db").stat().st_size < was  # the file shrank: the vacuum left the write-ahead log
    assert "freed pages" not in out.output
    out = r.invoke(cli, ["--config", str(conf), "db", "prune", "--before", "last week"])
    assert out.exit_code != 0 and "not an ISO date" in out.output


def test_prune_counts_with_dry_run_and_asks_first_on_a_terminal(tmp_path: Path, samples: Path,
                                                                ppocr_onnx: Path) -> None:
    """`db prune --before 2999-01-01` deleted everything at once: no --dry-run, no question."""
    conf = config_file(tmp_path)
    folder = _folder(tmp_path / "in", samples, ("page.png",))
    r = CliRunner()
    assert r.invoke(cli, ["--config", str(conf), "run", str(folder), "--no-progress"]).exit_code == 0
    out = r.invoke(cli, ["--config", str(conf), "db", "prune", "--before", "2999-01-01", "--dry-run"])
    assert out.exit_code == 0 and out.output.startswith("would prune 1 images") and "1 runs" in out.output, out.output
    prune_it = [sys.executable, "-m", "worker", "--config", str(conf), "db", "prune", "--before", "2999-01-01"]
    status, said = on_a_terminal(prune_it, answer=b"n\n")
    assert status == 1 and "this deletes 1 images" in said and "delete them? [y/N]" in said and "Aborted" in said, said
    assert r.invoke(cli, ["--config", str(conf), "query"]).exit_code == 0  # still there
    status, said = on_a_terminal(prune_it, answer=b"y\n")
    assert status == 0 and "pruned 1 images" in said, said
    status, said = on_a_terminal([*prune_it, "--yes"])  # nothing left; --yes: not asked
    assert status == 0 and "delete them?" not in said and "pruned 0 images" in said, said
