"""Does deployment match training? The worker's own tensor for an image (the decode and preprocessing `run` and
`watch` use, with the card's settings) and its raw outputs, held to arrays the user saved from their own
pipeline (`worker models check NAME --image IMG --expect-input X.npy --expect-output Y.npz`)."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from worker.errors import CheckInputError, ImageError
from worker.images import decode
from worker.models.card import ModelCard
from worker.tasks.preprocess import prepare

DEFAULT_ATOL = 1e-4  # the input tensor: what the production guides ask of an alignment check
DEFAULT_RTOL = 1e-3  # raw outputs: of the largest magnitude the user's output holds (logits scale)


def load_array(path: Path, what: str) -> np.ndarray:
    """A .npy file as saved by `np.save`."""
    try:
        found = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise CheckInputError(f"{path}: {what}: no such file") from None
    except (ValueError, OSError):  # numpy's words for a file of another kind speak of pickles: not helpful here
        raise CheckInputError(f"{path}: {what}: not a NumPy .npy file (save the array with np.save)") from None
    if isinstance(found, np.lib.npyio.NpzFile):
        raise CheckInputError(f"{path}: {what}: an .npz archive; give one array saved with np.save (.npy)")
    return np.asarray(found)


def load_outputs(path: Path) -> dict[str, np.ndarray]:
    """Expected raw outputs: an .npz of one array per output name, or one .npy (the model's first output)."""
    if zipfile.is_zipfile(path):
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: np.asarray(z[k]) for k in z.files}
        except ValueError as e:
            raise CheckInputError(f"{path}: expected outputs: {e}") from None
    return {"": load_array(path, "expected outputs")}


def image_of(path: Path, card: ModelCard, max_pixels: int, ignore_orientation: bool = False) -> np.ndarray:
    """The image as the pipeline decodes it (EXIF orientation applied), or as read without that turn."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckInputError(f"{path}: cannot read it: {e.strerror or e}") from None
    if ignore_orientation:
        found = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
        if found is not None:
            return found
    try:
        return decode(data, path.name, max_pixels, card.preprocess.depth)
    except ImageError as e:
        raise CheckInputError(f"{path}: {e.reason}") from None


def tensor_of(image: np.ndarray, card: ModelCard, interpolation: int = cv2.INTER_LINEAR) -> np.ndarray:
    """The network input for one image, (1, C, H, W) float32: the pipeline's preprocessing, batch of one."""
    x, _ = prepare(image, card.preprocess, (card.input.size[0], card.input.size[1]), interpolation)
    return x[None]


@dataclass(frozen=True)
class Difference:
    """Where two arrays of one shape part most: max and mean absolute difference, the worst element's index
    and both values there."""

    max_abs: float
    mean_abs: float
    worst: tuple[int, ...]
    mine: float
    theirs: float

    @classmethod
    def of(cls, mine: np.ndarray, theirs: np.ndarray) -> "Difference":
        d = np.abs(mine.astype(np.float64) - theirs.astype(np.float64))
        worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(d)), d.shape)) if d.size else ()
        return cls(float(d.max(initial=0.0)), float(d.mean()) if d.size else 0.0, worst,
                   float(mine[worst]) if d.size else 0.0, float(theirs[worst]) if d.size else 0.0)


@dataclass(frozen=True)
class Aligned:
    """The user's tensor brought to the worker's (1, C, H, W), and what had to be done to it (said to the user)."""

    tensor: np.ndarray
    notes: tuple[str, ...]


def align(theirs: np.ndarray, mine: np.ndarray, card: ModelCard, path: Path,
          rect_hw: tuple[int, int] | None = None) -> Aligned:
    """Match the user's tensor to the worker's NCHW batch of one: a missing batch axis is added, an NHWC tensor
    is transposed (each said, with the card key where one applies); any other shape is refused, naming
    `preprocess.rect` where it has the (h, w) a rect letterbox would give this image (`rect_hw`)."""
    notes: list[str] = []
    x = theirs
    if x.dtype.kind not in "fiu":
        raise CheckInputError(f"{path}: a {x.dtype} array; the network input is numbers")
    if x.ndim == 3:
        x = x[None]
        notes.append(f"yours has no batch axis {theirs.shape}: compared as a batch of one")
    if x.ndim == 4 and x.shape[0] > 1:
        x = x[:1]
        notes.append(f"yours holds a batch of {theirs.shape[0]}: its first tensor is compared")
    _, c, h, w = mine.shape
    layout = card.input.layout.upper()
    if x.ndim == 4 and x.shape[1:] != (c, h, w) and x.shape[1:] == (h, w, c):
        if layout == "NCHW":
            notes.append(f"yours is NHWC {tuple(x.shape)}, the card says nchw: compared transposed (if the "
                         "model takes NHWC, set input.layout: nhwc)")
        x = x.transpose(0, 3, 1, 2)
    if x.ndim == 4 and x.shape != mine.shape and rect_hw is not None and x.shape[2:] == rect_hw and \
            x.shape[:2] == mine.shape[:2]:  # the worker's own shape first: a square image's rect is the card's
        raise CheckInputError(f"{path}: shape {tuple(theirs.shape)} is a letterbox padded to a multiple of "
                              f"{card.preprocess.stride}, not to {list(card.input.size)} (Ultralytics' rect, for an "
                              f"export of dynamic height and width): set preprocess.rect: true")
    if x.shape != mine.shape:
        raise CheckInputError(f"{path}: shape {tuple(theirs.shape)} cannot be matched to the worker's {layout} "
                              f"tensor {tuple(mine.shape) if layout == 'NCHW' else (1, h, w, c)} (card "
                              f"'{card.name}': input.size {list(card.input.size)}, {c} channel(s))")
    if x.dtype != np.float32:
        notes.append(f"yours is {x.dtype}, the worker's float32: compared as numbers")
    return Aligned(x.astype(np.float32), tuple(notes))


def where(worst: tuple[int, ...]) -> str:
    """An NCHW index in words."""
    return ", ".join(f"{axis} {i}" for axis, i in zip(("batch", "channel", "y", "x"), worst))


@dataclass(frozen=True)
class OutputCheck:
    name: str
    shape: tuple[int, ...]
    difference: Difference | None  # None: shapes differ
    relative: float  # max abs difference over the largest magnitude in the user's output
    theirs_shape: tuple[int, ...]


def compare_outputs(mine: dict[str, np.ndarray], theirs: dict[str, np.ndarray], path: Path) -> list[OutputCheck]:
    """Each expected output against the worker's of that name (an unnamed one: the model's first output)."""
    checks = []
    first = next(iter(mine))
    for name, expected in theirs.items():
        key = name or first
        if key not in mine:
            raise CheckInputError(f"{path}: no output named {name!r}; the model's are {', '.join(mine)}")
        got = mine[key].astype(np.float32)
        if got.shape != expected.shape and got.squeeze().shape == expected.squeeze().shape:
            expected = expected.reshape(got.shape)
        if got.shape != expected.shape:
            checks.append(OutputCheck(key, got.shape, None, float("inf"), tuple(expected.shape)))
            continue
        diff = Difference.of(got, expected)
        scale = float(np.abs(expected).max(initial=0.0)) or 1.0
        checks.append(OutputCheck(key, got.shape, diff, diff.max_abs / scale, tuple(expected.shape)))
    return checks
