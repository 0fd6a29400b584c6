"""The library functions behind the CLI: assemble the parts once, run, summarize."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import sqlalchemy

from worker.config import Config, InputAction
from worker.host.disks import DiskAlarm, LowDisk, filesystems
from worker.runtime.engine import DEFAULT_INTRA_OP_THREADS, Engine, default_max_batch, default_threads
from worker.errors import ConfigError
from worker.intake.scan import extension_of, walk
from worker.intake.intake import Intake
from worker.intake.watch import LockedOutbox, WatchedInbox, inbox_lock
from worker.intake.jobs import Job, JobStatus
from worker.host.memory import stabilize_allocator
from worker.models.card import ModelCard, settings_digest
from worker.models.lookup import find_card
from worker.models.exported import check_exported, exported_keypoint_names, exported_labels, exported_warnings
from worker.models.fetch import sha256_file
from worker.models.pull import pull, with_labels
from worker.host.names import as_text
from worker.outputs.outbox import Outbox, output_rel
from worker.outputs.files import remove_temporaries
from worker.pipeline import Pipeline, Settings, summarize, warm_up_stages
from worker.pipeline.shards import PREPARE_PROCESS_THREADS, ProcessPipeline, default_processes
from worker.fleet import uses_queue
from worker.fleet.feeder import feed_folder, feed_inbox
from worker.fleet.leases import Leases
from worker.fleet.queue import ClaimQueue
from worker.measure.prometheus import Metrics, serving
from worker.status import StatusLog
from worker.store.shared import SharedConnection
from worker.store.db import database, sqlite_file
from worker.store.queries import other_roots
from worker.store.events import RunInfo
from worker.store.recorder import Recorder
from worker.tasks import TaskAdapter, adapter_for

log = logging.getLogger(__name__)

RUN_DISK_CHECK_S = 300.0  # `worker run` checks its disks' room this often (it has no status line)


@dataclass(frozen=True)
class Summary:
    run_id: int
    mode: str
    model: str
    providers: tuple[str, ...]
    outbox: Path
    db: str
    figures: dict[str, Any]
    inputs: str = ""  # what became of the inputs, when the pipeline moved or deleted them


def _archive(cfg: Config, inputs: InputAction | None) -> Path | None:
    """Where processed inputs go: the archive when they are moved (or, failed, kept there), else nowhere."""
    return cfg.archive if inputs in ("move", "delete") else None


def low_disk(cfg: Config, inputs: InputAction | None) -> str | None:
    """What is low on room now among the filesystems the worker fills, as the status line says it."""
    return _disks(cfg, inputs).check()


def _disks(cfg: Config, inputs: InputAction | None) -> LowDisk:
    """The filesystems the worker fills (outbox, archive, a SQLite database), watched for room."""
    return LowDisk(filesystems(_written(cfg, inputs)), time.monotonic, round(cfg.metrics.low_disk_gb * 2**30),
                   cfg.metrics.low_disk_percent / 100)


def _written(cfg: Config, inputs: InputAction | None) -> list[tuple[str, Path]]:
    """The folders the worker fills, by name: the outbox, the archive and a SQLite database's folder."""
    archive, db = _archive(cfg, inputs), sqlite_file(cfg.db)
    return [("outbox", cfg.outbox), *([("archive", archive)] if archive else []),
            *([("database", db.parent)] if db else [])]


def _refuse_inside(cfg: Config, root: Path, archive: Path | None) -> None:
    """The outbox or archive in the input folder would be read back as input (masks are images)."""
    for name, path in (("outbox", cfg.outbox), ("archive", archive)):
        if path is not None and path.resolve().is_relative_to(root.resolve()):
            raise ConfigError(f"{cfg.source or 'config'}: '{name}' ({path}) must not be the input folder {root} "
                              f"or inside it")


def _check_dirs(cfg: Config, root: Path, archive: Path | None) -> None:
    _refuse_inside(cfg, root, archive)
    for name, path in (("outbox", cfg.outbox), ("archive", archive)):
        if path is None:
            continue
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{cfg.source or 'config'}: '{name}' ({path}) cannot be created: {e.strerror}") from None
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{cfg.source or 'config'}: '{name}' ({path}) is not writable")


def _warn_shared_outbox(db: sqlalchemy.Engine, outbox: Path, root: Path) -> None:
    """Say so when other folders' runs wrote into this outbox: same-named images overwrite each other's
    outputs there, silently but for this (the database keeps every result)."""
    others = other_roots(db, as_text(str(outbox)), as_text(str(root)))
    if others:
        shown = ", ".join(others[-3:]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        log.warning("%s also holds the outputs of earlier runs over %s: an image here with the same path "
                    "relative to its folder as one there overwrites its outputs (the database keeps both "
                    "results); give each folder its own --outbox to keep both", outbox, shown)


@dataclass(frozen=True)
class ReadyModel:
    """A card's model loaded, held to the card and warmed up: what a pipeline runs, or `models check` reports."""

    card: ModelCard  # with its labels read
    onnx: Path
    engine: Engine
    adapter: TaskAdapter
    max_batch: int  # the largest batch the pipeline runs (the model's fixed batch, else the config's)


def ready_model(cfg: Config, card: ModelCard) -> ReadyModel:
    """Pull the card's ONNX file, load it, check it against the card, and warm it up at the largest batch
    with one synthetic image through every stage: a card that contradicts its model fails here
    (ModelError, ConfigError), before any image is taken."""
    onnx = pull(card, cfg.cache_dir)
    card = with_labels(card, cfg.cache_dir)
    engine = Engine.for_card(onnx, cfg.engine, cfg.engine.intra_op_threads or DEFAULT_INTRA_OP_THREADS, card)
    size_hw = (card.input.size[0], card.input.size[1])
    engine.check_input(size_hw, card.name, card.preprocess.rect)
    check_exported(card, engine.metadata, onnx)  # what the exporter says the model is, before any run
    for warning in exported_warnings(card, engine.metadata, engine.dynamic_hw):
        log.warning("%s", warning)
    if not card.labels and (names := exported_labels(engine.metadata)):  # a card of one's own export
        log.info("model '%s': %d class names from %s's metadata (%s ...)", card.name, len(names), onnx.name,
                 ", ".join(names[:3]))
        card = dataclasses.replace(card, labels=names)
    k = card.postprocess.keypoints[0] if card.postprocess.keypoints else 0
    if k and not card.postprocess.keypoint_names and (points := exported_keypoint_names(engine.metadata, k)):
        card = dataclasses.replace(card, postprocess=dataclasses.replace(card.postprocess, keypoint_names=points))
    wanted = cfg.pipeline.max_batch or default_max_batch(engine.on_gpu)
    # a model's fixed batch wins over the card (its batches are padded to it: Engine.run)
    max_batch = engine.static_batch or (wanted if card.input.dynamic_batch else 1)
    engine.warm_up(max_batch, size_hw)
    adapter = adapter_for(card)
    warm_up_stages(adapter, engine, cfg.pipeline.max_pixels, card.preprocess.depth)
    return ReadyModel(card, onnx, engine, adapter, max_batch)


@contextmanager
def open_pipeline(cfg: Config, mode: str, root: Path, inputs: InputAction | None = None,
                  on_finished: Callable[[Job, JobStatus], None] | None = None,
                  replay: bool = False, fleet: bool = False) -> Iterator[Pipeline | ProcessPipeline]:
    """Card, database, model (pulled, loaded, warmed up), recorder, outbox and pipeline, closed in order.

    `inputs`: what becomes of each input once its outcome is committed (None: nothing, nor any wait).
    `fleet`: claims from the database's queue (`pipeline.leases`), on two connections, in one process."""
    cfg = dataclasses.replace(cfg, outbox=cfg.outbox.absolute())  # as recorded: see _warn_shared_outbox
    archive = _archive(cfg, inputs)
    card = find_card(cfg.models_dir, cfg.model)  # a mistyped model name: refused before any folder is made
    _check_dirs(cfg, root, archive)
    stabilize_allocator()
    # the cheap checks first: a database that cannot be opened is said before a model is pulled (building
    # one from its package takes minutes the first time) and warmed up
    with database(cfg.db) as db:
        model = ready_model(cfg, card)
        card, engine, adapter, onnx, max_batch = model.card, model.engine, model.adapter, model.onnx, model.max_batch
        _warn_shared_outbox(db, cfg.outbox, root)
        p = cfg.pipeline
        processes = 1 if fleet else p.processes or default_processes()
        if fleet and p.processes > 1:
            log.warning("pipeline.processes: %d is not used in fleet mode, which runs one process per host", p.processes)
        auto_decode, auto_infer = default_threads(on_gpu=engine.on_gpu)  # which, depends on where the model runs
        if processes > 1:  # each prepare process's threads: two decode, one sending its batches here
            auto_decode = PREPARE_PROCESS_THREADS
        settings = Settings(decode_workers=p.decode_workers or auto_decode, infer_workers=p.infer_workers or auto_infer,
                            max_batch=max_batch, max_delay_ms=p.max_delay_ms, queue_size=max(1, p.queue_size),
                            max_pixels=p.max_pixels, max_attempts=max(1, p.max_attempts),
                            memory_sample_s=cfg.metrics.memory_sample_s or 5.0, inputs=inputs, archive=archive,
                            keep_image=cfg.outputs.overlays, replay=replay, jpeg_reduce=p.jpeg_reduce,
                            all_pages=p.pages == "all", empty_folders_s=cfg.inputs.empty_folders_s)
        if processes > 1:
            log.info("pipeline: %d prepare processes of %d decode threads each, batches of up to %d",
                     processes - 1, settings.decode_workers, settings.max_batch)
        else:
            log.info("pipeline: %d decode threads, %d inference threads, batches of up to %d",
                     settings.decode_workers, settings.infer_workers, settings.max_batch)
        info = RunInfo(mode=mode, root=as_text(str(root)), model=card.name, model_sha256=sha256_file(onnx),
                       card_sha256=settings_digest(card, settings.all_pages), providers=",".join(engine.providers),
                       config=cfg.as_dict())
        recorder = Recorder(db, info)
        metrics = Metrics(card.name, info.model_sha256, info.providers) if cfg.metrics.port else None
        shared = SharedConnection(db) if fleet else None
        leases = Leases(ClaimQueue(shared, recorder.run_id, card.name, info.root, cfg.fleet.lease_s)) if shared else None
        try:
            o = cfg.outputs
            outbox = Outbox(cfg.outbox, o.json, o.masks, o.yolo_txt, o.overlays, o.errors, pages=settings.all_pages)
            for folder in (cfg.outbox, archive):
                if folder is not None and (n := remove_temporaries(folder)):
                    log.warning("removed %d temporary files left by an earlier crash under %s", n, folder)
            if processes > 1:
                with ProcessPipeline(cfg=cfg, card=card, engine=engine, recorder=recorder, info=info, db=db,
                                     settings=settings, processes=processes - 1, on_finished=on_finished,
                                     metrics=metrics) as shards, \
                        serving(metrics, cfg.metrics.host, cfg.metrics.port, shards, _written(cfg, inputs)):
                    yield shards
            else:
                with Pipeline(card=card, engine=engine, adapter=adapter, recorder=recorder, outbox=outbox,
                              db=db, settings=settings, on_finished=on_finished, leases=leases,
                              shared=shared, metrics=metrics) as pipeline, \
                        serving(metrics, cfg.metrics.host, cfg.metrics.port, pipeline, _written(cfg, inputs)):
                    yield pipeline
        finally:
            recorder.close()
            if leases is not None and shared is not None:  # after the recorder: its outcomes are written first
                leases.close()
                shared.close()


def _summary(cfg: Config, pipeline: Pipeline | ProcessPipeline, mode: str, seconds: float) -> Summary:
    return Summary(run_id=pipeline.recorder.run_id, mode=mode, model=pipeline.card.name,
                   providers=tuple(pipeline.engine.providers), outbox=cfg.outbox, db=cfg.db,
                   figures=summarize(pipeline.counts, seconds), inputs=_inputs_said(pipeline.settings))


def _inputs_said(settings: Settings) -> str:
    if settings.inputs == "move":
        return f"moved to {settings.archive}/done/ and failed/"
    if settings.inputs == "delete":
        return f"done ones deleted, failed ones moved to {settings.archive}/failed/"
    return ""


def run_folder(cfg: Config, folder: Path, stop: threading.Event | None = None,
               progress: Callable[[int], Any] | None = None, total: Callable[[int], Any] | None = None) -> Summary:
    """Process every image under `folder` once (resumable: done images are skipped)."""
    folder = folder.absolute()
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a folder")
    if total is not None:  # a first walk that only counts: a list of 200,000 paths held 41.5 MB
        total(sum(1 for _ in walk(folder, cfg.extensions, skip=(cfg.outbox,))))
    not_images: Counter[str] = Counter()  # files left alone by their names, by extension: said at the end
    paths = walk(folder, cfg.extensions, skip=(cfg.outbox,), others=lambda p: not_images.update((extension_of(p.name),)))
    finished = (lambda job, status: progress(1)) if progress is not None else None
    inputs = None if cfg.inputs.run == "keep" else cfg.inputs.run  # keep: no input stage, no commit waits
    # an overnight run has no status line: a disk running low is logged at once and every few minutes
    disks = DiskAlarm(_disks(cfg, inputs), RUN_DISK_CHECK_S, time.monotonic)
    fleet = uses_queue(cfg)
    with open_pipeline(cfg, "run", folder, inputs, on_finished=finished, fleet=fleet) as pipeline:
        t0 = time.perf_counter()
        if pipeline.leases is not None:  # this host's share of the folder, through the claim queue
            feed_folder(cfg, folder, pipeline, pipeline.leases, stop or threading.Event(), disks.tick)
            paths = iter(())
        recovered = pipeline.recover(folder, stop) if not fleet else set()
        for path in paths:
            disks.tick()
            if stop is not None and stop.is_set():
                break
            if recovered and path.relative_to(folder).as_posix() in recovered:  # rare: skip the per-path work
                continue
            try:
                job = Job.from_path(folder, path)
            except OSError:  # vanished or unreadable: the pipeline records why
                job = Job(path=path, rel=path.relative_to(folder).as_posix(), size=-1, mtime_ns=0)
            pipeline.submit(job, stop, waiting=disks.tick)
        pipeline.finish_or_abandon(stop)
        summary = _summary(cfg, pipeline, "run", time.perf_counter() - t0)
    summary.figures["not_images"] = dict(not_images.most_common())
    return summary


def watch(cfg: Config, stop: threading.Event, burst: bool = False,
          on_finished: Callable[[Job, JobStatus], None] | None = None,
          ready: threading.Event | None = None) -> Summary:
    """Watch the inbox until `stop` is set; burst: process what is there now, then return.

    `ready` is set once the model is warm and the observer is live: a file landing after that is
    seen by its event (for supervisors, and for the bench's steady feed)."""
    inbox = cfg.inbox.absolute()
    find_card(cfg.models_dir, cfg.model)  # a mistyped model name: refused before any folder is made
    _check_inbox(cfg, inbox)
    if cfg.inputs.watch != "keep" and not os.access(inbox, os.W_OK):  # a read-only share: results still come
        log.error("%s is not writable: processed inputs cannot be moved or deleted; they stay in the inbox "
                  "(each is read once per start)", inbox)
    # before the locks: an outbox that is the inbox would otherwise be said to be another watcher's; one that
    # cannot be made is said in one line
    _check_dirs(cfg, inbox, _archive(cfg, cfg.inputs.watch))
    if uses_queue(cfg):  # several watchers on one inbox, on as many hosts: the claim queue shares it out
        return _watch(cfg, inbox, stop, burst, on_finished, ready, fleet=True)
    with inbox_lock(inbox), LockedOutbox(cfg.outbox, inbox) as outbox:
        return _watch(cfg, inbox, stop, burst, on_finished, ready, outbox=outbox)


def _check_inbox(cfg: Config, inbox: Path) -> None:
    """The inbox must be a folder; a missing one is made only when asked (watch.create_inbox, --create):
    a mistyped path would otherwise be watched, empty, forever."""
    where = f"{cfg.source or 'config'}: 'inbox' ({inbox})"
    if inbox.is_dir():
        return
    if inbox.exists():
        raise ConfigError(f"{where} is a file, not a folder")
    if not cfg.watch.create_inbox:
        raise ConfigError(f"{where} does not exist: check the path, or pass --create (config: watch.create_inbox: "
                          f"true) to have worker make it")
    try:
        inbox.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a folder above that cannot be written
        raise ConfigError(f"{where} cannot be created: {e.strerror or e}") from None
    log.info("created the inbox %s", inbox)


def _watch(cfg: Config, inbox: Path, stop: threading.Event, burst: bool,
           on_finished: Callable[[Job, JobStatus], None] | None, ready: threading.Event | None,
           fleet: bool = False, outbox: LockedOutbox | None = None) -> Summary:
    intake: Intake | None = None

    def finished(job: Job, status: JobStatus) -> None:
        if intake is not None:
            intake.forget(job)
        if on_finished is not None:
            on_finished(job, status)

    with open_pipeline(cfg, "watch", inbox, cfg.inputs.watch, on_finished=finished, fleet=fleet) as pipeline:
        t0 = time.perf_counter()
        if not fleet:
            pipeline.recover(inbox, stop)  # before intake: recovered inputs are archived by the time it scans
        disks = _disks(cfg, cfg.inputs.watch)
        if (low := disks.check()) is not None:  # said at start too: the first status line is minutes away
            log.warning("%s", low)
        status = StatusLog(cfg.watch.status_log_s, pipeline.counts, pipeline.depth,
                           held=lambda: intake.held() if intake is not None else 0, disks=disks)
        watched: WatchedInbox | None = None

        def check() -> None:  # every pass of the intake loop, and while it waits for room in the pipeline
            if watched is not None:
                watched.check()
            if outbox is not None:
                outbox.check()
            status.tick()

        if pipeline.leases is not None:
            feed_inbox(cfg, inbox, pipeline, pipeline.leases, stop, burst, ready, status.tick)
            return _summary(cfg, pipeline, "watch", time.perf_counter() - t0)
        intake = Intake(inbox, cfg.extensions, cfg.watch.settle_s, cfg.watch.rescan_interval_s,
                        lambda job: pipeline.submit(job, stop, waiting=check),
                        done=pipeline.kept if cfg.inputs.watch == "keep" else None,
                        incomplete_s=cfg.watch.incomplete_s)
        watched = None if burst else WatchedInbox(intake, cfg.watch.observer, cfg.watch.poll_interval_s)
        log.info("watching %s (model %s, providers %s, %s observer)", inbox, pipeline.card.name,
                 ",".join(pipeline.engine.providers), watched.kind if watched is not None else "no")
        if ready is not None:
            ready.set()
        try:
            intake.run(stop, burst=burst, check=check)
        finally:
            if watched is not None:
                watched.stop()
        if held := intake.held():
            log.info("%d file(s) held as cut short stay in the inbox for the next start", held)
        pipeline.finish_or_abandon(stop)
        summary = _summary(cfg, pipeline, "watch", time.perf_counter() - t0)
    return summary


DEMO_MODELS = ("ppocr-det", "efficientnet-lite0", "yolov3-tiny")


def demo(cfg: Config, models: tuple[str, ...] = DEMO_MODELS) -> tuple[Path, list[Summary]]:
    """Fetch the sample images and run each model over them, each into <outbox>/<model>/, with overlays
    (the results drawn on the images: what a person looks at first)."""
    from worker.measure.samples import fetch_samples

    folder = fetch_samples(cfg.cache_dir)
    cfg = dataclasses.replace(cfg, inputs=dataclasses.replace(cfg.inputs, run="keep"),  # the samples stay cached
                              outputs=dataclasses.replace(cfg.outputs, overlays=True))
    summaries = [run_folder(dataclasses.replace(cfg, model=m, outbox=cfg.outbox / m), folder) for m in models]
    return folder, summaries


def describe(outbox: Path, rel: str) -> str:
    """One line for an image's result, from its JSON in the outbox (for the demo's printout)."""
    import json

    path = outbox / f"{output_rel(rel)}.json"
    if not path.exists():
        return "(no result)"
    doc = json.loads(path.read_text())
    if isinstance(doc.get("pages"), list):  # pipeline.pages: all, a multi-page file
        return "; ".join(f"page {page['page']}: {_describe(doc['task'], page)}" for page in doc["pages"])
    return _describe(doc["task"], doc)


def _describe(task: str, doc: dict[str, Any]) -> str:
    """One line for one image's (or page's) results."""
    if task == "classify":
        top = doc["labels"][0]
        return f"{top['name']} {top['score']:.2f}" + (" (uncertain)" if doc["uncertain"] else "")
    if task == "detect":
        return ", ".join(f"{b['name']} {b['score']:.2f}" for b in doc["boxes"]) or "no boxes"
    if "classes" in doc:  # multi-class: each class but the background
        named = [f"{c['name']} {c['fraction']:.2%}" for c in doc["classes"] if c["class_id"]]
        return ", ".join(named) or "background only"
    return f"{doc['label']} mask {doc['mask_fraction']:.2%} of pixels -> {doc.get('mask')}"
