"""File names that are not UTF-8: recorded as text, and found again on disk."""

from __future__ import annotations

import os
from pathlib import Path

from worker.host.names import as_text, on_disk


def test_a_name_that_is_utf8_is_itself() -> None:
    assert as_text("ünïcødé 画像/a.jpg") == "ünïcødé 画像/a.jpg"
    assert as_text("back\\xe9slash.png") == "back\\xe9slash.png"  # a literal backslash stays as it is


def test_undecodable_bytes_are_recorded_as_escapes_and_found_again(tmp_path: Path) -> None:
    raw = b"d\xe4ta/caf\xe9.png"  # Latin-1, as an old share or zip file names them
    name = os.fsdecode(raw)
    assert as_text(name) == "d\\xe4ta/caf\\xe9.png"
    as_text(name).encode("utf-8")  # what the database and the JSON documents take
    (tmp_path / os.fsdecode(b"d\xe4ta")).mkdir()
    (tmp_path / name).write_bytes(b"x")
    assert os.fsencode(on_disk(tmp_path, as_text(name))) == raw
    assert on_disk(tmp_path, "plain.png") == "plain.png"
    (tmp_path / "lit\\xe9ral.png").write_bytes(b"y")  # a real name with a backslash: taken as it is
    assert on_disk(tmp_path, "lit\\xe9ral.png") == "lit\\xe9ral.png"
