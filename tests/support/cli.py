"""The CLI as the tests drive it: a config file with every writable path in a test folder, `worker run` over
sample images, and `main()` as the console script runs it."""

from __future__ import annotations

import shutil
from pathlib import Path

import click
from click.testing import CliRunner

from tests.conftest import CACHE, ROOT
from worker.cli import cli


def config_file(tmp_path: Path, models_dir: Path | None = None) -> Path:
    """tmp_path/config.yaml: paths in tmp_path, the bundled cards (or those of `models_dir`), the test cache."""
    p = tmp_path / "config.yaml"
    p.write_text(f"inbox: inbox\noutbox: outbox\narchive: archive\ndb: sqlite:///worker.db\n"
                 f"models_dir: {models_dir or ROOT / 'models'}\ncache_dir: {CACHE}\n"
                 f"watch: {{settle_s: 0.3, create_inbox: true}}\nmetrics: {{memory_sample_s: 0.5}}\n")
    return p


def cli_run(tmp_path: Path, samples: Path, names: tuple[str, ...], config: str) -> tuple[Path, CliRunner]:
    """`worker run` through the CLI over copies of sample images, with `config` added to the test config."""
    conf = config_file(tmp_path)
    conf.write_text(conf.read_text() + config)
    folder = tmp_path / "in"
    folder.mkdir()
    for name in names:
        shutil.copy(samples / name, folder / name)
    r = CliRunner()
    out = r.invoke(cli, ["--config", str(conf), "run", str(folder), "--no-progress"])
    assert out.exit_code == 0, out.output
    return conf, r


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def main_as_command(ctx: click.Context) -> None:
    """`main()` (the console script: a WorkerError as one `error:` line and its exit code) under CliRunner."""
    import sys

    from worker.cli.group import main

    sys.argv = ["worker", *ctx.args]
    main()
