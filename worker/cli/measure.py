"""The commands that measure the worker: `soak` and `bench`."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import click

from worker import config as config_mod
from worker.errors import ConfigError

from worker.cli.args import duration_s
from worker.cli.group import cli, load_config, with_paths
from worker.cli.render import clock, or_dash, plus_minus, write_file
from worker.cli.signals import two_stage_stop


@cli.command()
@click.option("--duration", default="2h", show_default=True, help="How long to run: 90s, 30m, 2h, 1d.")
@click.option("--images", "images", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="Folder of images to replay.")
@click.option("--warmup", default=None, help="Left out of the RSS slope (default: metrics.warmup_s).")
@click.option("--report", "report_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Write the soak's report (worker report, with its verdict) here (default: soak-report.html in "
                   "its outbox).")
@with_paths(archive=False)
@click.pass_context
def soak(ctx: click.Context, duration: str, images: Path, warmup: str | None, report_path: Path | None,
         **overrides: Any) -> None:
    """Replay images through the full pipeline for a long time and judge memory and latency.

    Writes into an outbox and a database of its own (a new soak-<time>/ folder beside the config's
    outbox) unless --outbox and --db are given; it never replaces another run's outputs or history.
    Says how it goes every 30 s (images, rate, RSS now, its slope so far), then prints the RSS slope
    (MB/hour, least squares after warm-up, and over the second half of that, which is judged),
    growth, and p50/p99 latency at the start and the end, and writes its report (`worker report`'s
    HTML file, its verdict first) into its outbox. Exits 1 when a soak.* threshold in the
    config is exceeded (FAIL), or when the run is too short to tell a slope at the limit from RSS
    noise (INCONCLUSIVE, with the duration that would).

    \b
    Example:
      worker soak --duration 2h --images ./samples --model efficientnet-lite0
    """
    from worker.measure.soak import PROGRESS_S, SoakProgress, soak as run_soak, soak_workspace

    def said(p: SoakProgress) -> None:
        slope = "slope so far: after the warm-up" if math.isnan(p.slope_mb_per_h) else \
            f"slope so far {p.slope_mb_per_h:+.2f} MB/h"
        click.echo(f"soak {clock(p.elapsed_s)} of {clock(p.duration_s)}: {p.images} images "
                   f"({p.images_per_s:.1f}/s), RSS {p.rss_mb:.1f} MB, {slope}", err=True)

    cfg = soak_workspace(load_config(ctx, **overrides), outbox_given=overrides.get("outbox") is not None,
                         db_given=overrides.get("db") is not None)
    click.echo(f"soak: outbox {cfg.outbox}, database {config_mod.without_password(cfg.db)}", err=True)
    seconds = duration_s(duration, positive=True)
    with two_stage_stop() as stop:  # a short soak says how it goes ten times
        v = run_soak(cfg, images, seconds, stop, warmup_s=duration_s(warmup) if warmup else None, progress=said,
                     progress_s=min(PROGRESS_S, max(1.0, seconds / 10)))
    click.echo(f"soak run {v.run_id}: {v.images} images in {v.seconds} s ({v.images / max(v.seconds, 1e-9):.1f} images/s)")
    if math.isnan(v.rss_slope_mb_per_h):  # the run ended within the warm-up: no trend to print
        click.echo(f"  RSS: peak {v.rss_peak_mb} MB; {v.samples} samples after the warm-up, too few for a slope")
    else:
        click.echo(f"  RSS after warm-up: {v.rss_start_mb} -> {v.rss_end_mb} MB (growth {v.rss_end_mb - v.rss_start_mb:+.1f} MB, "
                   f"peak {v.rss_peak_mb} MB), slope {v.rss_slope_mb_per_h:.2f} MB/h over {v.samples} samples, "
                   f"{or_dash(v.rss_late_slope_mb_per_h, '.2f')}{plus_minus(v.rss_late_slope_se_mb_per_h)} MB/h "
                   f"over their second half (judged)")
    click.echo(f"  latency ms: start p50 {or_dash(v.p50_start_ms, '.1f')} p99 {or_dash(v.p99_start_ms, '.1f')}; "
               f"end p50 {or_dash(v.p50_end_ms, '.1f')} p99 {or_dash(v.p99_end_ms, '.1f')}")
    for note in v.notes:
        click.echo(f"  note: {note}")
    click.echo(f"  its figures: worker stats --db {config_mod.without_password(cfg.db)} --run {v.run_id}")
    from worker.report.make import write_report

    reasons = "; ".join(v.failures or v.inconclusive)
    written = write_report(cfg.db, report_path or cfg.outbox / "soak-report.html", cfg.outbox.absolute(),
                           run_ids=(v.run_id,),
                           max_slope_mb_per_h=cfg.soak.max_rss_slope_mb_per_h,
                           verdict=v.verdict + (f": {reasons}" if reasons else ""))
    click.echo(f"  its report: {written.path}")
    if v.passed:
        click.echo("  verdict: PASS (memory and latency flat within the configured limits)")
    else:
        for reason in v.failures or v.inconclusive:
            click.echo(f"  verdict: {v.verdict}: {reason}")
        sys.exit(1)


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
    from worker.measure.bench import run_bench
    from worker.measure.bench.results import as_dicts, verdicts
    from worker.service import DEMO_MODELS

    cfg = load_config(ctx)
    if json_out is not None:  # its folder made now: one that cannot be is said before the bench's minutes
        try:
            json_out.absolute().parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--json {json_out}: cannot make its folder: {e.strerror or e}") from None
    results = run_bench(cfg, models or DEMO_MODELS, widths or (640, 1920), count, click.echo, rounds)
    if json_out is not None:
        write_file(json_out, json.dumps(as_dicts(results), indent=1))
    if check and not all(v.met for v in verdicts(results)):
        sys.exit(1)
