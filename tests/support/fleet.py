"""A fleet on one machine: worker processes each in a UTS namespace of its own (its own hostname, as a host
of its own would have; optionally pid 1 of a pid namespace), sharing one folder and one fresh database on
the PostgreSQL server this project's machines run (127.0.0.1:5432, or $WORKER_TEST_POSTGRES)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CACHE, ROOT

ADMIN = os.environ.get("WORKER_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
# set by .ci/run: a server that cannot be reached fails these tests instead of skipping them
REQUIRED = os.environ.get("WORKER_REQUIRE_POSTGRES") == "1"


def _admin() -> Any:
    psycopg = pytest.importorskip("psycopg", reason="psycopg not installed (pip install -e '.[postgres]')")
    try:
        return psycopg.connect(ADMIN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as e:
        if REQUIRED:
            raise
        pytest.skip(f"no PostgreSQL server at {ADMIN} ({str(e).strip()})")


@contextmanager
def fresh_database() -> Iterator[str]:
    """A database of its own on the server, dropped afterwards; yields its SQLAlchemy URL."""
    name = f"worker_test_{uuid.uuid4().hex[:12]}"
    with _admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        with _admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def rows(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1)) as c:
        return c.execute(sql, params).fetchall()


def write_config(tmp: Path, url: str, models: Path, lease_s: float = 2.0, **more: str) -> Path:
    conf = tmp / "config.yaml"
    extra = "".join(f"{k}: {v}\n" for k, v in more.items())
    conf.write_text(f"inbox: inbox\noutbox: outbox\narchive: archive\ndb: {url}\nmodel: stand-in\n"
                    f"models_dir: {models}\ncache_dir: {CACHE}\n"
                    f"fleet: {{lease_s: {lease_s}, scan_s: 0.5, poll_s: 0.2}}\n"
                    "watch: {settle_s: 0.2, create_inbox: true}\nmetrics: {memory_sample_s: 1.0}\n" + extra)
    return conf


@dataclass
class Host:
    name: str
    proc: subprocess.Popen
    log: Path

    def said(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)  # the namespace's whole tree: unshare, the shell, the worker

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait(30)


def start_host(conf: Path, name: str, *args: str, pid1: bool = False) -> Host:
    """`worker ARGS` as host `name`: a UTS namespace (and with `pid1`, a pid namespace where it is pid 1) of its
    own, made in a user namespace, so no root is needed."""
    ns = ["unshare", "--user", "--map-root-user", "--uts", *(["--pid", "--fork", "--mount", "--mount-proc"] if pid1 else [])]
    log = conf.parent / f"{name}.log"
    cmd = [*ns, "sh", "-c", 'hostname "$0" && exec "$@"', name, sys.executable, "-m", "worker", "--config", str(conf),
           *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=conf.parent, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    return Host(name, proc, log)


def can_make_hosts() -> None:
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--uts", "--pid", "--fork", "--mount",
                            "--mount-proc", "hostname", "probe"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"no UTS and pid namespaces of its own here (unshare: {probe.stderr.strip()})")
