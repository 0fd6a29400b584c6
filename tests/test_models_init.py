"""`worker models init NAME --onnx FILE`: a card from the export itself. An Ultralytics-style export (a YOLOv8
detector head whose file carries Ultralytics' metadata) gets task, size, layout and labels from it and then runs;
an export without metadata (the bundled EfficientNet-Lite0) with --task gets its input from its shape and the
rest marked to check; one whose task cannot be told is refused in one line."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import yaml
from click.testing import CliRunner

from tests.support.cli import config_file, main_as_command
from tests.support.onnx_models import rows_model

ULTRALYTICS = {"author": "Ultralytics", "version": "8.4.190", "task": "detect", "imgsz": "[32, 48]", "stride": "32",
               "end2end": "False", "batch": "1", "names": "{0: 'dent', 1: 'scratch'}"}


def _init(tmp_path: Path, *args: str) -> tuple[int, str]:
    conf = config_file(tmp_path, tmp_path / "models")
    out = CliRunner().invoke(main_as_command, ["--config", str(conf), "models", *args])
    return out.exit_code, out.output


def _export(path: Path, metadata: dict[str, str]) -> Path:
    rows = np.zeros((4 + 2, 21), np.float32)
    rows[:, 0] = [24, 16, 20, 10, 0.0, 0.9]
    rows_model(path, rows[None], np.zeros_like(rows)[None])
    model = onnx.load(str(path))
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(path))
    return path


def test_an_ultralytics_export_makes_a_card_that_runs(tmp_path: Path, samples: Path) -> None:
    (tmp_path / "models").mkdir()
    best = _export(tmp_path / "best.onnx", ULTRALYTICS)
    code, said = _init(tmp_path, "init", "mine", "--onnx", str(best))
    assert code == 0, said
    card = yaml.safe_load((tmp_path / "models" / "mine" / "model.yaml").read_text())
    assert card["task"] == "detect" and card["input"]["size"] == [32, 48] and card["input"]["name"] == "input"
    assert card["preprocess"]["resize"] == "letterbox" and card["preprocess"]["pad_value"] == 114
    assert card["postprocess"] == {"output": "output0", "layout": "yolov8", "threshold": 0.25, "iou": 0.7}
    assert "# inferred" in said and "2 class names (its metadata), read at start: dent, scratch" in said
    code, said = _init(tmp_path, "check", "mine")  # the card holds to the model, as a start does
    assert code == 0 and "model 'mine' (detect): ok" in said, said
    code, said = _init(tmp_path, "init", "mine", "--onnx", str(best))
    assert code == 2 and "exists: --force writes over it" in said
    seg = _export(tmp_path / "pose.onnx", {**ULTRALYTICS, "task": "pose", "kpt_shape": "[17, 3]"})
    assert _init(tmp_path, "init", "pose", "--onnx", str(seg))[0] == 0
    pose = yaml.safe_load((tmp_path / "models" / "pose" / "model.yaml").read_text())
    assert pose["postprocess"]["keypoints"] == [17, 3]


def test_an_export_without_metadata_needs_its_task(tmp_path: Path, effnet_onnx: Path) -> None:
    (tmp_path / "models").mkdir()
    shutil.copy(effnet_onnx, tmp_path / "effnet.onnx")
    code, said = _init(tmp_path, "init", "plain", "--onnx", str(tmp_path / "effnet.onnx"))
    assert code == 2 and "its metadata does not say what it does: give --task" in said and said.count("\n") == 1
    code, said = _init(tmp_path, "init", "plain", "--onnx", str(tmp_path / "effnet.onnx"), "--task", "classify")
    assert code == 0, said
    card = yaml.safe_load((tmp_path / "models" / "plain" / "model.yaml").read_text())
    assert card["input"] == {"name": "input", "size": [224, 224], "dynamic_batch": True}
    assert card["postprocess"] == {"output": "logits"} and "NOT inferred" in said
    code, said = _init(tmp_path, "check", "plain")
    assert code == 0, said
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    code, said = _init(tmp_path, "init", "junk", "--onnx", str(tmp_path / "junk.onnx"), "--task", "detect")
    assert code == 2 and "not an ONNX model" in said


def test_models_check_shows_the_concrete_shape_of_a_dynamic_export(tmp_path: Path) -> None:
    """A dynamic export declares its height and width as symbols (Ultralytics' as long expressions): `models
    check` shortens those and says the shape one image at the card's size gets; the card `init` writes for it
    letterboxes each image to its own size, as Ultralytics' predict() does for such an export (rect)."""
    (tmp_path / "models").mkdir()
    best = _export(tmp_path / "best.onnx", ULTRALYTICS)
    model = onnx.load(str(best))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "height", "floor(width / 32 + 0.5) * 32 - 0"  # a long expression
    onnx.save(model, str(best))
    assert _init(tmp_path, "init", "dyn", "--onnx", str(best))[0] == 0
    code, said = _init(tmp_path, "check", "dyn")
    assert code == 0 and "input  input tensor(float) [N, 3, height, ?] (one image at the card's size: " \
        "[1, 3, 32, 48]; rect: each image's own, sides padded to a multiple of 32)" in said, said


def test_a_card_is_written_where_the_user_works_and_never_among_workers_own(tmp_path: Path, monkeypatch) -> None:
    """No config file: models/ in the current folder; with one: models/ beside it; --models-dir: there. Worker's
    own cards (a checkout's models/, or a wheel's copy) are refused, and the card's path is normalised."""
    from worker.cli import cli
    from worker.models.lookup import bundled_cards

    work = tmp_path / "work"
    (work / "exports").mkdir(parents=True)
    best = _export(work / "exports" / "best.onnx", ULTRALYTICS)
    monkeypatch.chdir(work / "exports")
    monkeypatch.delenv("WORKER_CONFIG", raising=False)
    r = CliRunner()
    out = r.invoke(cli, ["models", "init", "here", "--onnx", "../exports/best.onnx"])
    assert out.exit_code == 0, out.output
    card = yaml.safe_load((work / "exports" / "models" / "here" / "model.yaml").read_text())
    assert card["onnx"] == str(best)  # no "..": the file itself
    (work / "line3").mkdir()
    (work / "line3" / "config.yaml").write_text("model: beside\n")
    out = r.invoke(cli, ["--config", str(work / "line3" / "config.yaml"), "models", "init", "beside", "--onnx",
                         str(best)])
    assert out.exit_code == 0 and (work / "line3" / "models" / "beside" / "model.yaml").is_file(), out.output
    listed = r.invoke(cli, ["--config", str(work / "line3" / "config.yaml"), "models", "list"])
    assert f"your cards:    {work / 'line3' / 'models'}\n" in listed.output, listed.output
    assert re.search(r"^beside +detect +yours ", listed.output, re.M) and not re.search(r"^here ", listed.output, re.M)
    out = r.invoke(cli, ["models", "init", "there", "--onnx", str(best), "--models-dir", str(work / "cards")])
    assert out.exit_code == 0 and (work / "cards" / "there" / "model.yaml").is_file(), out.output
    out = r.invoke(main_as_command, ["models", "init", "bad", "--onnx", str(best), "--models-dir", str(bundled_cards())])
    assert out.exit_code == 2 and "holds the cards that come with worker" in out.output, out.output
    assert not (bundled_cards() / "bad").exists()
    # a name is one folder's: `..` or a path would reach any folder, worker's own cards too
    for name in ("../../evil", "/tmp/abs", ".hidden", f"../../{bundled_cards().parent.name}/models/zz"):
        out = r.invoke(main_as_command, ["models", "init", name, "--onnx", str(best)])
        assert out.exit_code == 2 and "a card's name is the name of its folder" in out.output, (name, out.output)
    assert not (tmp_path / "evil").exists() and not (bundled_cards() / "zz").exists()
    out = r.invoke(main_as_command, ["run", str(work), "--model", "../exports/models/here"])
    assert out.exit_code == 2 and "a card's name is the name of its folder" in out.output, out.output
