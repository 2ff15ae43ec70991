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
  ``video_decode.SEEK_MIN_GAP`` frames ahead, or after a frame failed to decode (a seek skips a
  damaged stretch that sequential reading cannot cross). A seek that lands on the
  wrong frame makes the read start over without seeking.
* A truncated or damaged file gives the frames that could be decoded (``Frames.missed``
  counts the others); reading stops after ``MAX_CONSECUTIVE_MISSES`` failures in a row.
  If the planned frames all fail, one sequential pass is tried before giving up.
* An animated image is decoded by Pillow, which composites every frame on the full
  canvas and reaches a frame only through those before it: its canvas must be within
  ``MAX_PIXELS`` and the pixels decoded to sample it within ``video_decode.MAX_ANIMATION_PIXELS``
  (checked before decoding, from the canvas and frame count), else MediaError.

FFmpeg and OpenCV complain on stderr about broken files; while this module reads,
OpenCV's log level is set to silent and FFmpeg's ``av_log`` level to quiet (found in
the process's loaded ``libavutil``; both restored afterwards). Where ``libavutil``
cannot be found (Windows wheels link FFmpeg into one plugin DLL) FFmpeg's own
error lines can still appear.
"""

from __future__ import annotations

import os
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

import numpy as np

from ..errors import ConfigError, MediaError
from .media import ACCEPTED_IMAGES, ImageInput, local_path
from .remote import is_remote
from .video_decode import drop_repeats
from .video_frames import Frame, Frames, Opts, check_rates, format_timestamp, sample_indices, valid_fps
from .video_sources import folder_images, from_array, from_bytes, from_file, from_stills, from_url

if TYPE_CHECKING:
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
    if frame_rate is not None and not valid_fps(frame_rate):
        raise ConfigError(f"frame_rate must be between 0.01 and 1000, not {frame_rate}.")
    check_rates(fps, max_frames)
    opts = Opts(max_frames, fps, max_side)
    if isinstance(video, (bytes, bytearray, memoryview)) or (
            isinstance(video, str) and video.startswith("data:")):
        frames = from_bytes(video, opts)
    elif isinstance(video, str) and is_remote(video):
        frames = from_url(video, opts, allow_remote)
    elif isinstance(video, str) and video.lower().startswith("file://"):
        local = urllib.request.url2pathname(urllib.parse.urlsplit(video).path)
        frames = from_file(local_path(local, "Video"), video, opts)
    elif isinstance(video, np.ndarray):
        frames = from_array(video, frame_rate or 1.0, opts)
    elif isinstance(video, (str, os.PathLike)):
        path = local_path(video, "Video")
        if path.is_dir():
            frames = from_stills(folder_images(path), str(video), frame_rate or 1.0, opts)
        else:
            frames = from_file(path, str(video), opts)
    elif isinstance(video, (list, tuple)):
        if not video:
            raise MediaError("The list of video frames is empty: pass at least one image.")
        frames = from_stills(list(video), f"<list of {len(video)} images>", frame_rate or 1.0,
                              opts)
    else:
        raise MediaError(
            f"Unsupported video input of type {type(video).__name__}: pass a video file path, "
            "a file:// URL, a data: URI, the file's bytes, a folder of images, a list of images "
            f"(each one {ACCEPTED_IMAGES}) or a T×H×W×3 uint8 numpy array."
        )
    return drop_repeats(frames, threshold) if dedupe else frames
