"""Is a run still alive, and still making progress? Read from what it left in the database.

A worker writes a memory sample every `metrics.memory_sample_s` (5 s by default) with the number of
images in its pipeline (queued or in progress) and the number it has processed: that is its
heartbeat. A run that did not finish is
- running: its process exists (on this host), or its samples are recent (another host's);
- stalled: alive, but images wait and none has finished for `stall_s` (a hung decode, a full outbox,
  a database that refuses writes: its log says which), or its process exists and wrote no sample
  for a while (hung hard, or its pid now belongs to another program);
- gone: its process no longer exists (killed, crashed, the machine restarted); the images it had in
  flight are recovered by the next start on that folder;
- silent: another host's run with no recent sample (gone or hung: that cannot be told from here).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any, Sequence

from worker.host.durations import span_text
from worker.host.processes import process_exists

STALL_S = 300.0  # images in flight and none finished for this long: stalled
SILENT_MIN_S = 60.0  # no sample for max(this, 6 sample periods): the heartbeat has stopped
DEFAULT_SAMPLE_S = 5.0


class RunState(str, Enum):
    FINISHED = "finished"
    RUNNING = "running"
    STALLED = "stalled"
    GONE = "gone"
    SILENT = "silent"


@dataclass(frozen=True)
class Beat:
    """One memory sample, as far as health goes."""
    at: datetime
    in_flight: int  # images in the pipeline: queued or in progress
    processed: int  # done + failed so far in the run


@dataclass(frozen=True)
class Health:
    run: int
    mode: str
    state: RunState
    detail: str  # one line for people, saying what the state rests on
    last_sample_age_s: float | None
    in_flight: int | None
    stalled_for_s: float | None  # images in flight and none finished, for this long (alive runs)

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.run, "mode": self.mode, "state": self.state.value, "detail": self.detail,
                "last_sample_age_s": self.last_sample_age_s, "in_flight": self.in_flight,
                "stalled_for_s": self.stalled_for_s}


def sample_period_s(config: dict[str, Any] | None) -> float:
    """The run's own sampling period, from the config it recorded."""
    value = (config or {}).get("metrics.memory_sample_s")
    return float(value) if isinstance(value, (int, float)) and value > 0 else DEFAULT_SAMPLE_S


def stalled_for(beats: Sequence[Beat]) -> float:
    """Seconds over which the latest samples all show images in flight and the same processed count."""
    if not beats or beats[-1].in_flight <= 0:
        return 0.0
    last, first = beats[-1], beats[-1]
    for b in reversed(beats[:-1]):
        if b.processed != last.processed or b.in_flight <= 0:
            break
        first = b
    return (last.at - first.at).total_seconds()


def assess(run: dict[str, Any], beats: Sequence[Beat], now: datetime, stall_s: float = STALL_S) -> Health:
    """The state of one run (`run`: its row in `runs`; `beats`: its latest samples, oldest first)."""
    rid, mode = run["id"], run["mode"]
    last = beats[-1] if beats else None
    age = round(max((now - last.at).total_seconds(), 0.0), 1) if last else None  # a clock set back: not negative
    in_flight = last.in_flight if last else None

    def health(state: RunState, detail: str, stuck: float | None = None) -> Health:
        return Health(rid, mode, state, detail, age, in_flight, stuck)

    if run["finished_at"] is not None:
        return health(RunState.FINISHED, f"finished at {run['finished_at'].isoformat(timespec='seconds')}")
    where = f"pid {run['pid']} on {run['host']}"
    seen = f"last sample {_ago(age)}" if age is not None else "no sample yet"
    silent_after = max(SILENT_MIN_S, 6 * sample_period_s(run.get("config")))
    here = run["host"] == socket.gethostname()
    if here and not process_exists(run["pid"]):
        return health(RunState.GONE, f"stopped without finishing: {where} no longer exists ({seen}); "
                                     "the images it had in flight are recovered at the next start")
    if age is None or age > silent_after:
        since = age if age is not None else (now - run["started_at"]).total_seconds()
        if since <= silent_after:  # just started: its first sample is on its way
            return health(RunState.RUNNING, f"running: {where}, started {_ago(since)}, no sample yet")
        if here:
            return health(RunState.STALLED, f"stalled: {where} exists but wrote no sample for {span_text(since)} "
                                            "(hung, its database refusing writes, or that pid now belongs to "
                                            "another program; its log says which)")
        return health(RunState.SILENT, f"silent: no sample from {where} for {span_text(since)} "
                                       f"(gone or hung; its process cannot be checked from {socket.gethostname()})")
    assert last is not None
    stuck = stalled_for(beats)
    if stuck >= stall_s:
        return health(RunState.STALLED, f"stalled: {last.in_flight} image(s) in flight and none finished for "
                                        f"{span_text(stuck)} ({where}, {seen}; its log says why)", stuck)
    recent = [b for b in beats if (last.at - b.at).total_seconds() <= stall_s]
    span = (last.at - recent[0].at).total_seconds()
    rate = f", {last.processed - recent[0].processed} processed in the last {span_text(span)}" if span > 0 else ""
    return health(RunState.RUNNING, f"running: {where}, {seen}, {last.in_flight} in flight{rate}", stuck)


def _ago(seconds: float) -> str:
    return f"{span_text(seconds)} ago"
