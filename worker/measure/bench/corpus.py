"""The bench's corpora: the sample photographs resized and saved as JPEGs, and what creating a file costs
where the outputs go."""

from __future__ import annotations

import time
from pathlib import Path

import cv2

from worker.images import decode


def make_corpus(samples: Path, width: int, count: int, dest: Path) -> list[Path]:
    """`count` JPEGs `width` px wide, cycling through the sample photographs."""
    dest.mkdir(parents=True, exist_ok=True)
    # the worker's own decoder: OpenCV's imread would print libpng's colour-profile warnings
    sources = [decode(p.read_bytes(), p.name, 0) for p in sorted(samples.iterdir()) if p.suffix in (".png", ".jpg")]
    sources = [s for s in sources if s.shape[1] >= 300]
    out = []
    for i in range(count):
        img = sources[i % len(sources)]
        h = round(img.shape[0] * width / img.shape[1])
        big = cv2.resize(img, (width, h), interpolation=cv2.INTER_CUBIC)
        path = dest / f"img_{i:04d}.jpg"
        cv2.imwrite(str(path), big, [cv2.IMWRITE_JPEG_QUALITY, 90])
        out.append(path)
    return out


# Creating a file normally costs about 0.1 ms here. ext4 without a journal (this machine's) skips
# every inode freed in the last minute or so (five minutes more while its inode table block is not
# yet written back), one by one, on each create: after thousands of deletions nearby, each new file
# costs ~1 ms of kernel CPU (tests/perf/create_after_delete.py). B and C pay it (C for every output),
# the limit does not; the bench reports it so that such a round is seen for what it is.
SLOW_CREATE_US = 300.0


def _create_cost(folder: Path, n: int = 50) -> float:
    """Microseconds to create, write and close one small file in `folder` (made if missing), mean of `n`.

    The files are kept (deleting them would slow the creates that follow, see SLOW_CREATE_US)."""
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(n):
        (folder / f".create-probe-{i}").write_bytes(b"{}")
    return (time.perf_counter() - t0) / n * 1e6


def copies_of_first(files: list[Path]) -> list[int]:
    """Indexes of the later files with the same bytes as the first (the corpus repeats its pictures)."""
    first = files[0].read_bytes()
    return [i for i, p in enumerate(files) if i and p.stat().st_size == len(first) and p.read_bytes() == first]
