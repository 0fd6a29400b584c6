"""Warming up before intake: one synthetic image through every stage, so that the first real one pays
for no first call."""

from __future__ import annotations

import functools
import logging

import cv2
import numpy as np

from worker.runtime.engine import Engine
from worker.images import decode
from worker.tasks import TaskAdapter

log = logging.getLogger("worker.pipeline")


# the constructor waits at most this long for its threads' warm-ups, all together (a slow GPU's first
# call on a thread can take seconds); past it intake starts anyway
WARM_UP_WAIT_S = 60.0


@functools.lru_cache(maxsize=1)
def synthetic_jpeg(max_pixels: int) -> bytes:
    """A photo-sized (1920x1080, or less within `max_pixels`) JPEG of noise, for warm-ups. Encoding it
    takes about 50 ms: made once per start (warm_up_stages, then the Pipeline's threads), and let go
    by the Pipeline once its threads have warmed up."""
    scale = min(1.0, (max_pixels / (1920 * 1080)) ** 0.5) if max_pixels else 1.0
    h, w = max(1, int(1080 * scale)), max(1, int(1920 * scale))
    image = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return cv2.imencode(".jpg", image)[1].tobytes()


def warm_up_stages(adapter: TaskAdapter, engine: Engine, max_pixels: int, depth: int = 8) -> None:
    """Decode, preprocess, infer and postprocess one synthetic photo-sized JPEG before intake starts.

    The first calls into OpenCV's codecs and resizers and into numpy's kernels cost tens of
    milliseconds (more on big images); without this the first real image would pay them."""
    try:
        x, geometry = adapter.preprocess(decode(synthetic_jpeg(max_pixels), "warm-up", max_pixels, depth))
        output = engine.run(x[None])[0]
    except Exception as e:  # only a warm-up: real images will say what is wrong, one by one
        log.warning("warm-up of the image stages failed: %s", e)
        return
    # a card that contradicts its model (a labels file for another model, a multi-class segmenter)
    # stops the worker here, instead of failing or mislabelling every image
    adapter.check_output(output, engine.other_outputs)
    try:
        adapter.postprocess(output, geometry)
    except Exception as e:
        log.warning("warm-up of the image stages failed: %s", e)
