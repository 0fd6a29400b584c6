"""Decoding odd but valid images, and clear errors for bad ones."""

from __future__ import annotations

import io
import struct
import threading
import warnings

import cv2
import numpy as np
import pytest
from PIL import Image

from worker.errors import DecodeError, ImageTooLarge
from worker.images import decode, decode_reduced, file_pages, frames, later_pages, reopenable, tiff_pages


def _png(arr: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def test_gray_rgba_16bit_palette_become_bgr() -> None:
    gray = np.arange(64, dtype=np.uint8).reshape(8, 8)
    out = decode(_png(gray), "g.png", 10**6)
    assert out.shape == (8, 8, 3) and (out[..., 0] == gray).all()

    rgba = np.zeros((4, 5, 4), np.uint8)
    rgba[..., 0] = 200  # red
    rgba[..., 3] = 0  # fully transparent: dropped without compositing
    out = decode(_png(rgba), "a.png", 10**6)
    assert out.shape == (4, 5, 3) and (out[..., 2] == 200).all() and (out[..., 0] == 0).all()

    ok, enc = cv2.imencode(".png", np.full((3, 3, 3), 65535, np.uint16))
    out = decode(enc.tobytes(), "16.png", 10**6)
    assert out.dtype == np.uint8 and (out == 255).all()

    pal = Image.fromarray(np.zeros((6, 6, 3), np.uint8)).convert("P")
    buf = io.BytesIO()
    pal.save(buf, format="PNG")
    assert decode(buf.getvalue(), "p.png", 10**6).shape == (6, 6, 3)


def test_exif_orientation_is_applied() -> None:
    img = Image.fromarray(np.zeros((10, 20, 3), np.uint8))  # 20 wide, 10 high
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif)
    assert decode(buf.getvalue(), "r.jpg", 10**6).shape[:2] == (20, 10)


def test_gif_first_frame() -> None:
    frames = [Image.fromarray(np.full((4, 4, 3), v, np.uint8)) for v in (10, 250)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    assert decode(buf.getvalue(), "a.gif", 10**6).shape == (4, 4, 3)


def test_two_threads_reading_frames_leave_the_process_s_warnings_as_they_were(monkeypatch) -> None:
    """Pillow's warnings are silenced without swapping the process's warning filters: two decode threads,
    each part way through a multi-frame file, once left every warning of the process ignored (each had
    saved and then restored the filters the other had changed)."""
    frames_ = [Image.fromarray(np.full((4, 4, 3), v, np.uint8)) for v in (10, 130, 250)]
    buf = io.BytesIO()
    frames_[0].save(buf, format="GIF", save_all=True, append_images=frames_[1:])
    gif = buf.getvalue()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)  # each 16-pixel frame: Pillow's bomb warning
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    pages: dict[str, list[np.ndarray]] = {"a": [], "b": []}

    def read(me: str) -> None:  # a into its file, then b; a out, then b
        it = later_pages(gif, f"{me}.gif", 10**6)
        if me == "b":
            a_in.wait(10)
        pages[me].append(next(it))
        (a_in if me == "a" else b_in).set()
        (b_in if me == "a" else a_out).wait(10)
        pages[me].extend(it)
        if me == "a":
            a_out.set()

    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()  # no filter of Pillow's left by an earlier test behind the next one
        warnings.simplefilter("always")
        threads = [threading.Thread(target=read, args=(me,)) for me in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        warnings.warn("the worker's own", UserWarning)
    assert [len(p) for p in pages.values()] == [2, 2]
    assert [str(w.message) for w in seen] == ["the worker's own"]  # and none of Pillow's


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(DecodeError, match="e.jpg: empty file"):
        decode(b"", "e.jpg", 10**6)
    with pytest.raises(DecodeError, match="t.png: not an image"):
        decode(b"hello, I am text", "t.png", 10**6)
    good = _png(np.zeros((50, 50, 3), np.uint8))
    with pytest.raises(DecodeError, match="half.png"):
        decode(good[: len(good) // 2], "half.png", 10**6)


def test_pixel_limit_checked_from_header() -> None:
    big = _png(np.zeros((100, 100), np.uint8))
    with pytest.raises(ImageTooLarge, match="100x100 pixels is over the limit of 5000"):
        decode(big, "big.png", 5000)


def test_header_size_reads_jpeg_and_png_like_pillow() -> None:
    """The fast header reader must agree with Pillow, including progressive JPEGs, EXIF segments
    and 16-bit PNGs; odd or cut headers fall back to Pillow's answer or error."""
    from worker.images import check_header

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (37, 91, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6
    files = []
    for kwargs in ({}, {"progressive": True}, {"exif": exif.tobytes()}, {"quality": 20, "subsampling": 0}):
        buf = io.BytesIO()
        img.save(buf, format="JPEG", **kwargs)
        files.append(buf.getvalue())
    files.append(_png(np.zeros((37, 91), np.uint16)))
    files.append(_png(np.zeros((37, 91, 4), np.uint8)))
    for data in files:
        assert check_header(data, "x") == Image.open(io.BytesIO(data)).size == (91, 37)
    ok, bmp = cv2.imencode(".bmp", np.zeros((37, 91, 3), np.uint8))
    assert check_header(bmp.tobytes(), "x") == (91, 37)  # not JPEG or PNG: Pillow reads it
    with pytest.raises(DecodeError, match="cut.jpg"):
        decode(files[0][:30], "cut.jpg", 10**6)  # no start-of-frame yet: Pillow fails, clearly


def test_colour_profile_warnings_do_not_reach_stderr(samples, capfd) -> None:
    """page.png carries a malformed iCCP profile: libpng would warn on stderr at every decode."""
    data = (samples / "page.png").read_bytes()
    assert b"iCCP" in data[:4096]
    want = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    capfd.readouterr()
    got = decode(data, "page.png", 10**8)
    assert "libpng" not in capfd.readouterr().err
    assert np.array_equal(got, want)


def _jpeg(progressive: bool = False, thumbnail: bool = False) -> bytes:
    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8))
    extra = {}
    if thumbnail:  # an EXIF block that carries a whole JPEG (SOI ... SOS ... EOI) before the main scan
        small = io.BytesIO()
        img.resize((16, 12)).save(small, format="JPEG")
        exif = b"Exif\x00\x00" + small.getvalue()
        extra["exif"] = exif
    buf = io.BytesIO()
    img.save(buf, format="JPEG", progressive=progressive, **extra)
    return buf.getvalue()


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("thumbnail", [False, True])
def test_truncated_jpeg_is_refused_wherever_it_is_cut(progressive: bool, thumbnail: bool) -> None:
    data = _jpeg(progressive, thumbnail)
    assert data.count(b"\xff\xd9") == (2 if thumbnail else 1)
    assert decode(data, "ok.jpg", 10**6).shape == (64, 96, 3)
    assert decode(data + b"\x00" * 100, "padded.jpg", 10**6).shape == (64, 96, 3)  # trailing bytes: fine
    last_scan = data.rfind(b"\xff\xda")
    for cut in (len(data) - 2, len(data) - 50, last_scan + 10):
        with pytest.raises(DecodeError, match="cut.jpg: truncated JPEG"):
            decode(data[:cut], "cut.jpg", 10**6)
    with pytest.raises(DecodeError, match="cut.jpg: "):  # cut before the last scan: an error that names the file
        decode(data[:last_scan], "cut.jpg", 10**6)
    with pytest.raises(DecodeError, match="scan.jpg: truncated JPEG"):  # a scan marker after the end: cut, then appended
        decode(data + b"\xff\xda\x00\x08", "scan.jpg", 10**6)


def _flavours() -> dict[str, tuple[bytes, bool]]:
    """JPEGs of every common kind -> (bytes, whether the simplejpeg path takes it)."""
    rng = np.random.default_rng(2)
    base = cv2.GaussianBlur(rng.integers(0, 256, (61, 83, 3), dtype=np.uint8), (5, 5), 0)  # odd sizes: edge blocks
    rgb = Image.fromarray(base[:, :, ::-1])

    def pil(im: Image.Image, **kw) -> bytes:
        buf = io.BytesIO()
        im.save(buf, format="JPEG", **kw)
        return buf.getvalue()

    def exif(orientation: int) -> bytes:
        e = Image.Exif()
        e[0x0112] = orientation
        return e.tobytes()

    out = {f"subsampling {s}": (pil(rgb, quality=90, subsampling=s), True) for s in (0, 1, 2)}
    out["progressive"] = (pil(rgb, progressive=True), True)
    out["optimized tables"] = (pil(rgb, optimize=True), True)
    out["gray"] = (pil(rgb.convert("L")), True)
    out["restart markers"] = (cv2.imencode(".jpg", base, [cv2.IMWRITE_JPEG_RST_INTERVAL, 2])[1].tobytes(), True)
    out["exif upright"] = (pil(rgb, exif=exif(1)), True)
    for o in (3, 6, 8):
        out[f"exif orientation {o}"] = (pil(rgb, exif=exif(o)), False)
    for o in (1, 6):  # Motorola byte order, written by hand: header, IFD0 with one SHORT entry, next-IFD 0
        tiff = b"MM\x00\x2a" + struct.pack(">IHHHIHHI", 8, 1, 0x0112, 3, 1, o, 0, 0)
        out[f"exif big-endian orientation {o}"] = (pil(rgb, exif=b"Exif\x00\x00" + tiff), o == 1)
    out["cmyk"] = (pil(rgb.convert("CMYK")), False)
    return out


@pytest.mark.parametrize("kind", list(_flavours()))
def test_every_jpeg_decodes_exactly_as_opencv_does(kind: str) -> None:
    """The fast path (simplejpeg) only takes what it decodes pixel for pixel as OpenCV; the rest goes to OpenCV."""
    from worker.images.headers import _jpeg_header

    data, fast = _flavours()[kind]
    header = _jpeg_header(data)
    assert header is not None and header.plain is fast
    assert np.array_equal(decode(data, "f.jpg", 10**6), cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR))


def test_sample_photographs_decode_exactly_as_opencv_does(samples) -> None:
    from worker.images.headers import _jpeg_header

    photos = [p for p in sorted(samples.iterdir()) if p.suffix in (".jpg", ".jpeg")]
    for p in photos:
        data = p.read_bytes()
        assert _jpeg_header(data).plain, p.name
        assert np.array_equal(decode(data, p.name, 10**8), cv2.imread(str(p), cv2.IMREAD_COLOR)), p.name
    # and re-encoded at the bench's sizes and quality
    img = cv2.imread(str(photos[0]))
    for width in (640, 1920):
        big = cv2.resize(img, (width, round(img.shape[0] * width / img.shape[1])), interpolation=cv2.INTER_CUBIC)
        data = cv2.imencode(".jpg", big, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
        assert np.array_equal(decode(data, "b.jpg", 10**8), cv2.imdecode(np.frombuffer(data, np.uint8), 1))


def test_depth_16_keeps_a_16_bit_files_pixels_and_widens_the_rest() -> None:
    """`preprocess.depth: 16`: 16-bit PNGs and TIFFs as they are (BGR, uint16); 8-bit files, whatever
    their format, widened so that 255 is 65535; the same errors, naming the file."""
    levels = (np.arange(12, dtype=np.uint16).reshape(3, 4) * 5000 + 7)  # 12-bit and beyond, odd values
    bgr = np.dstack([levels, levels // 2, levels // 3]).astype(np.uint16)
    for ext, arr in ((".png", levels), (".png", bgr), (".tiff", levels), (".tiff", bgr)):
        ok, enc = cv2.imencode(ext, arr)
        out = decode(enc.tobytes(), f"deep{ext}", 10**6, depth=16)
        want = arr if arr.ndim == 3 else np.dstack([arr] * 3)
        assert out.dtype == np.uint16 and out.shape == (3, 4, 3)
        np.testing.assert_array_equal(out, want)
        assert decode(enc.tobytes(), f"deep{ext}", 10**6).dtype == np.uint8  # depth 8: as before

    rng = np.random.default_rng(4)
    photo = rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)
    gif = io.BytesIO()
    Image.fromarray(photo[:, :, ::-1]).convert("P").save(gif, format="GIF")
    for name, data in (("a.png", _png(photo)), ("a.jpg", cv2.imencode(".jpg", photo)[1].tobytes()),
                       ("a.gif", gif.getvalue())):
        eight = decode(data, name, 10**6)
        out = decode(data, name, 10**6, depth=16)
        assert out.dtype == np.uint16 and out.shape == eight.shape
        np.testing.assert_array_equal(out, eight.astype(np.uint16) * 257)

    with pytest.raises(DecodeError, match="e.png: empty file"):
        decode(b"", "e.png", 10**6, depth=16)
    with pytest.raises(DecodeError, match="t.png: not an image"):
        decode(b"hello, I am text", "t.png", 10**6, depth=16)
    whole = cv2.imencode(".png", np.zeros((50, 50), np.uint16) + 999)[1].tobytes()
    with pytest.raises(DecodeError, match="half.png"):
        decode(whole[: len(whole) // 2], "half.png", 10**6, depth=16)
    with pytest.raises(ImageTooLarge, match="50x50 pixels is over the limit of 2000"):
        decode(whole, "big.png", 2000, depth=16)


def _photo_jpeg(h: int, w: int, orientation: int = 1) -> bytes:
    """A smooth h x w photo-like JPEG (a gradient with some blobs), with an EXIF orientation."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.dstack([xx / w * 255, yy / h * 255, 128 + 100 * np.sin(xx / 50) * np.cos(yy / 70)]).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=92, exif=exif)
    return buf.getvalue()


def test_reduced_decode_takes_the_smallest_scale_that_keeps_what_the_resize_needs() -> None:
    """pipeline.jpeg_reduce: 1/2, 1/4 or 1/8 of a JPEG when that still has `needed` pixels; the original
    upright size comes back with it, so results can be mapped to it; otherwise the full decode."""
    jpeg = _photo_jpeg(1280, 1920)
    img, orig = decode_reduced(jpeg, "big.jpg", 10**8, lambda hw: (256, 384))
    assert orig == (1280, 1920) and img.shape == (320, 480, 3)  # 1/4: 1/8 would be 160 rows, under 256
    full = decode(jpeg, "big.jpg", 10**8)
    shrunk = cv2.resize(full, (480, 320), interpolation=cv2.INTER_AREA)
    assert np.abs(img.astype(int) - shrunk).mean() < 2  # the same picture, smaller
    deep, _ = decode_reduced(jpeg, "big.jpg", 10**8, lambda hw: (256, 384), depth=16)
    np.testing.assert_array_equal(deep, img.astype(np.uint16) * 257)

    img, orig = decode_reduced(jpeg, "big.jpg", 10**8, lambda hw: (700, 1000))  # 1/2 would be too small
    assert orig == (1280, 1920) and img.shape == (1280, 1920, 3)
    rotated, orig = decode_reduced(_photo_jpeg(1280, 1920, orientation=6), "r.jpg", 10**8, lambda hw: (384, 256))
    assert orig == (1920, 1280) and rotated.shape == (480, 320, 3)  # upright, as displayed
    png = _png(np.zeros((1280, 1920, 3), np.uint8))
    img, orig = decode_reduced(png, "big.png", 10**8, lambda hw: (256, 384))  # only JPEGs are reduced
    assert orig == (1280, 1920) and img.shape == (1280, 1920, 3)
    with pytest.raises(ImageTooLarge, match="big.jpg: 1920x1280 pixels is over the limit"):
        decode_reduced(jpeg, "big.jpg", 10**6, lambda hw: (256, 384))
    with pytest.raises(DecodeError, match="cut.jpg: truncated JPEG"):
        decode_reduced(jpeg[: len(jpeg) // 2], "cut.jpg", 10**8, lambda hw: (256, 384))


def test_32_bit_samples_are_refused_naming_the_file_and_16_bit_ones_decode() -> None:
    """A float or 32-bit integer TIFF holds measurements, not pixels: decoding clipped them to black
    or white and the image was done on that. A 16-bit PGM, which Pillow also opens in its 32-bit
    integer mode, still decodes."""
    for arr, what in ((np.full((4, 6), 0.5, np.float32), "float"), (np.full((4, 6), 3000, np.int32), "integer")):
        buf = io.BytesIO()
        Image.fromarray(arr, mode="F" if what == "float" else "I").save(buf, format="TIFF")
        for depth in (8, 16):
            with pytest.raises(DecodeError, match=f"m.tiff: a TIFF of 32-bit {what} samples, not 8- or 16-bit pixels"):
                decode(buf.getvalue(), "m.tiff", 10**6, depth=depth)
    pgm = cv2.imencode(".pgm", np.full((4, 6), 3000, np.uint16))[1].tobytes()
    assert decode(pgm, "g.pgm", 10**6)[0, 0].tolist() == [11, 11, 11]  # 3000 / 256
    assert decode(pgm, "g.pgm", 10**6, depth=16)[0, 0].tolist() == [3000] * 3


def test_depth_32_takes_a_32_bit_tiffs_own_values_and_any_other_files_as_floats() -> None:
    """`preprocess.depth: 32`: a float TIFF's samples as they are (negative ones too; gray replicated,
    colour in BGR order), a 32-bit integer TIFF's as floats, an 8- or 16-bit file's pixels at their own
    depth; a sample that is NaN or infinite (no data) fails the image, naming how many."""
    temps = (np.arange(24, dtype=np.float32).reshape(4, 6) - 10.0) * 2.5  # -25.0 .. 32.5
    buf = io.BytesIO()
    Image.fromarray(temps, mode="F").save(buf, format="TIFF")
    got = decode(buf.getvalue(), "t.tiff", 10**6, depth=32)
    assert got.dtype == np.float32 and got.shape == (4, 6, 3)
    assert all(np.array_equal(got[:, :, c], temps) for c in range(3))
    bgr = np.dstack([temps, temps * 2, -temps]).astype(np.float32)
    colour = cv2.imencode(".tiff", bgr, [cv2.IMWRITE_TIFF_COMPRESSION, 1])[1].tobytes()  # plain float samples
    assert np.array_equal(decode(colour, "c.tiff", 10**6, depth=32), bgr)
    # Pillow cannot open a colour float TIFF; OpenCV alone would decode it at 8 bits, clipped
    with pytest.raises(DecodeError, match="c.tiff: a TIFF of 32-bit float samples, not 8- or 16-bit pixels"):
        decode(colour, "c.tiff", 10**6)
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 6), -3000, np.int32), mode="I").save(buf, format="TIFF")
    assert decode(buf.getvalue(), "i.tiff", 10**6, depth=32)[0, 0].tolist() == [-3000.0] * 3
    assert decode(cv2.imencode(".png", np.full((4, 6), 200, np.uint8))[1].tobytes(), "g.png", 10**6,
                  depth=32)[0, 0].tolist() == [200.0] * 3
    assert decode(cv2.imencode(".png", np.full((4, 6), 3000, np.uint16))[1].tobytes(), "s.png", 10**6,
                  depth=32)[0, 0].tolist() == [3000.0] * 3
    holes = temps.copy()
    holes[0, :2] = np.nan
    holes[1, 0] = np.inf
    buf = io.BytesIO()
    Image.fromarray(holes, mode="F").save(buf, format="TIFF")
    with pytest.raises(DecodeError, match=r"h.tiff: 3 of its 24 samples are NaN or infinite \(no data\)"):
        decode(buf.getvalue(), "h.tiff", 10**6, depth=32)
    with pytest.raises(DecodeError, match="save it at 8 or 16 bits, or give the model's card preprocess.depth: 32"):
        decode(buf.getvalue(), "h.tiff", 10**6)
    with pytest.raises(ImageTooLarge, match="big.tiff: 6x4 pixels is over the limit of 20"):
        decode(buf.getvalue(), "big.tiff", 20, depth=32)
    with pytest.raises(ImageTooLarge, match="big.tiff: 6x4 pixels is over the limit of 20"):  # size from its tags
        decode(colour, "big.tiff", 20, depth=32)


def test_frames_counts_pages_and_frames_and_says_one_for_the_rest() -> None:
    """A multi-page TIFF, an animated GIF and an animated PNG (APNG) say how many; a JPEG, a still PNG
    and bytes that are no image say one (decoding then takes the first, or fails for its own reason)."""
    pages = [Image.new("RGB", (8, 6), c) for c in ("red", "green", "blue")]

    def saved(fmt: str, n: int, **kw) -> bytes:
        buf = io.BytesIO()
        pages[0].save(buf, fmt, save_all=n > 1, append_images=pages[1:n], **kw)
        return buf.getvalue()

    assert frames(saved("TIFF", 3)) == 3
    assert frames(saved("GIF", 2)) == 2
    assert frames(saved("PNG", 3)) == 3 and b"acTL" in saved("PNG", 3)
    assert frames(saved("PNG", 1)) == 1 and frames(saved("JPEG", 1)) == 1 and frames(saved("TIFF", 1)) == 1
    assert frames(b"not an image") == 1
    first = decode(saved("TIFF", 3), "three.tif", 10**6)
    assert first.shape == (6, 8, 3) and tuple(first[0, 0]) == (0, 0, 255)  # BGR: the red first page


def test_later_pages_give_each_page_as_decode_gives_the_first(tmp_path, monkeypatch) -> None:
    """pipeline.pages: all. Each later page of a TIFF (colour pages of two sizes, a gray one; 16-bit pages
    at depth 8, 16 and 32), a few at a time or one by one, as written; a GIF's and an APNG's frames; a page
    over the pixel limit, or of float samples under depth 8, is refused once the pages before it are out."""
    import worker.images as images

    rng = np.random.default_rng(3)
    pages = [rng.integers(0, 256, (40, 60, 3), dtype=np.uint8), rng.integers(0, 256, (30, 20, 3), dtype=np.uint8),
             rng.integers(0, 256, (10, 12), dtype=np.uint8), rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)]
    assert cv2.imwritemulti(str(tmp_path / "m.tif"), pages)
    data = (tmp_path / "m.tif").read_bytes()
    want = [p if p.ndim == 3 else np.repeat(p[:, :, None], 3, axis=2) for p in pages[1:]]
    for chunk in (16, 2, 1):  # every page in one call, a call ending between pages, one page a call
        monkeypatch.setattr(images.tiff, "PAGE_CHUNK", chunk)
        got = list(later_pages(data, "m.tif", 0))
        assert len(got) == 3 and all(np.array_equal(g, w) for g, w in zip(got, want)), chunk
        assert all(np.array_equal(g, w.astype(np.float32)) for g, w in zip(later_pages(data, "m", 0, 32), want))
    monkeypatch.setattr(images.tiff, "PAGE_CHUNK", 16)
    deep = [rng.integers(0, 65536, (8, 9, 3), dtype=np.uint16) for _ in range(2)]
    assert cv2.imwritemulti(str(tmp_path / "d.tif"), deep)
    data16 = (tmp_path / "d.tif").read_bytes()
    assert np.array_equal(next(later_pages(data16, "d.tif", 0, depth=16)), deep[1])
    assert cv2.imwrite(str(tmp_path / "one.tif"), deep[1])  # at depth 8, as `decode` makes 8 bits of 16
    assert np.array_equal(next(later_pages(data16, "d.tif", 0)), decode((tmp_path / "one.tif").read_bytes(), "o", 0))

    # 30x20 = 600 pixels on page 2: pages 2-4 in one call, but the page over the limit is said first
    with pytest.raises(ImageTooLarge, match="m.tif: 20x30 pixels is over the limit of 599"):
        next(later_pages(data, "m.tif", 599))
    bigger = [pages[0], pages[3], pages[1]]  # page 3 over the limit: page 2 comes out before it is refused
    assert cv2.imwritemulti(str(tmp_path / "b.tif"), bigger)
    out = later_pages((tmp_path / "b.tif").read_bytes(), "b.tif", 599)
    assert np.array_equal(next(out), pages[3])
    with pytest.raises(ImageTooLarge, match="b.tif: 20x30 pixels"):
        next(out)

    frames_ = [Image.new("RGB", (8, 6), c) for c in ("red", "blue", "lime")]
    for fmt, kw in (("GIF", {}), ("PNG", {"default_image": False})):
        buf = io.BytesIO()
        frames_[0].save(buf, fmt, save_all=True, append_images=frames_[1:], **kw)
        got = [tuple(p[0, 0]) for p in later_pages(buf.getvalue(), f"a.{fmt}", 0)]
        assert got == [(255, 0, 0), (0, 255, 0)], fmt  # BGR: blue, lime

    floats = [np.zeros((4, 5), np.float32), np.full((4, 5), -2.5, np.float32)]
    buf = io.BytesIO()
    Image.fromarray(floats[0]).save(buf, "TIFF", save_all=True, append_images=[Image.fromarray(floats[1])])
    with pytest.raises(DecodeError, match="a TIFF of 32-bit float samples"):
        next(later_pages(buf.getvalue(), "f.tif", 0))
    assert next(later_pages(buf.getvalue(), "f.tif", 0, depth=32))[0, 0].tolist() == [-2.5, -2.5, -2.5]


def test_a_tiff_read_from_disk_gives_every_page_as_from_its_bytes(tmp_path, monkeypatch) -> None:
    """A multi-page TIFF too large to read whole: its pages from the open file (first included) equal
    decode's first page and later_pages' others, at depth 8 and 16, however they are chunked; even once
    the file has been renamed away. tiff_pages counts pages of a TIFF only."""
    import worker.images as images

    rng = np.random.default_rng(5)
    pages = [rng.integers(0, 256, (40, 60, 3), dtype=np.uint8), rng.integers(0, 256, (30, 20), dtype=np.uint8),
             rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)]
    deep = [rng.integers(0, 65536, (8, 9, 3), dtype=np.uint16) for _ in range(3)]
    for name, written, depth in (("m.tif", pages, 8), ("d.tif", deep, 16), ("d.tif", deep, 8)):
        path = tmp_path / name
        assert cv2.imwritemulti(str(path), written)
        data = path.read_bytes()
        want = [decode(data, name, 0, depth), *later_pages(data, name, 0, depth)]
        assert len(want) == 3
        for chunk in (16, 2):
            monkeypatch.setattr(images.tiff, "PAGE_CHUNK", chunk)
            with path.open("rb") as f:
                assert tiff_pages(f) == 3
                path.rename(tmp_path / "away.tif")  # the open file is read, whatever its name now
                got = list(file_pages(f, reopenable(f, path), name, 0, depth))
                (tmp_path / "away.tif").rename(path)
            assert len(got) == 3 and all(g.dtype == w.dtype and np.array_equal(g, w) for g, w in zip(got, want))
    with (tmp_path / "m.tif").open("rb") as f:
        with pytest.raises(ImageTooLarge, match="m.tif: 60x40 pixels is over the limit of 2399"):  # the first page too
            next(file_pages(f, reopenable(f, tmp_path / "m.tif"), "m.tif", 2399))
    for other in (_png(pages[0]), b"II*\x00 not a TIFF after all", b""):
        assert tiff_pages(io.BytesIO(other)) == 0


def _gray_tiff(pages: list[np.ndarray], big: bool = False, loop: bool = False, reduced: frozenset[int] = frozenset(),
               compression: int = 1) -> bytes:
    """A TIFF (classic, or BigTIFF) of gray images, 8-bit or signed 16-bit (SampleFormat 2), each image's
    pixels then its directory, uncompressed, or in one LZMA strip with `compression` 34925 (any other
    compression is only named); with `loop`, the last directory's next is the first again (a malformed
    chain); the images numbered in `reduced` marked as reduced versions of another (NewSubfileType 1: a
    thumbnail, a pyramid's level)."""
    import lzma
    import struct

    count_fmt, entry_fmt, offset_fmt = ("Q", "HHQQ", "Q") if big else ("H", "HHII", "I")
    out = bytearray(b"II" + (struct.pack("<HHHQ", 43, 8, 0, 0) if big else struct.pack("<HI", 42, 0)))
    link, first = len(out) - struct.calcsize(offset_fmt), 0
    for k, page in enumerate(pages):
        pixels = len(out)
        raw = page.astype(page.dtype.newbyteorder("<")).tobytes()
        strip = lzma.compress(raw, format=lzma.FORMAT_XZ) if compression == 34925 else raw  # libtiff's LZMA reads .xz
        out += strip
        h, w = page.shape
        tags = [(254, 4, 1)] * (k in reduced) + [(256, 4, w), (257, 4, h), (258, 3, page.dtype.itemsize * 8),
                                                 (259, 3, compression), (262, 3, 1), (273, 4, pixels), (277, 3, 1),
                                                 (278, 4, h), (279, 4, len(strip))] + [(339, 3, 2)] * (page.dtype.kind == "i")
        at = len(out)
        first = first or at
        struct.pack_into("<" + offset_fmt, out, link, at)
        out += struct.pack("<" + count_fmt, len(tags))
        out += b"".join(struct.pack("<" + entry_fmt, tag, kind, 1, value) for tag, kind, value in tags)
        link = len(out)
        out += struct.pack("<" + offset_fmt, 0)
    if loop:
        struct.pack_into("<" + offset_fmt, out, link, first)
    return bytes(out)


def test_a_signed_16_bit_tiff_decodes_as_opencv_reads_it_whoever_reads_it(tmp_path, capfd) -> None:
    """A signed 16-bit gray TIFF (SampleFormat 2: some scientific cameras, elevation maps), as OpenCV reads it
    uncompressed: its values at depth 32, the high byte of each sample's bits at depth 8 (-1 -> 255, 256 ->
    1), widened at 16. Compressed with LZMA, which OpenCV cannot read, Pillow gives the same, every page,
    from bytes or from disk; before, Pillow's conversion clipped it at depth 8 (every negative value 0,
    everything over 255 white) and it was refused at 16 and 32 as 'a 16-bit colour TIFF'."""
    pages = [np.array([[-30000, -1, 0, 1], [255, 256, 20000, 32767]], np.int16),
             np.arange(-6, 6, dtype=np.int16).reshape(3, 4) * 1000]
    high = [(p.view(np.uint16) >> 8).astype(np.uint8) for p in pages]
    assert high[0].ravel().tolist() == [138, 255, 0, 0, 0, 1, 78, 127]
    for compression in (1, 34925):
        data = _gray_tiff(pages, compression=compression)
        path = tmp_path / f"s{compression}.tif"
        path.write_bytes(data)
        for depth, want in ((8, high), (16, [h.astype(np.uint16) * 257 for h in high]),
                            (32, [p.astype(np.float32) for p in pages])):
            want = [np.repeat(w[:, :, None], 3, axis=2) for w in want]
            got = [decode(data, path.name, 0, depth), *later_pages(data, path.name, 0, depth)]
            with path.open("rb") as f:
                got += list(file_pages(f, reopenable(f, path), path.name, 0, depth))
            assert len(got) == 4, (compression, depth)
            assert [(g.dtype, g.tolist()) for g in got] == [(w.dtype, w.tolist()) for w in want + want], (compression, depth)
    capfd.readouterr()  # OpenCV's own warnings for the uncompressed file's pages are not what this checks


def _tiff(pages: list[np.ndarray], compression: int = 1, extra: int = 0, cmyk: bool = False) -> bytes:
    """A classic little-endian TIFF of (H, W) or (H, W, C) pages of any integer or float dtype, each in one
    strip, uncompressed or LZMA (34925); C of 2 or 4 with ExtraSamples `extra` (1 associated alpha, 2
    unassociated), or with `cmyk` 4 inks (PhotometricInterpretation 5)."""
    import lzma

    out = bytearray(b"II" + struct.pack("<HI", 42, 0))
    link = 4
    for page in pages:
        h, w = page.shape[:2]
        c = page.shape[2] if page.ndim == 3 else 1
        raw = page.astype(page.dtype.newbyteorder("<")).tobytes()
        strip = lzma.compress(raw, format=lzma.FORMAT_XZ) if compression == 34925 else raw
        pixels = len(out)
        out += strip
        per_sample = []  # BitsPerSample and SampleFormat: (count, the SHORTs inline when two fit, else their offset)
        for value in (page.dtype.itemsize * 8, {"u": 1, "i": 2, "f": 3}[page.dtype.kind]):
            at = len(out)
            out += struct.pack(f"<{c}H", *[value] * c) + b"\0\0"
            per_sample.append((c, struct.unpack_from("<I", out, at)[0] if c <= 2 else at))
        entries = sorted([(256, 4, 1, w), (257, 4, 1, h), (258, 3, *per_sample[0]), (259, 3, 1, compression),
                          (262, 3, 1, 5 if cmyk else 2 if c >= 3 else 1), (273, 4, 1, pixels), (277, 3, 1, c),
                          (278, 4, 1, h), (279, 4, 1, len(strip)), (339, 3, *per_sample[1])] +
                         [(338, 3, 1, extra)] * (c in (2, 4) and not cmyk))
        struct.pack_into("<I", out, link, len(out))
        out += struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries)
        link = len(out)
        out += struct.pack("<I", 0)
    return bytes(out)


def _pillow_reads(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
        return True
    except Exception:
        return False


def test_a_tiff_opencv_cannot_read_decodes_as_the_same_pages_uncompressed(tmp_path, capfd) -> None:
    """Pages OpenCV cannot read (LZMA here) go to Pillow, which must give what OpenCV gives for the same pages
    uncompressed, every page, at every depth, from bytes and from disk: colour with alpha over black, as
    libtiff premultiplies it for OpenCV (Pillow's straight colour, before: a transparent pixel kept its
    colour); gray with associated alpha as stored (before: refused, Pillow converts it to nothing); signed
    8-bit gray's own values at depth 32 (before: read unsigned), and OpenCV's later pages of it at depth 16
    as 8-bit widened (before: int8 went on); CMYK as libtiff converts it (before: Pillow's rounding, +-1).
    Samples neither takes are named."""
    rng = np.random.default_rng(5)
    alpha = rng.integers(0, 256, (2, 6, 7, 1)).astype(np.uint16)
    cases = {
        "rgba": ([rng.integers(0, 256, (6, 7, 4), dtype=np.uint8) for _ in range(2)], 2, 0),
        "rgba-associated": ([np.concatenate([rng.integers(0, 256, (6, 7, 3)) * a // 255, a], axis=2).astype(np.uint8)
                             for a in alpha], 1, 1),  # valid premultiplied: Pillow divides it out, within 1 again
        "gray-associated": ([np.concatenate([rng.integers(0, 256, (6, 7, 1)) * a // 255, a], axis=2).astype(np.uint8)
                             for a in alpha], 1, 0),
        "int8": ([rng.integers(-128, 128, (6, 7), dtype=np.int8) for _ in range(2)], 0, 0),
        "cmyk": ([rng.integers(0, 256, (6, 7, 4), dtype=np.uint8) for _ in range(2)], -1, 0),  # -1: inks, no alpha
    }
    results: dict[str, dict[int, list[list[np.ndarray]]]] = {}
    for label, (pages, extra, within) in cases.items():
        got = results[label] = {}
        for compression in (1, 34925):
            data = _tiff(pages, compression, max(extra, 0), cmyk=extra < 0)
            path = tmp_path / f"{label}-{compression}.tif"
            path.write_bytes(data)
            if compression != 1 and not _pillow_reads(data):  # Pillow 10.0 reads no gray with associated alpha
                with pytest.raises(DecodeError, match=r"neither OpenCV nor Pillow here reads this TIFF \(compressed "
                                                      r"with LZMA\)"):
                    decode(data, path.name, 0)
                del results[label]
                break
            for depth in (8, 16, 32):
                pair = [decode(data, path.name, 0, depth), *later_pages(data, path.name, 0, depth)]
                with path.open("rb") as f:
                    pair += list(file_pages(f, reopenable(f, path), path.name, 0, depth))
                got.setdefault(depth, []).append(pair)
        if label not in results:
            continue
        for depth, (opencv, pillow) in got.items():
            assert len(opencv) == len(pillow) == 4 and all(o.dtype == p.dtype for o, p in zip(opencv, pillow))
            diff = max(int(np.abs(o.astype(np.int64) - p.astype(np.int64)).max()) for o, p in zip(opencv, pillow))
            assert diff <= within * (257 if depth == 16 else 1), (label, depth, diff)
    rgba = cases["rgba"][0][1].astype(np.uint16)  # its second page, read by Pillow: its colour over black
    assert np.array_equal(results["rgba"][8][1][1], ((rgba[:, :, 2::-1] * rgba[:, :, 3:] + 127) // 255).astype(np.uint8))
    assert np.array_equal(results["int8"][32][1][0], np.repeat(cases["int8"][0][0][:, :, None], 3, axis=2))
    rgb32 = _tiff([np.zeros((3, 4, 3), np.uint32)])
    with pytest.raises(DecodeError, match=r"u.tif: cannot decode: neither OpenCV nor Pillow here reads this TIFF "
                                          r"\(3 samples of 32-bit unsigned integers per pixel\)$"):
        decode(rgb32, "u.tif", 0, 32)  # before: 'not an image (unknown or corrupt format)'
    capfd.readouterr()  # OpenCV's warnings for the uncompressed files' pages are not what this checks


def test_a_tiff_s_pages_are_counted_from_its_directories_classic_or_big_and_colour_float(tmp_path, monkeypatch) -> None:
    """Pages are counted from the TIFF's own chain of directories: a BigTIFF's (a stack over 4 GB is one),
    a colour TIFF of float samples (which Pillow cannot open: it was taken for one page and its others
    dropped without a word), a chain that loops or is cut short (the pages before the fault); a reduced
    image in the chain (a thumbnail, a pyramid's level) is not a page."""
    import worker.images as images

    rng = np.random.default_rng(9)
    gray = [rng.integers(0, 256, (5 + k, 7), dtype=np.uint8) for k in range(3)]
    for big in (False, True):
        data = _gray_tiff(gray, big=big)
        assert frames(data) == 3, big
        got = list(later_pages(data, "g.tif", 0))
        assert all(np.array_equal(g, np.repeat(w[:, :, None], 3, axis=2)) for g, w in zip(got, gray[1:])) and len(got) == 2
        (tmp_path / "g.tif").write_bytes(data)
        with (tmp_path / "g.tif").open("rb") as f:
            assert tiff_pages(f) == 3 and len(list(file_pages(f, reopenable(f, tmp_path / "g.tif"), "g", 0))) == 3
    assert frames(_gray_tiff(gray, loop=True)) == 3
    big = bytearray(_gray_tiff(gray, big=True))
    at = int.from_bytes(big[8:16], "little")  # the first directory's offset, where its count of entries is
    big[at:at + 8] = (1 << 40).to_bytes(8, "little")  # a count no directory has: not read, the end
    assert frames(bytes(big)) == 1 and tiff_pages(io.BytesIO(bytes(big))) == 0
    whole = _gray_tiff(gray)
    assert frames(whole[:-10]) == 2  # the last directory cut short

    # thumbnails in the chain, bigger than the limit the pages are within: neither counted nor decoded
    thumb = rng.integers(0, 256, (20, 30), dtype=np.uint8)
    data = _gray_tiff([gray[0], thumb, gray[1], gray[2], thumb], reduced=frozenset({1, 4}))
    assert frames(data) == 3 and frames(_gray_tiff([gray[0], thumb, gray[1]])) == 3
    for chunk in (16, 1):
        monkeypatch.setattr(images.tiff, "PAGE_CHUNK", chunk)
        got = list(later_pages(data, "t.tif", 100))
        assert len(got) == 2 and all(np.array_equal(g[:, :, 0], w) for g, w in zip(got, gray[1:]))
        (tmp_path / "t.tif").write_bytes(data)
        with (tmp_path / "t.tif").open("rb") as f:
            assert tiff_pages(f) == 3
            got = list(file_pages(f, reopenable(f, tmp_path / "t.tif"), "t", 100))
        assert len(got) == 3 and all(np.array_equal(g[:, :, 0], w) for g, w in zip(got, gray))

    floats = [rng.random((6, 8, 3), dtype=np.float32) - 0.5 for _ in range(3)]
    assert cv2.imwritemulti(str(tmp_path / "f.tif"), floats, [cv2.IMWRITE_TIFF_COMPRESSION, 1])  # not LogLuv
    data = (tmp_path / "f.tif").read_bytes()
    with pytest.raises(OSError):  # Pillow cannot identify it
        Image.open(io.BytesIO(data))
    assert frames(data) == 3 and np.array_equal(decode(data, "f.tif", 0, 32), floats[0])
    got = list(later_pages(data, "f.tif", 0, 32))
    assert len(got) == 2 and all(np.array_equal(g, w) for g, w in zip(got, floats[1:]))
    with pytest.raises(DecodeError, match="f.tif: a TIFF of 32-bit float samples"):
        next(later_pages(data, "f.tif", 0))


def test_an_animated_webp_decodes_without_opencv_s_error_line(capfd) -> None:
    """OpenCV refuses an animated WebP and prints `[ERROR:0@...] ... does not support animated webp images`
    to stderr, once per file, into a service's log: such a file goes to Pillow first, its first frame."""
    frames_ = [Image.new("RGB", (8, 6), c) for c in ("red", "blue")]
    buf = io.BytesIO()
    frames_[0].save(buf, "WEBP", save_all=True, append_images=frames_[1:], lossless=True)
    capfd.readouterr()
    first = decode(buf.getvalue(), "a.webp", 0)
    assert tuple(first[0, 0]) == (0, 0, 255) and frames(buf.getvalue()) == 2
    assert "ERROR" not in capfd.readouterr().err
    still = io.BytesIO()
    frames_[1].save(still, "WEBP", lossless=True)  # a still WebP stays OpenCV's
    assert tuple(decode(still.getvalue(), "b.webp", 0)[0, 0]) == (255, 0, 0)


def _rgb16_lzma_tiff(img: np.ndarray) -> bytes:
    """A TIFF of one 16-bit RGB image in one LZMA-compressed strip (Pillow cannot write 16-bit colour)."""
    import lzma

    h, w, _ = img.shape
    out = bytearray(b"II" + struct.pack("<HI", 42, 0))
    strip = lzma.compress(img.astype("<u2").tobytes(), format=lzma.FORMAT_XZ)  # libtiff's LZMA reads .xz
    pixels = len(out)
    out += strip
    bits = len(out)
    out += struct.pack("<HHH", 16, 16, 16)
    tags = [(256, 4, 1, w), (257, 4, 1, h), (258, 3, 3, bits), (259, 3, 1, 34925), (262, 3, 1, 2), (273, 4, 1, pixels),
            (277, 3, 1, 3), (278, 4, 1, h), (279, 4, 1, len(strip))]
    struct.pack_into("<I", out, 4, len(out))
    out += struct.pack("<H", len(tags)) + b"".join(struct.pack("<HHII", *t) for t in tags) + struct.pack("<I", 0)
    return bytes(out)


@pytest.mark.parametrize("compression", ["zstd", "lzma"])
def test_a_tiff_opencv_cannot_read_goes_to_pillow_at_its_own_depth(compression, tmp_path, monkeypatch, capfd) -> None:
    """Zstandard and LZMA (which microscopy software writes; OpenCV's wheels lack both): every page through
    Pillow, first and later, from bytes or from disk, equal to what was written at depth 8, 16 and 32.
    Before, Pillow's conversion clipped a 16-bit gray page at 255 (a white image, silently), later pages
    failed ('OpenCV read no image there'), and OpenCV printed warnings for each file. With the compression
    not known in advance, OpenCV's failure falls back to Pillow the same way. 16-bit colour, which Pillow
    holds at 8 bits, is refused at depth 16 and 32, naming why."""
    import worker.images as images

    rng = np.random.default_rng(11)
    gray = [rng.integers(0, 65536, (9 + k, 13), dtype=np.uint16) for k in range(3)]
    colour = [rng.integers(0, 256, (7, 5 + k, 3), dtype=np.uint8) for k in range(3)]  # RGB as written
    for written in (gray, colour):
        path = tmp_path / f"{compression}{written[0].ndim}.tif"
        ims = [Image.fromarray(p) for p in written]
        try:
            ims[0].save(path, save_all=True, append_images=ims[1:], compression=compression)
        except OSError:  # Pillow 10.0's libtiff was built without Zstandard: it reads no such file either
            pytest.skip(f"this Pillow's libtiff lacks {compression}")
        data = path.read_bytes()
        for lacks in (images.samples.OPENCV_LACKS, {}):  # Pillow straight away, or after OpenCV fails
            monkeypatch.setattr(images.samples, "OPENCV_LACKS", lacks)
            monkeypatch.setattr(images.tiff, "PAGE_CHUNK", 2)
            for depth in (8, 16, 32):
                if written is gray:
                    want = [np.repeat((p if depth != 8 else (p >> 8).astype(np.uint8))[:, :, None], 3, axis=2) for p in gray]
                else:
                    want = [p[:, :, ::-1].astype(np.uint16) * 257 if depth == 16 else p[:, :, ::-1] for p in colour]
                want = [w.astype(np.float32) if depth == 32 else w for w in want]
                got = [decode(data, path.name, 0, depth), *later_pages(data, path.name, 0, depth)]
                with path.open("rb") as f:
                    got += list(file_pages(f, reopenable(f, path), path.name, 0, depth))
                assert len(got) == 6, (lacks, depth)
                assert all(g.dtype == w.dtype and np.array_equal(g, w) for g, w in zip(got, want + want)), (lacks, depth)
            if lacks:
                assert capfd.readouterr().err == ""  # OpenCV not asked, so nothing on stderr

    monkeypatch.undo()
    deep_colour = rng.integers(0, 65536, (6, 7, 3), dtype=np.uint16)
    data = _rgb16_lzma_tiff(deep_colour)
    assert np.array_equal(decode(data, "c.tif", 0), (deep_colour >> 8).astype(np.uint8)[:, :, ::-1])
    for depth in (16, 32):
        with pytest.raises(DecodeError, match=r"c.tif: a 16-bit colour TIFF that OpenCV cannot read \(LZMA\): Pillow "
                                              r"reads it at 8 bits only"):
            decode(data, "c.tif", 0, depth)

    # LERC, which neither reads: the failure names it, first page or later, rather than Pillow's bare code
    lerc = _gray_tiff([np.zeros((4, 5), np.uint8)] * 2, compression=34887)
    unreadable = r"l.tif: cannot decode: neither OpenCV nor Pillow here reads this TIFF \(compressed with LERC\)$"
    with pytest.raises(DecodeError, match=unreadable):
        decode(lerc, "l.tif", 0)
    with pytest.raises(DecodeError, match=unreadable):
        next(later_pages(lerc, "l.tif", 0))
