"""The card's preprocessing: resize modes, colour order, per-channel normalisation, geometry."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from worker.models.card import Preprocess
from worker.tasks.preprocess import _sample, prepare, resize_for


@pytest.mark.parametrize("resize", ["stretch", "shorter-crop", "letterbox"])
@pytest.mark.parametrize("color", ["rgb", "bgr"])
def test_normalisation_is_per_channel_in_card_order(resize: str, color: str) -> None:
    """(pixel - mean[c]) / std[c] for each channel c of the card's colour order, as float32 CHW."""
    spec = Preprocess(color=color, resize=resize, resize_shorter=40, mean=(10.0, 120.0, 250.0),  # type: ignore[arg-type]
                      std=(2.0, 64.0, 128.0))
    image = np.random.default_rng(1).integers(0, 256, (45, 71, 3), dtype=np.uint8)
    x, geo = prepare(image, spec, (32, 32))
    assert x.shape == (3, 32, 32) and x.dtype == np.float32 and x.flags.c_contiguous
    # recover the resized pixels from channel 0 and check all three channels against the formula
    pixels = x[0] * np.float32(2.0) + np.float32(10.0)
    assert np.allclose(pixels, np.round(pixels), atol=1e-3)
    if resize == "stretch":
        resized = cv2.resize(image, (32, 32), interpolation=cv2.INTER_LINEAR)
        if color == "rgb":
            resized = resized[:, :, ::-1]
        want = (resized.astype(np.float32) - np.float32([10, 120, 250])) / np.float32([2, 64, 128])
        np.testing.assert_allclose(x, want.transpose(2, 0, 1), rtol=1e-6, atol=1e-6)
        assert (geo.scale_x, geo.scale_y) == (32 / 71, 32 / 45)


@pytest.mark.parametrize("resize", ["stretch", "shorter-crop", "letterbox"])
def test_gray_gives_one_channel_of_opencvs_luma(resize: str) -> None:
    """color: gray -> (1, h, w): the luma of the resized image, normalised by the card's one mean and std."""
    spec = Preprocess(color="gray", resize=resize, resize_shorter=40, mean=(100.0,), std=(50.0,))  # type: ignore[arg-type]
    image = np.random.default_rng(2).integers(0, 256, (45, 71, 3), dtype=np.uint8)
    x, _ = prepare(image, spec, (32, 32))
    assert x.shape == (1, 32, 32) and x.dtype == np.float32 and x.flags.c_contiguous
    bgr, _ = prepare(image, Preprocess(color="bgr", resize=resize, resize_shorter=40,  # type: ignore[arg-type]
                                       mean=(0.0,) * 3, std=(1.0,) * 3), (32, 32))
    luma = 0.114 * bgr[0] + 0.587 * bgr[1] + 0.299 * bgr[2]  # BT.601, in OpenCV's BGR order
    np.testing.assert_allclose(x[0] * 50 + 100, luma, atol=0.51)  # OpenCV rounds to whole pixels


def test_gray_keeps_the_pixels_of_a_grayscale_image() -> None:
    """A grayscale file decodes to three equal channels; the model gets its pixels back unchanged."""
    gray = np.random.default_rng(3).integers(0, 256, (32, 32), dtype=np.uint8)
    x, _ = prepare(cv2.cvtColor(gray, cv2.COLOR_GRAY2BGR), Preprocess(color="gray"), (32, 32))
    np.testing.assert_array_equal(np.rint(x[0] * 255), gray)  # float32 division: round it back


@pytest.mark.parametrize("resize", ["stretch", "shorter-crop", "letterbox"])
def test_a_16_bit_image_is_normalised_in_16_bit_units(resize: str) -> None:
    """depth 16: the card's mean, std and pad_value are in 0-65535 units; the tensor is the uint8 one's
    for an image widened from 8 bits (x * 257) with every value in the card widened alike."""
    image = np.random.default_rng(5).integers(0, 256, (45, 71, 3), dtype=np.uint8)
    spec8 = Preprocess(color="rgb", resize=resize, resize_shorter=40, pad_value=114,  # type: ignore[arg-type]
                       mean=(10.0, 120.0, 250.0), std=(2.0, 64.0, 128.0))
    spec16 = Preprocess(color="rgb", resize=resize, resize_shorter=40, pad_value=114 * 257,  # type: ignore[arg-type]
                        mean=(2570.0, 30840.0, 64250.0), std=(514.0, 16448.0, 32896.0), depth=16)
    x8, geo8 = prepare(image, spec8, (32, 32))
    x16, geo16 = prepare(image.astype(np.uint16) * 257, spec16, (32, 32))
    assert x16.shape == (3, 32, 32) and x16.dtype == np.float32 and geo16 == geo8
    std8 = np.float32([2, 64, 128])[:, None, None]  # in 8-bit pixels: the 8-bit resize is fixed-point, to +-1
    np.testing.assert_allclose(x16 * std8, x8 * std8, atol=1.0)
    if resize == "letterbox":  # the padding is pad_value in 16-bit units, the 8-bit card's 114
        np.testing.assert_allclose(x16[:, 0, 0], x8[:, 0, 0], atol=1e-5)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.float32])
def test_shorter_crop_of_a_sliver_is_sampled_from_the_image_not_from_it_resized_whole(dtype) -> None:
    """A 4 x 20000 image (a line-scan strip, a corrupt header's dimensions) scaled to a shorter side of
    256 is 1,280,000 x 256: resized whole before the crop it took about a gigabyte and more than half a
    second (4 x 80000: 4 GB and 6.8 s). The crop is sampled straight from the image: the same pixels as
    resizing whole then cropping, within one level, with a few MB."""
    import tracemalloc

    spec = Preprocess(resize="shorter-crop", resize_shorter=256)
    rng = np.random.default_rng(0)
    top = 255 if dtype == np.uint8 else 65535 if dtype == np.uint16 else 1000.0
    for shape in ((10, 2000, 3), (3000, 7, 3)):  # small enough to resize whole for the comparison
        image = (rng.random(shape) * top).astype(dtype)
        got, geo = resize_for(image, spec, (224, 224))
        h, w = shape[:2]
        s = 256 / min(h, w)
        nw, nh = int(round(w * s)), int(round(h * s))
        want = cv2.resize(image, (nw, nh), interpolation=cv2.INTER_LINEAR)
        want = want[(nh - 224) // 2:(nh - 224) // 2 + 224, (nw - 224) // 2:(nw - 224) // 2 + 224]
        assert got.shape == want.shape == (224, 224, 3) and got.dtype == dtype
        assert np.abs(got.astype(np.float64) - want.astype(np.float64)).max() <= (1.0 if dtype != np.float32 else 0.01)
        assert (geo.scale_x, geo.left, geo.top) == (s, -((nw - 224) // 2), -((nh - 224) // 2))
    sliver = (rng.random((4, 20000, 3)) * top).astype(dtype)
    tracemalloc.start()
    try:
        resize_for(sliver, spec, (224, 224))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MB"


def test_stretch_asymmetric_of_an_image_wider_than_opencvs_warps_take(samples) -> None:
    """OpenCV's warps refuse images of 32767 pixels a side or more: a 20 x 40000 strip under a MediaPipe
    card failed with OpenCV's assertion text. Past that the same sampling (at x * W / w, black past the
    right and bottom edges) is done in numpy: held to warpPerspective on a photo both take (OpenCV rounds
    its weights to 1/32: within 4 levels, as tests/test_reference_selfie.py holds it to numpy too)."""
    rng = np.random.default_rng(1)
    photo = cv2.imread(str(samples / "chelsea.png"), cv2.IMREAD_COLOR)
    for image in (photo, photo[100:200, 150:300]):  # the small one stretched up: black past its edges
        h, w = image.shape[:2]
        warped, _ = resize_for(image, Preprocess(resize="stretch-asymmetric"), (256, 256))
        mine = _sample(image, np.arange(256) * (h / 256), np.arange(256) * (w / 256), replicate=False)
        diff = np.abs(mine.astype(int) - warped.astype(int))
        assert diff.max() <= 4 and diff.mean() < 0.5
    strip = rng.integers(0, 256, (20, 40000, 3), dtype=np.uint8)
    got, geo = resize_for(strip, Preprocess(resize="stretch-asymmetric"), (256, 256))
    assert got.shape == (256, 256, 3) and (geo.scale_x, geo.scale_y) == (256 / 40000, 256 / 20)
    assert got[:, 0].tolist() == _sample(strip, np.arange(256) * (20 / 256), np.zeros(1), replicate=False)[:, 0].tolist()


def test_depth_32_letterbox_pads_with_a_negative_value_and_subtracts_a_negative_mean() -> None:
    """Temperatures in degrees Celsius, a model trained on kelvins / 100: mean -273.15, padding -20.5 (a cold
    background), both in the file's own units; the image's own values, below zero too, go through."""
    spec = Preprocess(color="gray", resize="letterbox", depth=32, mean=(-273.15,) * 3,  # type: ignore[arg-type]
                      std=(100.0,) * 3, pad_value=-20.5)  # type: ignore[arg-type]
    image = np.full((16, 32, 3), -5.0, np.float32)  # twice as wide as high: rows of padding above and below
    x, geo = prepare(image, spec, (32, 32))
    assert x.shape == (1, 32, 32)
    np.testing.assert_allclose(x[0, 0], (-20.5 + 273.15) / 100, rtol=1e-6)  # the padding
    np.testing.assert_allclose(x[0, 16], (-5.0 + 273.15) / 100, rtol=1e-6)  # the image


def test_float_resize_keeps_the_fractions_of_a_level_that_the_8_bit_resize_rounds() -> None:
    """float_resize: true resizes float32 (torchvision's to_tensor then resize, as RF-DETR feeds its model):
    halving with half-pixel centres samples each output pixel midway between four input pixels, so it is
    exactly their mean, quarters of a level and all; the default 8-bit resize gives whole levels."""
    image = np.random.default_rng(39).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    blocks = image.astype(np.float64).reshape(32, 2, 48, 2, 3).mean(axis=(1, 3))  # (32, 48, 3), BGR
    spec = Preprocess(color="bgr", mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), float_resize=True)  # type: ignore[arg-type]
    x, _ = prepare(image, spec, (32, 48))
    np.testing.assert_allclose(x, blocks.transpose(2, 0, 1), atol=1e-4)
    assert (np.abs(blocks - np.round(blocks)) > 0.2).mean() > 0.3  # many pixels between two levels
    x8, _ = prepare(image, Preprocess(color="bgr", mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)), (32, 48))  # type: ignore[arg-type]
    assert np.array_equal(x8, np.round(x8)) and np.abs(x8 - blocks.transpose(2, 0, 1)).max() <= 0.5 + 1e-6


def test_a_letterbox_padded_at_the_bottom_right_puts_the_image_at_the_top_left() -> None:
    spec = Preprocess(resize="letterbox", pad_value=0, pad_at="bottom-right", mean=(0.0,) * 3,  # type: ignore[arg-type]
                      std=(1.0,) * 3)
    image = np.full((16, 32, 3), 200, np.uint8)  # twice as wide as high: padding below only
    x, geo = prepare(image, spec, (32, 32))
    assert (x[:, :16] == 200).all() and (x[:, 16:] == 0).all()
    assert (geo.left, geo.top) == (0, 0)
    np.testing.assert_allclose(geo.to_original(np.array([[32.0, 16.0]])), [[32.0, 16.0]])
    centred, _ = prepare(image, Preprocess(resize="letterbox", pad_value=0, mean=(0.0,) * 3,  # type: ignore[arg-type]
                                           std=(1.0,) * 3), (32, 32))
    assert (centred[:, 8:24] == 200).all() and (centred[:, :8] == 0).all()
