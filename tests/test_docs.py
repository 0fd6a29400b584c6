"""The documentation is tested: it tells no history, its links and anchors resolve, every command and
option it names exists, every config key is documented, and its SQL runs on a real database."""

from __future__ import annotations

import re
import sqlite3
import unicodedata
from pathlib import Path

import click
import pytest

from tests.conftest import ROOT
from worker.cli import cli
from worker.config import Config

DOCS = sorted((ROOT / "docs").glob("*.md"))
USER_DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS, ROOT / "tests" / "data" / "reference" / "README.md"]

# the story of the product's making belongs in git's history, not in the product
HISTORY = re.compile(r"\bsessions? \d+|\bbefore session\b|\bad[ -]hoc\b|\bof mine\b|\bthe issue\b|"
                     r"(?<!watchdog )\bissue #\d+|/tmp/s\d+/|/work/scratch|\.\./shared|(?-i:FACTS\.md)|\bNOTES\.md\b", re.I)


def _product_files() -> list[Path]:
    files = [p for p in USER_DOCS if p.exists()]
    for folder, pattern in (("worker", "**/*.py"), ("tests", "**/*.py"), ("migrations", "**/*.py"),
                            ("tests", "**/*.md")):
        files += sorted((ROOT / folder).glob(pattern))
    return [p for p in files if p.name != "test_docs.py"]  # which holds the patterns


def test_no_history_in_the_product() -> None:
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for p in _product_files() for n, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert found == [], "\n".join(found)


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    text = unicodedata.normalize("NFKC", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    for line in _outside_code(path.read_text()):
        if m := re.match(r"#{1,6} (.*)", line):
            anchors.add(_anchor(m[1]))
    return anchors


def _outside_code(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for doc in USER_DOCS:
        for line in _outside_code(doc.read_text()):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+://", target):
                    continue
                path, _, anchor = target.partition("#")
                file = (doc.parent / path).resolve() if path else doc
                if not file.exists():
                    broken.append(f"{doc.relative_to(ROOT)}: {target}: no such file")
                elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                    broken.append(f"{doc.relative_to(ROOT)}: {target}: no heading with that anchor")
    assert broken == [], "\n".join(broken)


GLOBAL_OPTIONS = {"--config", "-v", "--verbose", "--version", "-h", "--help"}


def _invocations(text: str) -> list[list[str]]:
    """`worker ...` command lines the text shows: inline code that starts with it, and lines of code
    blocks where `worker` (or a path to it) is a word; each cut at a shell operator or comment."""
    found = []
    spans = re.findall(r"`(worker [^`]+)`", "\n".join(_outside_code(text)))
    block_lines: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            block_lines.append(line)
    for line in [*spans, *block_lines]:
        words = re.split(r"\s+", line.replace("ExecStart=", " ").strip())
        for i, word in enumerate(words):
            if (word == "worker" or word.endswith("/bin/worker")) and (i == 0 or words[i - 1] in ("-m", "$", "&&")
                                                                      or word.endswith("/bin/worker")):
                rest = []
                for w in words[i + 1:]:
                    if w in ("|", ">", ">>", "&&", ";", "&", "#", "2>&1") or w.startswith("#"):
                        break
                    rest.append(w)
                found.append(rest)
                break
    # not a table's "list / check / pull", nor what `worker --version` prints
    return [words for words in found if " / " not in " ".join(words) and not (words and words[0][:1].isdigit())]


def _command(words: list[str]) -> tuple[click.Command | None, list[str], str]:
    """The click command the words name (global options skipped), the words after it, and its name."""
    words = list(words)
    while words and words[0] in GLOBAL_OPTIONS:
        option = words.pop(0)
        if option == "--config" and words:
            words.pop(0)
    command: click.Command = cli
    name = []
    while isinstance(command, click.Group) and words and not words[0].startswith("-"):
        sub = command.commands.get(words[0])
        if sub is None:
            return None, words, " ".join(name + [words[0]])
        name.append(words.pop(0))
        command = sub
    return (command if command is not cli else None), words, " ".join(name)


def test_every_command_and_option_the_docs_name_exists() -> None:
    wrong = []
    for doc in USER_DOCS:
        for words in _invocations(doc.read_text()):
            command, rest, name = _command(words)
            if command is None:
                if name and not name.startswith(("-", "...")):
                    wrong.append(f"{doc.relative_to(ROOT)}: `worker {' '.join(words)}`: no command `{name}`")
                continue
            options = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
            for word in rest:
                option = word.split("=", 1)[0]
                if option.startswith("-") and option != "-" and option not in options and not option[1:2].isdigit():
                    wrong.append(f"{doc.relative_to(ROOT)}: `worker {' '.join(words)}`: `worker {name}` has no {option}")
    assert wrong == [], "\n".join(wrong)


def test_the_docs_show_commands_and_notice_a_wrong_one() -> None:
    """The check above finds what it checks: commands in every form the docs use, and a wrong one."""
    shown = _invocations("run `worker run DIR --outbox NEW` or\n```sh\n"
                         "worker --config c.yaml watch --inbox in  # a comment\n.venv/bin/worker demo\n```\n")
    assert shown == [["run", "DIR", "--outbox", "NEW"], ["--config", "c.yaml", "watch", "--inbox", "in"], ["demo"]]
    command, rest, name = _command(["db", "prune", "--before", "90d", "--dry-run"])
    assert command is not None and name == "db prune" and rest == ["--before", "90d", "--dry-run"]
    assert _command(["nosuch", "--x"])[0] is None and _command(["nosuch"])[2] == "nosuch"


def _documented_keys() -> list[str]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    return re.findall(r"^\| `([a-z0-9_.]+)` \|", text, re.M)


def test_every_config_key_is_documented_and_every_documented_key_exists() -> None:
    keys = [k for k in Config().as_dict() if k != "source"]
    documented = _documented_keys()
    assert sorted(set(keys) - set(documented)) == [], "keys missing from docs/configuration.md"
    assert sorted(set(documented) - set(keys)) == [], "docs/configuration.md documents keys that do not exist"
    assert len(documented) == len(set(documented)), "a key documented twice"


def test_every_command_has_a_section_in_the_commands_doc() -> None:
    text = (ROOT / "docs" / "commands.md").read_text()
    headings = " ".join(re.findall(r"^## (.*)$", text, re.M))

    def leaves(group: click.Group, prefix: str = "") -> list[str]:
        out = []
        for name, command in group.commands.items():
            out += leaves(command, f"{prefix}{name} ") if isinstance(command, click.Group) else [prefix + name]
        return out

    for command in leaves(cli):
        assert f"`worker {command}" in headings, f"docs/commands.md has no section for `worker {command}`"


@pytest.fixture(scope="module")
def a_database(tmp_path_factory: pytest.TempPathFactory, samples: Path, effnet_onnx: Path) -> Path:
    """A real database of a run over sample images, one of them broken."""
    import dataclasses
    import shutil

    from worker.config import load
    from worker.service import run_folder

    tmp = tmp_path_factory.mktemp("docs-sql")
    folder = tmp / "in"
    folder.mkdir()
    for name in ("coffee.png", "chelsea.png"):
        shutil.copy(samples / name, folder / name)
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    from tests.conftest import CACHE

    cfg = dataclasses.replace(load(ROOT / "config.yaml"), outbox=tmp / "out", db=f"sqlite:///{tmp / 'w.db'}",
                              cache_dir=CACHE, model="efficientnet-lite0")
    run_folder(cfg, folder)
    return tmp / "w.db"


def test_the_sql_the_database_doc_shows_runs(a_database: Path) -> None:
    text = (ROOT / "docs" / "database.md").read_text()
    (block,) = re.findall(r"```sql\n(.*?)```", text, re.S)
    queries = [q.strip() for q in block.split(";") if q.strip()]
    assert len(queries) >= 4
    with sqlite3.connect(a_database) as db:
        answers = [db.execute(q).fetchall() for q in queries]
    assert answers[0] == [("broken.jpg", 1, answers[0][0][2])]  # the failure, with its reason
    assert all(answers[1:]), answers


def test_every_file_the_docs_name_exists() -> None:
    """`worker/pipeline/prepare.py`, `tests/test_db.py`: a file moved or renamed is not left named in the docs."""
    missing = []
    for doc in USER_DOCS:
        for path in re.findall(r"(?<![\w/.])((?:worker|tests|migrations)/[\w/.-]*\w\.(?:py|md|yaml|txt|npz))", doc.read_text()):
            if not (ROOT / path).exists() and not any(ch in path for ch in "*<"):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert missing == [], "\n".join(missing)
