"""pyproject.toml's dependency bounds and the file that pins their lowest versions agree."""

from __future__ import annotations

import re
import tomllib

from tests.conftest import ROOT


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lowest_versions_file_pins_every_lower_bound() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted: dict[str, str] = {}
    for requirement in project["dependencies"] + extras["test"] + extras["postgres"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(?:>=|==)\s*([0-9][^,;\s]*)(?:,.*)?", requirement)
        assert m, f"no lower bound in {requirement!r}: the tests could not be run against its lowest version"
        wanted[_canonical(m[1])] = m[2]
    lines = [line.strip() for line in (ROOT / "tests" / "lowest-versions.txt").read_text().splitlines()]
    pinned = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert {_canonical(name): version for name, version in pinned.items()} == wanted
