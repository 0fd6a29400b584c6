"""What creating an output file costs, in a fresh folder and right after files were deleted there
(not a test).

    python tests/perf/create_after_delete.py [FOLDER]

FOLDER (default: a new temporary folder) must be on the filesystem to be judged. Prints microseconds
per file written as the outbox does (temporary name, write, rename) for: 400 files in a new folder;
400 more in another folder 2 s after 2,000 files there were deleted; 400 in a new folder beside it;
and 400 in the first of those two 90 s later. On ext4 without a journal each create skips, one by
one, the inodes freed in the last minute or so (5 minutes more while their inode table block is not
yet written back), except those freed in the current second: the second and third figures are several
times the first. Journaled ext4 and tmpfs do not do this. Takes about 100 s.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path


def write_outputs(folder: Path, n: int, tag: str) -> float:
    """Microseconds per file: create a temporary name, write 600 bytes, rename into place."""
    data = b"x" * 600
    t0 = time.perf_counter()
    for i in range(n):
        tmp = folder / f".tmp-{tag}{i}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        os.write(fd, data)
        os.close(fd)
        os.replace(tmp, folder / f"{tag}{i}.json")
    return (time.perf_counter() - t0) / n * 1e6


def main(root: Path) -> None:
    fresh = root / "fresh"
    fresh.mkdir()
    print(f"{write_outputs(fresh, 400, 'a'):8.1f} us per file, new folder")
    churn = root / "churn"
    churn.mkdir()
    write_outputs(churn, 2000, "old")
    for p in churn.iterdir():
        p.unlink()
    time.sleep(2)  # ext4 does not count an inode freed in the current second as recent
    print(f"{write_outputs(churn, 400, 'b'):8.1f} us per file, 2 s after deleting 2,000 files in the same folder")
    beside = root / "beside"
    beside.mkdir()
    print(f"{write_outputs(beside, 400, 'c'):8.1f} us per file, a new folder beside it")
    time.sleep(90)
    print(f"{write_outputs(churn, 400, 'd'):8.1f} us per file, the same folder 90 s later")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(tempfile.mkdtemp(dir=sys.argv[1])))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
