"""Shared fixtures: real models and sample images (pulled once into the git-ignored cache), temporary
inbox/outbox/archive/database per test, and a check that no test leaks threads."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from worker.host import mounts
from worker.config import Config, load
from worker.models.lookup import find_card
from worker.models.pull import pull
from worker.measure.samples import fetch_samples

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "data" / "reference"  # golden outputs of the independent runtimes (see its README)
CACHE = ROOT / ".cache" / "worker"


@pytest.fixture(scope="session")
def samples() -> Path:
    return fetch_samples(CACHE)


@pytest.fixture(scope="session")
def ppocr_onnx() -> Path:
    return pull(find_card(ROOT / "models", "ppocr-det"), CACHE)


@pytest.fixture(scope="session")
def effnet_onnx() -> Path:
    return pull(find_card(ROOT / "models", "efficientnet-lite0"), CACHE)


@pytest.fixture(scope="session")
def yolo_onnx() -> Path:
    return pull(find_card(ROOT / "models", "yolov3-tiny"), CACHE)


@pytest.fixture(scope="session")
def selfie_onnx() -> Path:
    return pull(find_card(ROOT / "models", "selfie"), CACHE)


def run_on(tmp: Path, samples: Path, names, model: str):
    """Copy sample images into a folder and `run` the model over them; returns (config, summary)."""
    import shutil

    from worker.service import run_folder

    folder = tmp / "images"
    folder.mkdir()
    for name in names:
        shutil.copy(samples / name, folder / name)
    base = load(ROOT / "config.yaml")
    cfg = dataclasses.replace(base, outbox=tmp / "outbox", db=f"sqlite:///{tmp / 'w.db'}", cache_dir=CACHE,
                              models_dir=ROOT / "models", model=model)
    return cfg, run_folder(cfg, folder)


@contextlib.contextmanager
def read_only_view(src: Path, at: Path) -> Iterator[Path]:
    """`src` bind-mounted read-only at `at` (a folder) for the block: a read-only share, or another account's
    folder, which stops root too (file modes do not). Skips the test where it cannot mount (not root)."""
    if subprocess.run(["mount", "--bind", str(src), str(at)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(at)], check=True)
        yield at
    finally:
        subprocess.run(["umount", "-l", str(at)], check=True)


@pytest.fixture
def on_a_share(tmp_path: Path, monkeypatch) -> Path:
    """tmp_path/share, which the mount table (this machine's, with one line added) says is an NFS mount."""
    share = tmp_path / "share"
    share.mkdir()
    table = tmp_path / "mountinfo"
    table.write_text(mounts.MOUNTINFO.read_text()
                     + f"999 22 0:99 / {share.resolve()} rw,relatime - nfs4 nas:/export rw,vers=4.2\n")
    monkeypatch.setattr(mounts, "MOUNTINFO", table)
    return share


@pytest.fixture
def cfg(tmp_path: Path, ppocr_onnx: Path) -> Config:
    """The project's default config.yaml with every writable path in a temporary folder."""
    base = load(ROOT / "config.yaml")
    return dataclasses.replace(
        base,
        inbox=tmp_path / "inbox",
        outbox=tmp_path / "outbox",
        archive=tmp_path / "archive",
        db=f"sqlite:///{tmp_path / 'worker.db'}",
        cache_dir=CACHE,
        models_dir=ROOT / "models",
        watch=dataclasses.replace(base.watch, settle_s=0.3, rescan_interval_s=2.0, incomplete_s=1.0,
                                  create_inbox=True),
        metrics=dataclasses.replace(base.metrics, memory_sample_s=0.5),
    )


@pytest.fixture(scope="session", autouse=True)
def watchdog_inotify_thread() -> None:
    """watchdog's inotify threads, a process-wide singleton, started before any test: started by whichever
    test first watches a folder, they would be taken for that test's leak."""
    with contextlib.suppress(ImportError):  # not on Linux
        from watchdog.observers.inotify_c import InotifyFD

        InotifyFD.get_instance()


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"threads leaked: {[t.name for t in leaked]}"


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll a condition with a deadline (watchdog events are asynchronous by nature)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def image_rows(cfg: Config) -> dict:
    """rel_path -> the images row, read straight from the test's database."""
    from sqlalchemy import select

    from worker.store.db import open_db
    from worker.store.schema import ImageRow

    db = open_db(cfg.db)
    with db.connect() as c:
        rows = {r.rel_path: r for r in c.execute(select(ImageRow))}
    db.dispose()
    return rows
