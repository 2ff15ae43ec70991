"""Reading a video file with OpenCV/FFmpeg: only the sampled frames are decoded (seeking when
that is faster), frame sizes are checked before decoding, near-duplicates are dropped and
FFmpeg's own logging is kept quiet."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import glob
import math
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import PIL.Image

from ..errors import MediaError
from .media import (
    MAX_PIXELS,
    from_pil,
)

if TYPE_CHECKING:
    import cv2  # imported where a video is read: `import gguf_mcv` must not load OpenCV


from .video_frames import Frame, Frames, Opts, fit, make_frame, sample_indices, valid_fps

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


#: Pixels sampling an animated image (GIF, WebP, APNG, multi-page TIFF) may decode: Pillow
#: composites every frame on the full canvas at ~2-5 ns a pixel, so this is a few seconds.
MAX_ANIMATION_PIXELS = 2_000_000_000


#: What one frame costs at least, in pixels: Pillow's fixed work per frame (~40 µs).
_MIN_FRAME_COST_PIXELS = 16_384


#: GIF frame delays at or below this (ms) play as 100 ms, as browsers do.
_MIN_GIF_DELAY_MS = 10


_MAX_DURATION_S = 7 * 24 * 3600


_THUMB = (32, 32)


class PixelBudget:
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


def _seek(im: PIL.Image.Image, index: int, budget: PixelBudget) -> None:
    im.seek(index)
    budget.spend(im.size)  # a TIFF page may be larger than the first
    im.load()  # WebP sets a frame's duration only when it is decoded


def frame_starts(im: PIL.Image.Image, n_frames: int,
                  budget: PixelBudget) -> tuple[list[float], float]:
    """When each frame starts (s) and the total duration, from the per-frame delays."""
    starts, t_ms = [], 0
    for i in range(n_frames):
        _seek(im, i, budget)
        starts.append(t_ms / 1000)
        delay = int(im.info.get("duration") or 0)
        t_ms += delay if delay > _MIN_GIF_DELAY_MS else 100
    return starts, t_ms / 1000


def decode_frames(im: PIL.Image.Image, picked: list[int], budget: PixelBudget,
                   name: str) -> Iterator[tuple[int, np.ndarray]]:
    """``(index, rgb)`` of the ``picked`` frames, walking from the first frame only once."""
    wanted = set(picked)
    for i in range(max(picked) + 1):
        _seek(im, i, budget)
        if i in wanted:
            budget.spend(im.size)  # the conversion to RGB
            yield i, from_pil(im, f"{name}#{i}").rgb


def pick_by_time(starts: list[float], duration: float, opts: Opts) -> list[int]:
    """Frames on screen at the centres of ``n`` equal time intervals (delays may differ)."""
    n = min(opts.max_frames, len(starts))
    if opts.fps is not None:
        n = min(n, max(1, math.floor(duration * opts.fps + 0.5)))
    centres = [(j + 0.5) * duration / n for j in range(n)]
    return sorted({bisect.bisect_right(starts, c) - 1 for c in centres})


def from_video(path: Path, name: str, opts: Opts) -> Frames:
    import cv2

    opened: list[cv2.VideoCapture] = []

    def reopen() -> cv2.VideoCapture:
        opened.append(open_video(path, name))
        return opened[-1]

    with _quiet():
        try:
            cap = reopen()
            check_frame_size(cap, name)
            native, codec = cap.get(cv2.CAP_PROP_FPS), _fourcc(cap)
            rate = native if valid_fps(native) else None
            total = plausible_count(cap.get(cv2.CAP_PROP_FRAME_COUNT), rate)
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
    frames = [make_frame(i, i / rate if rate else None, rgb, name, None) for i, rgb in read]
    return Frames(frames, sampled=len(frames), missed=missed, native_fps=rate,
                  duration=total / rate if rate and total else None, total_frames=total,
                  source=name)


def plausible_count(count: float, rate: float | None) -> int | None:
    """The container's frame count, or None when it cannot be true (≤ 0, NaN, over a week)."""
    if not (math.isfinite(count) and count >= 1):
        return None
    if rate is not None and count / rate > _MAX_DURATION_S:
        return None
    return int(count)


def _read_known(cap: cv2.VideoCapture, reopen: Callable[[], cv2.VideoCapture], total: int,
                rate: float | None, opts: Opts, name: str) -> tuple[list[tuple[int, np.ndarray]], int]:
    planned = sample_indices(total, rate or 0.0, fps=opts.fps if rate else None,
                             max_frames=opts.max_frames)
    try:
        return _read_planned(cap, planned, opts.max_side, name, seek=True)
    except _SeekMismatch:
        return _read_planned(reopen(), planned, opts.max_side, name, seek=False)


def open_video(path: Path, name: str) -> cv2.VideoCapture:
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
    return np.ascontiguousarray(cv2.cvtColor(fit(bgr, max_side), cv2.COLOR_BGR2RGB))


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


def _scan(cap: cv2.VideoCapture, native: float | None, opts: Opts,
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


def _thumb(rgb: np.ndarray) -> np.ndarray:
    import cv2

    return cv2.resize(rgb, _THUMB, interpolation=cv2.INTER_AREA).astype(np.float32)


def drop_repeats(frames: Frames, threshold: float) -> Frames:
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
