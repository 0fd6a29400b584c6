"""Values typed on the command line: times, ages and durations."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import click


def parse_time(value: str) -> datetime:
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO date/time such as 2026-11-30 or 2026-11-30T08:00") from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def cutoff_time(value: str) -> datetime:
    """An ISO date/time (UTC if no zone), or an age back from now: 90d, 12h, 30m, 90s."""
    try:
        if "-" in value or ":" in value:  # a date or a time; an age has neither
            return parse_time(value)
        return datetime.now(timezone.utc) - timedelta(seconds=duration_s(value))
    except click.BadParameter:
        raise click.BadParameter(f"{value!r} is not an ISO date/time such as 2026-09-01 nor an age such as 90d "
                                 f"or 12h") from None


def optional_time(value: str | None) -> datetime | None:
    """--since / --until: an ISO date/time or an age (`cutoff_time`), or None when not given."""
    return None if value is None else cutoff_time(value)


def duration_s(value: str, positive: bool = False) -> float:
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
