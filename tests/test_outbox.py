"""The outbox writer: atomic files, paths kept inside their roots, verified moves."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from worker.errors import WorkerError
import worker.outputs.files as files_mod
from worker.outputs.outbox import Outbox, output_rel
from worker.outputs.files import (NAME_MAX, TMP_PREFIX, fit_name, inside, move_verified, remove_temporaries,
                                  remove_temporaries_of, write_atomic)
from worker.tasks.results import Classification, Mask


def test_writes_json_and_mask_without_temporaries(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "out")
    mask = Mask(mask=np.eye(4, dtype=bool), label="text", score=0.9)
    json_rel, outputs = box.write("a/b.png", mask, {"x": 1})
    assert (json_rel, outputs.mask, outputs.overlay) == ("a/b.png.json", "a/b.png.mask.png", None)
    assert json.loads((tmp_path / "out/a/b.png.json").read_text()) == {"x": 1, "mask": "a/b.png.mask.png"}
    assert not list((tmp_path / "out").rglob(".tmp-*"))


def test_each_name_holds_its_latest_outcome_results_or_an_error(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "out", write_overlays=True)
    out = tmp_path / "out" / "a"
    box.write("a/b.png", Mask(mask=np.eye(4, dtype=bool), label="text", score=0.9), {"x": 1})
    assert sorted(p.name for p in out.iterdir()) == ["b.png.json", "b.png.mask.png"]
    # new content under the name fails: its error in place of the earlier content's results
    assert box.write_error("a/b.png", {"error": "not an image"}) == "a/b.png.error.json"
    assert [p.name for p in out.iterdir()] == ["b.png.error.json"]
    assert json.loads((out / "b.png.error.json").read_text()) == {"error": "not an image"}
    box.write("a/b.png", Mask(mask=np.eye(4, dtype=bool), label="text", score=0.9), {"x": 2})  # done at last
    assert sorted(p.name for p in out.iterdir()) == ["b.png.json", "b.png.mask.png"]
    assert Outbox(tmp_path / "quiet", write_errors=False).write_error("c.png", {}) is None
    assert not list((tmp_path / "quiet").iterdir())


def test_a_page_folder_keeps_only_the_pages_the_latest_outcome_has_and_whatever_is_not_a_page_s(tmp_path: Path) -> None:
    """<rel>.pages/ holds page k's outputs (k from 2); a later outcome of fewer pages, or one page, or a
    failure, removes those past it, under pipeline.pages: all or `first` alike on a local disk (on a network
    share, under `first`, for a file of several pages only: one lookup per image would be a round trip each).
    An input folder that happens to share the name keeps its outputs."""
    box, first = Outbox(tmp_path / "out", write_yolo_txt=True, pages=True), Outbox(tmp_path / "out")
    mask = Mask(mask=np.eye(4, dtype=bool), label="text", score=0.9)
    for page in (1, 2, 3):
        box.write_page("s.tif", page, mask)
    pages = tmp_path / "out/s.tif.pages"
    box.write("s.tif.pages/4.png", mask, {"x": 1})  # an input of that name: its outputs are not pages'
    (pages / "5.mask.png.part").write_bytes(b"")
    assert box.write_document("s.tif", {"pages": 4}, 4) == "s.tif.json"
    theirs = ["4.png.json", "4.png.mask.png", "5.mask.png.part"]
    assert sorted(p.name for p in pages.iterdir()) == ["2.mask.png", "3.mask.png", "4.mask.png", *theirs]
    box.write_document("s.tif", {"pages": 2}, 2)
    assert sorted(p.name for p in pages.iterdir()) == ["2.mask.png", *theirs]
    first.write("s.tif", mask, {"x": 1})  # under `first`, a new content of one page (before: its pages stayed)
    assert sorted(p.name for p in pages.iterdir()) == theirs
    box.write_page("s.tif", 1, mask)
    first.write("s.tif", mask, {"x": 1}, frames=2)  # under `first`, the file's first page of two
    assert sorted(p.name for p in pages.iterdir()) == theirs
    shared = Outbox(tmp_path / "out")
    shared._every_outcome_drops_pages = False  # as on a network share (mounts.network_filesystem)
    box.write_page("s.tif", 1, mask)
    shared.write("s.tif", mask, {"x": 1})  # one page: not looked for there
    assert sorted(p.name for p in pages.iterdir()) == ["2.mask.png", *theirs]
    shared.write("s.tif", mask, {"x": 1}, frames=2)
    assert sorted(p.name for p in pages.iterdir()) == theirs
    for p in theirs:
        (pages / p).unlink()
    for outbox, frames in ((box, 1), (first, 3)):
        box.write_page("s.tif", 1, mask)
        outbox.write_error("s.tif", {"error": "x"}, frames)
        assert not pages.exists()  # emptied: the folder goes too
    box.write_page("s.tif", 1, mask)
    box.write("s.tif", mask, {"x": 1})  # one page now, under `all`
    assert not pages.exists()


def test_names_too_long_for_their_outputs_are_cut_short_and_stay_apart() -> None:
    assert fit_name("a.png", 12) == "a.png" and output_rel("d/a.png") == "d/a.png"
    for stem in ("x" * 300, "長" * 100, "ab\udce9" * 80):  # ASCII, 3-byte characters, bytes that are not UTF-8
        name = stem + ".jpg"
        cut = fit_name(name, 12)
        raw = os.fsencode(cut)
        assert len(raw) <= NAME_MAX - 12 and cut.endswith(".jpg") and "~" in cut, cut
        assert raw.startswith(os.fsencode(stem)[:200]), "its start kept"
        if stem.isascii() or stem[0] == "長":
            raw.decode("utf-8")  # never cut inside a character
        assert fit_name(stem + "y.jpg", 12) != cut, "names sharing a long start stay apart"
    long = "長" * 82 + ".jpg"  # 250 bytes: fits itself, not with ".overlay.jpg"
    assert fit_name(long) == long and output_rel("d/" + long) == "d/" + fit_name(long, len(".overlay.jpg"))


def test_an_image_with_a_name_near_the_limit_gets_its_outputs(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "out", write_overlays=True)
    rel = "a/" + "長" * 82 + ".jpg"
    mask = Mask(mask=np.eye(4, dtype=bool), label="text", score=0.9)
    json_rel, outputs = box.write(rel, mask, {"x": 1}, image=np.zeros((4, 4, 3), np.uint8))
    assert (json_rel, outputs.mask) == (output_rel(rel) + ".json", output_rel(rel) + ".mask.png")
    assert outputs.overlay == output_rel(rel) + ".overlay.jpg"  # named in the JSON and the database
    assert json.loads((tmp_path / "out" / json_rel).read_text())["overlay"] == outputs.overlay
    written = sorted(p.name for p in (tmp_path / "out/a").iterdir())
    assert written == sorted(os.path.basename(output_rel(rel)) + s for s in (".json", ".mask.png", ".overlay.jpg"))
    assert box.write_error(rel, {"error": "x"}) == output_rel(rel) + ".error.json"
    assert [p.name for p in (tmp_path / "out/a").iterdir()] == [os.path.basename(output_rel(rel)) + ".error.json"]
    # the archive's "other content under this name" suffix cuts it short too
    (tmp_path / "a").write_bytes(b"one")
    (tmp_path / "b").write_bytes(b"two")
    first = move_verified(tmp_path / "a", tmp_path / "arch" / ("長" * 84))
    second = move_verified(tmp_path / "b", tmp_path / "arch" / ("長" * 84))
    assert first != second and second.read_bytes() == b"two" and len(os.fsencode(second.name)) <= NAME_MAX


def test_paths_cannot_escape(tmp_path: Path) -> None:
    for rel in ("../x", "/etc/passwd", "a/../../x"):
        with pytest.raises(WorkerError, match="outside"):
            inside(tmp_path, rel)


def test_move_keeps_other_content(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"one")
    (tmp_path / "b").write_bytes(b"two")
    (tmp_path / "dst").mkdir()
    first = move_verified(tmp_path / "a", tmp_path / "dst" / "x.png")
    second = move_verified(tmp_path / "b", tmp_path / "dst" / "x.png")
    assert first != second and first.read_bytes() == b"one" and second.read_bytes() == b"two"


def test_results_check_shapes() -> None:
    with pytest.raises(ValueError):
        Mask(mask=np.zeros((2, 2), np.uint8), label="t", score=0)
    with pytest.raises(ValueError):
        Classification(class_ids=np.zeros(2, np.int64), scores=np.zeros(3), names=("a", "b"), uncertain=False)


def test_move_across_filesystems_copies_verifies_then_deletes(tmp_path: Path) -> None:
    import tempfile

    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem here")
    src = tmp_path / "in.jpg"
    src.write_bytes(b"x" * 100_000)
    with tempfile.TemporaryDirectory(dir=shm) as other:
        dst = move_verified(src, Path(other) / "done" / "in.jpg")
        assert dst.read_bytes() == b"x" * 100_000 and not src.exists()
        assert not list(Path(other).rglob(".tmp-*"))


def test_outputs_get_the_usual_permissions(tmp_path: Path) -> None:
    """0666 less the umask, like any program's output (not mkstemp's 0600): other accounts collect results."""
    old = os.umask(0o022)
    try:
        Outbox(tmp_path / "out").write("a.png", Mask(mask=np.eye(4, dtype=bool), label="text", score=0.9), {"x": 1})
    finally:
        os.umask(old)
    for name in ("a.png.json", "a.png.mask.png"):
        assert stat.S_IMODE((tmp_path / "out" / name).stat().st_mode) == 0o644, name


def test_a_temporary_left_by_a_crash_is_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / f".tmp-a.json{files_mod._owner_suffix()}").write_bytes(b"half a file from a crash")
    write_atomic(out / "a.json", b"{}")
    assert (out / "a.json").read_bytes() == b"{}" and [p.name for p in out.iterdir()] == ["a.json"]


def _life(pid: int, started: int | None = None, space: str | None = None) -> str:
    """A process life as a temporary's name carries it (worker.host.processes.life)."""
    from worker.host import processes

    return f"{space or processes._space()}-{pid}-{processes._started(pid) if started is None else started}"


def _temporaries(folder: Path, writers: dict[str, str]) -> set[str]:
    """A temporary in `folder` per writer's life, as write_atomic names them; plus one in a foreign format."""
    folder.mkdir(exist_ok=True)
    for tag, life in writers.items():
        (folder / f"{TMP_PREFIX}{tag}.json.{life}.7").write_bytes(b"half")
    (folder / f"{TMP_PREFIX}odd").write_bytes(b"half")
    return {p.name for p in folder.iterdir()}


def test_a_dead_prepare_process_s_temporaries_are_removed_where_its_images_were_written(tmp_path: Path) -> None:
    """`remove_temporaries_of`: the temporaries of one gone pid in the folders named, not below them; others stay,
    another pid namespace's of the same pid too."""
    writers = {"dead": _life(4_000_001, 5), "other": _life(4_000_002, 5),
               "container": _life(4_000_001, 5, space="0badf00d")}
    here = _temporaries(tmp_path / "out", writers)
    below = _temporaries(tmp_path / "out" / "d1", writers)
    (tmp_path / "out" / "a.json").write_bytes(b"{}")
    assert remove_temporaries_of(4_000_001, [tmp_path / "out", tmp_path / "out", tmp_path / "never-made"]) == 1
    assert here - {p.name for p in (tmp_path / "out").iterdir()} == {f"{TMP_PREFIX}dead.json.{writers['dead']}.7"}
    assert (tmp_path / "out" / "a.json").exists() and {p.name for p in (tmp_path / "out" / "d1").iterdir()} == below


def test_only_a_crashs_temporaries_are_removed_never_a_live_workers(tmp_path: Path, on_a_share: Path,
                                                                    monkeypatch) -> None:
    """Workers sharing an outbox: a start leaves the others' temporaries alone (before: it removed them all, and
    the first failed an image with "cannot write its outputs ...: No such file"), another container's too, whose
    pid (1 in each) says nothing here; it removes those of a process that died, and of this pid's earlier life."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_life = _life(dead.pid, 1)
    dead.wait()
    try:
        writers = {"live": _life(live.pid), "dead": dead_life, "mine": _life(os.getpid()),
                   "before": _life(os.getpid(), 1),  # this pid's life before this one (a restarted container's)
                   "container": _life(1, 1, space="0badf00d")}  # another container's pid 1
        here = _temporaries(tmp_path / "out", writers)
        assert remove_temporaries(tmp_path / "out") == 2
        gone = here - {p.name for p in (tmp_path / "out").iterdir()}
        assert gone == {f"{TMP_PREFIX}{tag}.json.{writers[tag]}.7" for tag in ("dead", "before")}
        _temporaries(on_a_share, writers)  # another host's workers may write there: their lives say nothing here
        assert remove_temporaries(on_a_share) == 0
        monkeypatch.setattr(files_mod, "STALE_TEMP_S", 0.0)  # untouched this long: a crash's, whoever wrote it
        assert remove_temporaries(on_a_share) == 6 and remove_temporaries(tmp_path / "out") == 4
        assert not list(tmp_path.rglob(f"{TMP_PREFIX}*"))
    finally:
        live.kill()
        live.wait()


WRITER = """
import sys, time
from pathlib import Path
from worker.outputs.files import staged, write_atomic
with staged():  # held as a fleet worker holds its outputs until its outcome's commit
    write_atomic(Path(sys.argv[1]) / "a.png.json", b"{}")
    print("written", flush=True)
    time.sleep(60)
"""
CLEANER = "import sys; from pathlib import Path; from worker.outputs.files import remove_temporaries; " \
          "print(remove_temporaries(Path(sys.argv[1])))"


def test_a_start_in_one_container_leaves_another_containers_temporaries_alone(tmp_path: Path) -> None:
    """Workers in containers on one volume are each pid 1 in a pid namespace of their own: a start in one removed
    the others' outputs in flight, taking their pid 1 for its own earlier life (1,200 done, 1,155 JSON files)."""
    pid1 = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if subprocess.run([*pid1, "true"], capture_output=True).returncode:
        pytest.skip("no pid namespace of its own here (unshare)")
    out = tmp_path / "out"
    out.mkdir()
    writer = subprocess.Popen([*pid1, sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "written"
        (temporary,) = out.iterdir()
        assert temporary.name.startswith(TMP_PREFIX) and ".json." in temporary.name
        cleaned = subprocess.run([*pid1, sys.executable, "-c", CLEANER, str(out)], capture_output=True, text=True)
        assert cleaned.stdout.strip() == "0" and temporary.exists(), cleaned.stderr
    finally:
        writer.kill()
        writer.wait()
