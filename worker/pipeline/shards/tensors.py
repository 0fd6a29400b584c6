"""The tensors a prepare process hands to the inference process, and the model's outputs back.

Each prepare process owns one region of one shared buffer (a memfd: anonymous, so nothing is left
in /dev/shm whatever way the processes end) sized for one batch. It writes a batch there and sends
its size; the inference process runs the session on a view of that region, without copying it, and
sends the outputs back pickled (one image's outputs are small next to its input tensor)."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from multiprocessing.connection import Connection
from typing import Callable

import numpy as np

from worker.runtime.model_output import ModelOutput

_BATCH = struct.Struct("<I")
EXIT_PARENT_GONE = 75  # a prepare process's exit status when the inference process went away


class SharedTensors:
    """`count` regions of (max_batch, channels, h, w) float32, over one memfd both sides map."""

    def __init__(self, fd: int, count: int, shape: tuple[int, int, int, int]) -> None:
        self.fd, self.count, self.shape = fd, count, shape
        self._region = int(np.prod(shape)) * 4
        size = max(1, self._region * count)
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        self._map = mmap.mmap(fd, size)
        whole = np.frombuffer(self._map, np.float32).reshape(count, *shape)
        self._views = [[whole[i, :n] for n in range(shape[0] + 1)] for i in range(count)]  # made once

    @classmethod
    def create(cls, count: int, shape: tuple[int, int, int, int]) -> "SharedTensors":
        return cls(os.memfd_create("worker-tensors", 0), count, shape)  # not inherited unless passed

    def region(self, index: int, n: int) -> np.ndarray:
        """Region `index`'s first `n` tensors (a view: writes go to the shared memory)."""
        return self._views[index][n]

    def close(self) -> None:
        self._views = []
        try:
            self._map.close()
        except BufferError:  # a view still held by a thread that is stopping: the mapping goes with the process
            pass
        os.close(self.fd)


class RemoteEngine:
    """What a prepare process's pipeline calls as its engine: the batch goes through region `index` to
    the inference process, which answers with the outputs (or the error's text)."""

    on_gpu = False  # the session, and any GPU, are the inference process's
    device_id = 0

    def __init__(self, tensors: SharedTensors, index: int, conn: Connection, providers: tuple[str, ...]) -> None:
        self._tensors, self._index, self._conn = tensors, index, conn
        self.providers = providers
        self._lock = threading.Lock()  # one batch in the region at a time

    def run(self, batch: np.ndarray) -> ModelOutput:
        n = len(batch)
        with self._lock:
            self._tensors.region(self._index, n)[...] = batch
            try:
                self._conn.send_bytes(_BATCH.pack(n))
                head = self._conn.recv_bytes()
            except (EOFError, OSError):  # the inference process is gone: not this batch's fault
                os._exit(EXIT_PARENT_GONE)
            if head[:1] == b"a":  # one array: its dtype and shape, then its bytes
                dtype, shape = head[1:].decode().split(";")
                dims = tuple(int(d) for d in shape.split(",") if d)
                out = np.empty(dims, np.dtype(dtype))  # writable, as a session's own outputs are
                self._conn.recv_bytes_into(out.reshape(-1).view(np.uint8).data)
                return out
            reply = self._conn.recv()
        if isinstance(reply, str):
            raise RuntimeError(reply)
        return reply  # type: ignore[no-any-return]

    def warm_up(self, batch_size: int, size_hw: tuple[int, int]) -> None:
        """The inference process warmed the session up before any prepare process started."""


def serve(tensors: SharedTensors, index: int, conn: Connection, run: Callable[[np.ndarray], ModelOutput]) -> None:
    """The inference process's side of one prepare process: run each batch it sends, until it goes away."""
    while True:
        try:
            (n,) = _BATCH.unpack(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            out: ModelOutput | str = run(tensors.region(index, n))
        except Exception as e:  # the batch's images fail with this reason; the session serves the next one
            out = f"{type(e).__name__}: {e}"
        try:
            if isinstance(out, np.ndarray):  # the common case, without pickling: about 40 us less per batch
                out = np.ascontiguousarray(out)
                conn.send_bytes(b"a" + f"{out.dtype.str};{','.join(map(str, out.shape))}".encode())
                conn.send_bytes(out.reshape(-1).view(np.uint8).data)
            else:
                conn.send_bytes(b"p")
                conn.send(out)
        except OSError:
            return
