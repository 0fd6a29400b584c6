"""Per-image costs on the hot path, old way against new, side by side in one run (not a test).

    python tests/perf/hot_path.py

Prints microseconds per call for: normalising a 224x224 tensor (broadcast over the colour axis vs
one channel at a time), reading an image's size (Pillow vs the header reader), encoding a 1920x1440
mask as PNG (OpenCV vs numpy bit packing + zlib), decoding a photo saved as a 640 px and a 1920 px
JPEG (OpenCV vs `decode`, which hands plain JPEGs to simplejpeg), the truncated-JPEG check (a
backward search for the last scan vs searches from both ends), the ledger check
(SQLAlchemy `execute` vs the compiled statement on a DB-API connection), one recorder
transaction with a claim, and eight images' timing rows written through SQLAlchemy's executemany vs
the recorder's compiled statement on the DB-API cursor.
"""

from __future__ import annotations

import io
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import cv2
import numpy as np
from PIL import Image
from sqlalchemy import bindparam, insert, select

from worker.images import check_header, decode
from worker.images.headers import _check_jpeg_complete
from worker.outputs.maskpng import encode_mask_png
from worker.models.card import Preprocess
from worker.measure.samples import fetch_samples
from worker.store.db import open_db
from worker.store.ledger import Ledger
from worker.store.recorder import Claimed, Recorder, RunInfo
from worker.store.schema import ImageRow, TimingRow
from worker.tasks.preprocess import prepare


def per_call_us(fn: Callable[[int], object], n: int = 500) -> float:
    """Best of 3 passes (noise only adds time)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
    spec = Preprocess(color="rgb", resize="shorter-crop", resize_shorter=256, mean=(127.0,) * 3, std=(128.0,) * 3)
    mean, inv = np.float32([127.0] * 3), 1.0 / np.float32([128.0] * 3)

    def old_prepare(i: int) -> np.ndarray:  # the same resize and crop, normalised by broadcasting
        crop = cv2.cvtColor(cv2.resize(image, (341, 256), interpolation=cv2.INTER_LINEAR)[16:240, 58:282],
                            cv2.COLOR_BGR2RGB)
        return np.ascontiguousarray(((crop.astype(np.float32) - mean) * inv).transpose(2, 0, 1))

    assert np.array_equal(old_prepare(0), prepare(image, spec, (224, 224))[0])
    rows = [("preprocess 640x480 -> 224x224, broadcast over colour (old)", per_call_us(old_prepare)),
            ("preprocess 640x480 -> 224x224, one channel at a time (new)",
             per_call_us(lambda i: prepare(image, spec, (224, 224))))]
    ok, jpeg = cv2.imencode(".jpg", image)
    data = jpeg.tobytes()
    rows += [("image size with Pillow (old)", per_call_us(lambda i: Image.open(io.BytesIO(data)).size)),
             ("image size from the JPEG header (new)", per_call_us(lambda i: check_header(data, "x")))]
    yy, xx = np.mgrid[:1440, :1920]
    mask = ((xx // 37 + yy // 23) % 3 == 0) & (yy % 200 > 40)  # text-like blocks, a 1920 px page
    rows += [("mask 1920x1440 to PNG, OpenCV 8-bit (old)",
              per_call_us(lambda i: cv2.imencode(".png", mask.astype(np.uint8) * 255), n=20)),
             ("mask 1920x1440 to PNG, numpy bit packing + zlib (new)", per_call_us(lambda i: encode_mask_png(mask), n=20))]
    photo = decode((fetch_samples(Path(__file__).parents[2] / ".cache/worker") / "chelsea.png").read_bytes(), "c", 10**8)
    for width in (640, 1920):  # as `worker bench` makes its corpora: resized, JPEG quality 90
        big = cv2.resize(photo, (width, round(photo.shape[0] * width / photo.shape[1])), interpolation=cv2.INTER_CUBIC)
        jpg = cv2.imencode(".jpg", big, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
        assert np.array_equal(decode(jpg, "x", 10**8), cv2.imdecode(np.frombuffer(jpg, np.uint8), cv2.IMREAD_COLOR))

        def old_check(i: int, jpg: bytes = jpg) -> bool:
            return jpg.find(b"\xff\xd9", jpg.rfind(b"\xff\xda")) != -1

        n = 200 if width == 640 else 30
        rows += [(f"decode {big.shape[1]}x{big.shape[0]} JPEG, OpenCV imdecode (old)",
                  per_call_us(lambda i, j=jpg: cv2.imdecode(np.frombuffer(j, np.uint8), cv2.IMREAD_COLOR), n=n)),
                 (f"decode {big.shape[1]}x{big.shape[0]} JPEG, worker.images.decode (new)",
                  per_call_us(lambda i, j=jpg: decode(j, "x", 10**8), n=n)),
                 (f"truncated-JPEG check, {len(jpg) // 1000} KB, backward search (old)", per_call_us(old_check)),
                 (f"truncated-JPEG check, {len(jpg) // 1000} KB, from both ends (new)",
                  per_call_us(lambda i, j=jpg: _check_jpeg_complete(j, "x")))]
    with tempfile.TemporaryDirectory() as tmp:
        db = open_db(f"sqlite:///{Path(tmp) / 'p.db'}")
        lookup = select(ImageRow.status, ImageRow.attempts, ImageRow.error).where(
            ImageRow.rel_path == bindparam("rel"), ImageRow.sha256 == bindparam("sha"),
            ImageRow.model == bindparam("model"))

        def through_sqlalchemy(i: int) -> object:
            with db.connect() as c:
                return c.execute(lookup, {"rel": f"{i}.jpg", "sha": "s" * 64, "model": "m"}).first()

        ledger = Ledger(db, "m")
        rows += [("ledger check through Connection.execute (old)", per_call_us(through_sqlalchemy)),
                 ("ledger check, compiled SQL on a DB-API connection (new)",
                  per_call_us(lambda i: ledger.check(f"{i}.jpg", "s" * 64)))]
        ledger.close()
        rec = Recorder(db, RunInfo("bench", tmp, "m", "", "cpu", {}))
        rows.append(("recorder: one transaction with one claim", per_call_us(
            lambda i: rec._write([Claimed(f"{i}-{time.perf_counter_ns()}.jpg", "s" * 64, 1)]), n=200)))
        # eight images' timing rows in one transaction: SQLAlchemy's executemany vs the compiled statement
        image_ids = [r[0] for r in rec._conn.exec_driver_sql("SELECT id FROM images LIMIT 8")]
        rec._conn.commit()
        timing = dict(run_id=rec.run_id, queue_wait_ms=1.0, decode_ms=2.0, preprocess_ms=1.0, infer_ms=15.0,
                      postprocess_ms=0.4, write_ms=0.8, total_ms=30.0, batch_size=1)
        batch = [dict(image_id=i, **timing) for i in image_ids]

        def timings_via(execute: Callable[[list[dict]], object]) -> Callable[[int], None]:
            def write(i: int) -> None:
                with rec._conn.begin() as t:
                    execute(batch)
                    t.rollback()  # the same eight rows every time
            return write

        rows += [("recorder: 8 timing rows through Connection.execute (old)",
                  per_call_us(timings_via(lambda b: rec._conn.execute(insert(TimingRow.__table__), b)), n=200)),
                 ("recorder: 8 timing rows, compiled SQL on the DB-API cursor (new)",
                  per_call_us(timings_via(lambda b: rec._hot["timings"].run(rec._conn, b)), n=200))]
        rec.close()
        db.dispose()
    for name, us in rows:
        print(f"{us:9.1f} us  {name}")


if __name__ == "__main__":
    sys.exit(main())
