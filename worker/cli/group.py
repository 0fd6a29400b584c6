"""The `worker` command group: its global options and logging, the options commands share, the
configuration a command runs with, and `main`, which turns the errors users make into one line."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import click

from worker import config as config_mod
from worker.config import Config, InputAction, Pages
from worker.errors import WorkerError
from worker.host.names import printable


log = logging.getLogger("worker")


def load_config(ctx: click.Context, inputs: InputAction | None = None, pages: Pages | None = None,
                metrics_port: int | None = None, **overrides: Any) -> Config:
    cfg = config_mod.load(ctx.obj["config_path"]).with_overrides(**overrides)
    if metrics_port is not None:  # --metrics-port
        cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, port=metrics_port))
    if inputs is not None:  # --inputs: for the command it is given to (watch or run)
        field: dict[str, Any] = {str(ctx.command.name): inputs}
        cfg = dataclasses.replace(cfg, inputs=dataclasses.replace(cfg.inputs, **field))
    if pages is not None:  # --pages
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, pages=pages))
    return cfg


def with_paths(*, inbox: str | None = None, archive: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The path options a command takes: --inbox (worded for the command; None: not taken), --outbox,
    --archive (unless False), --db and --model."""
    options = [
        *([click.option("--inbox", type=click.Path(path_type=Path), help=inbox)] if inbox else []),
        click.option("--outbox", type=click.Path(path_type=Path), help="Where results go (overrides config)."),
        *([click.option("--archive", type=click.Path(path_type=Path),
                        help="Where processed inputs go (see --inputs).")] if archive else []),
        click.option("--db", "db", help="Database URL, e.g. sqlite:///var/worker.db (overrides config)."),
        click.option("--model", help="Model card name under models/ (overrides config)."),
    ]

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        for opt in reversed(options):
            f = opt(f)
        return f

    return decorate


inputs_option = click.option(
    "--inputs", type=click.Choice(["move", "keep", "delete"]),
    help="What becomes of each input once recorded: move (to the archive), keep, or delete (done ones; failed "
         "ones are moved to the archive). Default: config inputs.watch (move) or inputs.run (keep).")


metrics_port_option = click.option(
    "--metrics-port", type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics on this port (/metrics, on metrics.host, 127.0.0.1 by default); 0: none. "
         "Default: config metrics.port (0).")

pages_option = click.option(
    "--pages", type=click.Choice(["first", "all"]),
    help="A multi-page file (TIFF pages, GIF/WebP/PNG frames): its first page only, or every page, one result "
         "listing them. Default: config pipeline.pages (first).")


# options the database commands share, worded once (a click option decorator makes a new Option each use)
db_option = click.option("--db", "db", help="Database URL (overrides config).")


path_filter = click.option("--path", "path_glob", help="Glob on the relative path, e.g. 'line3/*.png', or on the "
                                                        "file's full path when it starts with /.")


run_filter = click.option("--run", "run_id", type=int, help="Only images last touched by this run.")


model_filter = click.option("--model", help="Only images processed with this model card.")


label_filter = click.option("--label", help="Only images with this predicted class name (any case).")


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`worker --version`: what a bug report needs, read from the installed packages (onnxruntime not imported)."""
    if not value or ctx.resilient_parsing:
        return
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from worker import __version__

    builds = []
    for dist in ("onnxruntime", "onnxruntime-gpu"):
        with contextlib.suppress(PackageNotFoundError):
            builds.append(f"{dist} {version(dist)}")
    click.echo(f"worker {__version__} ({', '.join(builds) or 'no onnxruntime installed'}, "
               f"Python {platform.python_version()})")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the worker's, onnxruntime's and Python's versions and exit.")
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="Config file (default: $WORKER_CONFIG, else ./config.yaml, else built-in defaults).")
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
@click.pass_context
def cli(ctx: click.Context, config_path: Path | None, verbose: bool) -> None:
    """Hot-folder ONNX inference worker.

    \b
    Example:
      worker run ./images --model ppocr-det
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    logging.getLogger("alembic").setLevel(logging.WARNING)
    ctx.obj = {"config_path": config_path or config_mod.default_config_path()}


class _OneLineFormatter(logging.Formatter):
    """One line per message: control characters in it (a file name's newline, an escape sequence) are
    escaped, so that no name can forge a log line or drive the terminal; a traceback still follows."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


def main() -> None:
    from sqlalchemy.exc import DBAPIError

    try:
        cli(standalone_mode=True)
    except WorkerError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except DBAPIError as e:  # a command's own statement refused (`retry` by an account that may only read)
        from worker.store.db import refused_write_hint

        click.echo(f"error: database: {e.orig}{refused_write_hint(e)}", err=True)
        sys.exit(1)
