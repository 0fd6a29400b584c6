"""The process's memory: glibc's allocator kept from growing a heap per thread, its free pages given
back before each sample, and the sampler thread that records RSS, open files, threads and the pipeline's
depth (the heartbeat `worker health` reads)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import psutil

from worker.store.events import Sample

log = logging.getLogger(__name__)


def _glibc() -> Any:
    """glibc through ctypes, or None (other platforms and C libraries)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc has it; musl's libc.so.6 does not exist
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


def stabilize_allocator() -> bool:
    """Cap glibc's malloc arenas (default: 8 per core) so that image-sized buffers freed by one
    thread are reused by the next instead of growing one heap per thread: RSS then plateaus after
    warm-up, which a months-long run and a leak verdict both need. (Pinning the mmap threshold
    flattens RSS further but costs about 6 ms of page faults per image: measured, not worth it.)
    No-op off Linux/glibc."""
    if _LIBC is None:
        return False
    m_arena_max = -8
    return bool(_LIBC.mallopt(m_arena_max, 2) == 1)


def release_free_heap() -> None:
    """Give the pages that malloc holds free back to the OS (glibc's `malloc_trim(0)`), so that RSS
    follows the memory in use instead of the heaps' high-water marks: free pages held after a burst
    of large buffers otherwise show as RSS steps of 1-4 MB that a leak verdict cannot tell from a
    leak. No-op off glibc."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def take_sample(queue_depth: int, images_done: int, gpu_bytes: int | None = None, tree: bool = False) -> Sample:
    """This process's RSS, open files and threads; with `tree`, summed over it and its child processes
    (the prepare processes: a leak in one of them shows in the samples like one in this process), their
    memory as their proportional share (PSS) where the system tells it: the libraries and the shared
    tensors they all map count once, not once per process."""
    me = psutil.Process()
    rss = fds = threads = 0
    for proc in [me, *(me.children(recursive=True) if tree else [])]:
        try:
            with proc.oneshot():
                rss += (_pss(proc.pid) if tree else None) or proc.memory_info().rss
                threads += proc.num_threads()
                try:
                    fds += proc.num_fds()
                except AttributeError:  # Windows
                    fds += proc.num_handles()  # type: ignore[attr-defined]
        except psutil.NoSuchProcess:  # a prepare process that ended between the listing and the reading
            continue
    return Sample(rss_bytes=rss, fds=fds, threads=threads, queue_depth=queue_depth, images_done=images_done,
                  gpu_bytes=gpu_bytes)


def _pss(pid: int) -> int | None:
    """A process's proportional set size in bytes (Linux 4.14+: /proc/PID/smaps_rollup), else None."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


class MemorySampler:
    """Calls `sink(sample)` every `period_s` seconds on its own thread until `stop()`; gives malloc's
    free pages back to the OS before each sample (about 1-2 ms; see `release_free_heap`). `gpu`, when
    given, answers the GPU memory the process holds (see `worker.runtime.gpu.GpuMemory`); `tree`: the
    samples count the child processes too."""

    def __init__(self, period_s: float, sink: Callable[[Sample], None], state: Callable[[], tuple[int, int]],
                 gpu: Callable[[], int | None] | None = None, tree: bool = False) -> None:
        self._period = period_s
        self._tree = tree
        self._sink = sink
        self._state = state
        self._gpu = gpu
        self.last: Sample | None = None  # the latest sample taken (read by the Prometheus gauges)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            release_free_heap()  # each sample then measures memory in use, not the heaps' high-water marks
            self._sink(self._take())
            if self._stop.wait(self._period):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        release_free_heap()
        self._sink(self._take())  # the last sample shows the end state

    def _take(self) -> Sample:
        self.last = take_sample(*self._state(), gpu_bytes=self._gpu() if self._gpu is not None else None,
                                tree=self._tree)
        return self.last
