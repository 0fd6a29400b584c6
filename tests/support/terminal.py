"""A command run on a real pseudo-terminal: what a person at a terminal sees, and answers it is given."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios
from collections.abc import Sequence


def on_a_terminal(argv: Sequence[str], answer: bytes = b"", timeout: float = 120.0) -> tuple[int, str]:
    """Run `argv` with stdin, stdout and stderr on a new 120x30 pty, type `answer` at it, and return the exit
    status and everything it printed (a new pty is 0x0, where tqdm draws no bar)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen(list(argv), stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    if answer:
        os.write(controller, answer)
    said = bytearray()
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: every copy of the terminal's end is closed, the process has exited
            break
        if not chunk:
            break
        said += chunk
    os.close(controller)
    return proc.wait(timeout), said.decode(errors="replace")
