"""Configuration: frozen dataclasses, loaded and validated once from YAML.

Every error names the file, the key and what was expected. Relative paths are resolved against
the config file's folder, so `worker --config /srv/line3/config.yaml` works from any directory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from worker.errors import ConfigError

# The checkout the package is installed from (`pip install -e .`). Its model cards and its model cache
# are the defaults wherever `worker` starts: a config file elsewhere, or none, still finds them.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Where a wheel carries the checkout's models/, migrations/ and config.yaml (pyproject.toml maps them in);
# absent in a checkout, so an editable install reads the checkout's own.
BUNDLED = Path(__file__).resolve().parent / "_bundled"


def shipped(name: str) -> Path:
    """The folder or file `name` (models, migrations, config.yaml) that comes with worker: a wheel's copy,
    else the checkout's."""
    return BUNDLED / name if (BUNDLED / name).exists() else PROJECT_ROOT / name


def default_cache_dir() -> Path:
    """The checkout's .cache/worker; installed from a wheel, the user's cache ($XDG_CACHE_HOME/worker or
    ~/.cache/worker), not a folder inside site-packages."""
    if not BUNDLED.is_dir():
        return PROJECT_ROOT / ".cache" / "worker"
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or "")
    return (xdg if xdg.is_absolute() else Path.home() / ".cache") / "worker"  # the XDG spec ignores a relative one

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif")


# a key where 0 means nothing sensible (a sampler or poller that never sleeps, a retried image quarantined untried)
_POSITIVE = {"positive": True}


@dataclass(frozen=True)
class WatchConfig:
    # auto: polling where the inbox is on a network share (NFS, SMB: no inotify event for another machine's
    # files), native (inotify etc.) elsewhere
    observer: Literal["auto", "native", "polling"] = "auto"
    settle_s: float = 1.0  # size and mtime unchanged this long => fully written (polling, copy tools)
    # a file that looks cut short (a JPEG without its end marker, ...) waits until unchanged this long,
    # since its writer may come back (a resumed upload); 0: taken at once, as any other file
    incomplete_s: float = 30.0
    poll_interval_s: float = field(default=1.0, metadata=_POSITIVE)  # polling observer period
    rescan_interval_s: float = 30.0  # periodic inbox rescan, catches missed events; 0 disables
    status_log_s: float = 300.0  # log a status line this often (done, failed, latency, RSS); 0 disables
    create_inbox: bool = False  # make the inbox when it does not exist (else refused: a mistyped path)


InputAction = Literal["move", "keep", "delete"]
Pages = Literal["first", "all"]  # of a multi-page file: its first page, or every page


@dataclass(frozen=True)
class InputsConfig:
    """What becomes of an input once its outcome is recorded, for `watch` and for `run`."""

    watch: InputAction = "move"  # move: to <archive>/done|failed/<rel>; delete: done ones deleted, failed moved
    run: InputAction = "keep"  # keep: left where it is; move and delete as for watch
    # a subfolder of the inbox that moving (or deleting) its inputs left empty is removed once it has not
    # changed for this long (a writer that made it may still be writing into it); 0: left in place
    empty_folders_s: float = 86400.0


@dataclass(frozen=True)
class PipelineConfig:
    queue_size: int = 64  # bound of every queue between stages; full => the stage before waits
    # processes for the pipeline: 1 = one process (threads); N = the session's process and N-1 prepare
    # processes (read, decode, preprocess, outputs, rows); 0 = chosen from the core count
    processes: int = 0
    decode_workers: int = 0  # 0 = chosen from the core count
    infer_workers: int = 0  # threads calling the one shared session; 0 = chosen from the core count
    max_batch: int = 0  # micro-batch size (only for cards with dynamic_batch); 0 = 1 on CPU, 8 on a GPU
    max_delay_ms: float = 2.0  # how long the batcher waits to fill a batch
    max_pixels: int = 80_000_000  # refuse larger images before decoding them (decompression bombs)
    max_attempts: int = field(default=3, metadata=_POSITIVE)  # failed this many times: quarantined as failed
    jpeg_reduce: bool = False  # opt-in: decode big JPEGs at 1/2, 1/4, 1/8 scale (faster, results change slightly)
    # a multi-page file (TIFF pages, GIF/WebP/PNG frames): its first page only, or every page, one document
    pages: Pages = "first"


@dataclass(frozen=True)
class EngineConfig:
    providers: Literal["auto", "cpu", "cuda"] = "auto"
    require_gpu: bool = False  # refuse to start unless CUDA is really active
    intra_op_threads: int = 0  # onnxruntime threads per run call; 0 = 1 (parallelism comes from infer_workers)
    device_id: int = 0
    gpu_mem_limit_mb: int = 0  # 0 = no limit
    arena_extend_strategy: Literal["kSameAsRequested", "kNextPowerOfTwo"] = "kSameAsRequested"
    cudnn_conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = "HEURISTIC"
    cpu_mem_arena: bool = True  # onnxruntime's CPU memory arena; false: every run allocates from malloc


@dataclass(frozen=True)
class OutputConfig:
    json: bool = True  # <outbox>/<rel>.json per image
    masks: bool = True  # <outbox>/<rel>.mask.png for segmentation models
    yolo_txt: bool = False  # <outbox>/<rel>.txt for detection models: class cx cy w h score, or a mask's outline
    overlays: bool = False  # <outbox>/<rel>.overlay.jpg: the result drawn on the image
    errors: bool = True  # <outbox>/<rel>.error.json for a failed image, in place of its results


@dataclass(frozen=True)
class MetricsConfig:
    memory_sample_s: float = field(default=5.0, metadata=_POSITIVE)  # memory sample period
    warmup_s: float = 60.0  # samples before this are left out of the RSS slopes
    # a filesystem the worker fills (outbox, archive, SQLite database) is low under either: said on the
    # watcher's status line, in `worker run`'s log and by `worker health`; 0 and 0 never say it
    low_disk_gb: float = 2.0
    low_disk_percent: float = field(default=5.0, metadata={"at_most": 100})
    port: int = field(default=0, metadata={"at_least": 0, "at_most": 65535})  # Prometheus metrics on this port (watch, run); 0: none
    host: str = "127.0.0.1"  # the address the metrics are served on (0.0.0.0: every interface)


@dataclass(frozen=True)
class SoakConfig:
    max_rss_slope_mb_per_h: float = 2.0  # steady-state RSS slope above this fails the soak (CPU)
    max_p99_ratio: float = 0.0  # end p99 / start p99 above this fails the soak; 0 = not checked


@dataclass(frozen=True)
class FleetConfig:
    # queue: workers on several hosts share folders through the database's claim queue (PostgreSQL only);
    # local: one host (the inbox lock, the local scan); auto: queue on PostgreSQL, local on SQLite
    mode: Literal["auto", "queue", "local"] = "auto"
    lease_s: float = field(default=60.0, metadata=_POSITIVE)  # a claim's lease; renewed 4 times per span
    scan_s: float = field(default=5.0, metadata=_POSITIVE)  # the scanner lists a watched inbox this often
    poll_s: float = field(default=1.0, metadata=_POSITIVE)  # an idle worker looks for claimable rows this often


@dataclass(frozen=True)
class Config:
    inbox: Path = Path("var/inbox")
    outbox: Path = Path("var/outbox")
    archive: Path = Path("var/archive")
    db: str = "sqlite:///var/worker.db"
    model: str = "ppocr-det"
    models_dir: Path = Path("models")  # the user's cards, beside the config; the bundled ones are found after them
    cache_dir: Path = field(default_factory=default_cache_dir)
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS
    watch: WatchConfig = field(default_factory=WatchConfig)
    inputs: InputsConfig = field(default_factory=InputsConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    outputs: OutputConfig = field(default_factory=OutputConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    soak: SoakConfig = field(default_factory=SoakConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    source: Path | None = field(default=None, metadata={"internal": True})  # the file it came from

    def with_overrides(self, **changes: Any) -> "Config":
        """Apply CLI overrides (None means 'not given'); paths stay as given (relative to the cwd)."""
        given = {k: v for k, v in changes.items() if v is not None}
        for key in ("inbox", "outbox", "archive", "cache_dir", "models_dir"):
            if key in given:
                given[key] = Path(given[key]).absolute()
        return dataclasses.replace(self, **given)

    def as_dict(self) -> dict[str, Any]:
        def conv(v: Any) -> Any:
            if isinstance(v, Path):
                return str(v)
            if isinstance(v, tuple):
                return list(v)
            return v

        return {k: conv(v) for k, v in _flatten(dataclasses.asdict(self)).items()}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def default_config_path() -> Path | None:
    """$WORKER_CONFIG, else ./config.yaml if present."""
    env = os.environ.get("WORKER_CONFIG")
    if env:
        return Path(env)
    here = Path("config.yaml")
    return here if here.exists() else None


def template() -> str:
    """The documented config.yaml that comes with worker: every key with its default and a comment."""
    return shipped("config.yaml").read_text(encoding="utf-8")


def in_effect(path: Path | None) -> list[tuple[str, Any, bool]]:
    """Each key of the configuration `path` gives (None: the defaults) as (name, value, set in the file),
    for `worker config`. A file with an error raises the ConfigError a start would."""
    if path is None:
        cfg, given = load(None), set()
    else:  # read once: the file's own keys, and the configuration they give
        raw = read_yaml(Path(path), "config file")
        cfg, given = _loaded(raw, Path(path)), set(_flatten(raw)) if isinstance(raw, dict) else set()
    shown = {**cfg.as_dict(), "db": without_password(cfg.db)}  # printed, perhaps pasted into a ticket
    return [(key, value, key in given) for key, value in shown.items() if key != "source"]


def without_password(url: str) -> str:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:  # said when the database is opened
        return url


def load(path: Path | None) -> Config:
    """Load and validate a config file; None gives the defaults (var/ paths relative to the cwd)."""
    if path is None:
        return _resolve(Config(), Path.cwd())
    path = Path(path)
    return _loaded(read_yaml(path, "config file"), path)


def _loaded(raw: Any, path: Path) -> Config:
    """The configuration a file's YAML gives (validated), its relative paths resolved against its folder."""
    cfg = build(Config, {} if raw is None else raw, str(path), "")
    cfg = dataclasses.replace(cfg, source=path.absolute())
    return _resolve(cfg, path.absolute().parent)


def read_yaml(path: Path, what: str) -> Any:
    """A config file's or model card's YAML (`what` names which in errors), read as bytes so that PyYAML
    tells the encoding from them: UTF-8, or UTF-16 with its byte-order mark (what Windows Notepad saves
    as "Unicode"; read as UTF-8 text, a traceback)."""
    try:
        return yaml.safe_load(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except OSError as e:  # a folder, no permission: a traceback before
        raise ConfigError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    except yaml.YAMLError as e:  # bytes that are neither UTF-8 nor UTF-16 with a BOM included
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


# an environment variable in a path ($NAME or ${NAME}) that expansion left: it is not set
# a number in exponent form without a dot, which YAML 1.1 reads as a string (YAML 1.2 and JSON as a number)
_EXPONENT_ONLY = re.compile(r"[-+]?[0-9]+[eE][-+]?[0-9]+")
# finite numbers of either sign (a card's mean and pad value at preprocess.depth 32, in the file's own units:
# temperatures in degrees Celsius, say): Signed as a float, Number as given (an integer stays one: cards'
# digests hash the value as written, and a pixel value at depth 8 or 16 is an integer)
Signed = typing.NewType("Signed", float)
Number = typing.NewType("Number", float)
_UNSET_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})")


def _resolve(cfg: Config, base: Path) -> Config:
    def abs_(p: Path, key: str) -> Path:
        """~ and environment variables expanded ($HOME/scans, as a shell or a systemd unit would), then
        made absolute against the config file's folder; an unset variable is refused, not made a folder."""
        text = os.path.expandvars(os.path.expanduser(str(p)))
        if (unset := _UNSET_VARIABLE.search(text)) is not None:
            raise ConfigError(f"{cfg.source or 'config'}: '{key}' ({p}) names the environment variable "
                              f"{unset[0]}, which is not set")
        expanded = Path(text)
        return expanded if expanded.is_absolute() else (base / expanded)

    db = cfg.db
    if db.startswith("sqlite:///") and not db.startswith("sqlite:////") and db != "sqlite:///:memory:":
        db = "sqlite:///" + str(abs_(Path(db[len("sqlite:///"):]), "db"))
    exts = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in cfg.extensions)
    return dataclasses.replace(
        cfg,
        inbox=abs_(cfg.inbox, "inbox"),
        outbox=abs_(cfg.outbox, "outbox"),
        archive=abs_(cfg.archive, "archive"),
        models_dir=abs_(cfg.models_dir, "models_dir"),
        cache_dir=abs_(cfg.cache_dir, "cache_dir"),
        db=db,
        extensions=exts,
    )


T = typing.TypeVar("T")


def build(cls: type[T], raw: Any, file: str, prefix: str) -> T:
    """Build dataclass `cls` from a YAML mapping, checking keys and types."""
    where = prefix.rstrip(".") or "top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: {where}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(
                f"{file}: unknown key '{prefix}{key}' (expected one of: {', '.join(sorted(fields))})"
            )
        kwargs[key] = _coerce(hints[key], value, file, f"{prefix}{key}")
        if fields[key].metadata.get("positive") and not kwargs[key] > 0:
            raise ConfigError(f"{file}: '{prefix}{key}' must be more than 0, got {value!r}")
        if (top := fields[key].metadata.get("at_most")) is not None and kwargs[key] > top:
            raise ConfigError(f"{file}: '{prefix}{key}' must be at most {top}, got {value!r}")
        if (bottom := fields[key].metadata.get("at_least")) is not None and kwargs[key] < bottom:
            raise ConfigError(f"{file}: '{prefix}{key}' must be at least {bottom}, got {value!r}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, file: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, file, key + ".")  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, file, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{file}: '{key}' must be one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{file}: '{key}' must be a list, got {value!r}")
        return tuple(_coerce(args[0], v, file, key) for v in value)
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{file}: '{key}' must be a path (string), got {value!r}")
        return Path(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{file}: '{key}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{file}: '{key}' must be a non-negative integer, got {value!r}")
        return value
    if tp is Signed or tp is Number:
        if isinstance(value, str) and _EXPONENT_ONLY.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{file}: '{key}' must be a number, got {value!r}")
        return float(value) if tp is Signed else value
    if tp is float:  # YAML's .nan and .inf are floats too: a settle time of .inf never settles
        if isinstance(value, str) and _EXPONENT_ONLY.fullmatch(value.strip()):
            value = float(value)  # 1e3 or 5e-1, which YAML 1.1 (PyYAML) reads as a string: the number meant
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ConfigError(f"{file}: '{key}' must be a non-negative number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{file}: '{key}' must be a string, got {value!r}")
        return value
    raise ConfigError(f"{file}: '{key}': unsupported type {tp}")  # pragma: no cover - programming error
