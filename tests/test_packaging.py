"""pyproject.toml's dependency bounds and the file that pins their lowest versions agree."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import CACHE, ROOT


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lowest_versions_file_pins_every_lower_bound() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted: dict[str, str] = {}
    for requirement in project["dependencies"] + extras["test"] + extras["postgres"]:
        # (an environment marker after `;`: onnxruntime-gpu and onnxruntime, one per platform, both pinned)
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(?:>=|==)\s*([0-9][^,;\s]*)(?:,[^;]*)?(?:\s*;.*)?",
                         requirement)
        assert m, f"no lower bound in {requirement!r}: the tests could not be run against its lowest version"
        wanted[_canonical(m[1])] = m[2]
    lines = [line.strip() for line in (ROOT / "tests" / "lowest-versions.txt").read_text().splitlines()]
    pinned = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert {_canonical(name): version for name, version in pinned.items()} == wanted


def _worker(site: Path, cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`worker ARGS` as a wheel's user runs it: the installed copy only, from a folder of their own."""
    return subprocess.run([sys.executable, "-m", "worker", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=600)


@pytest.mark.slow
def test_a_wheel_carries_its_cards_and_migrations_and_runs_away_from_the_checkout(
        tmp_path: Path, samples: Path, effnet_onnx: Path) -> None:
    """Before, the wheel held the package alone: installed from it, `models list` said the cards'
    folder was not there and a start could not migrate its database (both live in the checkout)."""
    src = tmp_path / "src"  # a copy: a build must not write into the checkout
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0:  # the tracked files only
        for name in listed.stdout.decode().split("\0"):
            if name and (ROOT / name).is_file():
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, src / name)
    else:  # not a git checkout (an unpacked archive)
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", ".cache", "var", "build", "dist",
                                                                "*.egg-info", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("worker-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "worker").rglob("*.py")}
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    shipped = {f"worker/_bundled/{p.relative_to(ROOT).as_posix()}" for p in
               [ROOT / "config.yaml", *(ROOT / "models").glob("*/model.yaml"), *(ROOT / "migrations").rglob("*")]
               if p.is_file()}
    shipped = {n for n in shipped if "__pycache__" not in n}
    assert shipped <= names, f"config template, cards or migrations missing from the wheel: {sorted(shipped - names)}"

    site, home, elsewhere = tmp_path / "site", tmp_path / "home", tmp_path / "elsewhere"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=600)
    elsewhere.mkdir()
    # PYTHONPATH puts the wheel's copy before the editable install of the checkout
    env = {**os.environ, "PYTHONPATH": str(site), "HOME": str(home), "XDG_CACHE_HOME": ""}
    env.pop("WORKER_CONFIG", None)
    where = _worker(site, elsewhere, env, "--help")
    probe = subprocess.run([sys.executable, "-c", "import worker, worker.config as c; "
                            "print(worker.__file__); print(c.load(None).models_dir); print(c.load(None).cache_dir)"],
                           cwd=elsewhere, env=env, text=True, capture_output=True, check=True)
    package, models_dir, cache_dir = probe.stdout.split()
    assert where.returncode == 0 and Path(package).is_relative_to(site), probe.stdout
    assert Path(models_dir) == elsewhere / "models"  # the user's cards, beside the (absent) config; the wheel's after
    assert Path(cache_dir) == home / ".cache" / "worker"  # not a folder inside site-packages
    for xdg, expected in ((tmp_path / "xdg", tmp_path / "xdg" / "worker"), ("relative", home / ".cache" / "worker")):
        probe = subprocess.run([sys.executable, "-c", "import worker.config as c; print(c.load(None).cache_dir)"],
                               cwd=elsewhere, env={**env, "XDG_CACHE_HOME": str(xdg)}, text=True, capture_output=True,
                               check=True)
        assert Path(probe.stdout.strip()) == expected, xdg  # a relative one is ignored, as the XDG spec says

    template = _worker(site, elsewhere, env, "config", "--template")
    assert template.returncode == 0 and template.stdout == (ROOT / "config.yaml").read_text()
    listed = _worker(site, elsewhere, env, "models", "list")
    assert listed.returncode == 0, listed.stderr
    for name in ("efficientnet-lite0", "ppocr-det", "yolov3-tiny"):
        assert name in listed.stdout

    inbox = elsewhere / "in"
    inbox.mkdir()
    for name in ("chelsea.png", "rocket.jpg"):
        shutil.copy(samples / name, inbox / name)
    # the models already built for the other tests, so that this one downloads nothing
    (elsewhere / "config.yaml").write_text(f"model: efficientnet-lite0\ncache_dir: {CACHE}\n")
    ran = _worker(site, elsewhere, env, "run", str(inbox))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert sorted(p.name for p in (elsewhere / "var" / "outbox").iterdir()) == ["chelsea.png.json", "rocket.jpg.json"]
    assert json.loads((elsewhere / "var" / "outbox" / "chelsea.png.json").read_text())["labels"]
    asked = _worker(site, elsewhere, env, "db", "upgrade")  # the schema is at the wheel's newest revision
    assert asked.returncode == 0, asked.stderr
    # a card of the user's is written where the user works (models/ beside the config), never into the wheel,
    # and is listed as the user's beside the wheel's own
    before = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if "__pycache__" not in p.parts)
    inited = _worker(site, elsewhere, env, "models", "init", "mine", "--onnx", str(effnet_onnx), "--task", "classify")
    assert inited.returncode == 0 and (elsewhere / "models" / "mine" / "model.yaml").is_file(), inited.stderr
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if "__pycache__" not in p.parts) == before
    listed = _worker(site, elsewhere, env, "models", "list")
    assert re.search(r"^mine +classify +yours ", listed.stdout, re.M) and \
        re.search(r"^yolov3-tiny +detect +worker's ", listed.stdout, re.M), listed.stdout

