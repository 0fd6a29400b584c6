"""Which filesystem a path is on (Linux's /proc/self/mountinfo), and whether it is a network share.

Two choices hang on it. inotify reports only what this machine's kernel writes: a file that another
machine writes onto an NFS or SMB share makes no event here, so the watcher polls a share
(`watch.observer: auto`). And SQLite's WAL mode needs the database on a local disk
(https://sqlite.org/wal.html: "WAL does not work over a network filesystem"), so a database on a
share gets a warning.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# filesystems whose files other machines write (FUSE types as the kernel names them: fuse.<program>), and a
# virtual machine's folders shared from its host (virtiofs, VirtualBox, VMware; WSL's drvfs and 9p for C:\),
# where the host's writes make no inotify event in the guest either
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "ceph", "glusterfs", "lustre", "gpfs",
    "beegfs", "davfs", "fuse.sshfs", "fuse.glusterfs", "fuse.cephfs", "fuse.rclone", "fuse.s3fs",
    "fuse.gcsfuse", "fuse.davfs2", "fuse.juicefs", "fuse.moosefs", "fuse.lizardfs",
    "virtiofs", "vboxsf", "fuse.vmhgfs-fuse", "drvfs",
})
MOUNTINFO = Path("/proc/self/mountinfo")
_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline and backslash as \040 etc.


def filesystem_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem `path` is on ("ext4", "nfs4", "fuse.sshfs"): that of the last mount
    whose mount point is the longest prefix of its real path. None where it cannot be told (not Linux).
    `mountinfo`: the table's text (default: this process's)."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_bytes().decode("utf-8", "surrogateescape")
        except OSError:
            return None
    target = os.path.realpath(path)
    best, kind = -1, None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if not sep or len(fields) < 5 or not after:
            continue
        point = _OCTAL.sub(lambda m: chr(int(m[1], 8)), fields[4])
        inside = point == "/" or target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # >=: a later mount on the same point hides the earlier one
            best, kind = len(point), after[0]
    return kind


def network_filesystem(path: Path) -> str | None:
    """The type of the network filesystem `path` is on ("nfs4", "cifs"), None when it is a local one
    (or cannot be told)."""
    kind = filesystem_type(path)
    return kind if kind in NETWORK_FILESYSTEMS else None
