"""`worker run` end to end on real files: results, failures, resumability, database rows."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select, update

from worker.errors import ConfigError, ModelError, StoreError
from worker.service import open_pipeline, run_folder
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
    assert doc["task"] == "segment" and doc["mask_fraction"] > 0.1 and doc["mask"] == "page.png.mask.png"
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

    # the outbox holds each name's latest outcome: a failure's reason, then results once it is done
    error = json.loads((cfg.outbox / "broken.jpg.error.json").read_text())
    assert error["status"] == "failed" and "Truncated" in error["error"] and error["input"] == "broken.jpg"
    assert not (cfg.outbox / "broken.jpg.json").exists()
    shutil.copy(samples / "rocket.jpg", folder / "broken.jpg")
    assert run_folder(cfg, folder).figures["done"] == 1
    assert (cfg.outbox / "broken.jpg.json").exists() and not (cfg.outbox / "broken.jpg.error.json").exists()
    (folder / "page.png").write_bytes(b"not a png any more")
    assert run_folder(cfg, folder).figures["failed"] == 1
    assert sorted(p.name for p in cfg.outbox.glob("page.png*")) == ["page.png.error.json"]
    db.dispose()


def test_quarantine_after_max_attempts(cfg, tmp_path: Path) -> None:
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


def test_images_left_in_flight_by_a_dead_worker_go_first_and_alone(cfg, tmp_path: Path, samples: Path) -> None:
    """After a crash, each image that was in flight is processed on its own before the rest: if it
    is the one that crashes the worker, only its own attempts count towards quarantine."""
    from worker.store.recorder import Claimed, Commit, Recorder, RunInfo

    folder = tmp_path / "in"
    folder.mkdir()
    names = ["astronaut.png", "chelsea.png", "coffee.png", "page.png", "text.png", "rocket.jpg"]
    for name in names:
        shutil.copy(samples / name, folder / name)
    db = open_db(cfg.db)
    dead = Recorder(db, RunInfo("run", str(folder), "ppocr-det", "", "cpu", {}))  # a worker that claims, then dies
    for name in ("page.png", "text.png"):
        committed = Commit()
        dead.put(Claimed(name, hashlib.sha256((folder / name).read_bytes()).hexdigest(), 1, committed))
        assert committed.wait(10)
    dead.close()

    summary = run_folder(cfg, folder)
    assert (summary.figures["images"], summary.figures["done"], summary.figures["skipped"]) == (6, 6, 0)
    with db.connect() as c:
        rows = {r.rel_path: r for r in c.execute(select(ImageRow))}
    db.dispose()
    assert {n: rows[n].attempts for n in names} == {**{n: 1 for n in names}, "page.png": 2, "text.png": 2}
    assert all(rows[n].status == "done" for n in names)
    last_suspect = max(rows[n].updated_at for n in ("page.png", "text.png"))
    first_other = min(rows[n].updated_at for n in names if n not in ("page.png", "text.png"))
    assert last_suspect <= first_other  # both finished before any other image finished


def test_a_new_model_file_or_new_card_settings_process_done_images_again(cfg, tmp_path: Path, samples: Path,
                                                                         effnet_onnx: Path) -> None:
    """Done means done with this model file and these card settings: after retraining (a new file under
    the same card), or a corrected threshold, a rerun must not skip every image as already done."""
    import onnx

    card = tmp_path / "models" / "mine"
    card.mkdir(parents=True)
    shutil.copy(effnet_onnx, card / "mine.onnx")
    (card / "model.yaml").write_text("name: mine\ntask: classify\nonnx: mine.onnx\n"
                                     "input: {name: input, size: [224, 224], dynamic_batch: true}\n"
                                     "postprocess: {output: logits}\n")
    cfg = dataclasses.replace(cfg, models_dir=tmp_path / "models", model="mine")
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("coffee.png", "chelsea.png"):
        shutil.copy(samples / name, folder / name)

    def figures() -> tuple[int, int]:
        f = run_folder(cfg, folder).figures
        return f["done"], f["skipped"]

    assert figures() == (2, 0) and figures() == (0, 2)
    model = onnx.load(card / "mine.onnx")
    model.doc_string = "retrained"  # another file (another sha256) under the same card
    onnx.save(model, card / "mine.onnx")
    assert figures() == (2, 0) and figures() == (0, 2)
    db = open_db(cfg.db)
    with db.connect() as c:
        assert c.execute(select(ImageRow.attempts)).scalars().all() == [1, 1]  # a fresh count, not 2
        assert c.scalar(select(func.count()).select_from(ResultRow)) == 2  # replaced, never two
    db.dispose()

    # the same file under corrected card settings (here the threshold for `uncertain`): processed again;
    # a new description shapes no result: skipped
    text = (card / "model.yaml").read_text()
    (card / "model.yaml").write_text(text.replace("postprocess: {output: logits}", "postprocess: {output: logits, "
                                                                                 "threshold: 0.99}"))
    assert figures() == (2, 0) and figures() == (0, 2)
    assert all(json.loads((cfg.outbox / f"{n}.json").read_text())["uncertain"] for n in ("coffee.png", "chelsea.png"))
    (card / "model.yaml").write_text((card / "model.yaml").read_text() + "description: my classifier\n")
    assert figures() == (0, 2)


def test_runs_recorded_under_the_first_card_digests_still_count_as_done(cfg, tmp_path: Path, samples: Path,
                                                                        effnet_onnx: Path) -> None:
    """Upgrading past a change to how card settings are digested (or to a version that adds a setting
    at its default) must not reprocess what is done."""
    from tests.conftest import CACHE
    from worker.models.card import accepted_digests, settings_digest
    from worker.models.lookup import find_card
    from worker.models.pull import with_labels

    cfg = dataclasses.replace(cfg, model="efficientnet-lite0")
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(samples / "coffee.png", folder / "coffee.png")
    assert run_folder(cfg, folder).figures["done"] == 1
    card = with_labels(find_card(cfg.models_dir, "efficientnet-lite0"), CACHE)
    (first,) = accepted_digests(card) - {settings_digest(card)}
    db = open_db(cfg.db)
    with db.begin() as c:  # as the first version with card digests recorded the run
        c.execute(update(Run).values(card_sha256=first))
    db.dispose()
    f = run_folder(cfg, folder).figures
    assert (f["done"], f["skipped"]) == (0, 1)


def test_a_rerun_knows_unchanged_files_without_reading_them(cfg, tmp_path: Path, samples: Path,
                                                            effnet_onnx: Path, monkeypatch) -> None:
    """A file whose size and stamp (inode, mtime, ctime) are those of the read that was processed is
    done without being read again; any change to it, even one that keeps its size and mtime, or another
    folder with the same names and contents, is read (and its content decides)."""
    import cv2

    from worker.store import ledger

    # files written this second count as settled (they are not written to while the test reads them)
    monkeypatch.setattr(ledger, "SETTLED_S", 0.0)
    cfg = dataclasses.replace(cfg, model="efficientnet-lite0")
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    names = ["coffee.bmp", "sub/chelsea.bmp", "astronaut.bmp"]
    for name in names:
        cv2.imwrite(str(folder / name), cv2.imread(str(samples / Path(name).with_suffix(".png").name)))
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")

    def figures(where: Path = folder) -> tuple[int, int, int, int]:
        f = run_folder(cfg, where).figures
        return f["done"], f["failed"], f["skipped"], f["skipped_unread"]

    assert figures() == (3, 1, 0, 0)
    assert figures() == (0, 1, 3, 3)  # the failed one is read and tried again, never skipped

    # new pixels, same size, the old mtime put back (as `cp -p` or a careless tool would): read again
    path = folder / "coffee.bmp"
    st = path.stat()
    image = cv2.imread(str(path))
    cv2.imwrite(str(path), 255 - image)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert figures() == (1, 1, 2, 2)
    (folder / "astronaut.bmp").touch()  # a new mtime, the same content: read, and known by its content
    assert figures() == (0, 1, 3, 2)
    assert figures() == (0, 1, 3, 3)

    other = tmp_path / "copy"
    shutil.copytree(folder, other, copy_function=shutil.copy2)  # same names, contents and mtimes elsewhere
    assert figures(other) == (0, 1, 3, 0)


def test_a_file_changed_just_before_its_read_gets_no_stamp(cfg, tmp_path: Path, samples: Path, effnet_onnx: Path,
                                                           monkeypatch) -> None:
    """File times tick coarsely: a write in the same tick as the read would leave the stamp as it was. A
    file changed within SETTLED_S of its read is read again next time (and stamped then, once settled)."""
    from worker.store import ledger

    cfg = dataclasses.replace(cfg, model="efficientnet-lite0")
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(samples / "coffee.png", folder / "coffee.png")
    monkeypatch.setattr(ledger, "SETTLED_S", 3600.0)  # every file here changed "just now"
    figures = [run_folder(cfg, folder).figures for _ in range(2)]
    assert [(f["done"], f["skipped"], f["skipped_unread"]) for f in figures] == [(1, 0, 0), (0, 1, 0)]
    monkeypatch.setattr(ledger, "SETTLED_S", 0.0)  # settled now: read once more and stamped, then known
    figures = [run_folder(cfg, folder).figures for _ in range(2)]
    assert [(f["done"], f["skipped"], f["skipped_unread"]) for f in figures] == [(0, 1, 0), (0, 1, 1)]


def test_a_run_into_an_outbox_other_folders_wrote_says_so(cfg, tmp_path: Path, caplog, monkeypatch) -> None:
    """Outputs are named by the path relative to the folder: day2/a.png's overwrite day1/a.png's in a
    shared outbox. The start says so, naming the other folders; a folder's own reruns, and another
    outbox, do not (before: nothing said it, only the database kept day1's result)."""
    caplog.set_level(logging.WARNING, logger="worker.service")
    folders = [tmp_path / "day1", tmp_path / "day2"]
    for folder in folders:
        folder.mkdir()
        (folder / "a.png").write_text(f"{folder.name}: a text file named .png")  # fails fast, has outputs

    def shared_warnings(cfg, folder: Path) -> list[str]:
        caplog.clear()
        run_folder(cfg, folder)
        return [r.getMessage() for r in caplog.records if "also holds the outputs" in r.getMessage()]

    assert shared_warnings(cfg, folders[0]) == [] and shared_warnings(cfg, folders[0]) == []
    (said,) = shared_warnings(cfg, folders[1])
    assert said.startswith(f"{cfg.outbox.absolute()} also holds the outputs of earlier runs over {folders[0]}:")
    sha = {json.loads((cfg.outbox / "a.png.error.json").read_text())["sha256"]}  # day1's outcome file is gone
    assert sha == {hashlib.sha256((folders[1] / "a.png").read_bytes()).hexdigest()}
    (said,) = shared_warnings(cfg, folders[0])
    assert f"earlier runs over {folders[1]}:" in said
    monkeypatch.chdir(tmp_path)  # a relative --outbox: the folder it names is what counts
    elsewhere = dataclasses.replace(cfg, outbox=Path("other-out"))
    assert shared_warnings(elsewhere, folders[0]) == [] and shared_warnings(elsewhere, folders[0]) == []
    (said,) = shared_warnings(elsewhere, folders[1])
    assert said.startswith(f"{tmp_path / 'other-out'} also holds")
    db = open_db(cfg.db)  # a run on another host (a shared PostgreSQL): its folder named with its host
    with db.begin() as c:
        c.execute(update(Run).where(Run.root == str(folders[0])).values(host="scanner-2"))
    db.dispose()
    (said,) = shared_warnings(cfg, folders[1])
    assert f"earlier runs over scanner-2:{folders[0]}:" in said


def test_batch_size_zero_is_chosen_for_the_device_and_a_set_one_is_kept(cfg, effnet_onnx: Path, tmp_path: Path,
                                                                         caplog) -> None:
    effcfg = dataclasses.replace(cfg, model="efficientnet-lite0")  # a card with a dynamic batch
    assert effcfg.pipeline.max_batch == 0  # the default: chosen
    caplog.set_level(logging.INFO, logger="worker.service")
    (folder := tmp_path / "in").mkdir()
    with open_pipeline(effcfg, "run", folder) as pipeline:  # CPU here: batches of one
        assert (pipeline.settings.max_batch, pipeline.settings.infer_workers) == (1, os.cpu_count())
    assert f"pipeline: {min(os.cpu_count() or 1, 4)} decode threads, {os.cpu_count()} inference threads, " \
           f"batches of up to 1" in caplog.text
    four = dataclasses.replace(effcfg, pipeline=dataclasses.replace(effcfg.pipeline, max_batch=4))
    with open_pipeline(four, "run", folder) as pipeline:
        assert pipeline.settings.max_batch == 4


def test_a_start_checks_the_card_then_the_database_before_the_model(cfg, tmp_path: Path) -> None:
    """The cheap checks come first: a mistyped model name makes no database; a database that cannot be
    opened is said before the model is pulled (minutes, the first time) and warmed up."""
    folder = tmp_path / "images"
    folder.mkdir()
    models = tmp_path / "models"
    (models / "gone").mkdir(parents=True)  # a card whose ONNX file is not there: the model step fails
    (models / "gone" / "model.yaml").write_text("name: gone\nonnx: gone.onnx\ntask: classify\n"
                                                "input: {name: input, size: [32, 48]}\n")
    own = dataclasses.replace(cfg, models_dir=models, model="gone")
    with pytest.raises(ModelError, match="gone.onnx"):  # the card and database fine: the model's reason
        run_folder(own, folder)
    not_a_db = tmp_path / "not-a-database"
    not_a_db.write_text("some other file")
    with pytest.raises(StoreError, match="not-a-database"):
        run_folder(dataclasses.replace(own, db=f"sqlite:///{not_a_db}"), folder)
    fresh = tmp_path / "fresh.db"
    with pytest.raises(ConfigError, match="model 'nope': no card"):
        run_folder(dataclasses.replace(own, model="nope", db=f"sqlite:///{fresh}"), folder)
    assert not fresh.exists()


def _tiff(path: Path, *images: Path | np.ndarray) -> Path:
    """A multi-page TIFF of these pictures (files or BGR arrays), lossless: each page is its picture's pixels."""
    import cv2

    pages = [cv2.imread(str(p), cv2.IMREAD_COLOR) if isinstance(p, Path) else p for p in images]
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwritemulti(str(path), pages)
    return path


def test_pages_all_processes_every_page_into_one_outcome(cfg, tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    """pipeline.pages: all. A 3-page TIFF of three photos: each page's labels are those of its photo run on
    its own, in one JSON that lists the pages, one row (its labels every page's, its score the best page's)
    and one timing row; the default, `first`, keeps the first page only; switching between them processes
    done multi-page files again (their documents differ), not files of one page, and a rerun skips them."""
    folder = tmp_path / "in"
    photos = [samples / n for n in ("coffee.png", "chelsea.png", "motorcycle_left.png")]
    _tiff(folder / "three.tif", *photos)
    for p in photos:
        shutil.copy(p, folder / p.name)
    effnet = dataclasses.replace(cfg, model="efficientnet-lite0")
    first = run_folder(effnet, folder)
    assert (first.figures["done"], first.figures["pages"]) == (4, 4)
    doc = json.loads((cfg.outbox / "three.tif.json").read_text())
    assert doc["image"]["pages"] == 3 and "pages" not in doc and doc["labels"][0]["name"] == "espresso"

    every = dataclasses.replace(effnet, pipeline=dataclasses.replace(effnet.pipeline, pages="all"))
    figures = run_folder(every, folder).figures
    # done under `first`: the multi-page file is not done under `all`, a file of one page is
    assert (figures["done"], figures["pages"], figures["skipped"]) == (1, 3, 3)
    doc = json.loads((cfg.outbox / "three.tif.json").read_text())
    assert doc["status"] == "done" and doc["image"] == {"width": 600, "height": 400, "pages": 3}
    assert [p["page"] for p in doc["pages"]] == [1, 2, 3] and "labels" not in doc
    for page, photo in zip(doc["pages"], photos):
        alone = json.loads((cfg.outbox / f"{photo.name}.json").read_text())
        assert page["labels"] == alone["labels"] and page["image"] == {k: alone["image"][k] for k in ("width", "height")}
    assert [p["labels"][0]["name"] for p in doc["pages"]] == ["espresso", "tiger cat", "moped"]
    assert not (cfg.outbox / "three.tif.pages").exists()  # a classifier writes no per-page files
    db = open_db(cfg.db)
    with db.connect() as c:
        (image,) = c.execute(select(ImageRow).where(ImageRow.rel_path == "three.tif")).all()
        labels = {r.name: r.score for r in c.execute(select(LabelRow).where(LabelRow.image_id == image.id))}
        score = c.scalar(select(ResultRow.score).where(ResultRow.image_id == image.id))
        assert c.scalar(select(func.count()).select_from(TimingRow).where(TimingRow.image_id == image.id)) == 1
    db.dispose()
    tops = {p["labels"][0]["name"]: p["labels"][0]["score"] for p in doc["pages"]}
    assert {n: round(labels[n], 6) for n in tops} == tops and np.isclose(score, max(tops.values()), atol=1e-6)
    assert run_folder(every, folder).figures["skipped"] == 4
    back = run_folder(effnet, folder).figures
    assert (back["done"], back["skipped"]) == (1, 3)  # and back
    assert "pages" not in json.loads((cfg.outbox / "three.tif.json").read_text())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def test_a_stack_over_the_byte_limit_is_read_page_by_page_with_the_same_results(cfg, tmp_path: Path, samples: Path,
                                                                                effnet_onnx: Path, monkeypatch) -> None:
    """A multi-page TIFF bigger than 8 bytes x pipeline.max_pixels (a long microscope stack) whose pages are
    each within the limit is not refused but read from disk page by page: the same JSON as when it is
    read whole, under `all` and `first`; no file is left open. So is one over PAGES_FROM_DISK_BYTES, within
    the limit, under either setting. A file of one page over the limit is refused."""
    import worker.pipeline.prepare as pipeline  # where the decode threads read a file page by page

    real, from_disk = pipeline.file_pages, []

    def counted(*args, **kwargs):
        from_disk.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "file_pages", counted)
    folder = tmp_path / "in"
    photos = [samples / n for n in ("coffee.png", "chelsea.png", "motorcycle_left.png")]
    stack = _tiff(folder / "stack.tif", *photos, *photos)  # six pages
    limit = 741 * 500  # the largest page's pixels: 2.96 MB of bytes
    assert stack.stat().st_size > 8 * limit
    effnet = dataclasses.replace(cfg, model="efficientnet-lite0")

    def run(pages: str, max_pixels: int, name: str) -> dict:
        setting = dataclasses.replace(effnet.pipeline, pages=pages, max_pixels=max_pixels)
        own = dataclasses.replace(effnet, pipeline=setting, outbox=tmp_path / name, db=f"sqlite:///{tmp_path}/{name}.db")
        figures = run_folder(own, folder).figures
        assert (figures["done"], figures["failed"]) == (1, 0), figures
        doc = json.loads((tmp_path / name / "stack.tif.json").read_text())
        return {k: v for k, v in doc.items() if k != "timings_ms"}

    fds, whole = _open_fds(), {}
    for pages in ("all", "first"):
        read_so, whole[pages] = run(pages, limit, f"disk-{pages}"), run(pages, 0, f"whole-{pages}")
        assert read_so == whole[pages] and read_so["image"]["pages"] == 6 and from_disk == ["stack.tif"]
        from_disk.clear()
    assert "pages" not in whole["first"]  # the first page's labels, no pages list
    monkeypatch.setattr(pipeline, "PAGES_FROM_DISK_BYTES", stack.stat().st_size - 1)
    assert run("first", 0, "size-first") == whole["first"] and from_disk == ["stack.tif"]
    assert run("all", 0, "size-all") == whole["all"] and from_disk == ["stack.tif"] * 2
    all_pages = json.loads((tmp_path / "disk-all" / "stack.tif.json").read_text())["pages"]
    assert [p["labels"][0]["name"] for p in all_pages] == ["espresso", "tiger cat", "moped"] * 2
    assert _open_fds() == fds
    _tiff(folder / "stack.tif", np.random.default_rng(1).integers(0, 256, (300, 300, 3), dtype=np.uint8))
    setting = dataclasses.replace(effnet.pipeline, pages="all", max_pixels=30_000)  # 240,000 bytes
    summary = run_folder(dataclasses.replace(effnet, pipeline=setting), folder)
    assert summary.figures["failed"] == 1
    error = json.loads((cfg.outbox / "stack.tif.error.json").read_text())["error"]
    assert "bytes is more than any image within the pixel limit takes" in error


def test_a_stack_read_page_by_page_that_changes_meanwhile_fails_naming_why(cfg, tmp_path: Path, samples: Path,
                                                                            effnet_onnx: Path, monkeypatch) -> None:
    """Such a file is hashed at its claim and decoded later: another program writing to it in between (here,
    just as its first page, or its third, is decoded) fails it rather than giving that hash other pixels."""
    import worker.pipeline.prepare as pipeline  # where the decode threads read a file page by page

    real = pipeline.file_pages
    when = {"page": 0}

    def written_to_meanwhile(f, path, *args, **kwargs):
        for k, page in enumerate(real(f, path, *args, **kwargs)):
            if k == when["page"]:
                with open(folder / "stack.tif", "ab") as w:
                    w.write(b"more")
            yield page

    monkeypatch.setattr(pipeline, "file_pages", written_to_meanwhile)
    folder = tmp_path / "in"
    photos = [samples / n for n in ("coffee.png", "chelsea.png", "motorcycle_left.png")]
    _tiff(folder / "stack.tif", *photos, *photos)
    for pages, page, said in (("first", 0, ""), ("all", 2, "page 3 of 6: ")):
        when["page"] = page
        setting = dataclasses.replace(cfg.pipeline, pages=pages, max_pixels=741 * 500)
        summary = run_folder(dataclasses.replace(cfg, model="efficientnet-lite0", pipeline=setting), folder)
        assert summary.figures["failed"] == 1
        error = json.loads((cfg.outbox / "stack.tif.error.json").read_text())["error"]
        assert error == said + "changed while its pages were being read; its new content is read anew"


def test_pages_all_writes_each_page_s_mask_and_removes_what_an_earlier_content_left(cfg, tmp_path: Path,
                                                                                   samples: Path) -> None:
    """A segmenter's page k mask is <rel>.pages/<k>.mask.png, the same as its picture's alone; a new content
    of fewer pages leaves no mask of a page it does not have; a page that fails fails the file naming it,
    and its outputs are gone but the error file; COCO export makes each page an image of its own."""
    import cv2

    from worker.outputs.coco import coco
    from worker.store.queries import Filters

    every = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, pages="all", max_pixels=1_000_000))
    folder = tmp_path / "in"
    _tiff(folder / "docs.tif", samples / "page.png", samples / "text.png", samples / "page.png")
    shutil.copy(samples / "text.png", folder / "text.png")
    assert run_folder(every, folder).figures["done"] == 2
    doc = json.loads((cfg.outbox / "docs.tif.json").read_text())
    masks = ["docs.tif.mask.png", "docs.tif.pages/2.mask.png", "docs.tif.pages/3.mask.png"]
    assert [p["mask"] for p in doc["pages"]] == masks
    assert doc["pages"][1]["regions"] == json.loads((cfg.outbox / "text.png.json").read_text())["regions"]

    def read(rel: str):
        return cv2.imread(str(cfg.outbox / rel), cv2.IMREAD_UNCHANGED)

    page_mask = read(masks[0])
    assert (read(masks[1]) == read("text.png.mask.png")).all() and (page_mask == read(masks[2])).all()
    db = open_db(cfg.db)
    exported = coco(db, Filters(model="ppocr-det"), task="segment", outbox=cfg.outbox)
    db.dispose()
    pages = sorted((i.get("page", 0), i["file_name"], i["id"]) for i in exported["images"])
    assert [(p, f) for p, f, _ in pages] == [(0, "text.png"), (1, "docs.tif"), (2, "docs.tif"), (3, "docs.tif")]
    assert len({i for *_, i in pages}) == 4  # each page an image id of its own
    assert {a["image_id"] for a in exported["annotations"]} == {i for *_, i in pages}

    _tiff(folder / "docs.tif", samples / "text.png", samples / "page.png")  # fewer pages now
    assert run_folder(every, folder).figures["done"] == 1
    assert sorted(p.name for p in (cfg.outbox / "docs.tif.pages").iterdir()) == ["2.mask.png"]
    assert (read("docs.tif.pages/2.mask.png") == page_mask).all()
    first = run_folder(cfg, folder)  # pipeline.pages: first again: the file's JSON lists no pages, nor its folder
    assert (first.figures["done"], first.figures["skipped"]) == (1, 1)
    assert "pages" not in json.loads((cfg.outbox / "docs.tif.json").read_text())
    assert not (cfg.outbox / "docs.tif.pages").exists()

    big = cv2.resize(cv2.imread(str(samples / "page.png")), (1200, 900))  # 1,080,000 pixels: over the limit
    _tiff(folder / "docs.tif", samples / "text.png", big, samples / "page.png")  # page 3 is not even sent
    summary = run_folder(every, folder)
    assert summary.figures["failed"] == 1
    error = json.loads((cfg.outbox / "docs.tif.error.json").read_text())["error"]
    assert error == "page 2 of 3: 1200x900 pixels is over the limit of 1000000 (pipeline.max_pixels)"
    assert sorted(p.name for p in cfg.outbox.glob("docs.tif*")) == ["docs.tif.error.json"]


def test_a_run_and_a_watcher_say_at_start_that_a_disk_is_low(cfg, tmp_path: Path, caplog) -> None:
    """An overnight run has no status line, and a watcher's first is minutes away: both say at once
    when the outbox's, archive's or database's filesystem is low on room (here every one is, by the
    config's threshold of the whole disk, metrics.low_disk_percent: 100), naming the folders on it;
    `worker health` says it too, and nothing at thresholds of 0."""
    from click.testing import CliRunner

    from worker.cli import cli
    from worker.service import watch

    caplog.set_level(logging.WARNING)
    (folder := tmp_path / "in").mkdir()
    (folder / "a.png").write_text("a text file named .png")  # fails fast
    cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, low_disk_percent=100.0))  # always low
    run_folder(cfg, folder)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("low on disk: ")]
    assert len(said) == 1 and said[0].endswith(f"on the filesystem of the outbox and database ({tmp_path})"), said
    caplog.clear()
    watch(cfg, threading.Event(), burst=True)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("low on disk: ")]
    assert len(said) == 1 and "of the outbox, archive and database" in said[0], said

    conf = tmp_path / "config.yaml"
    where = f"inbox: {cfg.inbox}\noutbox: {cfg.outbox}\narchive: {cfg.archive}\ndb: {cfg.db}\n"
    conf.write_text(where + "metrics: {low_disk_percent: 100}\n")
    health = CliRunner().invoke(cli, ["--config", str(conf), "health", "--format", "json"])
    assert health.exit_code == 1  # finished: the state's exit status, whatever the disk
    assert json.loads(health.output)["low_disk"].startswith("low on disk: ")
    text = CliRunner().invoke(cli, ["--config", str(conf), "health"]).output
    assert text.startswith("run ") and "finished" in text and "; low on disk: " in text, text
    conf.write_text(where + "metrics: {low_disk_gb: 0, low_disk_percent: 0}\n")  # never low
    assert json.loads(CliRunner().invoke(cli, ["--config", str(conf), "health", "--format", "json"]).output)[
        "low_disk"] is None


def test_watch_refuses_a_missing_inbox_and_makes_no_folder_before_its_checks(cfg, tmp_path: Path) -> None:
    """A mistyped --inbox was made and watched, empty, forever; a mistyped --model was refused only after
    the inbox, outbox and archive had been made."""
    from worker.service import watch

    typo = dataclasses.replace(cfg, inbox=tmp_path / "typo" / "in",
                               watch=dataclasses.replace(cfg.watch, create_inbox=False))
    with pytest.raises(ConfigError, match=r"'inbox' \(.*typo/in\) does not exist: .*--create"):
        watch(typo, threading.Event(), burst=True)
    no_model = dataclasses.replace(cfg, model="efficientnet-lite9")
    with pytest.raises(ConfigError, match="model 'efficientnet-lite9': no card"):
        watch(no_model, threading.Event(), burst=True)
    with pytest.raises(ConfigError, match="model 'efficientnet-lite9': no card"):
        run_folder(no_model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no folder made before the checks passed"
    made = watch(cfg, threading.Event(), burst=True)  # watch.create_inbox (the CLI's --create)
    assert cfg.inbox.is_dir() and made.figures["images"] == 0


def test_a_rerun_into_another_outbox_gets_the_outputs_there(cfg, tmp_path: Path, samples: Path) -> None:
    """`worker run DIR --outbox NEW` over a folder done before skipped every image as already done, and
    NEW stayed empty. Now "done" means done into this outbox: the images are done again into NEW, and
    the summary says where the earlier outputs are (left as they are)."""
    cfg = dataclasses.replace(cfg, model="efficientnet-lite0")
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("coffee.png", "chelsea.png"):
        shutil.copy(samples / name, folder / name)
    first = run_folder(cfg, folder)
    assert first.figures["done"] == 2 and first.figures["earlier_outboxes"] == {}
    new = dataclasses.replace(cfg, outbox=tmp_path / "new")
    again = run_folder(new, folder)
    assert (again.figures["done"], again.figures["skipped"]) == (2, 0)
    assert again.figures["earlier_outboxes"] == {str(cfg.outbox): 2}
    assert sorted(p.name for p in new.outbox.iterdir()) == ["chelsea.png.json", "coffee.png.json"]
    assert sorted(p.name for p in cfg.outbox.iterdir()) == ["chelsea.png.json", "coffee.png.json"]  # left there
    rerun = run_folder(new, folder)  # done into this outbox now: skipped, unread
    assert (rerun.figures["done"], rerun.figures["skipped"]) == (0, 2) and rerun.figures["earlier_outboxes"] == {}
