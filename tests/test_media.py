"""Every image input kind and every bad-media case (a model only for the last few)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

import gguf_mcv
from gguf_mcv.errors import MediaError
from gguf_mcv.vision.media import MAX_PIXELS, Image, load_image


def encode(img: PIL.Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


RGB = PIL.Image.new("RGB", (40, 30), (200, 100, 50))
CODE_ROOT = str(Path(gguf_mcv.__file__).resolve().parent.parent)


def test_path_str_path_url_bytes_data_uri_pil_numpy_agree(tmp_path: Path) -> None:
    data = encode(RGB, "PNG")
    path = tmp_path / "a.png"
    path.write_bytes(data)
    inputs = [str(path), path, path.as_uri(), data, bytearray(data),
              "data:image/png;base64," + base64.b64encode(data).decode(), RGB,
              np.asarray(RGB)]
    digests = {load_image(i).digest for i in inputs}
    assert len(digests) == 1
    image = load_image(path)
    assert (image.width, image.height) == (40, 30)
    assert image.rgb.dtype == np.uint8 and image.rgb.shape == (30, 40, 3)
    assert load_image(image) is image


def test_exif_orientation_is_applied() -> None:
    img = PIL.Image.new("RGB", (40, 20), (0, 0, 255))
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90° clockwise when displayed
    rotated = load_image(encode(img, "JPEG", exif=exif))
    assert (rotated.width, rotated.height) == (20, 40)


@pytest.mark.parametrize("mode", ["P", "RGBA", "LA", "L", "1", "CMYK", "I;16", "I", "F", "YCbCr"])
def test_every_mode_becomes_rgb(mode: str) -> None:
    img = PIL.Image.new("RGB", (16, 8), (250, 250, 250)).convert(mode) if mode not in ("I;16",) \
        else PIL.Image.fromarray(np.full((8, 16), 65535, dtype=np.uint16))
    image = load_image(img)
    assert image.rgb.shape == (8, 16, 3) and image.rgb.dtype == np.uint8
    assert image.rgb.mean() > 200  # a light image stays light (16-bit scaled, not clipped to black)


def test_transparency_is_composited_on_white() -> None:
    clear = PIL.Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    assert load_image(encode(clear, "PNG")).rgb.min() == 255
    palette = PIL.Image.new("P", (4, 4), 0)
    palette.info["transparency"] = 0
    assert load_image(encode(palette, "PNG", transparency=0)).rgb.min() == 255


def test_sixteen_bit_png_is_scaled() -> None:
    arr = np.full((4, 4), 32768, dtype=np.uint16)
    image = load_image(encode(PIL.Image.fromarray(arr), "PNG"))
    assert 120 <= image.rgb[0, 0, 0] <= 135


def test_animated_gif_gives_first_frame() -> None:
    frames = [PIL.Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    image = load_image(buf.getvalue())
    assert image.rgb[0, 0, 0] > 200 and image.rgb[0, 0, 1] < 50


def test_webp_and_cmyk_jpeg() -> None:
    assert load_image(encode(RGB, "WEBP")).width == 40
    assert load_image(encode(RGB.convert("CMYK"), "JPEG")).rgb.shape == (30, 40, 3)


def test_numpy_variants() -> None:
    assert load_image(np.zeros((5, 6), dtype=np.uint8)).rgb.shape == (5, 6, 3)
    rgba = np.zeros((5, 6, 4), dtype=np.uint8)
    assert load_image(rgba).rgb.min() == 255  # fully transparent → white
    with pytest.raises(MediaError, match="dtype float64"):
        load_image(np.zeros((5, 6, 3)))
    with pytest.raises(MediaError, match="shape"):
        load_image(np.zeros((5, 6, 2), dtype=np.uint8))
    with pytest.raises(MediaError, match="no pixels"):
        load_image(np.zeros((0, 6, 3), dtype=np.uint8))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares a size without any pixel data (a decompression-bomb stand-in)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


def test_huge_declared_size_is_refused_before_decoding() -> None:
    with pytest.raises(MediaError, match="400000000 pixels"):
        load_image(png_header_only(20000, 20000))  # over Pillow's own bomb limit
    with pytest.raises(MediaError, match="10000×9000"):
        load_image(png_header_only(10000, 9000))  # under Pillow's limit, over ours
    assert 10000 * 9000 > MAX_PIXELS


@pytest.mark.parametrize("data,match", [
    (b"", "empty"),
    (b"hello, I am text", "could not be decoded"),
    (encode(RGB, "PNG")[:60], "could not be decoded"),
    (encode(RGB, "JPEG")[:200], "could not be decoded"),
])
def test_bad_bytes(data: bytes, match: str) -> None:
    with pytest.raises(MediaError, match=match):
        load_image(data)


def test_bad_locators(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="does not exist"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(MediaError, match="is a folder"):
        load_image(tmp_path)
    with pytest.raises(MediaError, match="remote URLs are off"):
        load_image("https://example.com/cat.jpg")
    with pytest.raises(MediaError, match="Malformed base64"):
        load_image("data:image/png;base64,@@@")
    with pytest.raises(MediaError, match="scheme"):
        load_image("ftp://example.com/cat.jpg")
    text = tmp_path / "notes.jpg"
    text.write_text("shopping list")
    with pytest.raises(MediaError, match="notes.jpg"):
        load_image(text)
    with pytest.raises(MediaError, match="Unsupported image input"):
        load_image(3.14)
    with pytest.raises(MediaError, match="not a usable file name"):
        load_image("cat\x00.png")


def test_media_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        load_image(b"nope")


def test_resizing_helpers_keep_aspect() -> None:
    image = Image(np.zeros((1000, 2000, 3), dtype=np.uint8), "x")
    small = image.resized_to_fit(448)
    assert (small.width, small.height) == (448, 224)
    assert image.resized_to_fit(4000) is image
    assert image.resized_to(20, 10).rgb.shape == (10, 20, 3)
    assert image.resized_to(2000, 1000) is image


# --- files that are not images, or not files at all --------------------------------------------

MEASURE = """
import json, resource, sys, time
from gguf_mcv.errors import MediaError
from gguf_mcv.vision.media import load_image
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    load_image(sys.argv[1])
    outcome = "decoded"
except MediaError as exc:
    outcome = str(exc)
print(json.dumps({"outcome": outcome, "seconds": time.perf_counter() - start,
                  "grew_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
"""


def load_in_child(path: Path) -> dict:
    """load_image(path) in a fresh process: its outcome, time and peak-memory growth."""
    env = {**os.environ, "PYTHONPATH": CODE_ROOT}  # the gguf_mcv this test imported
    run = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True,
                         text=True, timeout=120, env=env, check=False)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def sparse(path: Path, size: int, head: bytes = b"") -> Path:
    """A file of ``size`` bytes that starts with ``head`` and takes no disk space for the rest."""
    with path.open("wb") as f:
        f.write(head)
        f.truncate(size)
    return path


@pytest.mark.parametrize("size,head,match", [
    (3 * 2**30, b"", "GiB"),  # over the file-size limit: refused before anything is read
    (900 * 2**20, b"", "could not be decoded"),  # under it: only the header is read
    (900 * 2**20, png_header_only(64, 64), "could not be decoded"),  # a real header, junk after
], ids=["3GiB-zeros", "900MiB-zeros", "900MiB-png-header"])
def test_huge_file_is_refused_quickly_without_reading_it(tmp_path: Path, size: int, head: bytes,
                                                         match: str) -> None:
    result = load_in_child(sparse(tmp_path / "big.jpg", size, head))
    assert re.search(match, result["outcome"]), result
    assert result["seconds"] < 60, result  # generous: the memory it grew by is what shows a read
    assert result["grew_mib"] < 200, result  # reading the file would cost its size


def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.png"
    os.mkfifo(path)
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
@pytest.mark.timeout(20)  # opening the FIFO for reading would wait for a writer forever
def test_fifo_and_devices_are_refused_as_what_they_are(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="is a FIFO"):
        load_image(fifo(tmp_path))
    for device in ("/dev/zero", "/dev/null"):
        if os.path.exists(device):
            with pytest.raises(MediaError, match="is a character device, not a file"):
                load_image(device)


def test_memoryview_is_bytes_and_other_types_name_what_is_accepted() -> None:
    data = encode(RGB, "PNG")
    assert load_image(memoryview(data)).digest == load_image(data).digest
    for wrong in ({"url": "cat.png"}, 3.14, None, ["cat.png"]):
        with pytest.raises(MediaError, match="pass a file path .* a PIL image or an H×W×3 uint8"):
            load_image(wrong)


# --- PIL images the caller already opened --------------------------------------------------------


def test_closed_pil_image_is_a_media_error(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    RGB.save(path)
    pil = PIL.Image.open(path)
    pil.close()
    with pytest.raises(MediaError, match="PIL image"):
        load_image(pil)


def lazy_on_truncated_file(tmp_path: Path) -> PIL.Image.Image:
    """A PIL image opened lazily (header read, pixels not) on a file cut short afterwards."""
    path = tmp_path / "cut.png"
    path.write_bytes(encode(PIL.Image.fromarray(np.random.default_rng(3).integers(
        0, 256, (64, 64, 3), dtype=np.uint8)), "PNG"))
    pil = PIL.Image.open(path)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)
    return pil


def test_lazy_pil_image_on_a_truncated_file_is_a_media_error(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="PIL image"):
        load_image(lazy_on_truncated_file(tmp_path))


# --- through a model ---------------------------------------------------------------------------------


def test_model_ask_turns_bad_pil_images_into_media_errors(tiny_model, tmp_path: Path) -> None:
    closed = PIL.Image.new("RGB", (8, 8))
    closed_file = tmp_path / "c.png"
    closed.save(closed_file)
    closed = PIL.Image.open(closed_file)
    closed.close()
    for bad in (closed, lazy_on_truncated_file(tmp_path)):
        with pytest.raises(MediaError):
            tiny_model.ask("?", bad, max_tokens=1)


@pytest.mark.parametrize("size", [(1, 100_000), (100_000, 1), (3, 60_000), (40, 100_000)])
def test_extreme_aspect_ratio_is_answered_in_one_slice(tiny_model, size: tuple[int, int]) -> None:
    # libmtmd itself refuses these ("resize target 14x100002 is out of range")
    rgb = np.random.default_rng(1).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    low = tiny_model.ask("?", rgb, max_tokens=1, detail="low").usage.image_tokens
    for detail in ("auto", "high"):
        assert tiny_model.ask("?", rgb, max_tokens=1, detail=detail).usage.image_tokens == low
    assert tiny_model.ask("?", rgb, max_tokens=1, max_slices=9).usage.image_tokens == low


def test_a_12_megapixel_photo_decodes_in_few_copies_of_itself() -> None:
    """The memory model counts IMAGE_COPIES copies of W*H*3 while an image is decoded. An upright
    photo must not be copied by exif_transpose and convert (it peaked at 6 copies: 205 MiB)."""
    from gguf_mcv.planning import memory

    code = """
import io, numpy as np
from PIL import Image as P
from gguf_mcv.vision.media import load_image
a = np.random.default_rng(0).integers(0, 255, (375, 500, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
b = io.BytesIO(); P.fromarray(a).save(b, "JPEG"); data = b.getvalue(); del a
def status(k): return int(open("/proc/self/status").read().split(k + ":")[1].split()[0]) * 1024
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
rgb = load_image(data).rgb
print((status("VmHWM") - base) / rgb.nbytes)
"""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc to reset the peak")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    copies = float(done.stdout)
    assert copies <= memory.IMAGE_COPIES + 0.5, copies


# --- decoding no larger than the slices need (JPEG draft mode) ---------------------------------


def _photo_jpeg(size: tuple[int, int], orientation: int = 1) -> bytes:
    """The bundled example photo stretched to ``size``, as a JPEG (a camera photo's smooth content)."""
    from gguf_mcv.vision.onnx_vision import EXAMPLE_IMAGE

    pil = PIL.Image.open(EXAMPLE_IMAGE).convert("RGB").resize(size, PIL.Image.Resampling.BICUBIC)
    out = io.BytesIO()
    exif = PIL.Image.Exif()
    exif[0x0112] = orientation
    pil.save(out, "JPEG", quality=90, exif=exif.tobytes())
    return out.getvalue()


@pytest.mark.parametrize("orientation", [1, 6])
def test_a_jpeg_is_decoded_only_as_large_as_its_slices_need(orientation: int) -> None:
    """A 12 MP JPEG at detail="auto" is decoded at a reduced scale and resized to the same size as a
    full decode: the pixels differ only by what the resize's source changes."""
    from gguf_mcv.vision.media import draft_scale
    from gguf_mcv.vision.slicing import apply_detail, detail_size

    data = _photo_jpeg((4000, 3000), orientation)
    fit = lambda w, h: detail_size(w, h, detail="auto")  # noqa: E731
    full = apply_detail(load_image(data), detail="auto")
    drafted = load_image(data, fit=fit)
    upright = (3000, 4000) if orientation == 6 else (4000, 3000)
    assert (full.width, full.height) == (drafted.width, drafted.height) == fit(*upright)
    assert draft_scale(upright, fit(*upright)) >= 2  # the decode really was smaller
    diff = np.abs(full.rgb.astype(np.int16) - drafted.rgb.astype(np.int16))
    assert diff.mean() < 1.5 and np.percentile(diff, 99) <= 8, (diff.mean(), np.percentile(diff, 99))
    assert load_image(data, fit=fit).digest == drafted.digest  # deterministic: the embedding cache still hits


def test_a_small_or_non_jpeg_image_is_decoded_as_before() -> None:
    from gguf_mcv.vision.slicing import detail_size

    fit = lambda w, h: detail_size(w, h, detail="auto")  # noqa: E731
    small = _photo_jpeg((640, 480))
    assert load_image(small, fit=fit).digest == load_image(small).digest  # nothing to shrink
    png = io.BytesIO()
    PIL.Image.open(io.BytesIO(_photo_jpeg((2000, 1500)))).save(png, "PNG")
    expected = load_image(png.getvalue()).resized_to(*fit(2000, 1500))
    assert load_image(png.getvalue(), fit=fit).digest == expected.digest  # PNG has no draft mode


def test_a_12_megapixel_jpeg_wanted_smaller_decodes_in_a_fraction_of_its_size() -> None:
    """What the memory model counts for a photo at detail="auto": a 1/2-scale decode."""
    code = """
import io, numpy as np
from PIL import Image as P
from gguf_mcv.vision.media import load_image
from gguf_mcv.vision.slicing import detail_size
a = np.random.default_rng(0).integers(0, 255, (375, 500, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
b = io.BytesIO(); P.fromarray(a).save(b, "JPEG"); data = b.getvalue(); del a
def status(k): return int(open("/proc/self/status").read().split(k + ":")[1].split()[0]) * 1024
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
rgb = load_image(data, fit=lambda w, h: detail_size(w, h, detail="auto")).rgb
print((status("VmHWM") - base) / (4000 * 3000 * 3))
"""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc to reset the peak")
    from gguf_mcv.planning import memory

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    full_copies = float(done.stdout)
    assert full_copies <= memory.IMAGE_COPIES / 4 + 0.3, full_copies  # a quarter of the pixels, ~the same copies


def test_a_huge_grey_array_is_refused_before_it_is_expanded_to_rgb() -> None:
    """A 20000² grey frame (400 MB) is refused by the pixel limit before becoming 1.2 GB of RGB."""
    from test_video import peak_of

    side = 20_000
    grew, error = peak_of(f"import numpy as np\nfrom gguf_mcv.vision.media import load_image\n"
                          f"a = np.ones(({side}, {side}), np.uint8)",
                          "load_image(a)")
    assert error is not None and error.startswith("MediaError") and f"{side}×{side}" in error
    assert grew < side * side / 2, f"grew {grew / 2**20:.0f} MiB over the array itself"
