"""How a command that processes images stops: the first signal finishes what is in flight, a second exits."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

GIVE_BACK_S = 1.0  # a second signal within this of the first exits this long after the first


@contextlib.contextmanager
def two_stage_stop() -> Iterator[threading.Event]:
    """First SIGINT, SIGTERM or SIGHUP: stop intake, finish the images inference has started and give the
    others back (queued for the next start, no attempt counted). Second: exit at once (or, where it comes
    within GIVE_BACK_S of the first, that long after the first: the giving back is done by then).

    SIGHUP too: a terminal that goes away (an ssh session dropped) killed a worker started from it on the
    spot, and each such death counts an attempt against every image in flight (3 quarantine one)."""
    stop = threading.Event()
    first = 0.0

    def handler(signum: int, _frame: Any) -> None:
        nonlocal first
        if stop.is_set():
            # a second press right after the first (a habit at a terminal): the first's giving back, which
            # takes a fraction of a second, is let finish, up to GIVE_BACK_S after the first, then it exits
            if (left := first + GIVE_BACK_S - time.monotonic()) > 0:
                timer = threading.Timer(left, os._exit, (128 + signum,))
                timer.daemon = True  # a stop that finishes sooner exits as it would have
                timer.start()
                return
            os._exit(128 + signum)
        stop.set()
        first = time.monotonic()
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
