"""What becomes of an input once its outcome is recorded (`inputs.watch`, `inputs.run`, `--inputs`):
moved to the archive, deleted (a failed one is moved, to look at), or kept where it is."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

from click.testing import CliRunner

from tests.conftest import image_rows, wait_for
from tests.support.watching import Watching
from worker.cli import cli
from worker.service import run_folder, watch

BROKEN = b"\xff\xd8\xff\xe0 this is not really a jpeg"


def _inputs(cfg, **kw):
    return dataclasses.replace(cfg, inputs=dataclasses.replace(cfg.inputs, **kw))


def _fill(folder: Path, samples: Path) -> None:
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    shutil.copy(samples / "coffee.png", folder / "coffee.png")
    shutil.copy(samples / "page.png", folder / "sub" / "page.png")
    (folder / "broken.jpg").write_bytes(BROKEN)


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_run_keeps_the_folder_by_default_and_moves_or_deletes_when_told(cfg, tmp_path: Path, samples: Path) -> None:
    folder = tmp_path / "in"
    _fill(folder, samples)
    assert run_folder(cfg, folder).figures["done"] == 2
    assert _files(folder) == ["broken.jpg", "coffee.png", "sub/page.png"] and not cfg.archive.exists()

    moved = _inputs(dataclasses.replace(cfg, db=f"sqlite:///{tmp_path / 'moved.db'}"), run="move")
    summary = run_folder(moved, folder)
    assert (summary.figures["done"], summary.figures["failed"]) == (2, 1)
    assert _files(folder) == []
    assert _files(cfg.archive) == ["done/coffee.png", "done/sub/page.png", "failed/broken.jpg"]

    shutil.rmtree(cfg.archive)
    _fill(folder, samples)
    deleted = _inputs(dataclasses.replace(cfg, db=f"sqlite:///{tmp_path / 'deleted.db'}"), run="delete")
    assert run_folder(deleted, folder).figures["done"] == 2
    assert _files(folder) == [] and _files(cfg.archive) == ["failed/broken.jpg"]  # a failure kept, to look at
    assert {r.rel_path: r.status for r in image_rows(deleted).values()} == {
        "coffee.png": "done", "sub/page.png": "done", "broken.jpg": "failed"}


def test_watch_deletes_done_inputs_and_archives_failed_ones(cfg, samples: Path) -> None:
    cfg = _inputs(cfg, watch="delete")
    cfg.inbox.mkdir(parents=True)
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        _fill(cfg.inbox, samples)
        assert wait_for(lambda: _files(cfg.inbox) == [], timeout=60), _files(cfg.inbox)
    assert _files(cfg.archive) == ["failed/broken.jpg"]
    assert sorted(r for r, _ in w.finished) == ["broken.jpg", "coffee.png", "sub/page.png"]
    assert (cfg.outbox / "coffee.png.json").is_file()


def test_watch_keeps_inputs_and_rescans_do_not_read_them_again(cfg, samples: Path, monkeypatch) -> None:
    """Kept inputs stay in the inbox; each rescan sees them, and the worker remembers they are done
    (before, every rescan would read and hash each one again and count it as skipped)."""
    from worker.store import ledger

    monkeypatch.setattr(ledger, "SETTLED_S", 0.0)  # the files copied in count as settled: stamped when read
    cfg = _inputs(cfg, watch="keep")
    cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, rescan_interval_s=0.2, settle_s=0.1))
    cfg.inbox.mkdir(parents=True)
    with Watching(cfg) as w:
        assert w.ready.wait(120) and w.error is None
        _fill(cfg.inbox, samples)
        assert wait_for(lambda: len(w.finished) >= 3, timeout=60)
        # a dozen rescans: nothing more is submitted (a negative: it can only be watched for a while)
        assert not wait_for(lambda: len(w.finished) > 3, timeout=2.5), w.finished
        shutil.copy(samples / "rocket.jpg", cfg.inbox / "coffee.png")  # new content under a kept name: taken
        assert wait_for(lambda: len(w.finished) >= 4, timeout=60)
    assert _files(cfg.inbox) == ["broken.jpg", "coffee.png", "sub/page.png"] and not cfg.archive.exists()
    assert w.summary.figures["skipped"] == 0 and w.summary.figures["done"] == 3
    assert {(r.status, r.attempts) for r in image_rows(cfg).values()} == {("done", 1), ("failed", 1)}
    # after a restart each done one is known by its unchanged file, without reading it: skipped, not processed
    again = watch(cfg, threading.Event(), burst=True)
    assert (again.figures["skipped"], again.figures["skipped_unread"], again.figures["done"]) == (2, 2, 0)
    assert len(_files(cfg.inbox)) == 3


def test_the_inputs_option_overrides_the_config_for_its_command(cfg, tmp_path: Path, samples: Path) -> None:
    folder = tmp_path / "in"
    _fill(folder, samples)
    config = tmp_path / "config.yaml"
    config.write_text(f"outbox: {cfg.outbox}\narchive: {cfg.archive}\ndb: {cfg.db}\nmodel: {cfg.model}\n"
                      f"cache_dir: {cfg.cache_dir}\nmodels_dir: {cfg.models_dir}\ninputs: {{watch: keep}}\n")
    out = CliRunner().invoke(cli, ["--config", str(config), "run", str(folder), "--no-progress", "--inputs", "move"])
    assert out.exit_code == 0, out.output
    assert f"inputs:   moved to {cfg.archive}/done/ and failed/" in out.output
    assert _files(folder) == [] and _files(cfg.archive) == ["done/coffee.png", "done/sub/page.png", "failed/broken.jpg"]
    assert "--inputs" in CliRunner().invoke(cli, ["watch", "--help"]).output
