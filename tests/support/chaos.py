"""kill -9 `worker watch` again and again while a producer keeps dropping images into its inbox (half
renamed into place, half written in place in three chunks), then one watch to the end and SIGTERM: every
input must end with exactly one row, one complete outcome and one archived copy (tests/test_crash.py's
checks, at a scale too slow for the suite).

    python tests/support/chaos.py WORK_DIR ROUNDS IMAGES [--pages | --stacks]   # e.g. /tmp/chaos 60 2000 (about 2 minutes here)

WORK_DIR must not exist; it keeps the inbox, outbox, archive and database for a look afterwards.
--pages: every tenth image becomes a 3-page TIFF and the watcher runs with `pipeline.pages: all`; each
such input's one JSON must list its three pages. --stacks: the same, the TIFFs uncompressed and over the byte
limit (8 bytes x pipeline.max_pixels, set to the JPEGs' 48,000 pixels), so that each is read page by page."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.conftest import CACHE, wait_for
from tests.support.crash import check_outcome, kill_rounds, make_corpus, runs, start, write_config


def produce(src: Path, inbox: Path, rels: list[str], rng: random.Random) -> None:
    """Every input once, in a random order, a few ms apart: odd ones renamed into place from a hidden name,
    even ones written in place in three chunks 20 ms apart (the watcher must wait for the whole file)."""
    order = rels[:]
    rng.shuffle(order)
    for i, rel in enumerate(order):
        data = (src / rel).read_bytes()
        dest = inbox / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if i % 2:
            hidden = dest.with_name(f".{dest.name}.part")
            hidden.write_bytes(data)
            os.rename(hidden, dest)
        else:
            with open(dest, "wb") as f:
                k = len(data) // 3
                for part in (data[:k], data[k:2 * k], data[2 * k:]):
                    f.write(part)
                    f.flush()
                    time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.03))


# with --stacks: each image's pixels at most (the corpus's crops are 240x200 at most), 384,000 bytes a file
STACK_MAX_PIXELS = 48_000


def as_stacks(src: Path, rels: list[str], uncompressed: bool = False) -> list[str]:
    """Every tenth JPEG replaced by a 3-page TIFF of it and its two neighbours (distinct content each)."""
    import cv2

    out = []
    for i, rel in enumerate(rels):
        if i % 10 or rel.startswith("bad_"):
            out.append(rel)
            continue
        pages = [cv2.imread(str(src / r)) for r in (rel, rels[i + 1], rels[i + 2])]
        tif = rel.replace(".jpg", ".tif")
        assert cv2.imwritemulti(str(src / tif), pages, [cv2.IMWRITE_TIFF_COMPRESSION, 1] if uncompressed else [])
        assert not uncompressed or (src / tif).stat().st_size > 8 * STACK_MAX_PIXELS
        (src / rel).unlink()
        out.append(tif)
    return out


def main(tmp: Path, rounds: int, n: int, pages: bool = False, stacks: bool = False) -> None:
    tmp.mkdir(parents=True)
    rels = make_corpus(tmp / "src", CACHE / "samples", n=n, bad=10)
    pages = pages or stacks
    if pages:
        rels = as_stacks(tmp / "src", rels, uncompressed=stacks)
    conf = write_config(tmp)
    if pages:
        limit = f", max_pixels: {STACK_MAX_PIXELS}" if stacks else ""
        conf.write_text(conf.read_text().replace("pipeline: {max_attempts: 10}",
                                                 f"pipeline: {{max_attempts: 10, pages: all{limit}}}"))
    (tmp / "inbox").mkdir()
    producer = threading.Thread(target=produce, args=(tmp / "src", tmp / "inbox", rels, random.Random(5)))
    producer.start()
    killed = kill_rounds(conf, ["watch"], rounds, random.Random(3))
    producer.join()
    print("killed", killed, "of", rounds, flush=True)
    started = runs(tmp / "worker.db")
    proc = start(conf, "watch")
    assert wait_for(lambda: runs(tmp / "worker.db") > started, 120)
    assert wait_for(lambda: not [p for p in (tmp / "inbox").rglob("*") if p.is_file()], 600), "inbox not drained"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    check_outcome(tmp, rels)
    archived = sorted(p.relative_to(tmp / "archive").as_posix() for p in (tmp / "archive").rglob("*") if p.is_file())
    expected = sorted(("failed/" if r.startswith("bad_") else "done/") + r for r in rels)
    assert archived == expected, sorted(set(expected) ^ set(archived))[:10]
    with contextlib.closing(sqlite3.connect(tmp / "worker.db")) as c:  # `with` alone would not close it
        print("rows (status, count, most attempts):",
              c.execute("SELECT status, count(*), max(attempts) FROM images GROUP BY status").fetchall())
        print("starts:", c.execute("SELECT count(*) FROM runs").fetchone()[0])
    if pages:
        import json

        tiffs = [r for r in rels if r.endswith(".tif")]
        assert all(len(json.loads((tmp / "outbox" / f"{r}.json").read_text())["pages"]) == 3 for r in tiffs)
        print(len(tiffs), "3-page TIFFs, each one JSON of 3 pages" + (", each read page by page" if stacks else ""))
    print("OK: every input once, complete and archived")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "--pages" in sys.argv[4:], "--stacks" in sys.argv[4:])
