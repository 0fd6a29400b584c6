"""The bench's parts that can be checked cheaply: its corpus, and D (watch mode fed at a steady rate)."""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT
from worker.measure.bench.loops import plain_preprocess
from worker.measure.bench.corpus import _create_cost, copies_of_first, make_corpus
from worker.measure.bench.results import CorpusResult, as_dicts, verdicts
from worker.measure.bench.steady import STAGES, Steady, _bench_heap_frozen, _steady, first_by_stage
from worker.images import decode
from worker.models.lookup import find_card
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
    assert d.pipeline_ms.shape == d.landed_ms.shape == (4,) and d.stage_ms.shape == (4, len(STAGES))
    # every image was decoded and run; the stages recorded fit within its total
    assert np.all(d.stage_ms[:, STAGES.index("decode")] > 0) and np.all(d.stage_ms[:, STAGES.index("infer")] > 0)
    assert np.all(d.stage_ms.sum(axis=1) <= d.pipeline_ms + 0.01)
    assert first_by_stage(d, [2, 3]).startswith(f"queue_wait {d.stage_ms[0, 0]:.1f} / ")
    # landing comes before intake, and the archive move after the result: the outside view is the longer
    assert np.all(d.pipeline_ms > 0) and np.all(d.landed_ms >= d.pipeline_ms)
    assert sorted(p.name for p in (work / "archive" / "done").iterdir()) == [p.name for p in files]
    assert not [p for p in (work / "inbox").iterdir()]  # every file taken, no temporary name left behind
    assert all(p.exists() for p in files)  # the corpus itself is copied in, never moved


def test_steady_checks_its_arrays() -> None:
    with pytest.raises(ValueError, match="shapes"):
        Steady(pipeline_ms=np.ones(3), landed_ms=np.ones(2), stage_ms=np.ones((3, len(STAGES))))
    with pytest.raises(ValueError, match="shapes"):
        Steady(pipeline_ms=np.ones(0), landed_ms=np.ones(0), stage_ms=np.ones((0, len(STAGES))))
    with pytest.raises(ValueError, match="shapes"):
        Steady(pipeline_ms=np.ones(3), landed_ms=np.ones(3), stage_ms=np.ones((3, 2)))


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


def _result(model: str, width: int, **figures: float) -> CorpusResult:
    base = dict(images=300, bare_1t=100.0, bare_best=200.0, bare_best_at="2t b4", bare_parallel=180.0,
                decode_ms=1.2, preprocess_ms=0.5, postprocess_ms=0.1, plain_preprocess_ms=1.5, limit=160.0,
                limit_parallel=150.0, naive=100.0, naive_worker_pre=110.0, worker=144.0, ratio_naive=1.44,
                ratio_naive_worker_pre=1.3, worker_p50_ms=10.0, worker_p99_ms=20.0, worker_rss_peak_mb=180.0,
                steady_rate=72.0, steady_first_ms=20.0, steady_p50_ms=20.0, steady_p99_ms=40.0,
                steady_landed_p50_ms=60.0, steady_landed_p99_ms=90.0, create_file_us=30.0)
    return CorpusResult(model=model, width=width, **{**base, **figures})  # type: ignore[arg-type]


def _code(what: str) -> str:
    """A target's name in the bench's table, as its wording ends: `... (C/limit)` -> `C/limit`."""
    return what.rsplit("(", 1)[1].rstrip(")")


def test_verdicts_hold_each_corpus_to_the_targets() -> None:
    results = [_result("efficientnet-lite0", 640, worker=135.8, ratio_naive=1.29, worker_rss_peak_mb=401.0),
               _result("efficientnet-lite0", 1920, ratio_naive=1.5, steady_p99_ms=40.1, steady_first_ms=41.0),
               _result("yolov3-tiny", 640, worker=136.0, ratio_naive=0.5)]
    got = {(v.where, _code(v.what)): v for v in verdicts(results)}
    assert {k: v.met for k, v in got.items()} == {
        ("efficientnet-lite0 640 px", "C/limit"): False,  # 135.8 / 160 = 0.849
        ("efficientnet-lite0 640 px", "C/B"): False,  # 1.29 < 1.3
        ("efficientnet-lite0 640 px", "D p99/p50"): True,  # 2.0 is within
        ("efficientnet-lite0 640 px", "D first/p99"): True,
        ("efficientnet-lite0 640 px", "C peak RSS"): False,
        ("efficientnet-lite0 1920 px", "C/limit"): True,  # 0.90
        ("efficientnet-lite0 1920 px", "C/B"): True,  # 1.5 against 1920 px's own target, 1.5
        ("efficientnet-lite0 1920 px", "D p99/p50"): False,  # 2.005
        ("efficientnet-lite0 1920 px", "D first/p99"): False,  # the first image over p99: a cold start
        ("efficientnet-lite0 1920 px", "C peak RSS"): True,
        ("yolov3-tiny 640 px", "C/limit"): True,  # 136 / 160 = 0.85 exactly; C/B: efficientnet-lite0's only
        ("yolov3-tiny 640 px", "D p99/p50"): True,
        ("yolov3-tiny 640 px", "D first/p99"): True,
    }
    assert got[("efficientnet-lite0 640 px", "C/limit")].value == pytest.approx(0.84875)
    assert str(got[("efficientnet-lite0 640 px", "C/B")]).startswith("MISSED  efficientnet-lite0 640 px")
    assert str(got[("efficientnet-lite0 640 px", "C peak RSS")]).endswith(
        "worker run peak memory over 300 images, MB (C peak RSS) 401 <= 400")
    # --json carries them per corpus, beside the figures
    (first, *_) = as_dicts(results)
    assert first["ratio_limit"] == pytest.approx(0.84875) and first["images"] == 300
    assert [(_code(t["what"]), t["met"]) for t in first["targets"]] == [
        (what, v.met) for (where, what), v in got.items() if where == "efficientnet-lite0 640 px"]


def test_copies_of_first_finds_the_first_pictures_repeats_in_a_corpus(samples: Path, tmp_path: Path) -> None:
    files = make_corpus(samples, 320, 20, tmp_path / "corpus")  # cycles through the sample photographs
    copies = copies_of_first(files)
    first = files[0].read_bytes()
    assert copies and all(files[i].read_bytes() == first for i in copies)
    assert all(files[i].read_bytes() != first for i in range(1, len(files)) if i not in copies)
    assert 0 not in copies


def test_d_runs_with_the_benchs_own_objects_out_of_the_collector_and_gives_them_back() -> None:
    kept = [[i] for i in range(1000)]  # the bench's own long-lived objects, as its corpora and sessions
    with pytest.raises(RuntimeError), _bench_heap_frozen():
        assert gc.get_freeze_count() >= len(kept)  # full collections during D do not scan them
        raise RuntimeError("D failed")
    assert gc.get_freeze_count() == 0  # thawed, even after a failure


def test_the_bench_feeds_a_users_own_model_as_the_worker_does(tmp_path: Path) -> None:
    """A channels-last model that takes uint8 pixels: A, B and C each give it its layout and element type
    (before, A's float32 NCHW tensors stopped the bench with onnxruntime's INVALID_ARGUMENT traceback)."""
    import yaml
    from onnx import TensorProto

    from click.testing import CliRunner

    from tests.conftest import CACHE
    from tests.support.onnx_models import card_file, channels_last_model
    from worker.cli import cli

    models = tmp_path / "models"
    folder = card_file(models, "tf", "task: segment\ninput: {name: input, size: [32, 48], layout: nhwc}\n"
                        "preprocess: {color: rgb, resize: stretch, mean: [0, 0, 0], std: [1, 1, 1]}\n"
                        "postprocess: {output: logits}\nlabels: [background, leaf, sky]")
    channels_last_model(folder / "tf.onnx", TensorProto.UINT8)
    settings = yaml.safe_load((ROOT / "config.yaml").read_text())  # C runs `worker run` with this config
    settings.update(models_dir=str(models), cache_dir=str(CACHE))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(settings))
    # through the command, with --check: exit 1 exactly when a target is missed (12 images rarely meet them)
    out = CliRunner().invoke(cli, ["--config", str(tmp_path / "config.yaml"), "bench", "--model", "tf", "--width",
                                   "640", "--images", "12", "--rounds", "1", "--check", "--json",
                                   str(tmp_path / "bench.json")])
    (r,) = json.loads((tmp_path / "bench.json").read_text())
    assert r["model"] == "tf" and r["images"] == 12
    assert min(r[k] for k in ("bare_1t", "bare_parallel", "naive", "naive_worker_pre", "worker", "steady_p50_ms")) > 0
    assert "    round 1: A 1 thread " in out.stdout and "Issue" not in out.stdout
    missed = [t for t in r["targets"] if not t["met"]]
    assert out.exit_code == (1 if missed else 0), out.output
    assert f"{len(r['targets']) - len(missed)} of {len(r['targets'])} targets met" in out.stdout


def test_a_json_path_that_cannot_be_written_is_said_before_the_bench_runs(tmp_path: Path) -> None:
    """`worker bench --json` wrote its file with a traceback at the end of its minutes when it could not;
    a folder that cannot be made is said at once, and a folder given as the file by click."""
    from click.testing import CliRunner

    from worker.cli import cli
    from worker.errors import ConfigError

    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "b.json"
    out = CliRunner().invoke(cli, ["bench", "--model", "efficientnet-lite0", "--json", str(target)])
    assert isinstance(out.exception, ConfigError)  # main() prints it and exits 2
    assert str(out.exception) == f"--json {target}: cannot make its folder: File exists"
    out = CliRunner().invoke(cli, ["bench", "--model", "efficientnet-lite0", "--json", str(tmp_path)])
    assert out.exit_code == 2 and "is a directory" in out.output
