"""`worker watch` run on a thread for a test, recording the jobs it finishes."""

from __future__ import annotations

import threading

from worker.intake.jobs import JobStatus
from worker.service import watch


class Watching:
    """Runs `watch` on a thread; records finished jobs."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.finished: list[tuple[str, JobStatus]] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-watch")

    def _run(self) -> None:
        try:
            self.summary = watch(self.cfg, self.stop, on_finished=lambda j, s: self.finished.append((j.rel, s)),
                                 ready=self.ready)
        except BaseException as e:  # surfaced by the test
            self.error = e
            self.ready.set()

    def __enter__(self) -> "Watching":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        assert self.error is None, self.error
