"""Property-based fuzzing of the media layer: ``load_image`` and ``sample_frames``.

The contract under test: whatever bytes or string arrive, ``load_image`` returns a valid
:class:`~gguf_mcv.vision.media.Image` (uint8, H×W×3, C-contiguous, the file's dimensions after
its EXIF orientation) or raises :class:`~gguf_mcv.errors.MediaError` — nothing else,
ever; ``sample_frames`` returns valid frames or raises ``MediaError``.

Inputs: random bytes; byte mutations (bit flips, overwrites, insertions, deletions,
truncations) of small valid files in every format Pillow reads and writes, and of small
AVI/MP4 videos; random images of random PIL modes and sizes saved in random formats,
some with an EXIF orientation; random strings as paths and URIs.

Runs derandomized without an example database (``FUZZ``), so every run — here and in
CI — tries the same examples; the whole file takes well under 30 s.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from gguf_mcv.errors import MediaError
from gguf_mcv.vision.media import MAX_PIXELS, Image, load_image
from gguf_mcv.vision.video import sample_frames

# Pillow warns about the damaged files it still decodes (bad TIFF tags, short EXIF): expected here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:PIL.*")

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow])


def fuzz(max_examples: int) -> settings:
    """FUZZ with this many examples."""
    return settings(FUZZ, max_examples=max_examples)


# --- checking outcomes ------------------------------------------------------------------------------


def check_image(image: Image, size: tuple[int, int] | None = None) -> None:
    """``image`` is what load_image promises; of ``size`` (width, height) when given."""
    assert isinstance(image, Image)
    rgb = image.rgb
    assert isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8
    assert rgb.ndim == 3 and rgb.shape[2] == 3, rgb.shape
    assert rgb.flags.c_contiguous
    assert 1 <= image.width and 1 <= image.height and image.width * image.height <= MAX_PIXELS
    if size is not None:
        assert (image.width, image.height) == size
    assert len(image.digest) == 64  # hashing reads every pixel


def image_or_media_error(src: Any, size: tuple[int, int] | None = None) -> Image | None:
    """load_image(src): a checked Image, or None for a MediaError. Anything else propagates."""
    try:
        image = load_image(src)
    except MediaError:
        return None
    check_image(image, size)
    return image


def frames_or_media_error(src: Any, max_frames: int = 4) -> None:
    """sample_frames(src): checked frames, or a MediaError. Anything else propagates."""
    try:
        frames = sample_frames(src, max_frames=max_frames, fps=1.0)
    except MediaError:
        return
    assert 1 <= len(frames) <= max_frames
    assert frames.sampled >= len(frames)
    for frame in frames:
        check_image(frame.image)
        assert frame.index >= 0
        assert frame.timestamp is None or frame.timestamp >= 0


# --- base files ---------------------------------------------------------------------------------------


def _pixels(w: int, h: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x * y) % 256], axis=2)
    return np.clip(rgb + rng.integers(-20, 21, rgb.shape), 0, 255).astype(np.uint8)


def _save(pil: PIL.Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    pil.save(buf, fmt, **kw)
    return buf.getvalue()


def _exif(orientation: int) -> bytes:
    exif = PIL.Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def _base_images() -> dict[str, bytes]:
    """Small valid files: the seeds of the mutation fuzzer (one per format or variant)."""
    rgb = PIL.Image.fromarray(_pixels(24, 16))
    frames = [PIL.Image.fromarray(_pixels(24, 16, seed=s)) for s in range(3)]
    out: dict[str, bytes] = {
        "png": _save(rgb, "PNG"),
        "png_palette_trns": _save(rgb.convert("P"), "PNG", transparency=3),
        "png_16bit": _save(PIL.Image.fromarray(_pixels(24, 16)[:, :, 0].astype(np.uint16) * 257), "PNG"),
        "png_interlaced_rgba": _save(rgb.convert("RGBA"), "PNG", interlace=1),
        "apng": _save(frames[0], "PNG", save_all=True, append_images=frames[1:], duration=100),
        "jpeg": _save(rgb, "JPEG", quality=85),
        "jpeg_exif6": _save(rgb, "JPEG", quality=85, exif=_exif(6)),
        "jpeg_progressive": _save(rgb, "JPEG", quality=85, progressive=True),
        "jpeg_cmyk": _save(rgb.convert("CMYK"), "JPEG"),
        "gif": _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=[50, 0, 200]),
        "webp": _save(rgb, "WEBP", quality=70),
        "webp_lossless_alpha": _save(rgb.convert("RGBA"), "WEBP", lossless=True),
        "webp_animated": _save(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=100),
        "bmp": _save(rgb, "BMP"),
        "bmp_palette": _save(rgb.convert("P"), "BMP"),
        "tiff": _save(rgb, "TIFF"),
        "tiff_lzw_exif": _save(rgb, "TIFF", compression="tiff_lzw", exif=_exif(8)),
        "tiff_float": _save(PIL.Image.fromarray(_pixels(24, 16)[:, :, 0].astype(np.float32) / 7), "TIFF"),
        "ico": _save(rgb, "ICO"),
        "ppm": _save(rgb, "PPM"),
        "tga_rle": _save(rgb, "TGA", compression="tga_rle"),
        "pcx": _save(rgb, "PCX"),
        "sgi": _save(rgb, "SGI"),
        "qoi": _save(rgb, "QOI"),
        "dds": _save(rgb.convert("RGBA"), "DDS"),
    }
    return out


BASE_IMAGES = _base_images()


def _base_videos() -> dict[str, bytes]:
    """A tiny MJPG AVI and mp4v MP4 written by OpenCV (empty when this build cannot write them)."""
    import cv2

    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, fourcc in (("avi", "MJPG"), ("mp4", "mp4v")):
            path = Path(folder) / f"base.{name}"
            writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), 5.0, (32, 24))
            if not writer.isOpened():
                continue
            for i in range(6):
                frame = np.zeros((24, 32, 3), np.uint8)
                frame[:, (i * 5) % 28:(i * 5) % 28 + 4] = 255
                writer.write(frame)
            writer.release()
            out[name] = path.read_bytes()
    return out


BASE_VIDEOS = _base_videos()

# --- strategies ---------------------------------------------------------------------------------------

# (kind, position, value): positions are taken modulo the current length
_op = st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "dup"]),
                st.integers(0, 2**20), st.integers(0, 255))


def mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    """``data`` with each of ``ops`` applied in turn."""
    buf = bytearray(data)
    for kind, pos, value in ops:
        if not buf:
            break
        i = pos % len(buf)
        if kind == "flip":
            buf[i] ^= 1 << (value % 8)
        elif kind == "set":
            buf[i] = value
        elif kind == "insert":
            buf[i:i] = bytes([value]) * (1 + value % 16)
        elif kind == "delete":
            del buf[i:i + 1 + value % 16]
        elif kind == "truncate":
            del buf[i:]
        else:  # duplicate a short run: repeated chunks and markers
            buf[i:i] = buf[i:i + 1 + value % 64]
    return bytes(buf)


def mutated(bases: dict[str, bytes]) -> st.SearchStrategy[bytes]:
    return st.builds(lambda name, ops: mutate(bases[name], ops),
                     st.sampled_from(sorted(bases)), st.lists(_op, min_size=1, max_size=4))


_BYTES_PER_PIXEL = {"L": 1, "P": 1, "LA": 2, "PA": 2, "La": 2, "RGB": 3, "YCbCr": 3, "LAB": 3,
                    "HSV": 3, "RGBA": 4, "RGBa": 4, "RGBX": 4, "CMYK": 4, "I;16": 2, "I;16B": 2,
                    "I;16L": 2, "I": 4, "F": 4}
MODES = ["1", *_BYTES_PER_PIXEL]
FORMATS = ["PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "ICO", "PPM", "TGA", "PCX", "SGI", "QOI",
           "DDS", "SPIDER", "JPEG2000"]
EXIF_FORMATS = {"JPEG", "PNG", "WEBP"}
RESIZING_FORMATS = {"ICO"}  # may store another size than the one given


def _writable() -> list[tuple[str, str]]:
    """The (mode, format) pairs this Pillow can save: probed once, so no example is wasted."""
    pairs = []
    for mode in MODES:
        im = PIL.Image.frombytes(mode, (3, 2), bytes(64))
        for fmt in FORMATS:
            try:
                _save(im, fmt)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            pairs.append((mode, fmt))
    return pairs


WRITABLE = _writable()


def _random_pil(mode: str, w: int, h: int, seed: int) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    n = (w + 7) // 8 * h if mode == "1" else w * h * _BYTES_PER_PIXEL[mode]
    raw = rng.bytes(n)
    if mode == "F":  # floats in a plausible range, plus the odd extreme, infinity or NaN
        values = rng.normal(0, 300, w * h).astype(np.float32)
        extremes = np.array([0, 1e30, -1e30, 65536, np.inf, -np.inf, np.nan], np.float32)
        odd = rng.random(w * h) < 0.05
        values[odd] = rng.choice(extremes, size=int(odd.sum()))
        raw = values.tobytes()
    return PIL.Image.frombytes(mode, (w, h), raw)


@st.composite
def random_images(draw: st.DrawFn) -> tuple[bytes, tuple[int, int], dict[str, Any]]:
    """An encoded random image, the size it must decode to (after EXIF) and how it was made."""
    mode, fmt = draw(st.sampled_from(WRITABLE))
    w, h = draw(st.integers(1, 64)), draw(st.integers(1, 64))
    pil = _random_pil(mode, w, h, draw(st.integers(0, 2**32 - 1)))
    kw: dict[str, Any] = {}
    orientation = 1
    if fmt in EXIF_FORMATS and draw(st.booleans()):
        orientation = draw(st.integers(1, 8))
        kw["exif"] = _exif(orientation)
    if mode in ("P", "L") and fmt in ("PNG", "GIF") and draw(st.booleans()):
        kw["transparency"] = draw(st.integers(0, 255))
    try:
        data = _save(pil, fmt, **kw)
    except (OSError, ValueError):
        assume(False)  # e.g. a size this encoder refuses
    size = (h, w) if orientation in (5, 6, 7, 8) else (w, h)
    return data, size, {"mode": mode, "format": fmt, "orientation": orientation, "size": (w, h)}


# --- load_image ----------------------------------------------------------------------------------------


@fuzz(300)
@given(st.binary(max_size=4096))
def test_random_bytes(data: bytes) -> None:
    image_or_media_error(data)


@fuzz(3000)
@given(mutated(BASE_IMAGES))
def test_mutated_images(data: bytes) -> None:
    image_or_media_error(data)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # e.g. numpy casting NaN pixels to uint8
@fuzz(600)
@given(random_images())
def test_random_modes_and_formats(case: tuple[bytes, tuple[int, int], dict[str, Any]]) -> None:
    data, size, how = case
    image = load_image(data)  # a valid file must decode
    check_image(image, None if how["format"] in RESIZING_FORMATS else size)


_ORIENT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
    8: lambda a: np.rot90(a, 1),
}


@fuzz(60)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 8), st.sampled_from(["PNG", "WEBP"]),
       st.integers(0, 2**32 - 1))
def test_exif_orientation_pixels(w: int, h: int, orientation: int, fmt: str, seed: int) -> None:
    """Lossless RGB with an EXIF orientation decodes to exactly the displayed pixels."""
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    kw = {"lossless": True, "exact": True} if fmt == "WEBP" else {}
    data = _save(PIL.Image.fromarray(rgb), fmt, exif=_exif(orientation), **kw)
    image = load_image(data)
    np.testing.assert_array_equal(image.rgb, _ORIENT[orientation](rgb))


# Strings that once escaped as bare exceptions: a name longer than NAME_MAX (raw base64 text
# passed without its "data:" prefix is the realistic case: OSError ENAMETOOLONG) and a home
# folder that does not exist (RuntimeError from Path.expanduser).
_LONG_NAME = "iVBORw0KGgo" * 60
_NO_HOME = "~no-such-user-gguf-mcv/photo.jpg"


@fuzz(150)
@given(st.text(max_size=60))
@example("data:image/png;base64,")
@example("file:///")
@example("x\x00y.png")
@example(_LONG_NAME)
@example(_NO_HOME)
@example("/" + "a/" * 3000)
def test_random_strings(text: str) -> None:
    """Any string is a path, file:// or data: URI, or a refused URL: an Image or a MediaError."""
    image_or_media_error(text)


@fuzz(40)
@given(st.text(max_size=60))
@example(_LONG_NAME)
@example(_NO_HOME)
@example("file://" + "b" * 400)
def test_random_strings_as_videos(text: str) -> None:
    frames_or_media_error(text)


def test_spider_still() -> None:
    """A single-image SPIDER file decodes (its plugin refuses any seek, even to frame 0)."""
    data = _save(PIL.Image.fromarray(np.arange(12, dtype=np.float32).reshape(3, 4)), "SPIDER")
    check_image(load_image(data), (4, 3))


# --- sample_frames ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="media_fuzz_") as folder:
        yield Path(folder)


def _as_file(folder: Path, data: bytes, suffix: str) -> Path:
    path = folder / f"input{suffix}"
    path.write_bytes(data)
    return path


@fuzz(40)
@given(st.binary(min_size=1, max_size=2048), st.sampled_from([".mp4", ".avi", ".mkv", ".webm", ".mov"]))
def test_video_random_bytes(scratch: Path, data: bytes, suffix: str) -> None:
    frames_or_media_error(_as_file(scratch, data, suffix))


@pytest.mark.skipif(not BASE_VIDEOS, reason="this OpenCV build writes neither MJPG AVI nor mp4v MP4")
@fuzz(200)
@given(mutated(BASE_VIDEOS), st.booleans())
def test_video_mutated(scratch: Path, data: bytes, as_bytes: bool) -> None:
    frames_or_media_error(data if as_bytes else _as_file(scratch, data, ".avi"))


@fuzz(800)
@given(mutated({k: v for k, v in BASE_IMAGES.items() if k in ("gif", "apng", "webp_animated", "png",
                                                                 "jpeg", "tiff_lzw_exif", "bmp")}))
def test_video_mutated_images(scratch: Path, data: bytes) -> None:
    """Images given as videos take Pillow's path in the video module, with its own error handling."""
    frames_or_media_error(_as_file(scratch, data, ".gif"))


def test_base_files_decode() -> None:
    """The mutation seeds are themselves valid (else the fuzzers would test nothing)."""
    for name, data in BASE_IMAGES.items():
        check_image(load_image(data))
    for name, data in BASE_VIDEOS.items():
        assert len(sample_frames(data, max_frames=4, dedupe=False)) >= 1, name
    assert len(WRITABLE) > 50, WRITABLE
