"""Which filesystem a path is on, read from the kernel's mount table; what the watcher and the database
make of a network share."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from worker.host import mounts
from worker.intake.intake import Intake
from worker.intake.observer import observer_kind
from worker.intake.watch import WatchedInbox
from worker.store.db import open_db

# the format of /proc/self/mountinfo (proc(5)): mount point in field 5, the type after " - "
TABLE = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /mnt/scans rw,relatime shared:20 - nfs4 nas:/export/scans rw,vers=4.2
41 22 0:51 / /mnt/my\\040share rw,relatime shared:21 - cifs //nas/share rw,vers=3.1.1
42 22 8:2 / /mnt/scans2 rw,relatime shared:22 - xfs /dev/sdb1 rw
43 40 0:52 / /mnt/scans/local rw,relatime shared:23 - tmpfs tmpfs rw
44 22 0:53 / /mnt/over rw,relatime - nfs nas:/a rw
45 22 0:54 / /mnt/over rw,relatime - ext4 /dev/sdc1 rw
46 22 0:55 / /home/me/remote rw,nosuid - fuse.sshfs me@host:/data rw
"""


@pytest.mark.parametrize(("path", "kind"), [
    ("/", "ext4"), ("/srv/in", "ext4"), ("/mnt/scans", "nfs4"), ("/mnt/scans/day1/a.jpg", "nfs4"),
    ("/mnt/my share/in", "cifs"),  # the table writes a space as \040
    ("/mnt/scans2/in", "xfs"),  # a prefix of the name, not of the path
    ("/mnt/scans/local/x", "tmpfs"),  # the longest mount point wins
    ("/mnt/over/x", "ext4"),  # mounted over: the later mount hides the earlier
    ("/home/me/remote/in", "fuse.sshfs"),
])
def test_the_filesystem_a_path_is_on(path: str, kind: str) -> None:
    assert mounts.filesystem_type(Path(path), TABLE) == kind
    assert (kind in mounts.NETWORK_FILESYSTEMS) == (kind in ("nfs4", "cifs", "fuse.sshfs"))


def test_this_machines_table_agrees_with_findmnt(tmp_path: Path) -> None:
    if not mounts.MOUNTINFO.exists() or shutil.which("findmnt") is None:
        pytest.skip("no /proc/self/mountinfo or findmnt here")
    for path in (tmp_path, Path("/proc/self"), Path("/")):
        expected = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(path)],
                                  capture_output=True, text=True, check=True).stdout.strip()
        assert mounts.filesystem_type(path) == expected, path


def test_auto_polls_an_inbox_on_a_share_and_watches_a_local_one_natively(tmp_path: Path, on_a_share: Path,
                                                                         caplog) -> None:
    with caplog.at_level(logging.INFO, logger="worker.intake.watch"):
        assert observer_kind("auto", tmp_path) == "native"
        assert observer_kind("auto", on_a_share / "in") == "polling"
        assert observer_kind("polling", on_a_share) == "polling"
        assert observer_kind("native", on_a_share) == "native"  # asked for: kept, with a warning
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said[0][0] == "INFO" and "network share (nfs4): polling it every 1 s" in said[0][1]
    assert said[1][0] == "WARNING" and "wait for the rescan" in said[1][1] and len(said) == 2
    watched = WatchedInbox(Intake(on_a_share, (".jpg",), 1.0, 0.0, lambda job: None), "auto", 0.5)
    try:
        assert watched.kind == "polling" and type(watched._observer).__name__ == "PollingObserver"
    finally:
        watched.stop()


def test_a_database_on_a_share_is_warned_about(tmp_path: Path, on_a_share: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="worker.store.db"):
        open_db(f"sqlite:///{tmp_path}/local.db").dispose()
        assert not caplog.records
        open_db(f"sqlite:///{on_a_share}/shared.db").dispose()
    (record,) = caplog.records
    assert f"{on_a_share}/shared.db is on a network share (nfs4)" in record.getMessage()
