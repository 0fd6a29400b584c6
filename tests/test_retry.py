"""`worker retry`: a quarantined image gets through once its cause is fixed, on real folders and a real
watcher (burst mode), with its input moved back from the archive."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

from tests.conftest import image_rows
from worker.retry import retry_failed
from worker.service import watch
from worker.store.db import open_db
from worker.store.queries import Filters


def test_a_quarantined_image_is_retried_once_its_cause_is_fixed(cfg, tmp_path: Path, samples: Path,
                                                               effnet_onnx: Path, caplog) -> None:
    # a pixel limit too low for coffee.png (600x400), not for page.png (384x191); one attempt each
    low = dataclasses.replace(cfg.pipeline, max_pixels=100_000, max_attempts=1)
    cfg = dataclasses.replace(cfg, model="efficientnet-lite0", pipeline=low)
    (cfg.inbox / "sub").mkdir(parents=True)
    shutil.copy(samples / "coffee.png", cfg.inbox / "sub" / "coffee.png")
    shutil.copy(samples / "page.png", cfg.inbox / "page.png")
    assert watch(cfg, threading.Event(), burst=True).figures["failed"] == 1
    assert "warm-up" not in caplog.text  # its synthetic photo is made within the pixel limit
    failed = cfg.archive / "failed" / "sub" / "coffee.png"
    assert failed.is_file() and (cfg.archive / "done" / "page.png").is_file()

    shutil.move(failed, cfg.inbox / "sub" / "coffee.png")  # dropped again as it is: quarantined at once
    assert watch(cfg, threading.Event(), burst=True).figures["failed"] == 1
    assert "quarantined" in image_rows(cfg)["sub/coffee.png"].error and failed.is_file()

    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(low, max_pixels=80_000_000))  # the cause, fixed
    db = open_db(cfg.db)
    assert retry_failed(db, Filters(path="page.png")).reset == 0  # nothing failed there
    retried = retry_failed(db, Filters())  # from the archive the watcher was configured with
    db.dispose()
    assert (retried.reset, retried.left) == (1, 0)
    assert retried.moved == ((failed.absolute(), cfg.inbox.absolute() / "sub" / "coffee.png"),)
    assert not failed.exists() and image_rows(cfg)["sub/coffee.png"].attempts == 0

    summary = watch(cfg, threading.Event(), burst=True)
    assert (summary.figures["done"], summary.figures["failed"]) == (1, 0)
    row = image_rows(cfg)["sub/coffee.png"]
    assert (row.status, row.attempts, row.error) == ("done", 1, None)
    assert (cfg.archive / "done" / "sub" / "coffee.png").is_file()
    assert (cfg.outbox / "sub" / "coffee.png.json").is_file()


def test_a_failed_image_named_in_latin1_goes_back_under_its_own_name(cfg, samples: Path, effnet_onnx: Path) -> None:
    low = dataclasses.replace(cfg.pipeline, max_pixels=100_000, max_attempts=1)
    cfg = dataclasses.replace(cfg, model="efficientnet-lite0", pipeline=low)
    name = "caf\udce9.png"  # the byte 0xE9 (Latin-1 'é', from an old share): not UTF-8
    cfg.inbox.mkdir(parents=True, exist_ok=True)
    shutil.copy(samples / "coffee.png", cfg.inbox / name)
    assert watch(cfg, threading.Event(), burst=True).figures["failed"] == 1
    assert (cfg.archive / "failed" / name).is_file() and (cfg.outbox / f"{name}.error.json").is_file()
    assert "over the limit" in image_rows(cfg)["caf\\xe9.png"].error  # recorded, the byte written as \xe9

    db = open_db(cfg.db)
    retried = retry_failed(db, Filters(path="caf*"))
    db.dispose()
    assert retried.moved == ((cfg.archive.absolute() / "failed" / name, cfg.inbox.absolute() / name),)
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(low, max_pixels=80_000_000))
    assert watch(cfg, threading.Event(), burst=True).figures["done"] == 1
    assert image_rows(cfg)["caf\\xe9.png"].status == "done" and (cfg.archive / "done" / name).is_file()
    assert (cfg.outbox / f"{name}.json").is_file() and not (cfg.outbox / f"{name}.error.json").exists()
