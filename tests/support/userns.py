"""A test that must lower a per-user kernel limit, or mount a filesystem, runs in a user namespace of its
own (with a mount namespace of its own for mounts), where the limit is its own to set (/proc/sys/user/) and
its mounts are seen by no other process: the machine's settings and mount table stay as they are, and the
test needs no root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_INSIDE = "WORKER_TEST_IN_OWN_USER_NAMESPACE"  # the node id of the test that runs inside


def own_user_namespace(request: pytest.FixtureRequest, mounts: bool = False) -> bool:
    """False where the calling test has just run, whole, in a new user namespace (with a mount namespace
    of its own if `mounts`), and passed there (its output is the assertion's message otherwise); True
    inside that namespace, where it goes on as root of it.

    Skips where no such namespace can be made (`unshare --user --map-root-user`: a kernel or container
    that forbids them)."""
    if os.environ.get(_INSIDE) == request.node.nodeid:
        return True
    unshare = ["unshare", "--user", "--map-root-user", *(["--mount"] if mounts else [])]
    probe = subprocess.run([*unshare, "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"no user namespace of its own here (unshare: {probe.stderr.strip() or probe.returncode})")
    proc = subprocess.run([*unshare, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           request.node.nodeid], cwd=ROOT, capture_output=True, text=True, timeout=280,
                          env={**os.environ, _INSIDE: request.node.nodeid})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout, proc.stdout[-3000:]  # not skipped in there
    return False


def own_inotify_watches() -> int:
    """inotify watches this process holds (a new user namespace counts only its own processes')."""
    used = 0
    for info in Path("/proc/self/fdinfo").iterdir():
        try:
            used += sum(line.startswith("inotify wd:") for line in info.read_text().splitlines())
        except OSError:  # closed meanwhile
            continue
    return used
