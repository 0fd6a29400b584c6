"""The report's page: one HTML file that holds everything it shows (charts as inline SVG, thumbnails as base64
JPEG, no script, no network), and its figures as JSON (`<script type="application/json" id="report-data">`)."""

from __future__ import annotations

import base64
import html
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from worker import __version__
from worker.measure.metrics import judge_memory
from worker.outputs.outbox import output_rel
from worker.report import charts
from worker.report.data import Pictured, ReportData

THUMB_PX = 180
_VERDICT_CSS = {"PASS": "ok", "INCONCLUSIVE": "unsure", "FAIL": "bad"}
STYLE = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
.figures td:first-child{color:#555}.gallery{display:flex;flex-wrap:wrap;gap:10px}
.gallery figure{margin:0;width:190px;font-size:12px;word-break:break-all}.gallery img{max-width:180px;max-height:180px}
.verdict{font-weight:bold}.ok{color:#176117}.bad{color:#a61b1b}.unsure{color:#8a5300}svg{max-width:100%;height:auto}"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{_e(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{v if isinstance(v, _Html) else _e(v)}</td>" for v in r.values()) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


class _Html(str):
    """Markup put in a table cell as it is."""


def _thumbnail(path: Path | None) -> str | None:
    if path is None:
        return None
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        return None
    scale = THUMB_PX / max(image.shape[:2])
    if scale < 1:
        image = cv2.resize(image, (max(1, round(image.shape[1] * scale)), max(1, round(image.shape[0] * scale))),
                           interpolation=cv2.INTER_AREA)
    ok, jpg = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 80])
    return base64.b64encode(np.asarray(jpg).tobytes()).decode() if ok else None


def _gallery(items: list[Pictured]) -> str:
    if not items:
        return "<p>none</p>"
    out = []
    for p in items:
        b64 = _thumbnail(p.picture)
        img = f'<img alt="{_e(p.rel)}" src="data:image/jpeg;base64,{b64}">' if b64 else "<p>(no picture)</p>"
        out.append(f"<figure>{img}<figcaption>{_e(p.rel)}<br>{_e(p.caption)}</figcaption></figure>")
    return f'<div class="gallery">{"".join(out)}</div>'


def _chart(svg: str | None, empty: str) -> str:
    return svg if svg is not None else f"<p>{_e(empty)}</p>"


def _memory_verdict(stats: dict[str, Any], limit: float, warmup_s: float) -> tuple[str, str]:
    """(css class, text) of one run's memory trend, judged as `worker soak` judges it (judge_memory): a slope
    shorter runs cannot tell from noise is neither within nor over the limit."""
    mem = stats["memory"]
    slope = mem.get("late_slope_mb_per_h", float("nan"))
    failures, inconclusive, _ = judge_memory(mem, limit, warmup_s)
    if failures or inconclusive:
        return ("bad" if failures else "unsure"), f"run {stats['run']}: {(failures or inconclusive)[0]}."
    return "ok", (f"run {stats['run']}: RSS grows {slope:+.2f} MB/h over the second half of its samples after the "
                  f"warm-up: within the limit of {limit:g} MB/h (soak.max_rss_slope_mb_per_h); from "
                  f"{mem.get('rss_start_mb')} to {mem.get('rss_end_mb')} MB, peak {mem.get('rss_peak_mb')} MB.")


def _judged(stats: dict[str, Any]) -> bool:
    """Whether a run has a trend to draw: enough samples in the second half after its warm-up."""
    slope = stats["memory"].get("late_slope_mb_per_h")
    return slope is not None and slope == slope and stats["memory"].get("late_samples", 0) >= 3  # not NaN


def _runs_table(data: ReportData) -> str:
    def finished(r: dict[str, Any]) -> str:
        if r["finished_at"]:
            return r["finished_at"].strftime("%Y-%m-%d %H:%M:%S")
        return f"not (last seen {data.ends[r['id']].strftime('%Y-%m-%d %H:%M:%S')})"

    by_run = {s["run"]: s for s in data.stats}
    return _table([{"run": r["id"], "mode": r["mode"], "host": r["host"], "model": r["model"],
                    "model sha256": r["model_sha256"][:16] + "...", "providers": r["providers"],
                    "version": r["version"], "started (UTC)": r["started_at"].strftime("%Y-%m-%d %H:%M:%S"),
                    "finished": finished(r), "wall s": _seconds((data.ends[r['id']] - r['started_at']).total_seconds()),
                    "images": _processed(by_run[r["id"]]), "images/s": by_run[r["id"]].get("images_per_s") or "-"}
                   for r in data.runs])


def _seconds(s: float) -> str:
    return f"{s:.1f}" if s < 10 else f"{s:.0f}"


def _processed(stats: dict[str, Any]) -> int:
    return int(stats["counts"].get("done", 0)) + int(stats["counts"].get("failed", 0))


def render(data: ReportData, outbox: Path, max_slope_mb_per_h: float, made_at: datetime,
           verdict: str | None = None) -> str:
    runs = data.runs
    done, failed = data.counts.get("done", 0), data.counts.get("failed", 0)
    span, rate = data.busy_s(), data.images_per_s
    judged = {s["run"] for s in data.stats if _judged(s)}
    figures = {"runs": [r["id"] for r in runs], "images": data.counts, "wall_s": round(span, 1),
               "images_per_s": None if rate is None else round(rate, 2), "bucket_s": data.bucket_s,
               "per_run": {str(s["run"]): {"images": _processed(s), "images_per_s": s.get("images_per_s"),
                                           "wall_s": round((data.ends[s["run"]] - r["started_at"]).total_seconds(), 1)}
                           for s, r in zip(data.stats, runs)},
               "throughput": data.throughput, "latency_ms": data.latency,
               "memory_mb": {str(m.run): [(b, round(v, 2), g) for b, v, g in m.series] for m in data.memory},
               "trend_mb_per_h": {str(m.run): round(m.trend[1] * 3600, 3) if m.trend and m.run in judged else None
                                  for m in data.memory},
               "failures": data.failures, "labels": data.labels, "scores": data.scores,
               "gallery": {k: [p.rel for p in v] for k, v in data.gallery.items()}, "verdict": verdict}
    head = _runs_table(data)
    verdicts = [f'<p class="verdict {css}">{_e(text)}</p>' for css, text in
                (_memory_verdict(s, max_slope_mb_per_h, float(s["memory"]["warmup_s"])) for s in data.stats)]
    failures = _table([{"images": n, "reason": reason,
                        "for example": _Html(f'<a href="{_e((outbox / (output_rel(rel) + ".error.json")).as_uri())}">'
                                             f'{_e(rel)}</a>')} for reason, n, rel in data.failures])
    embedded = json.dumps(figures).replace("</", "<\\/")  # no "</script>" inside
    stage_charts = "".join(f"<h3>run {s['run']}</h3>{_chart(charts.stages(s), 'no done image')}" for s in data.stats)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>worker report: runs {_e(', '.join(str(r['id']) for r in runs))}</title>
<style>{STYLE}</style></head><body>
<h1>worker report</h1>
{f'<p class="verdict {_VERDICT_CSS.get(verdict.split(":")[0], "bad")}">soak verdict: {_e(verdict)}</p>' if verdict else ""}
<table class="figures">
<tr><td>runs</td><td>{_e(', '.join(str(r['id']) for r in runs))}</td></tr>
<tr><td>images</td><td>done {done}, failed {failed}, other {sum(data.counts.values()) - done - failed}</td></tr>
<tr><td>wall time</td><td>{_seconds(span)} s{" (while any of the runs was running)" if len(runs) > 1 else ""}</td></tr>
<tr><td>images/s</td><td>{"-" if rate is None else f"{rate:.2f}"} (done and failed over the wall time)</td></tr>
<tr><td>made</td><td>{made_at.strftime('%Y-%m-%d %H:%M:%S')} UTC by worker {_e(__version__)}</td></tr>
</table>
{head}
<h2>Throughput</h2>{_chart(charts.throughput(data), 'no image finished')}
<h2>Latency</h2>{_chart(charts.latency(data), 'no image done')}
<h2>Latency by stage</h2>{stage_charts}
<h2>Memory</h2>{_chart(charts.memory(data, judged), 'no memory sample')}{''.join(verdicts)}
<h2>Failures by reason</h2>{failures}
<h2>Labels</h2>{_chart(charts.labels(data), 'no label')}
<h2>Scores</h2>{_chart(charts.scores(data), 'no result')}
<h2>Gallery</h2>
<h3>slowest</h3>{_gallery(data.gallery.get('slowest', []))}
<h3>failed</h3>{_gallery(data.gallery.get('failed', []))}
<h3>done</h3>{_gallery(data.gallery.get('done', []))}
<script type="application/json" id="report-data">{embedded}</script>
</body></html>
"""
