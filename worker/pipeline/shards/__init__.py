"""The pipeline over several processes: prepare processes around one inference process.

    submit(job) -> prepare process k (by its path) -> read, hash, claim, decode, preprocess
                       -> [shared tensors] -> the one session, here -> outputs back -> postprocess, outbox, rows

Each prepare process runs the thread pipeline (worker/pipeline) with its batches sent here
(`tensors.RemoteEngine`), its own database writer, and writes into this process's run. This process
keeps the session, sends each job to the process its path falls to (one image is never in two
processes at once), and holds no more jobs in flight per process than its queue takes. Per image it
only sends the job, runs its batch and reads its notice: a fifth of the Python calls the whole
pipeline makes in one process (tests/test_processes.py counts them).

A prepare process that dies (a decoder crashing on a poison file) is replaced; the jobs it held go
to its successor one at a time, each claim charging an attempt as a crash of the whole worker does,
so that only a file that crashes it again and again ends in quarantine."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import posixpath
import queue
import socket
import subprocess
import sys
import threading
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Iterable

from sqlalchemy import Engine as DbEngine

from worker.config import Config
from worker.errors import WorkerError
from worker.host.cores import usable_cores
from worker.host.memory import MemorySampler
from worker.intake.jobs import Job, JobStatus
from worker.measure.prometheus import StageObserver
from worker.models.card import ModelCard, accepted_digests
from worker.outputs.files import remove_temporaries_of
from worker.pipeline import recover_in_flight
from worker.pipeline.archive import InputArchive
from worker.pipeline.items import Counts, Settings
from worker.pipeline.shards.shard import ShardSpec, Snapshot
from worker.pipeline.shards.tensors import SharedTensors, serve
from worker.runtime.engine import Engine
from worker.runtime.gpu import GpuMemory
from worker.store.events import RunInfo, Sample
from worker.store.ledger import Ledger, WhatDone
from worker.store.recorder import Recorder

log = logging.getLogger("worker.pipeline")

# below this many cores one process's threads keep up: its Python work per image (about 1 ms) allows
# about 1,000 images/s, more than that many cores decode (docs/performance.md)
PROCESSES_FROM_CORES = 6
PREPARE_PROCESS_THREADS = 2  # decode threads in each prepare process
STATUSES = {s.value: s for s in JobStatus}
SEND_GROUP = 256  # jobs sent in one message at most
START_S = 300.0  # a prepare process has this long to say it is ready (it imports, connects, warms up)
MAX_DEATHS = 5  # prepare processes dying this often in a row beyond max_attempts, no image finished: stop


def default_processes(cores: int | None = None) -> int:
    """1 (threads only) on a small machine; else one prepare process per two cores, beside the session's."""
    n = cores or usable_cores()
    return 1 if n < PROCESSES_FROM_CORES else 1 + n // 2


class Shard:
    """The inference process's handle on one prepare process: its connections, its jobs in flight."""

    def __init__(self, index: int, proc: subprocess.Popen[bytes], control: Connection, infer: socket.socket) -> None:
        self.index, self.proc, self.control, self.infer = index, proc, control, infer
        self.lock = threading.Lock()  # one sender at a time on the control connection
        self.in_flight: dict[int, Job] = {}  # sequence number -> job sent, not yet finished
        self.ready = threading.Event()
        self.closed = threading.Event()
        self.snapshot = Snapshot()
        self.final: Counts | None = None
        self.report: Counts | None = None  # its counts when last asked (`report`)
        self.reported = threading.Event()
        self.started = False  # said it is ready
        self.gone = False

    def send(self, order: tuple[Any, ...]) -> None:
        with self.lock:
            self.control.send(order)


class ProcessPipeline:
    """`Pipeline`'s interface (submit, drain, recover, counts, close) over `processes` prepare processes."""

    leases = None  # fleet mode runs in one process (its two connections per host)

    def __init__(self, *, cfg: Config, card: ModelCard, engine: Engine, recorder: Recorder, info: RunInfo,
                 db: DbEngine, settings: Settings, processes: int,
                 on_finished: Callable[[Job, JobStatus], None] | None = None,
                 metrics: StageObserver | None = None) -> None:
        """`metrics`: Prometheus's stage histograms, observed with the timings each prepare process sends."""
        self.card, self.engine, self.recorder, self.settings = card, engine, recorder, settings
        self.metrics = metrics
        self.on_finished = on_finished
        self.counts = Counts()
        self._cfg, self._info = cfg, info
        self._shape = (settings.max_batch, card.preprocess.channels, card.input.size[0], card.input.size[1])
        self._tensors = SharedTensors.create(processes, self._shape)
        self._idle = threading.Condition()
        self._pending = 0
        self._seq = 0
        self._closing = False
        self._giving_back = False  # the run was stopped: a successor of a dead prepare process is told too
        self._deaths = 0
        self._retired: list[Snapshot] = []  # the last counts of prepare processes that died
        # inputs processed and kept in the inbox (watch, `inputs: keep`): intake need not submit them again
        self._kept = InputArchive("keep", None) if settings.inputs == "keep" else None
        done = WhatDone(recorder.model_sha256, accepted_digests(card, settings.all_pages),
                        accepted_digests(card, False) | accepted_digests(card, True), "")
        self._ledger = Ledger(db, card.name, recorder.root, done)
        self._shards: list[Shard] = []
        self._outgoing: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (shard, seq, job) to send; None: stop
        self._sender = threading.Thread(target=self._send_loop, name="send-jobs", daemon=True)
        self._sender.start()
        try:
            self._shards = [self._start(i) for i in range(processes)]
            for shard in self._shards:
                self._wait_ready(shard)
        except BaseException:
            self._kill_all()
            raise
        gpu = GpuMemory(engine.device_id) if engine.on_gpu else None
        self._sampler = MemorySampler(settings.memory_sample_s, recorder.put,
                                      lambda: (self._pending, self.counts.processed), gpu=gpu, tree=True)

    # --- the prepare processes

    def _start(self, index: int) -> Shard:
        control, control_child = socket.socketpair()
        infer, infer_child = socket.socketpair()
        fds = (control_child.fileno(), infer_child.fileno(), self._tensors.fd)
        proc = subprocess.Popen([sys.executable, "-m", "worker.pipeline.shards", *map(str, fds)],
                                pass_fds=fds, stdin=subprocess.DEVNULL)
        control_child.close()
        infer_child.close()
        shard = Shard(index, proc, Connection(control.detach()), infer)
        # a job is told finished once its outcome is committed (`keep` waits for that where `run` would not):
        # a prepare process that dies then leaves no image told finished and not on record
        settings = dataclasses.replace(self.settings, infer_workers=1, record_memory=False,
                                       inputs=self.settings.inputs or "keep",
                                       remember_kept=self.settings.inputs == "keep")
        shard.control.send(ShardSpec(index, self._tensors.count, self._shape, self._cfg, self.card, settings,
                                     self._info, self.recorder.run_id, tuple(self.engine.providers),
                                     logging.getLogger().getEffectiveLevel(), self.metrics is not None))
        threading.Thread(target=serve, args=(self._tensors, index, shard.infer, self.engine.run),
                         name=f"infer-{index}", daemon=True).start()
        threading.Thread(target=self._listen, args=(shard,), name=f"notices-{index}", daemon=True).start()
        return shard

    def _wait_ready(self, shard: Shard) -> None:
        if not shard.ready.wait(START_S) or shard.gone:
            raise WorkerError(f"prepare process {shard.index} (pid {shard.proc.pid}) did not start: see the log above")

    def _listen(self, shard: Shard) -> None:
        """Read one prepare process's messages until it closes or dies."""
        while True:
            try:
                message = shard.control.recv()
            except (EOFError, OSError):
                break
            if message[0] == "finished":
                self._finished(shard, message[1], message[2])
                if self.metrics is not None:
                    for timings in message[3]:
                        self.metrics.observe(timings)
            elif message[0] == "ready":
                shard.started = True
                shard.ready.set()
            elif message[0] == "report":
                shard.report = message[1]
                shard.reported.set()
            elif message[0] == "closed":
                shard.final = message[1]
                shard.closed.set()
        shard.gone = True
        shard.ready.set()  # wakes whoever waits for it
        shard.closed.set()
        if shard.started and not self._closing and shard.final is None:  # one that never started fails the start
            threading.Thread(target=self._replace, args=(shard,), name=f"replace-{shard.index}", daemon=True).start()

    def _finished(self, shard: Shard, finished: list[tuple[int, str]], snapshot: Snapshot) -> None:
        shard.snapshot = snapshot
        self._sum_counts()
        jobs = [(shard.in_flight.pop(seq), STATUSES[status]) for seq, status in finished if seq in shard.in_flight]
        if jobs:
            self._deaths = 0
        with self._idle:
            self._pending -= len(jobs)
            self._idle.notify_all()
        if self._kept is not None:
            for job, status in jobs:
                if status is not JobStatus.QUEUED:
                    self._kept.archive(job, status, (0, job.size, job.mtime_ns))
        if self.on_finished is not None:
            for job, status in jobs:
                self.on_finished(job, status)

    def _sum_counts(self) -> None:
        snapshots = [*self._retired, *(s.snapshot for s in self._shards)]
        for name in ("done", "failed", "skipped", "unread", "pages", "taken", "given_back"):
            setattr(self.counts, name, sum(getattr(s, name) for s in snapshots))

    def _replace(self, dead: Shard) -> None:
        """Start a successor for a prepare process that died and give it the dead one's jobs, one at a time."""
        code = dead.proc.wait()
        self._deaths += 1
        log.error("prepare process %d (pid %d) died (%s) with %d image(s) in flight: starting another; each of "
                  "them is tried again on its own, charged one attempt", dead.index, dead.proc.pid,
                  f"signal {-code}" if code < 0 else f"exit code {code}", len(dead.in_flight))
        # a poison file kills its process at most max_attempts times before its claim quarantines it
        if self._deaths > self.settings.max_attempts + MAX_DEATHS:
            log.critical("prepare processes keep dying with no image finished: stopping")
            os._exit(70)
        self._retired.append(dead.snapshot)  # its counts so far stay counted
        if n := remove_temporaries_of(dead.proc.pid, self._written_folders(dead.in_flight.values())):
            log.warning("removed %d temporary files prepare process %d left", n, dead.index)
        shard = self._start(dead.index)
        owed = sorted(dead.in_flight.items())
        shard.in_flight.update(owed)  # its own from now on: should it die too, its successor gets them all
        self._shards[dead.index] = shard
        self._wait_ready(shard)
        if self._giving_back:
            with contextlib.suppress(OSError):  # gone again: its own successor is told in turn
                shard.send(("give_back",))
        for seq, job in owed:
            self._send(shard, seq, dataclasses.replace(job, take_over=True))
            with self._idle:
                self._idle.wait_for(lambda: seq not in shard.in_flight or shard.gone)
            if shard.gone:
                return

    def _written_folders(self, jobs: Iterable[Job]) -> list[Path]:
        """The folders where outputs (and moved inputs) of these jobs are written."""
        roots = [self._cfg.outbox]
        if self.settings.archive is not None:
            roots += [self.settings.archive / "done", self.settings.archive / "failed"]
        return [root / posixpath.dirname(job.rel) for job in jobs for root in roots]

    def _send(self, shard: Shard, seq: int, job: Job) -> None:
        shard.in_flight[seq] = job
        self._outgoing.put((shard, seq, job))

    def _send_loop(self) -> None:
        """Send the jobs submitted, each process's in one message per wake-up: under load the jobs that
        came meanwhile go together (one pickling, one system call), alone a job goes at once."""
        while True:
            waiting = [self._outgoing.get()]
            while len(waiting) < SEND_GROUP:
                try:
                    waiting.append(self._outgoing.get_nowait())
                except queue.Empty:
                    break
            groups: dict[Shard, list[tuple[int, tuple[str, str, int, int, float, bool]]]] = {}
            for entry in waiting:
                if entry is not None:
                    shard, seq, job = entry
                    groups.setdefault(shard, []).append((seq, job.as_tuple()))
            for shard, jobs in groups.items():
                try:
                    shard.send(("jobs", jobs))
                except OSError:  # it died meanwhile: its successor gets the jobs with the others it held
                    pass
            if None in waiting:
                return

    # --- Pipeline's interface

    def submit(self, job: Job, stop: threading.Event | None = None,
               waiting: Callable[[], object] | None = None) -> bool:
        """As `Pipeline.submit`: blocks while the prepare process the job falls to holds a full queue."""
        index = zlib.crc32(job.rel.encode("utf-8", "surrogateescape")) % len(self._shards)
        with self._idle:
            self._pending += 1
        while True:
            with self._idle:
                shard = self._shards[index]
                if shard.ready.is_set() and not shard.gone and len(shard.in_flight) < self.settings.queue_size:
                    self._seq += 1
                    seq = self._seq
                    break
                self._idle.wait(0.2)
            if waiting is not None:
                waiting()
            if stop is not None and stop.is_set() and (shard.snapshot.outbox_full or shard.snapshot.db_down):
                with self._idle:  # not taken: it stays where it is for the next start
                    self._pending -= 1
                    self._idle.notify_all()
                if self.on_finished is not None:
                    self.on_finished(job, JobStatus.QUEUED)
                return False
        self._send(shard, seq, job)
        return True

    def wait_for_room(self, max_pending: int) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending < max_pending)

    def recover(self, root: Path, stop: threading.Event | None = None) -> set[str]:
        """The images a dead worker left in flight, one at a time (`recover_in_flight`), until `stop`."""
        return recover_in_flight(self._ledger, root, self.submit, self.drain, stop)

    def kept(self, rel: str, sig: tuple[int, int]) -> bool:
        """As `Pipeline.kept`, by the (size, mtime_ns) intake saw: an input changed since is submitted
        again, and found done by its file's stamp, unread, when its content is the one processed."""
        return self._kept is not None and self._kept.kept(rel, sig)

    def depth(self) -> int:
        return self._pending

    def last_sample(self) -> Sample | None:
        """The memory sampler's latest sample, summed over every process."""
        return self._sampler.last

    def drain(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _tell_all(self, order: str) -> None:
        for shard in self._shards:
            try:
                shard.send((order,))
            except OSError:  # it died meanwhile: its successor starts without what the order undoes
                pass

    def abandon_waiting(self) -> int:
        self._tell_all("abandon")
        return 0

    def give_back(self) -> None:
        """As `Pipeline.give_back`, in every prepare process."""
        self._giving_back = True
        self._tell_all("give_back")

    def finish_or_abandon(self, stop: threading.Event | None) -> None:
        given_back = False
        while True:
            if stop is not None and stop.is_set() and not given_back:
                self.give_back()
                self.abandon_waiting()
                given_back = True
            if self.drain(timeout=0.2):
                break
        self._gather_latencies()

    def _gather_latencies(self) -> None:
        """The prepare processes' latencies of their done images, into `counts` (for the summary)."""
        reports = []
        for shard in self._shards:
            shard.reported.clear()
            try:
                shard.send(("report",))
            except OSError:
                continue
            if shard.reported.wait(30) and shard.report is not None:
                reports.append(shard.report)
        window = type(self.counts.latencies_ms)()
        for counts in reports:
            for ms in counts.latencies_ms.last():
                window.add(float(ms))
            self.counts.earlier_outboxes = counts.earlier_outboxes + self.counts.earlier_outboxes
        self.counts.latencies_ms = window

    def close(self) -> None:
        """Each prepare process finishes what it holds and stops; then the sampler and the shared memory."""
        self._closing = True
        self._outgoing.put(None)
        self._sender.join()
        self._sampler.stop()  # its last sample while every process is there: the end state, not a drop
        for shard in self._shards:
            try:
                shard.send(("close",))
            except OSError:
                pass
        for shard in self._shards:
            shard.closed.wait()
            shard.proc.wait()
            if (final := shard.final) is not None:
                shard.snapshot = Snapshot.of(final)
        self._sum_counts()
        self._ledger.close()
        self._tensors.close()

    def _kill_all(self) -> None:
        self._closing = True
        for shard in self._shards:
            shard.proc.kill()
            shard.proc.wait()
        self._tensors.close()

    def __enter__(self) -> "ProcessPipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
