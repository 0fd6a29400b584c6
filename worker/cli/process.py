"""The commands that process images: `watch`, `run` and `demo`."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import click

from worker.cli.group import cli, inputs_option, load_config, metrics_port_option, pages_option, with_paths
from worker.cli.render import print_summary
from worker.cli.signals import two_stage_stop


@cli.command()
@with_paths(inbox="Folder to watch (overrides config); it must exist, unless --create.")
@click.option("--create", is_flag=True, help="Make the inbox if it does not exist (config: watch.create_inbox).")
@inputs_option
@pages_option
@metrics_port_option
@click.pass_context
def watch(ctx: click.Context, create: bool, **overrides: Any) -> None:
    """Watch the inbox and process every image that arrives; Ctrl-C stops.

    Once its outcome is recorded, each input moves to <archive>/done/ or <archive>/failed/ (or, with
    --inputs, is deleted or kept). An inbox on a network share (NFS, SMB) is polled: see watch.observer
    in config.yaml.

    \b
    Example:
      worker watch --inbox /srv/scans/in --outbox /srv/scans/out
      worker watch --metrics-port 9464
    """
    from worker.service import watch as watch_inbox

    cfg = load_config(ctx, **overrides)
    if create:
        cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, create_inbox=True))
    with two_stage_stop() as stop:
        summary = watch_inbox(cfg, stop)
    print_summary(summary)


@cli.command("run")
@click.argument("folder", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@with_paths()
@inputs_option
@pages_option
@metrics_port_option
@click.pass_context
def run_cmd(ctx: click.Context, folder: Path, no_progress: bool, **overrides: Any) -> None:
    """Process every image under FOLDER once; a rerun skips images already done.

    FOLDER is left as it is, unless --inputs move (to <archive>/done|failed/) or delete.

    \b
    Example:
      worker run ./overnight --outbox ./results
      worker run ./scanned-documents --model ppocr-det --pages all
    """
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from worker.service import run_folder

    tqdm.monitor_interval = 0  # no monitor thread: the bar is updated from our finish thread

    cfg = load_config(ctx, **overrides)
    bar = tqdm(total=0, unit="img", disable=no_progress or None, file=sys.stderr)

    def set_total(n: int) -> None:
        bar.total = n
        bar.refresh()

    try:  # log lines printed above the bar, not into it
        with two_stage_stop() as stop, logging_redirect_tqdm(tqdm_class=tqdm):
            summary = run_folder(cfg, folder, stop, progress=bar.update, total=set_total)
    finally:
        bar.close()
    print_summary(summary)
    for earlier, n in summary.figures.get("earlier_outboxes", {}).items():
        click.echo(f"  {n} of the done images were done before into {earlier}: done again into this outbox "
                   f"(the outputs there are left as they are)")
    if summary.figures["failed"]:
        click.echo(f"  failures: worker query --status failed --run {summary.run_id}")
    if others := summary.figures.get("not_images"):
        counts = ", ".join(f"{ext} {n}" for ext, n in others.items())
        click.echo(f"  left alone: {sum(others.values())} files whose names are not images' ({counts}); "
                   f"`extensions` in the config lists the names taken")
    if not summary.figures["images"]:
        click.echo(f"  note: no image under {folder.absolute()} (names ending {' '.join(cfg.extensions)}; "
                   f"hidden and temporary names are left alone)")


@cli.command()
@with_paths(archive=False)
@click.pass_context
def demo(ctx: click.Context, **overrides: Any) -> None:
    """Pull the models and the sample images, then `run` each model over them.

    Runs the three bundled cards (text masks, ImageNet labels, COCO boxes), or only --model,
    each into <outbox>/<model>/, with an overlay per image (<name>.overlay.jpg: the result drawn on it).

    \b
    Example:
      worker demo
    """
    from worker.service import DEMO_MODELS, demo as run_demo, describe

    model = overrides.pop("model")
    cfg = load_config(ctx, **overrides)
    folder, summaries = run_demo(cfg, (model,) if model else DEMO_MODELS)
    click.echo(f"sample images: {folder}")
    for s in summaries:
        print_summary(s)
        box = s.outbox
        for image in sorted(p.name for p in folder.iterdir()):
            click.echo(f"    {image:<22} {describe(box, image)}")
    click.echo("look at the results drawn on the images: "
               + ", ".join(f"{s.outbox}/*.overlay.jpg" for s in summaries))
    click.echo("the results as data: worker query; timings and memory: worker stats")
