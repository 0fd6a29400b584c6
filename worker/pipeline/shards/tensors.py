"""The tensors a prepare process hands to the inference process, and the model's outputs back.

Each prepare process owns one region of one shared buffer (a memfd: anonymous, so nothing is left
in /dev/shm whatever way the processes end) sized for one batch. It writes a batch there and sends
its size; the inference process runs the session on a view of that region, without copying it, and
sends the outputs back pickled (one image's outputs are small next to its input tensor)."""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import struct
import threading
from typing import Any, Callable

import numpy as np

from worker.pipeline.infer import within
from worker.runtime.model_output import ModelOutput

_BATCH = struct.Struct("<4I")  # the batch's shape: (n, channels, height, width)
_ANSWER = struct.Struct("<IQ")
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

    def region(self, index: int, n: int, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Region `index`'s first `n` tensors (a view: writes go to the shared memory), of the region's
        shape or of a smaller one (a rect letterbox's), laid out from the region's start."""
        if shape is None or tuple(shape) == self.shape[1:]:
            return self._views[index][n]
        return within(self._views[index][self.shape[0]], n, shape)

    def close(self) -> None:
        self._views = []
        try:
            self._map.close()
        except BufferError:  # a view still held by a thread that is stopping: the mapping goes with the process
            pass
        os.close(self.fd)


def _receive(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes (EOFError when the other side is gone)."""
    data = sock.recv(size, socket.MSG_WAITALL)
    if len(data) < size:
        raise EOFError
    return data


def _receive_into(sock: socket.socket, buffer: memoryview) -> None:
    while buffer.nbytes:
        got = sock.recv_into(buffer, buffer.nbytes, socket.MSG_WAITALL)
        if not got:
            raise EOFError
        buffer = buffer[got:]


class RemoteEngine:
    """What a prepare process's pipeline calls as its engine: the batch goes through region `index` to
    the inference process, which answers with the outputs (or the error's text).

    On the socket, a batch is its shape (4 x 4 bytes); an answer is a header's and a payload's lengths (4
    and 8 bytes), the header (`a<dtype>;<shape>` for one array, whose bytes the payload is; `p` for
    anything else, pickled) and the payload: plain socket calls, one or two per batch each way."""

    on_gpu = False  # the session, and any GPU, are the inference process's
    device_id = 0

    def __init__(self, tensors: SharedTensors, index: int, sock: socket.socket, providers: tuple[str, ...]) -> None:
        self._tensors, self._index, self._sock = tensors, index, sock
        self.providers = providers
        self._lock = threading.Lock()  # one batch in the region at a time

    def run(self, batch: np.ndarray) -> ModelOutput:
        n = len(batch)
        with self._lock:
            self._tensors.region(self._index, n, batch.shape[1:])[...] = batch
            try:
                self._sock.sendall(_BATCH.pack(*batch.shape))
                head_size, size = _ANSWER.unpack(_receive(self._sock, _ANSWER.size))
                head = _receive(self._sock, head_size)
                if head[:1] == b"a":  # one array: its dtype and shape, then its bytes
                    dtype, shape = head[1:].decode().split(";")
                    out = np.empty(tuple(int(d) for d in shape.split(",") if d), np.dtype(dtype))
                    _receive_into(self._sock, memoryview(out.reshape(-1).view(np.uint8).data))  # writable
                    return out
                reply = pickle.loads(_receive(self._sock, size))
            except (EOFError, OSError):  # the inference process is gone: not this batch's fault
                os._exit(EXIT_PARENT_GONE)
        if isinstance(reply, str):
            raise RuntimeError(reply)
        return reply  # type: ignore[no-any-return]

    def warm_up(self, batch_size: int, size_hw: tuple[int, int]) -> None:
        """The inference process warmed the session up before any prepare process started."""


def serve(tensors: SharedTensors, index: int, sock: socket.socket, run: Callable[[np.ndarray], ModelOutput]) -> None:
    """The inference process's side of one prepare process: run each batch it sends, until it goes away."""
    while True:
        try:
            n, *shape = _BATCH.unpack(_receive(sock, _BATCH.size))
        except (EOFError, OSError):
            return
        try:
            out: ModelOutput | str = run(tensors.region(index, n, tuple(shape)))
        except Exception as e:  # the batch's images fail with this reason; the session serves the next one
            out = f"{type(e).__name__}: {e}"
        if isinstance(out, np.ndarray):  # the common case, not pickled
            out = np.ascontiguousarray(out)
            head = b"a" + f"{out.dtype.str};{','.join(map(str, out.shape))}".encode()
            payload: Any = out.reshape(-1).view(np.uint8).data
        else:
            head, payload = b"p", pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            sock.sendmsg([_ANSWER.pack(len(head), len(payload)), head, payload])
        except OSError:
            return
