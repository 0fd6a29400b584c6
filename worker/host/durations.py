"""Durations written for people: what the logs and `worker health` say."""

from __future__ import annotations


def span_text(seconds: float) -> str:
    """45 s, 12 min, 3.5 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
