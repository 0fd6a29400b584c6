"""How a command that processes images stops: the first signal finishes what is in flight, a second exits."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def two_stage_stop() -> Iterator[threading.Event]:
    """First SIGINT, SIGTERM or SIGHUP: stop intake, finish the images inference has started and give the
    others back (queued for the next start, no attempt counted). Second: exit at once.

    SIGHUP too: a terminal that goes away (an ssh session dropped) killed a worker started from it on the
    spot, and each such death counts an attempt against every image in flight (3 quarantine one)."""
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            os._exit(128 + signum)
        stop.set()
        try:
            print(f"\n{signal.Signals(signum).name}: stopping: finishing the images being inferred, giving the "
                  f"others back (again to exit now)", file=sys.stderr)
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
