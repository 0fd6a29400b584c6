"""The bench's parts that can be checked cheaply: its corpus, and D (watch mode fed at a steady rate)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT
from worker.bench import Steady, _create_cost, _steady, make_corpus, plain_preprocess
from worker.images import decode
from worker.models.card import find_card
from worker.tasks.preprocess import prepare


def test_corpus_is_jpegs_of_the_asked_width(samples: Path, tmp_path: Path) -> None:
    files = make_corpus(samples, 640, 5, tmp_path / "c640")
    assert [p.name for p in files] == [f"img_{i:04d}.jpg" for i in range(5)]
    assert {decode(p.read_bytes(), p.name, 0).shape[1] for p in files} == {640}


def test_create_probe_times_real_files_and_keeps_them(tmp_path: Path) -> None:
    out = tmp_path / "out"  # C's outbox, made by the probe before `worker run` writes into it
    assert _create_cost(out, n=5) > 0
    assert _create_cost(out, n=5) > 0  # an existing folder is fine; the same names are rewritten
    assert sorted(p.name for p in out.iterdir()) == [f".create-probe-{i}" for i in range(5)]


def test_steady_feeds_the_real_watcher_and_times_each_image(cfg, samples: Path, tmp_path: Path) -> None:
    files = make_corpus(samples, 640, 4, tmp_path / "corpus")
    work = tmp_path / "steady"
    cfg = dataclasses.replace(cfg, db=f"sqlite:///{tmp_path / 'steady.db'}")
    d = _steady(cfg, files, rate=8.0, work=work)
    assert d.pipeline_ms.shape == d.landed_ms.shape == (4,)
    # landing comes before intake, and the archive move after the result: the outside view is the longer
    assert np.all(d.pipeline_ms > 0) and np.all(d.landed_ms >= d.pipeline_ms)
    assert sorted(p.name for p in (work / "archive" / "done").iterdir()) == [p.name for p in files]
    assert not [p for p in (work / "inbox").iterdir()]  # every file taken, no temporary name left behind
    assert all(p.exists() for p in files)  # the corpus itself is copied in, never moved


def test_steady_checks_its_arrays() -> None:
    with pytest.raises(ValueError, match="shapes"):
        Steady(pipeline_ms=np.ones(3), landed_ms=np.ones(2))
    with pytest.raises(ValueError, match="shapes"):
        Steady(pipeline_ms=np.ones(0), landed_ms=np.ones(0))


@pytest.mark.parametrize("model", ["efficientnet-lite0", "yolov3-tiny", "ppocr-det"])  # crop, letterbox, stretch
def test_the_naive_loops_plain_preprocessing_makes_the_workers_tensor(samples: Path, model: str) -> None:
    card = find_card(ROOT / "models", model)
    size = (card.input.size[0], card.input.size[1])
    for name in ("coffee.png", "page.png", "astronaut.png"):
        image = decode((samples / name).read_bytes(), name, 0)
        plain, plain_geo = plain_preprocess(image, card.preprocess, size)
        ours, geo = prepare(image, card.preprocess, size)
        assert plain.shape == ours.shape == (3, *size) and plain.dtype == ours.dtype == np.float32
        # the same pixels; dividing by std instead of multiplying by 1/std differs in the last bit at most
        np.testing.assert_allclose(plain, ours, rtol=1e-6, atol=1e-6)
        assert plain_geo == geo
