"""A TCP proxy on loopback in front of the PostgreSQL server that cuts a connection right after the server
committed a transaction, before the client hears so: the server's CommandComplete("COMMIT") is dropped and both
sockets are closed. Only on connections whose client sent a marked statement (`marker`, e.g. the recorder's
batch number), and `cuts` times in all."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class CommitCutter:
    def __init__(self, upstream: tuple[str, int], marker: bytes, cuts: int) -> None:
        self.upstream, self.marker, self.left = upstream, marker, cuts
        self.cut = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="pgproxy", daemon=True).start()

    def url(self, database_url: str) -> str:
        """`database_url` (postgresql+psycopg://USER@HOST:PORT/DB) through this proxy, with no SSL or GSS
        negotiation (its one-byte answers are the only unframed server messages)."""
        head, _, db = database_url.rpartition("/")
        user = head.split("//", 1)[1].split("@", 1)[0]
        return f"postgresql+psycopg://{user}@127.0.0.1:{self.port}/{db}?sslmode=disable&gssencmode=disable"

    def close(self) -> None:
        self._stop.set()
        _close(self._server)  # shut down: wakes the accept() it blocks in

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            marked = threading.Event()
            threading.Thread(target=self._up, args=(client, server, marked), name="pgproxy-up", daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, marked), name="pgproxy-down",
                             daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, marked: threading.Event) -> None:
        """Client to server, as it comes; noting a connection that sends the marker."""
        tail = b""
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self.marker in tail + data:
                    marked.set()
                tail = data[-len(self.marker):]
                server.sendall(data)
        _close(client, server)

    def _down(self, server: socket.socket, client: socket.socket, marked: threading.Event) -> None:
        """Server to client, message by message (type byte, length including itself): a COMMIT's completion on
        a marked connection is dropped, and the connection cut, while cuts are left."""
        buf = b""
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                buf += data
                out = b""
                while len(buf) >= 5:
                    size = struct.unpack("!I", buf[1:5])[0] + 1
                    if len(buf) < size:
                        break
                    message, buf = buf[:size], buf[size:]
                    if message[:1] == b"C" and message[5:].rstrip(b"\0") == b"COMMIT" and marked.is_set() \
                            and self._take():
                        client.sendall(out)
                        _close(client, server)
                        return
                    out += message
                client.sendall(out)
        _close(client, server)

    def _take(self) -> bool:
        with self._lock:
            if self.left <= 0:
                return False
            self.left -= 1
            self.cut += 1
            return True


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()
