"""The commands that read what the worker recorded: `query`, `stats`, `health`, `fleet`, `report` and `export coco`."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import click

from worker.errors import CheckInputError, ConfigError

from worker.cli.args import duration_s, optional_time
from worker.cli.group import cli, db_option, label_filter, load_config, model_filter, path_filter, run_filter
from worker.cli.render import emit_rows, nan_to_none, or_dash, plus_minus, resolution, write_file


@cli.command()
@click.option("--status", type=click.Choice(["queued", "processing", "done", "failed"]))
@path_filter
@click.option("--since", help="Updated at or after: an ISO time (UTC if no zone) or an age back from now, e.g. 2h, 7d.")
@click.option("--until", help="Updated before: an ISO time or an age, as --since.")
@run_filter
@label_filter
@click.option("--min-score", type=float, help="Only images with a predicted class at or above this score.")
@model_filter
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
@db_option
@click.pass_context
def query(ctx: click.Context, status: str | None, path_glob: str | None, since: str | None, until: str | None,
          run_id: int | None, label: str | None, min_score: float | None, model: str | None, limit: int, fmt: str,
          db: str | None) -> None:
    """List images with their status, result and latency from the database.

    \b
    Example:
      worker query --status failed --format csv
      worker query --path 'line3/*' --label text --min-score 0.5
      worker query --since 2h --status failed
    """
    from worker.store.db import database
    from worker.store.queries import STAGES, Filters, query_images

    cfg = load_config(ctx, db=db)
    filters = Filters(status=status, path=path_glob, since=optional_time(since), until=optional_time(until),
                      run_id=run_id, min_score=min_score, label=label, model=model, limit=limit)
    with database(cfg.db, create=False, read_only=True) as engine:
        rows = query_images(engine, dataclasses.replace(filters, limit=limit + 1))  # one more: are there more?
    left_out = len(rows) > limit
    matched = ["matched_label", "matched_score"] if label is not None or min_score is not None else []
    if rows or fmt != "table":  # a table of no rows: no header either
        emit_rows(rows[1:] if left_out else rows, fmt, ["id", "run_id", "rel_path", "model", "status", "attempts", "top_label",
                                                "score", *matched, "total_ms", "updated_at", "error"],
              more=["created_at", "root", "outbox", *STAGES[:-1], "batch_size", "sha256", "json_path", "mask_path"])
    if left_out:  # after the rows, where a reader of a long table looks last
        click.echo(f"(the latest {limit} matching images, oldest first; --limit shows more)", err=True)
    if not rows:
        click.echo("no image matched" + (f" (--label {label!r}: any case, a class's whole name)" if label else ""),
                   err=True)
        sys.exit(1)


@cli.command()
@click.option("--run", "run_id", type=int, help="One run (default: the last --last runs).")
@click.option("--last", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@db_option
@click.option("--warmup", default=None, help="Left out of the RSS slopes: 90s, 10m (default: each run's own, "
                                            "metrics.warmup_s or a soak's --warmup).")
@click.option("--since", help="Only what happened at or after: an ISO time (UTC if no zone) or an age, e.g. 24h.")
@click.option("--until", help="Only what happened before: an ISO time or an age, as --since.")
@click.pass_context
def stats(ctx: click.Context, run_id: int | None, last: int, fmt: str, db: str | None, warmup: str | None,
          since: str | None, until: str | None) -> None:
    """Per-run counts, what the images held (labels, scores), throughput, latency and memory trend.

    \b
    Example:
      worker stats --last 3
      worker stats --run 12 --warmup 10m
      worker stats --since 24h     # a watcher of months: its last day
    """
    from worker.store.db import database
    from worker.store.stats import run_stats

    cfg = load_config(ctx, db=db)
    warm = duration_s(warmup) if warmup else None  # None: each run's own
    with database(cfg.db, create=False, read_only=True) as engine:
        runs = run_stats(engine, run_id=run_id, last=last, warmup_s=warm, since=optional_time(since), until=optional_time(until))
    if fmt == "json":
        click.echo(json.dumps(nan_to_none(runs), indent=1))
        return
    if not runs:
        click.echo("no run active in that window" if since or until else
                   "no runs on record yet (`worker run` or `worker watch` records one)")
    for r in runs:
        m = r["memory"]
        click.echo(f"run {r['run']} {r['mode']} model={r['model']} providers={r['providers']} "
                   f"started={r['started_at']} finished={r['finished_at'] or '-'}")
        if since or until:
            w = r["window"]
            click.echo(f"  only from {w['since'] or 'its start'} until {w['until'] or 'now'}")
        if r["health"]["state"] != "finished":
            click.echo(f"  state: {r['health']['detail']}")
        counted = "outcomes" if r["read_from"] == "tallies" else "counts"  # a replayed image counts each time
        click.echo(f"  {counted}: {json.dumps(r['counts'])}  images/s: {or_dash(r['images_per_s'])}  "
                   f"mean batch: {or_dash(r['batch_size_mean'])}")
        if r["results"]:
            click.echo(f"  {_results_line(r['results'])}")
        if r["batch_size_mean"] is None:
            click.echo("  latency: no image done")
        else:
            li = r["latency_images"]
            over = f"  (1 in {li['stride']} of {li['of']} images: {li['read']})" if li["stride"] > 1 else ""
            if r["read_from"] == "tallies":
                over = f"  (of {li['of']} images, read from the run's tallies: within 4%)"
            click.echo(f"  latency ms        p50       p95       p99{over}")
            for stage, p in r["latency_ms"].items():
                click.echo(f"  {stage:<15}{p['p50']:>8}  {p['p95']:>8}  {p['p99']:>8}")
        if m["samples"]:
            every = f" (1 in {m['sample_stride']} of {m['samples']})" if m["sample_stride"] > 1 else ""
            slopes = (f"slope {m['slope_mb_per_h']} MB/h over {m['steady_samples']} samples{every} after warm-up, "
                      f"{or_dash(m['late_slope_mb_per_h'])}{plus_minus(m.get('late_slope_se_mb_per_h'))} MB/h over "
                      f"their second half{resolution(m, cfg.soak.max_rss_slope_mb_per_h)}"
                      if not math.isnan(m["slope_mb_per_h"]) else
                      f"too few samples after the {m['warmup_s']:g} s warm-up for a slope (--warmup)")
            click.echo(f"  memory: RSS {m['rss_start_mb']} -> {m['rss_end_mb']} MB (peak {m['rss_peak_mb']}), {slopes}")
        if "gpu_peak_mb" in m:
            click.echo(f"  GPU memory: {m['gpu_start_mb']} -> {m['gpu_end_mb']} MB (peak {m['gpu_peak_mb']}), "
                       f"slope {or_dash(m['gpu_slope_mb_per_h'])} MB/h after warm-up")


_SCORES = {"classify": "top-1 probability", "detect": "best box's score", "segment": "mean mask probability"}
_LISTED_LABELS = 8  # the most frequent; the JSON lists them all


def _results_line(res: dict[str, Any]) -> str:
    """`stats`' line on what a run's done images held: the most frequent labels and the score."""
    n = res["images"]

    def share(k: int) -> str:
        return f"{k} ({100 * k / n:.1f}%)"

    listed = res["labels"][:_LISTED_LABELS]
    if res["task"] == "classify":
        found = "top label " + ", ".join(f"{lb['name']} {share(lb['images'])}" for lb in listed)
    elif res["task"] == "detect":
        found = "boxes of " + ", ".join(f"{lb['name']} {lb['boxes']} in {share(lb['images'])}" for lb in listed)
    else:
        found = "found " + ", ".join(f"{lb['name']} in {share(lb['images'])}" for lb in listed)
    more = len(res["labels"]) - len(listed)
    found = (found + (f" and {more} more" if more else "")) if listed else "nothing found"
    none = f"; nothing in {share(res['none'])}" if res["none"] and listed else ""
    p = res["score"]
    scores = (f"; {_SCORES.get(res['task'], 'score')} p5 {p['p5']}, p50 {p['p50']}, p95 {p['p95']}"
              if listed else "")
    return f"results: {n} images done; {found}{none}{scores}"


@cli.command()
@click.option("--inbox", type=click.Path(path_type=Path), help="The watched inbox (default: the config's).")
@click.option("--run", "run_id", type=int, help="This run instead (any mode).")
@click.option("--stalled-after", default="5m", show_default=True,
              help="Images in flight and none finished for this long: stalled (90s, 10m).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@db_option
@click.pass_context
def health(ctx: click.Context, inbox: Path | None, run_id: int | None, stalled_after: str, fmt: str,
           db: str | None) -> None:
    """Is the watcher running and making progress? Exit 0 if so, 1 if not (for monitors).

    Reads the database: the latest `watch` run on the inbox, its process and its memory samples
    (the heartbeat). States: running, stalled, gone (stopped without finishing), silent (another
    host's, no recent sample), finished. Also says when the outbox's, archive's or SQLite database's
    filesystem here is low on room (the exit status is the state's alone).

    \b
    Example:
      worker health --inbox /srv/scans/in
      worker health --run 12 --format json
    """
    from worker.service import low_disk
    from worker.store.db import database
    from worker.store.stats import other_watchers, run_health

    cfg = load_config(ctx, db=db, inbox=inbox)
    root = None if run_id is not None else str(cfg.inbox.absolute())
    with database(cfg.db, create=False, read_only=True) as engine:
        h = run_health(engine, run_id=run_id, root=root, stall_s=duration_s(stalled_after))
        # none on that inbox: the watchers this database knows, named
        others = other_watchers(engine, duration_s(stalled_after)) if h is None and run_id is None else []
    if h is None:
        what = f"run {run_id}" if run_id is not None else f"watch run on {root}"
        if fmt == "json":
            click.echo(json.dumps({"state": None, "detail": f"no {what} on record",
                                   "watchers": [o.as_dict() | {"inbox": inbox, "host": host}
                                                for o, inbox, host in others]}))
        else:
            click.echo(f"no {what} on record" + (": the watchers in this database are" if others else ""))
            for o, watched, host in others:
                click.echo(f"  run {o.run} on {host} watching {watched}: {o.state.value} "
                           f"(worker health --inbox {watched})")
        sys.exit(1)
    low = low_disk(cfg, cfg.inputs.watch)  # this host's filesystems the config writes to
    click.echo(json.dumps(h.as_dict() | {"low_disk": low}) if fmt == "json"
               else f"run {h.run} ({h.mode}) {h.detail}" + (f"; {low}" if low else ""))
    sys.exit(0 if h.state == "running" else 1)


@cli.group()
def export() -> None:
    """Export results in other formats.

    \b
    Example:
      worker export coco --run 3 -o detections.json
    """


@export.command("coco")
@run_filter
@path_filter
@label_filter
@click.option("--min-score", type=float, help="Only images with a box or region at or above this score.")
@click.option("--model", help="Detection or segmentation model whose results are exported; its card names the "
                             "categories (default: --run's model, else the config's).")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="File to write (default: standard output, when it is not a terminal).")
@db_option
@click.option("--outbox", type=click.Path(path_type=Path),
              help="Where the masks are (default: the outbox of the run that made each result).")
@click.option("--rle", is_flag=True, help="A segmenter's regions (an instance segmenter's masks) as run-length "
                                          "encodings (exact, holes included) instead of polygons.")
@click.pass_context
def export_coco(ctx: click.Context, run_id: int | None, path_glob: str | None, label: str | None,
                min_score: float | None, model: str | None, output: Path | None, db: str | None,
                outbox: Path | None, rle: bool) -> None:
    """Write detection or segmentation results as COCO JSON (images, categories, annotations with scores;
    a segmenter's regions, and an instance segmenter's boxes, with their polygons, traced from the masks
    in the outbox).

    \b
    Example:
      worker export coco --run 3 -o detections.json
      worker export coco --model ppocr-det --rle -o text-regions.json
    """
    from worker.outputs.coco import coco
    from worker.models.lookup import find_card
    from worker.models.pull import with_labels
    from worker.store.db import database
    from worker.store.queries import Filters, run_model

    cfg = load_config(ctx, db=db)
    with database(cfg.db, create=False, read_only=True) as engine:
        name = model or (run_model(engine, run_id) if run_id is not None else cfg.model)
        card = find_card(cfg.models_dir, name)
        if card.task not in ("detect", "segment"):
            raise ConfigError(f"model {card.name!r} is a {card.task} model: COCO export takes a detection or "
                              f"segmentation model's results (--model NAME)")
        card = with_labels(card, cfg.cache_dir)
        filters = Filters(run_id=run_id, path=path_glob, label=label, min_score=min_score, model=card.name,
                          limit=10**9)
        doc = coco(engine, filters, card.labels, card.task, outbox.absolute() if outbox else None, rle,
                   default_outbox=cfg.outbox)
    if not doc["images"]:
        run = f" in run {run_id}" if run_id is not None else ""
        click.echo(f"no done results of model {card.name!r}{run} match: nothing written", err=True)
        sys.exit(1)
    text = json.dumps(doc, indent=1)
    if output is None and sys.stdout.isatty():  # thousands of lines scrolling past help no one
        raise CheckInputError(f"the COCO JSON of {len(doc['images'])} images and {len(doc['annotations'])} "
                              f"annotations is for a file: -o FILE (or redirect: worker export coco > FILE)")
    if output is None:
        click.echo(text)
    else:
        write_file(output, text)
        click.echo(f"{output}: {len(doc['images'])} images, {len(doc['annotations'])} annotations")


@cli.command()
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@db_option
@click.pass_context
def fleet(ctx: click.Context, fmt: str, db: str | None) -> None:
    """The workers sharing this database (fleet mode): each run alive, its host, heartbeat, leases held and
    rate; each folder's queue by state and the host scanning it.

    \b
    Example:
      worker fleet --db postgresql+psycopg://worker@dbhost/worker
      worker fleet --format json
    """
    from worker.fleet.status import fleet_view
    from worker.store.db import database

    cfg = load_config(ctx, db=db)
    with database(cfg.db, create=False, read_only=True) as engine:
        view = fleet_view(engine, cfg.fleet.lease_s)
    if fmt == "json":
        click.echo(json.dumps(view.as_dict(), indent=2))
        return
    click.echo(f"{len(view.members)} run(s) alive")
    if view.members:
        columns = ["run", "host", "pid", "mode", "model", "heartbeat_s", "leases", "files/s", "folder"]
        emit_rows([{"run": m.run, "host": m.host, "pid": m.pid, "mode": m.mode, "model": m.model,
                    "heartbeat_s": m.heartbeat_s, "leases": m.leases, "files/s": m.rate, "folder": m.root}
                   for m in view.members], "table", columns)
    for f in view.folders:
        states = ", ".join(f"{k} {v}" for k, v in sorted(f.states.items())) or "empty"
        scanner = f"scanned by run {f.scanner} on {f.scanner_host}" if f.scanner is not None else "no scanner now"
        last = f"; last full scan {f.last_scan_s:g} s ago" if f.last_scan_s is not None else ""
        click.echo(f"{f.root} ({f.model}): {states}; {scanner}{last}")


@cli.command()
@click.option("--run", "run_ids", type=int, multiple=True, help="A run (repeatable; default: the latest).")
@click.option("--last", type=click.IntRange(min=1), default=1, show_default=True, help="The last K runs.")
@click.option("--since", help="The runs active at or after: an ISO time (UTC if no zone) or an age, e.g. 7d.")
@click.option("--until", help="The runs started before: an ISO time or an age, as --since.")
@click.option("--model", help="Only runs of this model.")
@click.option("--warmup", default=None, help="Left out of the memory trends: 90s, 10m (default: each run's own, "
                                            "metrics.warmup_s or a soak's --warmup).")
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False), default=Path("report.html"),
              show_default=True, help="The HTML file to write.")
@db_option
@click.pass_context
def report(ctx: click.Context, run_ids: tuple[int, ...], last: int, since: str | None, until: str | None,
           model: str | None, warmup: str | None, output: Path, db: str | None) -> None:
    """Write one self-contained HTML file of what the database knows of some runs: throughput, latency
    over time and by stage, memory with its trend after the warm-up and the verdict, failures by reason,
    labels and scores, and a gallery of the slowest, failed and done images. It opens offline, from the
    file, in any browser.

    \b
    Example:
      worker report -o night.html
      worker report --last 3 --model efficientnet-lite0
      worker report --run 4 --run 7 -o compared.html
    """
    from worker.report.make import write_report

    cfg = load_config(ctx, db=db)
    written = write_report(cfg.db, output, cfg.outbox.absolute(), run_ids=run_ids, last=last,
                           since=optional_time(since), until=optional_time(until), model=model,
                           warmup_s=duration_s(warmup) if warmup else None,
                           max_slope_mb_per_h=cfg.soak.max_rss_slope_mb_per_h)
    click.echo(f"wrote {written.path} ({written.size // 1024} KB): run(s) {', '.join(map(str, written.runs))}, "
               f"{written.images} images")
