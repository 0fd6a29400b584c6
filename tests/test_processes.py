"""The pipeline over several processes (pipeline.processes): the same results as one process, a dead
prepare process replaced with its images charged once, nothing left behind after kill -9 or Ctrl-C,
memory counted over every process, and the session's process doing a bounded amount of work per image."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from tests.conftest import wait_for
from tests.support.crash import check_outcome, finished_rows, kill_rounds, make_corpus, start, write_config
from worker.config import Config
from worker.host.memory import take_sample
from worker.service import run_folder

SHARD = "worker.pipeline.shards"


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # ended (or a zombie) meanwhile
        return ""


def _prepare_processes(pid: int) -> list[psutil.Process]:
    try:
        return [c for c in psutil.Process(pid).children(recursive=True) if SHARD in _cmdline(c)]
    except psutil.Error:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _results(outbox: Path) -> dict[str, list[tuple[str, float]]]:
    return {p.relative_to(outbox).as_posix(): [(lab["name"], round(lab["score"], 5))
                                              for lab in json.loads(p.read_text())["labels"]]
            for p in sorted(outbox.rglob("*.json")) if not p.name.endswith(".error.json")}


@pytest.mark.timeout(300)
def test_processes_give_the_results_one_process_gives(tmp_path: Path, cfg: Config, samples: Path,
                                                      effnet_onnx: Path) -> None:
    folder = tmp_path / "in"
    rels = make_corpus(folder, samples, n=40, bad=2)
    figures = {}
    for processes in (1, 3):
        c = dataclasses.replace(cfg, model="efficientnet-lite0", outbox=tmp_path / f"out{processes}",
                                db=f"sqlite:///{tmp_path}/p{processes}.db",
                                pipeline=dataclasses.replace(cfg.pipeline, processes=processes))
        figures[processes] = run_folder(c, folder).figures
    assert figures[3]["done"] == figures[1]["done"] == 40 and figures[3]["failed"] == figures[1]["failed"] == 2
    assert _results(tmp_path / "out3") == _results(tmp_path / "out1") and len(_results(tmp_path / "out3")) == 40
    with sqlite3.connect(tmp_path / "p3.db") as db:
        assert db.execute("select count(*), count(finished_at) from runs").fetchone() == (1, 1), "one run"
        assert db.execute("select count(*) from images where status = 'done' and attempts = 1").fetchone()[0] == 40
        assert db.execute("select count(*) from timings").fetchone()[0] == 42
        assert db.execute("select count(*) from memory_samples").fetchone()[0] >= 2
    assert figures[3]["p50"] > 0 and figures[3]["p99"] >= figures[3]["p50"] and len(rels) == 42


@pytest.mark.timeout(400)
def test_a_prepare_process_that_dies_is_replaced_and_its_images_charged(tmp_path: Path, samples: Path,
                                                                        effnet_onnx: Path) -> None:
    rels = make_corpus(tmp_path / "in", samples)
    conf = write_config(tmp_path, processes=3)
    db = tmp_path / "worker.db"
    proc = start(conf, "run", str(tmp_path / "in"), "--no-progress")
    try:
        assert wait_for(lambda: finished_rows(db) >= 30, 120)
        victims = _prepare_processes(proc.pid)
        assert len(victims) == 2
        victims[0].kill()  # as a decoder crashing on a poison file would
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert f"prepare process 0 (pid {victims[0].pid}) died (signal 9)" in err \
        or f"prepare process 1 (pid {victims[0].pid}) died (signal 9)" in err, err
    check_outcome(tmp_path, rels)
    with sqlite3.connect(db) as c:
        attempts = dict(c.execute("select attempts, count(*) from images group by attempts").fetchall())
    assert set(attempts) <= {1, 2}, "an image in flight is charged once for the death, and only once"


@pytest.mark.timeout(400)
def test_kill_9_leaves_no_prepare_process_and_no_shared_memory(tmp_path: Path, samples: Path,
                                                               effnet_onnx: Path) -> None:
    rels = make_corpus(tmp_path / "in", samples)
    conf = write_config(tmp_path, processes=3)
    shm = _shm()
    seen: list[psutil.Process] = []
    watching = threading.Event()

    def note_children() -> None:  # the prepare processes of each start, to check that each is gone
        while not watching.is_set():
            for p in psutil.Process().children():
                if "worker" in _cmdline(p):
                    seen.extend(c for c in _prepare_processes(p.pid) if c not in seen)
            watching.wait(0.1)

    t = threading.Thread(target=note_children, daemon=True)
    t.start()
    try:
        killed = kill_rounds(conf, ["run", str(tmp_path / "in"), "--no-progress"], 3, random.Random(3))
    finally:
        watching.set()
        t.join()
    assert killed >= 2 and len(seen) >= 2 * killed
    assert wait_for(lambda: not [p for p in seen if _alive(p)], 10), "the prepare processes die with the worker"
    # and those started too late for the 0.1 s look above (a replacement spawned just before the kill): a
    # start while one still writes would keep its temporary file, as a live process's
    assert wait_for(lambda: not [p for p in psutil.process_iter() if SHARD in _cmdline(p) and _alive(p)], 10)
    assert _shm() == shm, "nothing left in /dev/shm"
    proc = start(conf, "run", str(tmp_path / "in"), "--no-progress")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    check_outcome(tmp_path, rels)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_leaves_no_prepare_process_and_no_shared_memory(tmp_path: Path, samples: Path, effnet_onnx: Path,
                                                               signals: int) -> None:
    rels = make_corpus(tmp_path / "in", samples)
    conf = write_config(tmp_path, processes=3)
    conf.write_text(conf.read_text().replace("processes: 3", "processes: 3, queue_size: 500"))
    shm = _shm()
    # SIGINT's default disposition: a test run started in the background (`pytest &`) ignores it, and the
    # worker rightly keeps an ignored signal ignored
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--config", str(conf), "run", str(tmp_path / "in"),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert wait_for(lambda: finished_rows(tmp_path / "worker.db") >= 20, 120)
        children = _prepare_processes(proc.pid)
        assert len(children) == 2
        proc.send_signal(signal.SIGINT)
        if signals == 2:
            assert proc.stderr is not None
            while (line := proc.stderr.readline()) and "stopping: finishing" not in line:
                pass
            proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the second within a second of the first lets the giving back finish: exits 0 if that is done before the
    # second's deadline, else 130 (worker.cli.signals.GIVE_BACK_S); either way nothing may be left behind
    assert proc.returncode in ((0,) if signals == 1 else (0, 128 + signal.SIGINT))
    assert wait_for(lambda: not [c for c in children if _alive(c)], 10)
    assert _shm() == shm
    rerun = start(conf, "run", str(tmp_path / "in"), "--no-progress")
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    check_outcome(tmp_path, rels)


def test_memory_samples_count_the_child_processes() -> None:
    """A leak in a prepare process shows in the samples: they add up the child processes' memory."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(300 << 20); b[::4096] = "
                              "b'x' * len(b[::4096]); print(1, flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "1"
        alone, tree = take_sample(0, 0), take_sample(0, 0, tree=True)
        assert tree.rss_bytes - alone.rss_bytes >= 250 << 20  # its 300 MB, less what this process shares
        assert tree.threads > alone.threads and tree.fds > alone.fds
    finally:
        child.kill()
        child.wait()


def _calls(cfg: Config, folder: Path, tag: str, processes: int) -> int:
    """Python function calls in this process during a run over `folder` (every thread)."""
    c = dataclasses.replace(cfg, model="efficientnet-lite0", outbox=folder.parent / f"out-{tag}",
                            db=f"sqlite:///{folder.parent}/{tag}.db",
                            pipeline=dataclasses.replace(cfg.pipeline, processes=processes))
    calls = [0]

    def count(frame: object, event: str, arg: object) -> None:
        if event == "call":
            calls[0] += 1

    threading.setprofile(count)
    sys.setprofile(count)
    try:
        run_folder(c, folder)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return calls[0]


@pytest.mark.timeout(300)
def test_the_session_process_does_a_bounded_number_of_python_calls_per_image(tmp_path: Path, cfg: Config,
                                                                            samples: Path, effnet_onnx: Path) -> None:
    """Its Python work per image is what limits how many prepare processes it feeds: counted in calls
    (a count, not a timing) as the difference between runs of 20 and 80 images, after a first run
    that imports what a run imports."""
    folders = {n: tmp_path / f"in{n}" for n in (5, 20, 80)}
    for n, folder in folders.items():
        make_corpus(folder, samples, n=n, bad=0)
    per_image = {}
    for processes in (2, 1):
        _calls(cfg, folders[5], f"warm{processes}", processes)
        counts = {n: _calls(cfg, folders[n], f"p{processes}-{n}", processes) for n in (20, 80)}
        per_image[processes] = (counts[80] - counts[20]) / 60
    print(f"Python calls per image in the session's process: {per_image[2]:.0f} with a prepare process, "
          f"{per_image[1]:.0f} in one process")
    assert 0 < per_image[2] < 150 and per_image[2] * 3 < per_image[1]


@pytest.mark.timeout(300)
def test_an_instance_segmenter_s_paired_outputs_and_overlays_come_out_the_same(tmp_path: Path, cfg: Config) -> None:
    """Outputs that are not one array (boxes' rows and prototype masks) cross the processes pickled; the
    decoded image travels with its item for the overlay: the same files as in one process."""
    import cv2
    import numpy as np

    from tests.support.onnx_models import card_file, quadrant_segmenter

    models, images = tmp_path / "models", tmp_path / "images"
    images.mkdir()
    folder = card_file(models, "quad", "task: detect\ninput: {name: images, size: [32, 48]}\n"
                                        "preprocess: {color: rgb, resize: letterbox, mean: [0, 0, 0], "
                                        "std: [255, 255, 255]}\n"
                                        "postprocess: {output: output0, masks: output1, layout: yolov8, "
                                        "threshold: 0.5}\nlabels: [part, scratch]")
    quadrant_segmenter(folder / "quad.onnx", "yolov8")
    for level in (255, 20, 130):
        cv2.imwrite(str(images / f"level{level}.png"), np.full((64, 96, 3), level, np.uint8))
    outs = {}
    for processes in (1, 3):
        out = tmp_path / f"out{processes}"
        c = dataclasses.replace(cfg, model="quad", models_dir=models, outbox=out, db=f"sqlite:///{tmp_path}/q{processes}.db",
                                outputs=dataclasses.replace(cfg.outputs, overlays=True),
                                pipeline=dataclasses.replace(cfg.pipeline, processes=processes))
        assert run_folder(c, images).figures["done"] == 3
        outs[processes] = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert sorted(outs[3]) == sorted(outs[1]) and len(outs[3]) == 9  # JSON, mask PNG, overlay each
    for name, data in outs[1].items():
        if name.endswith(".json"):
            assert json.loads(outs[3][name])["boxes"] == json.loads(data)["boxes"], name
        else:
            assert outs[3][name] == data, name


POISON = """
import os, sys
if "worker.pipeline.shards" in sys.orig_argv:  # a prepare process dies processing poison.jpg, past its claim
    def die_on_poison(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and \
                ".tmp-poison.jpg.json" in os.fsdecode(args[0]):  # writing its results: its claim is on record
            os._exit(1)
    sys.addaudithook(die_on_poison)
"""


@pytest.mark.timeout(400)
def test_a_file_that_kills_its_prepare_process_every_time_is_quarantined_alone(tmp_path: Path, samples: Path,
                                                                             effnet_onnx: Path) -> None:
    """As a decoder crashing on a poison file would: each death charges it once more, and its successor
    also dies on it, until its claim quarantines it; the images in flight beside it are done once."""
    rels = make_corpus(tmp_path / "in", samples, n=40, bad=0)
    (tmp_path / "in" / "poison.jpg").write_bytes((tmp_path / "in" / rels[0]).read_bytes() + b"\0")
    conf = write_config(tmp_path, processes=2)
    conf.write_text(conf.read_text().replace("max_attempts: 10", "max_attempts: 3"))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(POISON)
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--config", str(conf), "run", str(tmp_path / "in"),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert err.count("prepare process 0") == 3, "it died on the file once per attempt"
    with sqlite3.connect(tmp_path / "worker.db") as c:
        rows = {r[0]: r[1:] for r in c.execute("select rel_path, status, attempts, error from images")}
    status, attempts, error = rows.pop("poison.jpg")
    assert (status, attempts) == ("failed", 3) and error.startswith("quarantined after 3 attempts"), error
    assert sorted(rows) == sorted(rels)
    assert all(status == "done" and attempts <= 2 for status, attempts, _ in rows.values()), rows
