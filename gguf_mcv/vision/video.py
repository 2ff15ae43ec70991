"""Turn a video into a few sampled RGB frames, the way MiniCPM-V wants them.

MiniCPM-V's recipe: about one frame per second, at most 64, chosen by centred
uniform sampling when there are more, each fed as an image without slicing. On a
CPU every frame costs a full vision-encoder pass, so :func:`default_max_frames`
caps the count by what the machine can encode in a minute or two.

Inputs of :func:`sample_frames`: a video file OpenCV/FFmpeg reads (mp4, avi, mkv,
webm, mov...), by path, ``file://`` URL, ``data:`` URI or as bytes (``http(s)`` URLs
only with ``allow_remote=True``); an image file (animated GIF/WebP/PNG are decoded
by Pillow with their per-frame durations; a still gives one frame); a folder of
images (sorted by name, numbers in names compared as numbers); a list of anything
:func:`~gguf_mcv.vision.media.load_image` takes; a T×H×W×3 ``uint8`` numpy array. Folders,
lists and arrays play at ``frame_rate`` frames per second (default 1). FIFOs and
devices are refused without being opened.

Only the sampled frames are decoded and kept, so memory does not grow with the
video's length. How a file is read:

* Frame count and rate come from the container (``CAP_PROP_FRAME_COUNT``,
  ``CAP_PROP_FPS``). A rate that is 0, NaN, below 0.01 or above 1000 is treated as
  unknown: frames are then spread uniformly by count and have no timestamp. A count
  that is not positive, or claims more than a week of video, is treated as unknown:
  the file is decoded once, sequentially, keeping frames on a grid whose step doubles
  whenever more than ``2 * max_frames`` are held (a bounded reservoir).
* Sequential ``grab()`` between sampled frames, ``retrieve()`` only at them; a seek
  (``CAP_PROP_POS_FRAMES``) when the next sampled frame is more than
  ``SEEK_MIN_GAP`` frames ahead, or after a frame failed to decode (a seek skips a
  damaged stretch that sequential reading cannot cross). A seek that lands on the
  wrong frame makes the read start over without seeking.
* A truncated or damaged file gives the frames that could be decoded (``Frames.missed``
  counts the others); reading stops after ``MAX_CONSECUTIVE_MISSES`` failures in a row.
  If the planned frames all fail, one sequential pass is tried before giving up.
* An animated image is decoded by Pillow, which composites every frame on the full
  canvas and reaches a frame only through those before it: its canvas must be within
  ``MAX_PIXELS`` and the pixels decoded to sample it within ``MAX_ANIMATION_PIXELS``
  (checked before decoding, from the canvas and frame count), else MediaError.

FFmpeg and OpenCV complain on stderr about broken files; while this module reads,
OpenCV's log level is set to silent and FFmpeg's ``av_log`` level to quiet (found in
the process's loaded ``libavutil``; both restored afterwards). Where ``libavutil``
cannot be found (Windows wheels link FFmpeg into one plugin DLL) FFmpeg's own
error lines can still appear.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import glob
import http.client
import math
import os
import re
import tempfile
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import PIL.Image

from ..errors import ConfigError, MediaError
from .media import (
    ACCEPTED_IMAGES,
    MAX_PIXELS,
    Image,
    ImageInput,
    data_uri_bytes,
    from_pil,
    load_image,
    local_path,
    open_pil,
    regular_file,
)

if TYPE_CHECKING:
    import cv2  # imported where a video is read: `import gguf_mcv` must not load OpenCV

    from ..hardware import Hardware

__all__ = [
    "DEFAULT_THRESHOLD", "Frame", "Frames", "default_max_frames", "format_timestamp",
    "sample_frames", "sample_indices",
]

VideoInput = Union[str, os.PathLike, bytes, Sequence[ImageInput], np.ndarray]

#: MiniCPM-V's own cap on frames per video.
MAX_FRAMES = 64
#: Mean absolute difference (0-255, over a 32×32 RGB thumbnail) below which a frame
#: repeats the last kept one. Roughly (changed share of the picture) × (contrast): 1.5
#: is 1% of the picture changing by 150 levels, or 5% by 30. Measured on 320×240 and
#: 640×480 clips: a static shot with sensor noise σ=3 gives 0.4-0.8 (σ=8: ~1.05,
#: after mp4v ~0.7); a ball of radius h/8 moving 5% of the width per second ≥ 2, at
#: 3%/s ~1.4 (dropped: that slow, one frame says it all). Below ~200 px wide the
#: noise floor rises (64×48, σ=3: ~1.2-1.8), so tiny videos may keep static frames.
DEFAULT_THRESHOLD = 1.5
#: Seek instead of grabbing when the next sampled frame is more than this many frames
#: ahead. A seek decodes from the previous keyframe, so it wins once the gap exceeds
#: about half the keyframe interval: 12 frames for mpeg4/mp4v, 30-60 for phone h264,
#: 250 for x264's default. 120 wins for intervals up to ~240 and never loses more than
#: 120 extra decodes.
SEEK_MIN_GAP = 120
#: Stop reading after this many failed grabs/seeks in a row.
MAX_CONSECUTIVE_MISSES = 8
#: A sequential scan (unknown frame count) stops after this many frames, ~90 h at 30 fps.
MAX_SCAN_FRAMES = 10_000_000
#: Remote videos larger than this are refused (``allow_remote=True``).
MAX_REMOTE_BYTES = 500_000_000
REMOTE_TIMEOUT_S = 20.0
#: Pixels sampling an animated image (GIF, WebP, APNG, multi-page TIFF) may decode: Pillow
#: composites every frame on the full canvas at ~2-5 ns a pixel, so this is a few seconds.
MAX_ANIMATION_PIXELS = 2_000_000_000
#: What one frame costs at least, in pixels: Pillow's fixed work per frame (~40 µs).
_MIN_FRAME_COST_PIXELS = 16_384
#: GIF frame delays at or below this (ms) play as 100 ms, as browsers do.
_MIN_GIF_DELAY_MS = 10
_MAX_DURATION_S = 7 * 24 * 3600
_THUMB = (32, 32)
_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


@dataclass(frozen=True)
class Frame:
    """One sampled frame: its number in the source, its time (s; None if unknown), its pixels."""

    index: int
    timestamp: float | None
    image: Image = field(repr=False)


class Frames(list):
    """The kept :class:`Frame` values, in order, and what the sampling found.

    ``sampled``: frames decoded before near-duplicate removal; ``dropped``: removed
    as near-duplicates; ``missed``: planned frames that could not be decoded (a
    truncated or damaged file); ``duration`` (s), ``native_fps`` and
    ``total_frames``: of the source, None where unknown; ``source``: the input's name.
    """

    def __init__(self, frames: Sequence[Frame] = (), *, sampled: int = 0, dropped: int = 0,
                 missed: int = 0, duration: float | None = None, native_fps: float | None = None,
                 total_frames: int | None = None, source: str = "") -> None:
        super().__init__(frames)
        self.sampled, self.dropped, self.missed = sampled, dropped, missed
        self.duration, self.native_fps, self.total_frames = duration, native_fps, total_frames
        self.source = source

    def __repr__(self) -> str:
        return (f"Frames({len(self)} of {self.source}: sampled={self.sampled}, "
                f"dropped={self.dropped}, missed={self.missed}, duration={self.duration})")


def format_timestamp(seconds: float) -> str:
    """``12.0`` → ``"12.0 s"``: a frame's time for prompts (``f"at {format_timestamp(t)}"``)."""
    return f"{seconds:.1f} s"


def sample_indices(total_frames: int, native_fps: float, *, fps: float | None = 1.0,
                   max_frames: int) -> list[int]:
    """Frame numbers to decode: about ``fps`` per second of video, at most ``max_frames``.

    The video is cut into ``n = round(duration * fps)`` equal intervals (at least 1,
    at most ``max_frames`` and ``total_frames``) and the frame at the centre of each is
    taken: ``gap = total / n``, ``idx = int(i * gap + gap / 2)``, MiniCPM-V's formula.
    ``fps=None``, or a ``native_fps`` that is not a usable rate, means just
    ``max_frames`` spread uniformly. Pure: no decoding.
    """
    _check_rates(fps, max_frames)
    if total_frames <= 0:
        return []
    n = max_frames
    if fps is not None and _valid_fps(native_fps):
        n = min(n, max(1, math.floor(total_frames / native_fps * fps + 0.5)))
    n = min(n, total_frames)
    gap = total_frames / n
    return [int(i * gap + gap / 2) for i in range(n)]


def default_max_frames(hardware: Hardware | None = None) -> int:
    """How many frames a video may cost on this machine (``hardware`` defaults to ``probe()``).

    With a GPU llama.cpp can offload to: 64, MiniCPM-V's own cap (32 on a Jetson,
    whose GPU is a fraction of a desktop one). CPU only: 4 per recommended thread,
    between 8 and 32 — a vision-encoder pass takes ~8-17 s on 2 cores and about
    halves with twice the cores, so the cap keeps encoding near 1-2 minutes
    (2 threads: 8, 3: 12, 4: 16, 8 or more: 32).
    """
    if hardware is None:
        from ..hardware import probe

        hardware = probe()
    if hardware.gpu is not None and hardware.gpu_offload:
        return MAX_FRAMES // 2 if hardware.board_kind == "jetson" else MAX_FRAMES
    return max(8, min(32, 4 * hardware.recommended_threads))


def sample_frames(video: VideoInput, *, max_frames: int | None = None, fps: float | None = 1.0,
                  dedupe: bool = True, threshold: float = DEFAULT_THRESHOLD,
                  max_side: int | None = None, frame_rate: float | None = None,
                  allow_remote: bool = False) -> Frames:
    """Sample ``video`` into at most ``max_frames`` frames, about ``fps`` per second.

    ``max_frames`` defaults to :func:`default_max_frames`; ``fps=None`` spreads
    ``max_frames`` uniformly. ``dedupe`` drops a frame whose thumbnail differs from the
    last kept one by less than ``threshold`` (the first frame is always kept).
    ``max_side`` scales kept frames down (aspect kept). ``frame_rate`` is the playback
    rate of a folder, list or array (default 1 frame per second); files carry their own.
    An ``http(s)`` URL is downloaded (at most ``MAX_REMOTE_BYTES``) only with ``allow_remote``.
    Raises :class:`MediaError` naming the input when nothing usable can be read.
    """
    if max_frames is None:
        max_frames = default_max_frames()
    if max_side is not None and max_side < 1:
        raise ConfigError(f"max_side must be at least 1, not {max_side}.")
    if threshold < 0:
        raise ConfigError(f"threshold must not be negative, not {threshold}.")
    if frame_rate is not None and not _valid_fps(frame_rate):
        raise ConfigError(f"frame_rate must be between 0.01 and 1000, not {frame_rate}.")
    _check_rates(fps, max_frames)
    opts = _Opts(max_frames, fps, max_side)
    if isinstance(video, (bytes, bytearray, memoryview)) or (
            isinstance(video, str) and video.startswith("data:")):
        frames = _from_bytes(video, opts)
    elif isinstance(video, str) and _is_remote(video):
        frames = _from_url(video, opts, allow_remote)
    elif isinstance(video, str) and video.lower().startswith("file://"):
        local = urllib.request.url2pathname(urllib.parse.urlsplit(video).path)
        frames = _from_file(local_path(local, "Video"), video, opts)
    elif isinstance(video, np.ndarray):
        frames = _from_array(video, frame_rate or 1.0, opts)
    elif isinstance(video, (str, os.PathLike)):
        path = local_path(video, "Video")
        if path.is_dir():
            frames = _from_stills(_folder_images(path), str(video), frame_rate or 1.0, opts)
        else:
            frames = _from_file(path, str(video), opts)
    elif isinstance(video, (list, tuple)):
        if not video:
            raise MediaError("The list of video frames is empty: pass at least one image.")
        frames = _from_stills(list(video), f"<list of {len(video)} images>", frame_rate or 1.0,
                              opts)
    else:
        raise MediaError(
            f"Unsupported video input of type {type(video).__name__}: pass a video file path, "
            "a file:// URL, a data: URI, the file's bytes, a folder of images, a list of images "
            f"(each one {ACCEPTED_IMAGES}) or a T×H×W×3 uint8 numpy array."
        )
    return _dedupe(frames, threshold) if dedupe else frames


# --- sources -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Opts:
    max_frames: int
    fps: float | None
    max_side: int | None


def _check_rates(fps: float | None, max_frames: int) -> None:
    if max_frames < 1:
        raise ConfigError(f"max_frames must be at least 1, not {max_frames}.")
    if fps is not None and not (fps > 0 and math.isfinite(fps)):
        raise ConfigError(f"fps must be a positive number or None, not {fps}.")


def _valid_fps(fps: float) -> bool:
    return bool(0.01 <= fps <= 1000)  # also False for NaN


def _fit(rgb: np.ndarray, max_side: int | None) -> np.ndarray:
    import cv2

    h, w = rgb.shape[:2]
    if max_side is None or max(h, w) <= max_side:
        return rgb
    scale = max_side / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return cv2.resize(rgb, size, interpolation=cv2.INTER_AREA)


def _frame(index: int, timestamp: float | None, rgb: np.ndarray, name: str,
           max_side: int | None, source: str | None = None) -> Frame:
    if source is None:
        source = f"{name}@{timestamp:.1f}s" if timestamp is not None else f"{name}#{index}"
    return Frame(index, timestamp, Image(np.ascontiguousarray(_fit(rgb, max_side)), source))


def _from_array(arr: np.ndarray, rate: float, opts: _Opts) -> Frames:
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
    frames = [_frame(i, i / rate, arr[i].copy(), name, opts.max_side) for i in picked]
    return Frames(frames, sampled=len(frames), duration=total / rate, native_fps=rate,
                  total_frames=total, source=name)


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def _folder_images(folder: Path) -> list[Path]:
    files = [p for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES
             and not p.name.startswith(".") and p.is_file()]
    if not files:
        raise MediaError(
            f"Video folder {folder} holds no images ({', '.join(sorted(_IMAGE_SUFFIXES))})."
        )
    return sorted(files, key=lambda p: _natural_key(p.name))


def _from_stills(items: list[Any], name: str, rate: float, opts: _Opts) -> Frames:
    total = len(items)
    picked = sample_indices(total, rate, fps=opts.fps, max_frames=opts.max_frames)
    frames = []
    for i in picked:  # only the sampled images are decoded
        image = load_image(items[i])
        frames.append(_frame(i, i / rate, image.rgb, name, opts.max_side, source=image.source))
    return Frames(frames, sampled=len(frames), duration=total / rate, native_fps=rate,
                  total_frames=total, source=name)


def _is_remote(text: str) -> bool:
    return urllib.parse.urlsplit(text).scheme.lower() in ("http", "https")


def _from_url(url: str, opts: _Opts, allow_remote: bool) -> Frames:
    """A video at an ``http(s)`` URL: downloaded into a temporary file, if allowed."""
    if not allow_remote:
        raise MediaError(
            f"Refusing to fetch remote video {url}: remote URLs are off. Download it and pass "
            "the file (or its bytes), or allow remote media: sample_frames(..., "
            "allow_remote=True), or gguf_mcv.load(..., allow_remote_media=True) for a Model."
        )
    with tempfile.TemporaryDirectory(prefix="gguf_mcv_video_") as folder:
        path = Path(folder) / "video"
        _download(url, path)
        return _from_file(path, url, opts)


def _download(url: str, path: Path) -> None:
    try:
        with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT_S) as resp, path.open("wb") as out:
            copied = 0
            while chunk := resp.read(1 << 20):
                copied += len(chunk)
                if copied > MAX_REMOTE_BYTES:
                    raise MediaError(f"Remote video {url} is larger than {MAX_REMOTE_BYTES:,} bytes: "
                                     "download it yourself and pass the file.")
                out.write(chunk)
    except (OSError, http.client.HTTPException) as exc:
        raise MediaError(f"Could not fetch video {url}: {exc}.") from exc


def _from_bytes(video: bytes | bytearray | memoryview | str, opts: _Opts) -> Frames:
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
        return _from_file(path, name, opts)


def _from_file(path: Path, name: str, opts: _Opts) -> Frames:
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
    return _from_video(path, name, opts)


def _is_image(head: bytes) -> bool:
    """Pillow handles GIF/PNG/APNG/WebP/JPEG/BMP/TIFF: real per-frame delays, stills as 1 frame."""
    return (head.startswith((b"GIF87a", b"GIF89a", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM",
                             b"II*\x00", b"MM\x00*"))
            or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"))


def _from_image_file(path: Path, name: str, opts: _Opts) -> Frames:
    """An image file: an animation's frames by their delays, or a still as one frame.

    Pillow composites every frame of an animation onto the full canvas, however small
    the frame, and can only reach a frame by decoding all those before it; the
    :class:`_PixelBudget` bounds that work (and refuses at once what cannot fit in it).
    """
    try:
        with open_pil(path) as im:
            n_frames = getattr(im, "n_frames", 1)
            budget = _PixelBudget(name, im.size, n_frames)
            starts, duration = _frame_starts(im, n_frames, budget)
            picked = _pick_by_time(starts, duration, opts)
            frames = [_frame(i, starts[i], rgb, name, opts.max_side)
                      for i, rgb in _decode_frames(im, picked, budget, name)]
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


class _PixelBudget:
    """The pixels an animated image may cost to sample, spent frame by frame as decoded.

    Sampling walks the frames twice (once for their delays, once up to the last
    sampled frame) and converts each sampled frame once. Refuses at once an animation
    whose two walks alone exceed :data:`MAX_ANIMATION_PIXELS`.
    """

    def __init__(self, name: str, canvas: tuple[int, int], n_frames: int) -> None:
        self.name, self.left = name, MAX_ANIMATION_PIXELS
        self._check_frame(canvas)
        need = 2 * n_frames * self._cost(canvas)
        if need > self.left:
            w, h = canvas
            raise MediaError(
                f"Video {name} is an animation of {n_frames:,} frames on a {w}×{h} canvas: "
                f"sampling it means compositing every frame on the whole canvas, twice (about "
                f"{need:,} pixels' work), over the {MAX_ANIMATION_PIXELS:,}-pixel limit. Scale it "
                "down or cut it shorter first (e.g. with ffmpeg)."
            )

    def spend(self, size: tuple[int, int]) -> None:
        """Account for decoding one frame of ``size``; MediaError once the budget is spent."""
        self._check_frame(size)
        self.left -= self._cost(size)
        if self.left < 0:
            raise MediaError(
                f"Video {self.name} needs more than {MAX_ANIMATION_PIXELS:,} pixels decoded to "
                "sample its frames: scale it down or cut it shorter first (e.g. with ffmpeg)."
            )

    def _check_frame(self, size: tuple[int, int]) -> None:
        w, h = size
        if w * h > MAX_PIXELS:
            raise MediaError(f"Video {self.name} has {w}×{h}-pixel frames, over the "
                             f"{MAX_PIXELS:,}-pixel limit.")

    @staticmethod
    def _cost(size: tuple[int, int]) -> int:
        return max(size[0] * size[1], _MIN_FRAME_COST_PIXELS)


def _seek(im: PIL.Image.Image, index: int, budget: _PixelBudget) -> None:
    im.seek(index)
    budget.spend(im.size)  # a TIFF page may be larger than the first
    im.load()  # WebP sets a frame's duration only when it is decoded


def _frame_starts(im: PIL.Image.Image, n_frames: int,
                  budget: _PixelBudget) -> tuple[list[float], float]:
    """When each frame starts (s) and the total duration, from the per-frame delays."""
    starts, t_ms = [], 0
    for i in range(n_frames):
        _seek(im, i, budget)
        starts.append(t_ms / 1000)
        delay = int(im.info.get("duration") or 0)
        t_ms += delay if delay > _MIN_GIF_DELAY_MS else 100
    return starts, t_ms / 1000


def _decode_frames(im: PIL.Image.Image, picked: list[int], budget: _PixelBudget,
                   name: str) -> Iterator[tuple[int, np.ndarray]]:
    """``(index, rgb)`` of the ``picked`` frames, walking from the first frame only once."""
    wanted = set(picked)
    for i in range(max(picked) + 1):
        _seek(im, i, budget)
        if i in wanted:
            budget.spend(im.size)  # the conversion to RGB
            yield i, from_pil(im, f"{name}#{i}").rgb


def _pick_by_time(starts: list[float], duration: float, opts: _Opts) -> list[int]:
    """Frames on screen at the centres of ``n`` equal time intervals (delays may differ)."""
    n = min(opts.max_frames, len(starts))
    if opts.fps is not None:
        n = min(n, max(1, math.floor(duration * opts.fps + 0.5)))
    centres = [(j + 0.5) * duration / n for j in range(n)]
    return sorted({bisect.bisect_right(starts, c) - 1 for c in centres})


# --- OpenCV -----------------------------------------------------------------------------


def _from_video(path: Path, name: str, opts: _Opts) -> Frames:
    import cv2

    opened: list[cv2.VideoCapture] = []

    def reopen() -> cv2.VideoCapture:
        opened.append(_open(path, name))
        return opened[-1]

    with _quiet():
        try:
            cap = reopen()
            check_frame_size(cap, name)
            native, codec = cap.get(cv2.CAP_PROP_FPS), _fourcc(cap)
            rate = native if _valid_fps(native) else None
            total = _plausible_count(cap.get(cv2.CAP_PROP_FRAME_COUNT), rate)
            read, missed = _read_known(cap, reopen, total, rate, opts, name) if total else ([], 0)
            if not read:  # count unknown or wrong: one sequential pass
                read, total = _scan(reopen() if total else cap, rate, opts, name)
                missed = 0
        finally:
            for cap in opened:
                cap.release()
    if not read:
        raise MediaError(
            f"Video {name} has no frame that could be decoded (codec {codec or 'unknown'}): "
            "it is empty, truncated, damaged or uses a codec this OpenCV build cannot decode."
        )
    frames = [_frame(i, i / rate if rate else None, rgb, name, None) for i, rgb in read]
    return Frames(frames, sampled=len(frames), missed=missed, native_fps=rate,
                  duration=total / rate if rate and total else None, total_frames=total,
                  source=name)


def _plausible_count(count: float, rate: float | None) -> int | None:
    """The container's frame count, or None when it cannot be true (≤ 0, NaN, over a week)."""
    if not (math.isfinite(count) and count >= 1):
        return None
    if rate is not None and count / rate > _MAX_DURATION_S:
        return None
    return int(count)


def _read_known(cap: cv2.VideoCapture, reopen: Callable[[], cv2.VideoCapture], total: int,
                rate: float | None, opts: _Opts, name: str) -> tuple[list[tuple[int, np.ndarray]], int]:
    planned = sample_indices(total, rate or 0.0, fps=opts.fps if rate else None,
                             max_frames=opts.max_frames)
    try:
        return _read_planned(cap, planned, opts.max_side, name, seek=True)
    except _SeekMismatch:
        return _read_planned(reopen(), planned, opts.max_side, name, seek=False)


def _open(path: Path, name: str) -> cv2.VideoCapture:
    import cv2

    # FFmpeg by name: CAP_ANY would let the image-sequence backend read "%d" in file names.
    backend = cv2.CAP_FFMPEG if cv2.videoio_registry.hasBackend(cv2.CAP_FFMPEG) else cv2.CAP_ANY
    cap = cv2.VideoCapture(str(path), backend)
    if not cap.isOpened():
        raise MediaError(
            f"Video {name} could not be opened: it is not a video FFmpeg can read (not a "
            "video, a codec this build lacks, a truncated or damaged header, or no frames)."
        )
    return cap


def _fourcc(cap: cv2.VideoCapture) -> str:
    import cv2

    value = cap.get(cv2.CAP_PROP_FOURCC)
    code = int(value) if math.isfinite(value) and value > 0 else 0
    text = "".join(chr((code >> 8 * k) & 0xFF) for k in range(4))
    return text.strip("\x00 ") if text.isprintable() else ""


def check_frame_size(cap: cv2.VideoCapture, name: str) -> None:
    """MediaError naming the video when its container declares frames over ``MAX_PIXELS`` (checked
    before any frame is decoded: a 1.6 MB file of 9000² frames otherwise held 1.2 GB of them)."""
    import cv2

    w, h = cap.get(cv2.CAP_PROP_FRAME_WIDTH), cap.get(cv2.CAP_PROP_FRAME_HEIGHT)
    if math.isfinite(w) and math.isfinite(h) and w * h > MAX_PIXELS:
        raise MediaError(f"Video {name} has {int(w)}×{int(h)}-pixel frames, over the {MAX_PIXELS:,}-pixel "
                         "limit: scale it down (e.g. ffmpeg -vf scale=1920:-2) before asking about it.")


def _rgb(cap: cv2.VideoCapture, max_side: int | None, name: str, index: int) -> np.ndarray | None:
    import cv2

    ok, bgr = cap.retrieve()
    if not ok or bgr is None or bgr.ndim != 3 or bgr.shape[2] != 3:
        return None
    if bgr.shape[0] * bgr.shape[1] > MAX_PIXELS:  # a container that declared a smaller size
        raise MediaError(f"Frame {index} of video {name} is {bgr.shape[1]}×{bgr.shape[0]} pixels, over the "
                         f"{MAX_PIXELS:,}-pixel limit: scale the video down before asking about it.")
    return np.ascontiguousarray(cv2.cvtColor(_fit(bgr, max_side), cv2.COLOR_BGR2RGB))


class _SeekMismatch(Exception):
    """A seek landed on another frame than asked: this file's seeking is not trustworthy."""


def _read_planned(cap: cv2.VideoCapture, planned: list[int], max_side: int | None, name: str,
                  *, seek: bool) -> tuple[list[tuple[int, np.ndarray]], int]:
    """Decode the ``planned`` frames (ascending): ``(index, rgb)`` pairs and how many failed."""
    import cv2

    out: list[tuple[int, np.ndarray]] = []
    pos = 0  # the frame the next grab() returns
    misses = 0  # in a row
    for k in planned:
        if misses >= MAX_CONSECUTIVE_MISSES or (misses and not seek):
            break  # without seeking nothing gets past a frame that failed
        seeking = seek and (misses > 0 or k - pos > SEEK_MIN_GAP)
        if seeking:
            cap.set(cv2.CAP_PROP_POS_FRAMES, k)
            pos = k
        ok = True
        while ok and pos < k:
            ok, pos = cap.grab(), pos + 1
        ok = ok and cap.grab()
        if ok and seeking and round(cap.get(cv2.CAP_PROP_POS_FRAMES)) != k + 1:
            raise _SeekMismatch  # the caller starts over, grabbing only

        rgb = _rgb(cap, max_side, name, k) if ok else None
        pos = k + 1
        if rgb is None:
            misses += 1
        else:
            misses = 0
            out.append((k, rgb))
    return out, len(planned) - len(out)


def _scan(cap: cv2.VideoCapture, native: float | None, opts: _Opts,
          name: str) -> tuple[list[tuple[int, np.ndarray]], int]:
    """One sequential pass of a video whose length is unknown: a bounded, thinning reservoir.

    Frames are kept at the centres of a grid of ``step`` frames (one per ``1/fps`` s when
    the rate is known, else every frame); when more than ``2 * max_frames`` are held,
    every other one goes and the step doubles. Returns the pick and the frames seen.
    """
    step = max(1.0, native / opts.fps) if native and opts.fps else 1.0
    held: list[tuple[int, np.ndarray]] = []
    first: tuple[int, np.ndarray] | None = None
    i = fails = 0
    target = int(step / 2)
    while i < MAX_SCAN_FRAMES and fails < MAX_CONSECUTIVE_MISSES:
        if not cap.grab():
            fails += 1
            continue
        fails = 0
        if i >= target:
            rgb = _rgb(cap, opts.max_side, name, i)
            if rgb is not None:
                held.append((i, rgb))
                if len(held) > 2 * opts.max_frames:
                    held, step = held[1::2], step * 2
                target = max(i + 1, int((len(held) + 0.5) * step))
        elif i == 0:  # kept in case the video is shorter than half a step
            rgb = _rgb(cap, opts.max_side, name, 0)
            first = (0, rgb) if rgb is not None else None
        i += 1
    if not held and first is not None:
        held = [first]
    if not held:
        return [], i
    n = min(len(held), opts.max_frames)
    if opts.fps is not None and native:
        n = min(n, max(1, math.floor(i / native * opts.fps + 0.5)))
    return [held[j] for j in sample_indices(len(held), 1.0, fps=None, max_frames=n)], i


# --- near-duplicates -------------------------------------------------------------------------


def _thumb(rgb: np.ndarray) -> np.ndarray:
    import cv2

    return cv2.resize(rgb, _THUMB, interpolation=cv2.INTER_AREA).astype(np.float32)


def _dedupe(frames: Frames, threshold: float) -> Frames:
    """Drop frames within ``threshold`` of the last kept one.

    The thumbnail keeps colour, not just luma: a cut between two scenes of equal
    brightness (red to green) must not look like a repeat.
    """
    kept: list[Frame] = []
    last: np.ndarray | None = None
    for frame in frames:
        thumb = _thumb(frame.image.rgb)
        if last is not None and float(np.abs(thumb - last).mean()) < threshold:
            continue
        kept.append(frame)
        last = thumb
    return Frames(kept, sampled=frames.sampled, dropped=len(frames) - len(kept),
                  missed=frames.missed, duration=frames.duration, native_fps=frames.native_fps,
                  total_frames=frames.total_frames, source=frames.source)


# --- keeping OpenCV and FFmpeg quiet -------------------------------------------------------

_AV_LOG_QUIET = -8
_quiet_lock = threading.Lock()
_quiet_depth = 0
_saved: tuple[int, int | None] = (0, None)
_avutil: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _find_avutil() -> ctypes.CDLL | None:
    """The ``libavutil`` OpenCV's FFmpeg backend uses, if it is a separate shared library."""
    import cv2

    candidates: list[str] = []
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as maps:  # Linux: exactly the copy loaded in this process
            candidates += [ln.split()[-1] for ln in maps if "libavutil" in ln and "/" in ln]
    top = Path(cv2.__file__).resolve().parent
    for pattern in ("../opencv_*.libs/libavutil*", ".dylibs/libavutil*", "../*.libs/libavutil*"):
        candidates += sorted(glob.glob(str(top / pattern)))
    for candidate in candidates:
        with contextlib.suppress(OSError, AttributeError):
            lib = ctypes.CDLL(candidate)
            lib.av_log_set_level.argtypes = [ctypes.c_int]
            lib.av_log_get_level.restype = ctypes.c_int
            return lib
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence OpenCV's logger and FFmpeg's ``av_log`` while inside; restore on the way out."""
    global _quiet_depth, _saved, _avutil
    import cv2

    with _quiet_lock:
        if _quiet_depth == 0:
            cv_level = cv2.utils.logging.getLogLevel()
            cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)
            if _avutil is False:
                # OpenCV sets FFmpeg's level when its backend first opens something; open
                # a missing file first so that our level comes after, not before.
                cv2.VideoCapture(os.path.join(os.sep, "nonexistent-gguf-mcv", "x.mp4"),
                                 cv2.CAP_FFMPEG).release()
                _avutil = _find_avutil()
            av_level = None
            if isinstance(_avutil, ctypes.CDLL):
                av_level = _avutil.av_log_get_level()
                _avutil.av_log_set_level(_AV_LOG_QUIET)
            _saved = (cv_level, av_level)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                cv2.utils.logging.setLogLevel(_saved[0])
                if _saved[1] is not None and isinstance(_avutil, ctypes.CDLL):
                    _avutil.av_log_set_level(_saved[1])
