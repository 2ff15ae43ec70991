"""Turn any image input into one validated RGB value with a content hash.

Accepted inputs: file paths (``str`` or ``Path``), ``file://`` URLs, ``data:``
URIs, raw bytes (``bytes``, ``bytearray`` or ``memoryview``), PIL images, numpy
arrays (H×W×3 ``uint8`` RGB; H×W and H×W×4 are accepted too) and :class:`Image`
itself. ``http(s)`` URLs only when the caller passes ``allow_remote=True``, and then only
from public addresses (:mod:`gguf_mcv.vision.remote`).

Decoding happens here, in Python, never inside llama.cpp: EXIF orientation is
applied, every PIL mode is converted to 8-bit RGB (transparency composited on
white, 16-bit and float images scaled down), animated images give their first
frame, and images whose header declares more than ``MAX_PIXELS`` pixels are
refused before their pixels are decoded. A file is decoded from the file system
(Pillow reads only what it needs) after checking that it is a regular file of at
most ``MAX_FILE_BYTES``; FIFOs and devices are refused without being opened.
Anything wrong raises :class:`~gguf_mcv.errors.MediaError` naming the input.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import stat
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import IO, Callable, Union

import numpy as np
import PIL.Image
import PIL.ImageOps

from ..errors import MediaError
from . import remote

#: Images declaring more pixels than this are refused (a decompression-bomb guard).
MAX_PIXELS = 64_000_000
#: Image files larger than this are refused before they are read (no image format
#: needs more for ``MAX_PIXELS`` pixels: 16-bit RGBA uncompressed is 512 MB).
MAX_FILE_BYTES = 2**30
#: Remote images larger than this are refused.
MAX_REMOTE_BYTES = 50_000_000

ImageInput = Union[str, os.PathLike, bytes, bytearray, memoryview, PIL.Image.Image, np.ndarray,
                   "Image"]
ACCEPTED_IMAGES = ("a file path (str or Path), a file:// URL, a data: URI, bytes (bytes, bytearray "
                   "or memoryview), a PIL image or an H×W×3 uint8 numpy array")


@dataclass(frozen=True, eq=False)
class Image:
    """A decoded 8-bit RGB image (``rgb`` is H×W×3, C-contiguous) and where it came from."""

    rgb: np.ndarray
    source: str

    @property
    def width(self) -> int:
        return int(self.rgb.shape[1])

    @property
    def height(self) -> int:
        return int(self.rgb.shape[0])

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the size and pixels: equal pixels give equal digests."""
        h = hashlib.sha256(f"{self.width}x{self.height}:".encode())
        h.update(self.rgb.data.cast("B"))
        return h.hexdigest()

    def resized_to(self, width: int, height: int) -> "Image":
        """This image resampled to ``width``×``height`` (itself when the size is unchanged)."""
        if (width, height) == (self.width, self.height):
            return self
        pil = PIL.Image.fromarray(self.rgb).resize((width, height), PIL.Image.Resampling.BICUBIC)
        return Image(np.ascontiguousarray(np.asarray(pil)), self.source)

    def resized_to_fit(self, max_side: int) -> "Image":
        """This image scaled down (aspect kept) so neither side exceeds ``max_side``."""
        if max(self.width, self.height) <= max_side:
            return self
        scale = max_side / max(self.width, self.height)
        return self.resized_to(max(1, round(self.width * scale)), max(1, round(self.height * scale)))


#: maps an image's (upright) width and height to the size its caller resizes it to
FitSize = Callable[[int, int], tuple[int, int]]


def load_image(src: ImageInput, *, allow_remote: bool = False, fit: FitSize | None = None) -> Image:
    """Decode ``src`` into an :class:`Image`, or raise :class:`MediaError` naming it.

    ``fit`` gives the size the image is wanted at, from its own: the image returned has that
    size. Where that is smaller, a JPEG is decoded at the smallest of 1/8, 1/4 or 1/2 of its
    size that is still at least as large on both sides (Pillow's draft mode: a 12 MP photo
    wanted at 1 MP is decoded at 3 MP, never at 12), then resized; only the resize's source
    differs from a full decode's."""
    image = _load(src, allow_remote, fit)
    if fit is None or isinstance(src, (bytes, bytearray, memoryview, str, os.PathLike)):
        return image  # decoded: already fitted (from the size the file declares)
    return image.resized_to(*fit(image.width, image.height))


def _load(src: ImageInput, allow_remote: bool, fit: FitSize | None) -> Image:
    if isinstance(src, Image):
        return src
    if isinstance(src, np.ndarray):
        return _from_array(src, "<numpy array>")
    if isinstance(src, PIL.Image.Image):
        return from_pil(src, "<PIL image>")
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        return _decode(data, f"<{len(data)} bytes>", fit)
    if isinstance(src, (str, os.PathLike)):
        return _from_locator(os.fspath(src), allow_remote, fit)
    raise MediaError(f"Unsupported image input of type {type(src).__name__}: pass {ACCEPTED_IMAGES}.")


def _from_locator(text: str, allow_remote: bool, fit: FitSize | None = None) -> Image:
    if text.startswith("data:"):
        return _decode(data_uri_bytes(text), text[:40] + "…", fit)
    scheme = remote.url_scheme(text)
    if scheme in ("http", "https"):
        if not allow_remote:
            raise MediaError(
                f"Refusing to fetch remote image {text}: remote URLs are off. "
                "Download it yourself, or pass allow_remote=True (public addresses only)."
            )
        return _decode(remote.fetch(text, max_bytes=MAX_REMOTE_BYTES), text, fit)
    if scheme == "file":
        text = urllib.request.url2pathname(urllib.parse.urlsplit(text).path)
    elif scheme and len(scheme) > 1:  # one letter is a Windows drive, not a scheme
        raise MediaError(f"Unsupported image URL scheme {scheme!r} in {text}.")
    path = local_path(text, "Image")
    size = regular_file(path, "Image").st_size
    if size == 0:
        raise MediaError(f"Image file {path} is empty (0 bytes).")
    if size > MAX_FILE_BYTES:
        raise MediaError(
            f"Image file {path} is {size / 2**30:.1f} GiB, over the {MAX_FILE_BYTES / 2**30:g} GiB "
            "an image may have: is it really an image? Convert it to JPEG or PNG first."
        )
    return _decode(path, str(path), fit)


def regular_file(path: Path, what: str) -> os.stat_result:
    """``path``'s status if it is a regular file; otherwise MediaError saying what it is.

    Decided from ``stat`` alone: opening a FIFO for reading would wait for a writer,
    and a device such as ``/dev/zero`` never ends.
    """
    try:
        status = path.stat()
    except FileNotFoundError:
        raise MediaError(f"{what} file {path} does not exist: check the path.") from None
    except OSError as exc:
        raise MediaError(f"Cannot read {what.lower()} file {path}: {exc.strerror or exc}.") from exc
    except ValueError as exc:  # a NUL byte: Path.exists() says False rather than raising
        raise MediaError(f"{what} {str(path)[:80]!r} is not a usable file name ({exc}).") from exc
    if not stat.S_ISREG(status.st_mode):
        raise MediaError(f"{what} {path} is {_file_kind(status.st_mode)}, not a file: "
                         "pass the path of a file.")
    return status


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def local_path(text: str | os.PathLike, what: str) -> Path:
    """``text`` as a local path (``~`` expanded); MediaError for a name no file can have.

    Checked by asking the file system, so a too-long name (raw base64 passed without its
    ``data:`` prefix), a NUL byte or an unknown ``~user`` becomes a clear MediaError.
    """
    text = os.fspath(text)
    try:
        path = Path(text).expanduser()
        path.exists()
    except (OSError, RuntimeError, ValueError) as exc:
        shown = text if len(text) <= 80 else text[:77] + "…"
        raise MediaError(f"{what} {shown!r} is not a usable file name ({exc}).") from exc
    return path


def data_uri_bytes(uri: str) -> bytes:
    """The payload of a ``data:`` URI (base64 or percent-encoded); MediaError if malformed."""
    header, sep, payload = uri.partition(",")
    if not sep:
        raise MediaError("Malformed data URI: no ',' separating header and data.")
    try:
        if header.endswith(";base64"):
            return base64.b64decode(payload, validate=True)
        return urllib.parse.unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"Malformed base64 in data URI ({header}): {exc}.") from exc


def _decode(data: bytes | Path, source: str, fit: FitSize | None = None) -> Image:
    """Decode encoded ``data``, or the file at that path (read lazily by Pillow); a JPEG at a
    reduced scale when ``fit`` wants it smaller (see :func:`load_image`)."""
    if not data:
        raise MediaError(f"Image {source} is empty (0 bytes).")
    with _decoding(source), open_pil(io.BytesIO(data) if isinstance(data, bytes) else data) as pil:
        _check_size(pil.size, source)
        wanted = _wanted_size(pil, fit) if fit is not None else None
        if wanted is not None and pil.format == "JPEG" and wanted[0] < pil.width and wanted[1] < pil.height:
            pil.draft(pil.mode, wanted)
        if wanted is not None and _turned(pil):
            wanted = wanted[1], wanted[0]
        # an animated image opens on its first frame; asking for the frame count would
        # walk every frame and fail on a file cut short after the first
        image = Image(_to_rgb(pil, source), source)
    del pil  # Pillow's decode buffer, before the resize makes its own
    return image if wanted is None else image.resized_to(*wanted)


def draft_scale(size: tuple[int, int], wanted: tuple[int, int]) -> int:
    """The JPEG scale denominator (1, 2, 4 or 8) Pillow's draft mode decodes ``size`` at for
    ``wanted``: the largest whose decoded size is still at least ``wanted`` on both sides."""
    ratio = min(size[0] // max(1, wanted[0]), size[1] // max(1, wanted[1]))
    return next(s for s in (8, 4, 2, 1) if ratio >= s)


def _turned(pil: PIL.Image.Image) -> bool:
    """Whether EXIF orientation turns ``pil`` by a quarter (the camera was held sideways)."""
    return pil.getexif().get(_EXIF_ORIENTATION, 1) in (5, 6, 7, 8)


def _wanted_size(pil: PIL.Image.Image, fit: FitSize) -> tuple[int, int]:
    """The size ``fit`` wants the opened image at, from the size its file declares (upright for
    ``fit``), in the file's own orientation."""
    w, h = pil.size
    if _turned(pil):
        tw, th = fit(h, w)
        return th, tw
    return fit(w, h)


def from_pil(pil: PIL.Image.Image, source: str) -> Image:
    """The current frame of an open PIL image as an :class:`Image`; MediaError naming ``source``.

    A closed image, or one opened lazily on a file that has changed since, is a MediaError.
    """
    with _decoding(source):
        return Image(_to_rgb(pil, source), source)


def open_pil(fp: Path | IO[bytes]) -> PIL.Image.Image:
    """``PIL.Image.open`` without the decompression-bomb warning (``MAX_PIXELS`` applies instead)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        return PIL.Image.open(fp)


@contextmanager
def _decoding(source: str) -> Iterator[None]:
    """Turn whatever Pillow raises while reading ``source`` into a :class:`MediaError`."""
    try:
        yield
    except MediaError:
        raise
    except PIL.Image.DecompressionBombError as exc:
        raise MediaError(
            f"Image {source} is too large to decode safely ({exc}); scale it down before asking about it."
        ) from exc
    except MemoryError as exc:
        raise MediaError(f"Image {source} needs more memory to decode than is available.") from exc
    except Exception as exc:  # noqa: BLE001
        # Pillow's format plugins raise many kinds of exception on malformed data
        # (OSError, SyntaxError, IndexError, TypeError, NotImplementedError, struct.error...),
        # a closed image raises ValueError: for untrusted input every one of them means
        # "not a decodable image".
        raise MediaError(
            f"Image {source} could not be decoded ({type(exc).__name__}: {exc}). "
            "Is it a complete, open JPEG/PNG/WebP/GIF/BMP/TIFF image?"
        ) from exc


def _check_size(size: tuple[int, int], source: str) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise MediaError(f"Image {source} has no pixels ({w}×{h}).")
    if w * h > MAX_PIXELS:
        raise MediaError(
            f"Image {source} declares {w}×{h} pixels, over the {MAX_PIXELS:,}-pixel limit: "
            "scale it down before asking about it."
        )


#: EXIF tag 0x0112: how the camera was turned (1: upright)
_EXIF_ORIENTATION = 0x0112


def _to_rgb(pil: PIL.Image.Image, source: str) -> np.ndarray:
    _check_size(pil.size, source)
    # exif_transpose copies the whole image even when there is nothing to turn: only call
    # it when the photo says it is turned (a 12 MP photo's decode peaked at 6 copies)
    if pil.getexif().get(_EXIF_ORIENTATION, 1) != 1:
        pil = PIL.ImageOps.exif_transpose(pil)
    pil.load()
    mode = pil.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.nan_to_num(np.asarray(pil, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        top = 65535.0 if mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        gray = np.clip(arr / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))
    if mode == "P" and "transparency" in pil.info:
        pil = pil.convert("RGBA")
    if pil.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = pil.convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        pil = PIL.Image.alpha_composite(white, rgba)
    if pil.mode != "RGB":
        pil = pil.convert("RGB")
    return np.ascontiguousarray(np.asarray(pil, dtype=np.uint8))


def _from_array(arr: np.ndarray, source: str) -> Image:
    if arr.dtype != np.uint8:
        raise MediaError(
            f"Image {source} has dtype {arr.dtype}; expected uint8 RGB values 0-255 "
            "(convert with np.clip(a, 0, 255).astype(np.uint8))."
        )
    if arr.ndim in (2, 3):  # before any conversion: a grey 20000² frame would take 1.2 GB as RGB
        _check_size((arr.shape[1], arr.shape[0]), source)
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    elif arr.ndim == 3 and arr.shape[2] == 4:
        return Image(_to_rgb(PIL.Image.fromarray(np.ascontiguousarray(arr)), source), source)
    elif arr.ndim != 3 or arr.shape[2] != 3:
        raise MediaError(f"Image {source} has shape {arr.shape}; expected H×W×3 (RGB).")
    _check_size((arr.shape[1], arr.shape[0]), source)
    return Image(np.ascontiguousarray(arr), source)
