"""Files written and moved so that no reader ever sees half of one: the atomic write (a temporary name,
then a rename over the final one), the one mover of input files (verified across filesystems), names
that fit, and what a crash left behind."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path


from worker.errors import WorkerError
from worker.host.mounts import network_filesystem
from worker.host.processes import life, life_ended


TMP_PREFIX = ".tmp-"
FULL = {errno.ENOSPC, errno.EDQUOT}  # the filesystem, not the file: writes wait for room


def inside(root: Path, rel: str) -> Path:
    """root/rel, refusing anything that would land outside root ('..', absolute paths).

    A lexical check (no filesystem calls; it runs for every output file): the outbox is ours, so a
    symbolic link inside it is the administrator's choice, not an input's."""
    norm = posixpath.normpath(rel)
    if posixpath.isabs(norm) or norm == ".." or norm.startswith("../") or norm == ".":
        raise WorkerError(f"refusing path outside {root}: {rel!r}")
    return root / norm


NAME_MAX = 255  # bytes in one file name: ext4, XFS, Btrfs, tmpfs, ZFS and APFS alike


def fit_name(name: str, room: int = 0) -> str:
    """`name` (one path component) as it is when its bytes and `room` more fit in one file name;
    otherwise cut short: its start (never inside a character), "~", 10 hex digits of the whole name's
    sha256 (two long names that share a start stay apart) and its extension, `room` bytes under the limit.

    The outputs add up to 12 bytes to an input's name (".overlay.jpg"): an input name over 243 bytes,
    about 80 characters of Chinese or Japanese, would otherwise fail them with "File name too long"."""
    raw = os.fsencode(name)
    if len(raw) + room <= NAME_MAX:
        return name
    ext = os.fsencode(os.path.splitext(name)[1])
    ext = ext if len(ext) <= 16 else b""
    tag = b"~" + hashlib.sha256(raw).hexdigest()[:10].encode()
    keep = NAME_MAX - room - len(tag) - len(ext)
    while keep > 0 and 0x80 <= raw[keep] < 0xC0:  # a UTF-8 continuation byte: back to its character's start
        keep -= 1
    return os.fsdecode(raw[:keep] + tag + ext)


# a temporary's name ends with its writer's life (worker.host.processes.life: pid namespace and boot, pid, start
# time; never the pid alone, which repeats across containers) and thread: remove_temporaries tells a crash's from
# a live worker's by it; a temporary that nothing has changed for this long is a crash's whatever its name
STALE_TEMP_S = 3600.0
_OWNER = re.compile(r"\.([0-9a-f]{8}-\d+-\d+)\.\d+$")
_LIFE = life()  # this process's, once: a prepare process is a process started anew, with a life of its own


def _owner_suffix() -> str:
    return f".{_LIFE}.{threading.get_native_id()}"


class Staged:
    """The output files of one image written under temporary names, and the removals its outcome calls for, made
    only when `settle(True)`: published once the outcome's commit won (fleet mode: a worker whose claim passed
    to another while it worked never replaces nor removes that one's outputs)."""

    def __init__(self) -> None:
        self.renames: list[tuple[Path, Path]] = []
        self.removals: list[Path] = []

    def settle(self, publish: bool) -> None:
        """Rename the temporaries into place and make the removals (publish), or delete the temporaries."""
        for tmp, path in self.renames:
            if publish:
                os.replace(tmp, path)
            else:
                tmp.unlink(missing_ok=True)
        for path in self.removals if publish else ():
            path.unlink(missing_ok=True)
        self.renames, self.removals = [], []


_staging = threading.local()  # the Staged of the block `staged()` runs on this thread, if any


@contextlib.contextmanager
def staged() -> Iterator[Staged]:
    """While the block runs, this thread's write_atomic and remove_output are held in a Staged (discarded if the
    block raises)."""
    stage = _staging.stage = Staged()
    try:
        yield stage
    except BaseException:
        stage.settle(False)
        raise
    finally:
        _staging.stage = None


def remove_output(path: Path) -> None:
    """Remove an output file (an earlier outcome's), now or, in a `staged()` block, when its stage is published."""
    stage: Staged | None = getattr(_staging, "stage", None)
    if stage is not None:
        stage.removals.append(path)
    else:
        path.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temporary name beside `path`, then rename it over `path`.

    The file gets the usual permissions (0666 less the umask), as any program's output would: mkstemp
    would make it 0600, unreadable to the people and services that collect results. The temporary
    name is unique per process and thread, so the only file it can meet is one left by a crash (then
    truncated; `remove_temporaries` clears those at start)."""
    unique = _owner_suffix()
    tmp = path.parent / f"{TMP_PREFIX}{fit_name(path.name, len(TMP_PREFIX) + len(unique))}{unique}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(tmp, flags, 0o666)
    except FileNotFoundError:  # first file in this folder (a mkdir per file would cost a syscall each time)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, flags, 0o666)
    stage: Staged | None = getattr(_staging, "stage", None)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if stage is not None:
            stage.renames.append((tmp, path))
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_temporaries(root: Path) -> int:
    """Delete the temporary files a crash left behind under root (never complete outputs).

    Another worker may be writing into the same folder (two `worker run`s of one folder share an
    outbox, as do containers on one volume): its temporaries are its own, in flight. A temporary is left
    over when the process life its name gives (see _owner_suffix) has ended on this machine, in this pid
    namespace, or when nothing has changed it for STALE_TEMP_S: another container's, or another host's on
    a network share, only then."""
    n = 0
    if not root.exists():
        return n
    shared = network_filesystem(root)
    for p in root.rglob(TMP_PREFIX + "*"):
        owner = _OWNER.search(p.name)
        try:
            stale = time.time() - p.lstat().st_ctime >= STALE_TEMP_S
        except FileNotFoundError:  # its writer renamed it meanwhile
            continue
        if stale or (not shared and owner is not None and life_ended(owner[1]) is True):
            p.unlink(missing_ok=True)
            n += 1
    return n


def remove_temporaries_of(pid: int, folders: Iterable[Path]) -> int:
    """Delete the temporary files that process `pid`, gone, left in `folders` (each folder itself, not below
    it): where a prepare process that died was writing, told by the images it held. Only this pid namespace's
    (its child's): another container's pid of the same number is another process."""
    n = 0
    for folder in set(folders):
        try:
            entries = list(os.scandir(folder))
        except OSError:  # never made, or gone: nothing of it there
            continue
        for entry in entries:
            owner = _OWNER.search(entry.name) if entry.name.startswith(TMP_PREFIX) else None
            if owner is not None and owner[1].startswith(f"{_LIFE.split('-')[0]}-{pid}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    n += 1
    return n


def move_verified(src: Path, dst: Path) -> Path:
    """Move src to dst (renaming dst with a content suffix if taken by other content).

    Same filesystem: one rename. Across filesystems: copy to a temporary name, verify size and
    sha256, rename, then delete the source, so a crash never leaves the file in neither place.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    st = os.lstat(src)
    if not stat.S_ISREG(st.st_mode):  # a named pipe with an image's name: never opened (it would block)
        if dst.exists():
            dst = dst.with_name(fit_name(f"{dst.name}.{st.st_ino}{dst.suffix}"))
        try:
            os.replace(src, dst)
        except OSError as e:
            raise WorkerError(f"{src}: not a regular file, and it cannot be renamed to {dst}: {e.strerror}") from None
        return dst
    if dst.exists():
        digest = _sha256(src)[:12]
        if _sha256(dst)[:12] != digest:
            dst = dst.with_name(fit_name(f"{dst.name}.{digest}{dst.suffix}"))
    try:
        os.replace(src, dst)
        return dst
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    if not os.access(src.parent, os.W_OK):  # a read-only share: the copy would be made, the source never removed
        raise PermissionError(errno.EACCES, f"{src.parent} is not writable: the file cannot be moved out of it")
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f"{TMP_PREFIX}copy-", suffix=_owner_suffix())
    os.close(fd)
    try:
        shutil.copy2(src, tmp)
        if os.path.getsize(tmp) != os.path.getsize(src) or _sha256(Path(tmp)) != _sha256(src):
            raise WorkerError(f"{src}: copy to {dst} did not verify; source kept")
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    src.unlink()
    return dst


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
