"""Every kind of video input turned into frames: arrays, folders and lists of images, animated
images, bytes, ``data:``/``file://`` URIs and (allowed by the caller) remote URLs."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import MediaError
from . import remote
from .media import (
    data_uri_bytes,
    load_image,
    open_pil,
    regular_file,
)

if TYPE_CHECKING:

    pass

from .video_decode import PixelBudget, decode_frames, frame_starts, from_video, pick_by_time
from .video_frames import Frames, Opts, make_frame, sample_indices

#: Remote videos larger than this are refused (``allow_remote=True``).
MAX_REMOTE_BYTES = 500_000_000



_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


def from_array(arr: np.ndarray, rate: float, opts: Opts) -> Frames:
    name = "<frames array>"
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[3] != 3:
        raise MediaError(
            f"Video {name} has dtype {arr.dtype} and shape {arr.shape}; expected T×H×W×3 uint8 "
            "RGB frames (stack single images with np.stack)."
        )
    if arr.shape[0] == 0 or arr.shape[1] == 0 or arr.shape[2] == 0:
        raise MediaError(f"Video {name} has no frames or no pixels (shape {arr.shape}).")
    total = arr.shape[0]
    picked = sample_indices(total, rate, fps=opts.fps, max_frames=opts.max_frames)
    # .copy(): a frame must not keep the caller's whole array alive.
    frames = [make_frame(i, i / rate, arr[i].copy(), name, opts.max_side) for i in picked]
    return Frames(frames, sampled=len(frames), duration=total / rate, native_fps=rate,
                  total_frames=total, source=name)


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def folder_images(folder: Path) -> list[Path]:
    files = [p for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES
             and not p.name.startswith(".") and p.is_file()]
    if not files:
        raise MediaError(
            f"Video folder {folder} holds no images ({', '.join(sorted(_IMAGE_SUFFIXES))})."
        )
    return sorted(files, key=lambda p: _natural_key(p.name))


def from_stills(items: list[Any], name: str, rate: float, opts: Opts) -> Frames:
    total = len(items)
    picked = sample_indices(total, rate, fps=opts.fps, max_frames=opts.max_frames)
    frames = []
    for i in picked:  # only the sampled images are decoded
        image = load_image(items[i])
        frames.append(make_frame(i, i / rate, image.rgb, name, opts.max_side, source=image.source))
    return Frames(frames, sampled=len(frames), duration=total / rate, native_fps=rate,
                  total_frames=total, source=name)


def from_url(url: str, opts: Opts, allow_remote: bool) -> Frames:
    """A video at an ``http(s)`` URL: downloaded into a temporary file, if allowed."""
    if not allow_remote:
        raise MediaError(
            f"Refusing to fetch remote video {url}: remote URLs are off. Download it and pass "
            "the file (or its bytes), or allow remote media: sample_frames(..., "
            "allow_remote=True), or gguf_mcv.load(..., allow_remote_media=True) for a Model."
        )
    with tempfile.TemporaryDirectory(prefix="gguf_mcv_video_") as folder:
        path = Path(folder) / "video"
        remote.download(url, path, max_bytes=MAX_REMOTE_BYTES)
        return from_file(path, url, opts)


def from_bytes(video: bytes | bytearray | memoryview | str, opts: Opts) -> Frames:
    """A video given as bytes or a ``data:`` URI: decoded through a temporary file (OpenCV needs one)."""
    if isinstance(video, str):
        name = video[:40] + "…"
        data = data_uri_bytes(video)
    else:
        data = bytes(video)
        name = f"<{len(data)} bytes of video>"
    if not data:
        raise MediaError(f"Video {name} is empty (0 bytes).")
    with tempfile.TemporaryDirectory(prefix="gguf_mcv_video_") as folder:
        path = Path(folder) / "video"
        path.write_bytes(data)
        return from_file(path, name, opts)


def from_file(path: Path, name: str, opts: Opts) -> Frames:
    regular_file(path, "Video")  # never open a FIFO or a device
    try:
        with path.open("rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise MediaError(f"Cannot read video file {name}: {exc.strerror or exc}.") from exc
    if not head:
        raise MediaError(f"Video file {name} is empty (0 bytes).")
    if _is_image(head):
        return _from_image_file(path, name, opts)
    return from_video(path, name, opts)


def _is_image(head: bytes) -> bool:
    """Pillow handles GIF/PNG/APNG/WebP/JPEG/BMP/TIFF: real per-frame delays, stills as 1 frame."""
    return (head.startswith((b"GIF87a", b"GIF89a", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM",
                             b"II*\x00", b"MM\x00*"))
            or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"))


def _from_image_file(path: Path, name: str, opts: Opts) -> Frames:
    """An image file: an animation's frames by their delays, or a still as one frame.

    Pillow composites every frame of an animation onto the full canvas, however small
    the frame, and can only reach a frame by decoding all those before it; the
    :class:`PixelBudget` bounds that work (and refuses at once what cannot fit in it).
    """
    try:
        with open_pil(path) as im:
            n_frames = getattr(im, "n_frames", 1)
            budget = PixelBudget(name, im.size, n_frames)
            starts, duration = frame_starts(im, n_frames, budget)
            picked = pick_by_time(starts, duration, opts)
            frames = [make_frame(i, starts[i], rgb, name, opts.max_side)
                      for i, rgb in decode_frames(im, picked, budget, name)]
    except MediaError:
        raise
    except Exception as exc:  # noqa: BLE001
        # Pillow's plugins raise many exception types on malformed frames (IndexError,
        # TypeError, OSError...): for untrusted files each means "not decodable".
        raise MediaError(
            f"Video {name} could not be decoded ({type(exc).__name__}: {exc})."
        ) from exc
    return Frames(frames, sampled=len(frames), duration=duration,
                  native_fps=len(starts) / duration, total_frames=len(starts), source=name)
