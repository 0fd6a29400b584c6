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
from worker.outputs.outbox import output_rel
from worker.report import charts
from worker.report.data import Pictured, ReportData

THUMB_PX = 180
STYLE = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
.figures td:first-child{color:#555}.gallery{display:flex;flex-wrap:wrap;gap:10px}
.gallery figure{margin:0;width:190px;font-size:12px;word-break:break-all}.gallery img{max-width:180px;max-height:180px}
.verdict{font-weight:bold}.ok{color:#176117}.bad{color:#a61b1b}svg{max-width:100%;height:auto}"""


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


def render(data: ReportData, outbox: Path, max_slope_mb_per_h: float, made_at: datetime,
           verdict: str | None = None) -> str:
    runs = data.runs
    done, failed = data.counts.get("done", 0), data.counts.get("failed", 0)
    span = (max((r["finished_at"] or made_at) for r in runs) - min(r["started_at"] for r in runs)).total_seconds()
    rate = sum(s.get("images_per_s") or 0 for s in data.stats)
    figures = {"runs": [r["id"] for r in runs], "images": data.counts, "wall_s": round(span, 1),
               "images_per_s": round(rate, 2), "bucket_s": data.bucket_s,
               "throughput": data.throughput, "latency_ms": data.latency,
               "memory_mb": [(b, round(m, 2), g) for b, m, g in data.memory],
               "trend_mb_per_h": round(data.trend[1] * 3600, 3) if data.trend else None,
               "failures": data.failures, "labels": data.labels, "scores": data.scores,
               "gallery": {k: [p.rel for p in v] for k, v in data.gallery.items()}, "verdict": verdict}
    head = _table([{"run": r["id"], "mode": r["mode"], "host": r["host"], "model": r["model"],
                    "model sha256": r["model_sha256"][:16] + "...", "providers": r["providers"],
                    "version": r["version"], "started (UTC)": r["started_at"].strftime("%Y-%m-%d %H:%M:%S"),
                    "finished": r["finished_at"].strftime("%Y-%m-%d %H:%M:%S") if r["finished_at"] else "not"}
                   for r in runs])
    verdicts = []
    for s in data.stats:
        slope = s["memory"].get("late_slope_mb_per_h")
        if slope is None or slope != slope or s["memory"].get("late_samples", 0) < 3:  # none, or NaN
            verdicts.append(f"<p>run {s['run']}: too few memory samples after the warm-up to judge its trend.</p>")
            continue
        ok = slope <= max_slope_mb_per_h
        verdicts.append(f'<p class="verdict {"ok" if ok else "bad"}">run {s["run"]}: RSS grows {slope:+.2f} MB/h over '
                        f'the second half of its samples after the warm-up: {"within" if ok else "over"} the limit '
                        f'of {max_slope_mb_per_h:g} MB/h (soak.max_rss_slope_mb_per_h); from '
                        f'{s["memory"].get("rss_start_mb")} to {s["memory"].get("rss_end_mb")} MB, peak '
                        f'{s["memory"].get("rss_peak_mb")} MB.</p>')
    failures = _table([{"images": n, "reason": reason,
                        "for example": _Html(f'<a href="{_e((outbox / (output_rel(rel) + ".error.json")).as_uri())}">'
                                             f'{_e(rel)}</a>')} for reason, n, rel in data.failures])
    embedded = json.dumps(figures).replace("</", "<\\/")  # no "</script>" inside
    stage_charts = "".join(f"<h3>run {s['run']}</h3>{_chart(charts.stages(s), 'no done image')}" for s in data.stats)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>worker report: runs {_e(', '.join(str(r['id']) for r in runs))}</title>
<style>{STYLE}</style></head><body>
<h1>worker report</h1>
{f'<p class="verdict {"ok" if verdict.startswith("PASS") else "bad"}">soak verdict: {_e(verdict)}</p>' if verdict else ""}
<table class="figures">
<tr><td>runs</td><td>{_e(', '.join(str(r['id']) for r in runs))}</td></tr>
<tr><td>images</td><td>done {done}, failed {failed}, other {sum(data.counts.values()) - done - failed}</td></tr>
<tr><td>wall time</td><td>{span:.0f} s</td></tr>
<tr><td>images/s</td><td>{rate:.2f}</td></tr>
<tr><td>made</td><td>{made_at.strftime('%Y-%m-%d %H:%M:%S')} UTC by worker {_e(__version__)}</td></tr>
</table>
{head}
<h2>Throughput</h2>{_chart(charts.throughput(data), 'no image finished')}
<h2>Latency</h2>{_chart(charts.latency(data), 'no image done')}
<h2>Latency by stage</h2>{stage_charts}
<h2>Memory</h2>{_chart(charts.memory(data), 'no memory sample')}{''.join(verdicts)}
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
