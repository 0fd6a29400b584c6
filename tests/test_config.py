"""Config loading: defaults, documented keys, and errors that name the file, key and expectation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from worker.config import Config, load
from worker.errors import ConfigError
from worker.service import run_folder


def test_project_config_equals_defaults() -> None:
    cfg = load(ROOT / "config.yaml")
    defaults = load(None)
    for f in dataclasses.fields(Config):
        if f.name in ("source",) or isinstance(getattr(cfg, f.name), Path) or f.name == "db":
            continue
        assert getattr(cfg, f.name) == getattr(defaults, f.name), f.name


def test_every_key_is_documented_in_config_yaml() -> None:
    text = (ROOT / "config.yaml").read_text()
    raw = yaml.safe_load(text)
    flat = Config().as_dict()
    for key in flat:
        head, _, tail = key.partition(".")
        if key in ("source", "models_dir", "cache_dir"):
            continue
        assert head in raw and (not tail or tail in raw[head]), f"{key} missing from config.yaml"
    for key in ("models_dir", "cache_dir"):  # their defaults are worker's own, not a folder beside the file
        assert f"\n# {key}: " in text and key not in raw, key


def test_the_template_works_wherever_it_is_written(tmp_path: Path, monkeypatch) -> None:
    """`worker config --template > config.yaml` in a new folder: the cards and cache are still worker's own
    (they were resolved against the new folder, which has no models/)."""
    from click.testing import CliRunner

    from worker.cli import cli

    monkeypatch.chdir(tmp_path)
    r = CliRunner()
    (tmp_path / "config.yaml").write_text(r.invoke(cli, ["config", "--template"]).stdout)
    cfg = load(tmp_path / "config.yaml")
    assert cfg.models_dir == load(None).models_dir and cfg.cache_dir == load(None).cache_dir
    listed = r.invoke(cli, ["models", "list"])
    assert listed.exit_code == 0 and "efficientnet-lite0" in listed.stdout, listed.output


def test_relative_paths_resolve_against_the_config_folder(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("inbox: in\ndb: sqlite:///w.db\n")
    cfg = load(p)
    assert cfg.inbox == tmp_path / "in" and cfg.db == f"sqlite:///{tmp_path / 'w.db'}"


@pytest.mark.parametrize("text, needle", [
    ("inboxx: x\n", "unknown key 'inboxx'"),
    ("pipeline:\n  max_batch: four\n", "'pipeline.max_batch' must be a non-negative integer"),
    ("watch:\n  observer: fast\n", "'watch.observer' must be one of auto, native, polling"),
    ("engine: [1]\n", "engine: expected a mapping"),
    ("engine:\n  require_gpu: 1\n", "'engine.require_gpu' must be true or false"),
    ("inbox: [\n", "not valid YAML"),
    # 0 where it means nothing sensible: a sampler or a poller that never sleeps, a retried image quarantined untried
    ("metrics:\n  memory_sample_s: 0\n", "'metrics.memory_sample_s' must be more than 0, got 0"),
    ("watch:\n  poll_interval_s: 0.0\n", "'watch.poll_interval_s' must be more than 0, got 0.0"),
    ("pipeline:\n  max_attempts: 0\n", "'pipeline.max_attempts' must be more than 0, got 0"),
    ("metrics:\n  low_disk_percent: 150\n", "'metrics.low_disk_percent' must be at most 100, got 150"),
    ("watch:\n  settle_s: .inf\n", "'watch.settle_s' must be a non-negative number, got inf"),  # never settles
    ("watch:\n  incomplete_s: .nan\n", "'watch.incomplete_s' must be a non-negative number, got nan"),
])
def test_errors_name_file_and_key(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(p)
    assert str(p) in str(e.value) and needle in str(e.value)


def test_a_number_in_exponent_form_is_the_number_it_says(tmp_path: Path) -> None:
    """PyYAML (YAML 1.1) reads 5e-1 and 2e3 as strings: `max_delay_ms: 5e-1` was refused as "must be a
    non-negative number, got '5e-1'". Such a string is the number; a word or a negative one is still refused."""
    p = tmp_path / "c.yaml"
    p.write_text("pipeline:\n  max_delay_ms: 5e-1\nwatch:\n  settle_s: 2E0\n  rescan_interval_s: 3e+1\n")
    cfg = load(p)
    assert (cfg.pipeline.max_delay_ms, cfg.watch.settle_s, cfg.watch.rescan_interval_s) == (0.5, 2.0, 30.0)
    for bad in ("-5e-1", "5e", "e5", "fast"):
        p.write_text(f"pipeline:\n  max_delay_ms: {bad}\n")
        with pytest.raises(ConfigError, match="'pipeline.max_delay_ms' must be a non-negative number"):
            load(p)


def test_paths_expand_home_and_environment_variables_and_refuse_unset_ones(tmp_path: Path, monkeypatch) -> None:
    """`$SCANS/inbox` in a config made a folder literally named `$SCANS` beside the config file; it is
    expanded as a shell or a systemd unit would, ~ too, and a variable that is not set is refused."""
    monkeypatch.setenv("S31_SCANS", str(tmp_path / "scans"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("S31_NOT_SET", raising=False)
    conf = tmp_path / "c" / "config.yaml"
    conf.parent.mkdir()
    conf.write_text("inbox: $S31_SCANS/in\noutbox: ${S31_SCANS}/out\narchive: ~/archive\n"
                    "db: sqlite:///$S31_SCANS/worker.db\n")
    cfg = load(conf)
    assert (cfg.inbox, cfg.outbox, cfg.archive) == (tmp_path / "scans" / "in", tmp_path / "scans" / "out",
                                                    tmp_path / "home" / "archive")
    assert cfg.db == f"sqlite:///{tmp_path / 'scans' / 'worker.db'}"
    conf.write_text("outbox: ${S31_NOT_SET}/out\n")
    with pytest.raises(ConfigError, match=r"config.yaml: 'outbox' \(\$\{S31_NOT_SET\}/out\) names the environment "
                                          r"variable \$\{S31_NOT_SET\}, which is not set"):
        load(conf)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load(tmp_path / "nope.yaml")


def test_missing_model_and_unwritable_outbox(cfg, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    with pytest.raises(ConfigError, match="model 'nope': no card at .*known models: .*ppocr-det"):
        run_folder(dataclasses.replace(cfg, model="nope"), folder)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    import os

    if os.geteuid() == 0:  # root writes anywhere: use a path below a file instead
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "out"
    else:
        target = locked / "out"
    with pytest.raises(ConfigError, match="'outbox'"):
        run_folder(dataclasses.replace(cfg, outbox=target), folder)
    with pytest.raises(ConfigError, match="must not be the input folder .* or inside it"):
        run_folder(dataclasses.replace(cfg, outbox=folder / "out"), folder)


def test_watch_into_its_own_inbox_is_refused_as_such(cfg, tmp_path: Path) -> None:
    """`worker watch --outbox` naming the inbox itself said `another worker watches into this outbox`:
    its own inbox lock was in the way. Now it is refused for what it is, before any lock."""
    import threading

    from worker.service import watch

    inbox = tmp_path / "in"
    for outbox, archive in ((inbox, tmp_path / "archive"), (tmp_path / "out", inbox / "archive")):
        bad = dataclasses.replace(cfg, inbox=inbox, outbox=outbox, archive=archive)
        with pytest.raises(ConfigError, match=f"must not be the input folder {inbox} or inside it"):
            watch(bad, threading.Event(), burst=True)
    (tmp_path / "a-file").write_text("")
    for path, why in ((tmp_path / "a-file", "is a file, not a folder"),
                      (tmp_path / "a-file" / "in", "cannot be created: Not a directory")):
        with pytest.raises(ConfigError, match=f"'inbox' \\({path}\\) {why}"):  # before: a traceback
            watch(dataclasses.replace(cfg, inbox=path), threading.Event(), burst=True)


def test_bundled_cards_and_cache_are_found_from_any_folder(tmp_path: Path, monkeypatch) -> None:
    """Started elsewhere, with no config file or one that does not set them, the worker finds the
    checkout's model cards after the user's own (models/ beside the file or in the cwd, there or not), and
    uses the checkout's model cache (other relative paths stay relative to the cwd or file)."""
    from worker.models.lookup import find_card

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORKER_CONFIG", raising=False)
    conf = tmp_path / "line3.yaml"
    conf.write_text("inbox: scans\nmodel: efficientnet-lite0\n")
    for cfg in (load(None), load(conf)):
        assert cfg.models_dir == tmp_path / "models" and cfg.cache_dir == ROOT / ".cache" / "worker"
        assert find_card(cfg.models_dir, "efficientnet-lite0").folder == ROOT / "models" / "efficientnet-lite0"
    # a card of the user's, of a bundled card's name, is the one used
    mine = tmp_path / "models" / "efficientnet-lite0"
    mine.mkdir(parents=True)
    (mine / "model.yaml").write_text((ROOT / "models" / "efficientnet-lite0" / "model.yaml").read_text())
    assert find_card(load(conf).models_dir, "efficientnet-lite0").folder == mine
    assert load(None).inbox == tmp_path / "var" / "inbox" and load(conf).inbox == tmp_path / "scans"
    conf.write_text("models_dir: cards\n")  # set: relative to the file, as every path
    assert load(conf).models_dir == tmp_path / "cards"


def test_a_config_file_saved_as_utf16_is_read_and_unreadable_ones_are_said(tmp_path: Path) -> None:
    """Windows Notepad's "Unicode" is UTF-16 with a byte-order mark; a folder or bytes that are no
    text at all gave tracebacks (IsADirectoryError, UnicodeDecodeError) from every command."""
    text = "model: yolov3-tiny\npipeline:\n  queue_size: 8\n"
    for encoding in ("utf-16", "utf-8-sig"):  # both write their byte-order mark
        p = tmp_path / f"{encoding}.yaml"
        p.write_bytes(text.encode(encoding))
        cfg = load(p)
        assert cfg.model == "yolov3-tiny" and cfg.pipeline.queue_size == 8, encoding
    with pytest.raises(ConfigError, match=f"{tmp_path}: cannot read the config file: Is a directory"):
        load(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"model: \xff\xfe\x00yolo\n")
    with pytest.raises(ConfigError, match=f"{bad}: not valid YAML: unacceptable character #x00ff"):
        load(bad)
