"""How commands print: summaries, tables, JSON and CSV, and the small formatting rules they share."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Sequence

import click

from worker.errors import WorkerError
from worker.host.names import printable


def print_summary(summary: Any) -> None:
    f = summary.figures
    click.echo(f"run {summary.run_id} ({summary.mode}, model {summary.model}, providers {','.join(summary.providers)})")
    taken = f", {f['taken']} left to another worker that had them" if f.get("taken") else ""
    unread = f"; {f['skipped_unread']} known by their unchanged files, not read" if f.get("skipped_unread") else ""
    pages = f" ({f['pages']} pages)" if f.get("pages", f["done"]) != f["done"] else ""
    click.echo(f"  images {f['images']}: done {f['done']}{pages}, failed {f['failed']}, skipped {f['skipped']} "
               f"(already done{unread}){taken}")
    latency = f"latency ms p50 {f['p50']} p95 {f['p95']} p99 {f['p99']}" if f["done"] else "no image done"
    if f.get("given_back"):
        click.echo(f"  given back: {f['given_back']} claimed but not started when stopped (queued for the next "
                   f"start; no attempt counted)")
    click.echo(f"  {f['images_per_s']} images/s over {f['seconds']} s; {latency}")
    click.echo(f"  outbox:   {summary.outbox}")
    if summary.inputs:
        click.echo(f"  inputs:   {summary.inputs}")
    click.echo(f"  database: {summary.db}")


def emit_rows(rows: list[dict[str, Any]], fmt: str, columns: list[str], more: Sequence[str] = ()) -> None:
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
    if isinstance(v, float):  # four significant digits, never an exponent (1.699e+04 ms is 16990 ms)
        return f"{v:.4g}" if 1e-3 <= abs(v) < 1e4 or v == 0 else f"{v:.0f}" if abs(v) >= 1e4 else \
            f"{v:.6f}".rstrip("0").rstrip(".")
    s = printable(str(v))  # a name's newline would break the table's rows (the JSON and CSV keep it)
    # only the error is cut to keep a table readable (the JSON and CSV have it whole); a path never is:
    # its end, the file's name, is what the reader looks for
    return s if column != "error" or len(s) <= 60 else s[:57] + "..."


def write_file(path: Path, text: str) -> None:
    """A file a command was asked to write (-o, --json), whole or not at all: whoever reads it never
    finds half of it; a path that cannot be written is one line, not a traceback."""
    from worker.outputs.files import write_atomic

    try:
        write_atomic(path, text.encode())
    except OSError as e:  # a folder of that name, no permission, disk full
        raise WorkerError(f"cannot write {path}: {e.strerror or e}") from None


def nan_to_none(value: Any) -> Any:
    """NaN (a run with no image done, too few samples for a slope) as None: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nan_to_none(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def or_dash(value: Any, spec: str = "") -> str:
    """A figure, or '-' where there is none (None from the database, NaN from too few samples)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def resolution(memory: dict[str, Any], limit: float) -> str:
    """'; its 20 s resolve only slopes above about 180 MB/h' where a run's second half after warm-up was
    too short (or RSS wandered too much) to tell a slope of `limit` from noise, as `worker soak` judges it;
    nothing where it was long enough. A 75-second run's -1390 MB/h is not a trend."""
    from worker.measure.metrics import resolvable_slope

    if math.isnan(memory.get("late_slope_mb_per_h", math.nan)):
        return ""
    resolved, _, _ = resolvable_slope(memory)
    if resolved <= limit:
        return ""
    span = memory.get("late_span_s", 0.0)
    window = f"{span / 60:.0f} min" if span >= 60 else f"{span:.0f} s"
    return f"; its {window} resolve only slopes above about {resolved:.0f} MB/h" if math.isfinite(resolved) \
        else "; too short to resolve a slope"


def plus_minus(se: Any) -> str:
    """' +- 1.94' after a slope with its standard error, nothing where there is none."""
    return "" if or_dash(se) == "-" else f" +- {se:.2f}"


def clock(seconds: float) -> str:
    """1:02:03 for 3723 s."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def yaml_value(value: Any) -> str:
    """A value as config.yaml writes it: true/false, [a, b], numbers and text as they are."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(map(yaml_value, value)) + "]"
    return str(value)
