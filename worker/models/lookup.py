"""Where model cards are found: the user's folder (`models_dir`: the config's, else `models/` beside the config
file or in the current folder), then the cards that come with worker. A user's card of a bundled card's name
is the one used (`worker models list` says so)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from worker.config import shipped
from worker.errors import ConfigError
from worker.models.card import ModelCard, load_card


def bundled_cards() -> Path:
    return shipped("models")


def card_folders(models_dir: Path) -> list[Path]:
    """The folders searched for a card, first found first: `models_dir`, then the bundled cards."""
    bundled = bundled_cards()
    same = models_dir.absolute() == bundled.absolute() or (models_dir.exists() and models_dir.samefile(bundled))
    return [models_dir] if same else [models_dir, bundled]


def card_name(name: str) -> str:
    """`name` where it names a card: one folder's name (`..`, a path or a hidden name could reach any file)."""
    if not name or name in (".", "..") or name.startswith(".") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(f"model {name!r}: a card's name is the name of its folder, with no '/' and not starting "
                          f"with '.' (e.g. my-detector)")
    return name


def find_card(models_dir: Path, name: str) -> ModelCard:
    """The card called `name`: the user's (under models_dir) before a bundled one."""
    card_name(name)
    folders = card_folders(models_dir)
    for folder in folders:
        if (folder / name / "model.yaml").exists():
            return load_card(folder / name / "model.yaml")
    known = ", ".join(sorted({p.parent.name for f in folders for p in f.glob("*/model.yaml")})) or "none"  # unparsed
    looked = " or ".join(str(f / name / "model.yaml") for f in folders)
    gone = "" if models_dir.is_dir() else f"; models_dir {models_dir} is not a folder"
    raise ConfigError(f"model '{name}': no card at {looked} (known models: {known}){gone}")


@dataclass(frozen=True)
class Listed:
    card: ModelCard
    bundled: bool  # one that comes with worker
    shadowed: bool  # a bundled card that a user's card of the same name replaces


def list_cards(models_dir: Path) -> tuple[list[Listed], list[ConfigError]]:
    """Every card found (the user's, then the bundled ones) that loads, and the reason for each one that does
    not (a card being edited must not hide the others)."""
    listed: list[Listed] = []
    errors: list[ConfigError] = []
    mine: set[str] = set()
    folders = card_folders(models_dir)
    for folder in folders:
        bundled = folder is folders[-1] and folder.absolute() == bundled_cards().absolute()
        for path in sorted(folder.glob("*/model.yaml")):
            try:
                card = load_card(path)
            except ConfigError as e:
                errors.append(e)
                mine.add(path.parent.name)
                continue
            listed.append(Listed(card, bundled, bundled and path.parent.name in mine))
            if not bundled:
                mine.add(path.parent.name)
    return listed, errors
