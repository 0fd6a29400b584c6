"""Prometheus metrics of a running `worker watch` or `worker run` (`metrics.port`, off by default), in a
registry of the worker's own, served over HTTP by prometheus-client:

    worker_images_total{model, outcome}        images finished: done, failed, skipped (counters)
    worker_stage_seconds{model, stage}         each image's time per stage and in total (histograms)
    worker_queue_depth, worker_rss_bytes, worker_gpu_memory_bytes, worker_disk_free_bytes{folder},
    worker_last_image_timestamp_seconds        gauges, read at each scrape
    worker_info{version, model, model_sha256, providers}

Counters and gauges are read from the pipeline when scraped (memory from its sampler's latest sample, the one
`metrics.memory_sample_s` writes to the database: RSS over every process of the worker, GPU memory through
NVML); the stage histograms are observed as each image finishes (with prepare processes, `pipeline.processes`
> 1, each sends its images' timings with its notices of finished images: `TimingsRelay`)."""

from __future__ import annotations

import errno
from collections import deque
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from worker import __version__
from worker.errors import ConfigError

if TYPE_CHECKING:
    from worker.pipeline.items import Counts
    from worker.store.events import Sample

STAGES = ("queue_wait", "decode", "preprocess", "infer", "postprocess", "write", "total")
# seconds: from a small model's few milliseconds on a GPU to a big TIFF's seconds on a CPU
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class StageObserver(Protocol):
    """What the finish stage hands each finished image's timings to (ms, the recorder's `timings` row)."""

    def observe(self, timings: dict[str, float] | None) -> None: ...


class TimingsRelay:
    """A prepare process's StageObserver: keeps the timings until its next notice takes them to the process
    that serves the metrics (`take`)."""

    def __init__(self) -> None:
        self._waiting: deque[dict[str, float] | None] = deque()

    def observe(self, timings: dict[str, float] | None) -> None:
        self._waiting.append(timings)

    def take(self) -> list[dict[str, float] | None]:
        return [self._waiting.popleft() for _ in range(len(self._waiting))]


class Metrics:
    """The registry, the stage histograms (`observe`, from the finish stage) and, once `serve` is called, the
    counters and gauges read from the pipeline and the HTTP endpoint."""

    def __init__(self, model: str, model_sha256: str, providers: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        self._stages = Histogram("worker_stage_seconds", "Each image's time in a stage of the pipeline, and in total",
                                 ["model", "stage"], buckets=BUCKETS, registry=self.registry)
        self._by_stage = {s: self._stages.labels(model, s) for s in STAGES}
        Info("worker", "The worker and its model", registry=self.registry).info(
            {"version": __version__, "model": model, "model_sha256": model_sha256, "providers": providers})
        self.last_image = 0.0  # time.time() of the last image finished
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def observe(self, timings: dict[str, float] | None) -> None:
        """One finished image's timings in ms (the recorder's `timings` row)."""
        self.last_image = time.time()
        if timings is None:
            return
        for stage, histogram in self._by_stage.items():
            ms = timings.get(f"{stage}_ms")
            if ms is not None:
                histogram.observe(ms / 1000)

    def serve(self, host: str, port: int, counts: Callable[[], tuple[int, int, int]], depth: Callable[[], int],
              folders: Sequence[tuple[str, Path]], sample: Callable[[], Sample | None]) -> None:
        """Read the pipeline at each scrape (`counts`: done, failed, skipped; `sample`: its latest memory sample)
        and serve /metrics on host:port."""
        self.registry.register(_Live(self, counts, depth, folders, sample))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            why = "in use by another program" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise ConfigError(f"metrics.port {port} on {host}: cannot listen there ({why}); choose another "
                              f"(--metrics-port) or 0 to serve no metrics") from None

    @property
    def port(self) -> int:
        return int(self._server.server_port) if self._server is not None else 0

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Live(Collector):
    """What is read at each scrape: the counters of finished images and the gauges."""

    def __init__(self, metrics: Metrics, counts: Callable[[], tuple[int, int, int]], depth: Callable[[], int],
                 folders: Sequence[tuple[str, Path]], sample: Callable[[], Sample | None]) -> None:
        self.metrics, self.counts, self.depth, self.folders, self.sample = metrics, counts, depth, folders, sample

    def describe(self) -> list[Any]:
        return []  # families made at each collect (their label values are only known then)

    def collect(self) -> Iterator[Any]:
        model = self.metrics.model
        images = CounterMetricFamily("worker_images", "Images finished, by outcome", labels=["model", "outcome"])
        for outcome, n in zip(("done", "failed", "skipped"), self.counts()):
            images.add_metric([model, outcome], n)
        yield images
        yield GaugeMetricFamily("worker_queue_depth", "Images in the pipeline: submitted and not yet finished",
                                value=self.depth())
        if (sample := self.sample()) is not None:
            yield GaugeMetricFamily("worker_rss_bytes", "Resident memory of the worker (its processes together)",
                                    value=sample.rss_bytes)
            if sample.gpu_bytes is not None:
                yield GaugeMetricFamily("worker_gpu_memory_bytes", "GPU memory the worker holds (NVML)",
                                        value=sample.gpu_bytes)
        free = GaugeMetricFamily("worker_disk_free_bytes", "Free room on the filesystem of each folder the worker "
                                 "fills", labels=["folder"])
        for name, path in self.folders:
            try:
                free.add_metric([name], shutil.disk_usage(path).free)
            except OSError:
                continue  # not made yet (an archive before its first move)
        yield free
        yield GaugeMetricFamily("worker_last_image_timestamp_seconds", "When the last image finished (Unix time; "
                                "0 before the first)", value=self.metrics.last_image)


class Served(Protocol):
    """What the metrics read of a pipeline at each scrape."""

    counts: Counts

    def depth(self) -> int: ...

    def last_sample(self) -> Sample | None: ...


@contextmanager
def serving(metrics: Metrics | None, host: str, port: int, pipeline: Served,
            folders: Sequence[tuple[str, Path]]) -> Iterator[None]:
    """/metrics on host:port while the block runs (nothing when `metrics` is None)."""
    if metrics is None:
        yield
        return
    c = pipeline.counts
    metrics.serve(host, port, lambda: (c.done, c.failed, c.skipped), pipeline.depth, folders, pipeline.last_sample)
    logging.getLogger(__name__).info("Prometheus metrics on http://%s:%d/metrics", host, metrics.port)
    try:
        yield
    finally:
        metrics.close()
