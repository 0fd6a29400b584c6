import io

import cv2
import numpy as np
import pytest
from PIL import Image

from worker.outputs.maskpng import encode_class_png, encode_mask_png


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (480, 640), (1441, 1921)])
def test_readers_get_the_mask_back(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    mask = rng.random(shape) > 0.7  # widths that are not multiples of 8 check the row padding
    data = encode_mask_png(mask)
    by_cv2 = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    assert by_cv2.dtype == np.uint8 and by_cv2.shape == shape
    assert np.array_equal(by_cv2, mask.astype(np.uint8) * 255)
    image = Image.open(io.BytesIO(data))
    assert image.mode == "1" and image.size == (shape[1], shape[0])
    assert np.array_equal(np.asarray(image.convert("L")), mask.astype(np.uint8) * 255)


def test_same_pixels_as_opencvs_8_bit_png_and_smaller() -> None:
    yy, xx = np.mgrid[:600, :900]
    mask = ((xx // 37 + yy // 23) % 3 == 0) & (yy > 40)  # text-like blocks
    ours = encode_mask_png(mask)
    ok, theirs = cv2.imencode(".png", mask.astype(np.uint8) * 255)
    assert ok
    read = [cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_GRAYSCALE) for b in (ours, theirs.tobytes())]
    assert np.array_equal(read[0], read[1])
    assert len(ours) < len(theirs)


@pytest.mark.parametrize("bad", [np.zeros((4, 4), np.uint8), np.zeros((4, 4, 1), bool), np.zeros((0, 4), bool)])
def test_refuses_what_is_not_a_mask(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="mask must"):
        encode_mask_png(bad)


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (1441, 1921)])
def test_readers_get_the_class_indices_back(shape: tuple[int, int]) -> None:
    classes = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    data = encode_class_png(classes)
    assert np.array_equal(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED), classes)
    image = Image.open(io.BytesIO(data))
    assert image.mode == "L" and np.array_equal(np.asarray(image), classes)


@pytest.mark.parametrize("bad", [np.zeros((4, 4), bool), np.zeros((4, 4, 1), np.uint8), np.zeros((0, 4), np.uint8)])
def test_refuses_what_is_not_a_class_mask(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="classes must"):
        encode_class_png(bad)
