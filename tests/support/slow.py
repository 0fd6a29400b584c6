"""An outbox on a slow share, for tests of stopping: a site folder whose sitecustomize makes every result take
half a second to write in the worker processes started with it on their PYTHONPATH."""

from __future__ import annotations

from pathlib import Path

SLOW_OUTBOX = """
import time
from worker.outputs import outbox

_write = outbox.Outbox.write
def slow(self, *args, **kwargs):
    time.sleep(0.5)
    return _write(self, *args, **kwargs)
outbox.Outbox.write = slow
"""


def slow_outbox_site(tmp: Path) -> Path:
    """tmp/site with that sitecustomize: put it on PYTHONPATH."""
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SLOW_OUTBOX)
    return site
