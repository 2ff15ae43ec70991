"""Sampled video frames as values (:class:`Frame`, :class:`Frames`) and the pure maths of choosing
them: which indices to take (:func:`sample_indices`), how many fit, their timestamps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError
from .media import (
    Image,
)

if TYPE_CHECKING:

    pass




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
    check_rates(fps, max_frames)
    if total_frames <= 0:
        return []
    n = max_frames
    if fps is not None and valid_fps(native_fps):
        n = min(n, max(1, math.floor(total_frames / native_fps * fps + 0.5)))
    n = min(n, total_frames)
    gap = total_frames / n
    return [int(i * gap + gap / 2) for i in range(n)]


@dataclass(frozen=True)
class Opts:
    max_frames: int
    fps: float | None
    max_side: int | None


def check_rates(fps: float | None, max_frames: int) -> None:
    if max_frames < 1:
        raise ConfigError(f"max_frames must be at least 1, not {max_frames}.")
    if fps is not None and not (fps > 0 and math.isfinite(fps)):
        raise ConfigError(f"fps must be a positive number or None, not {fps}.")


def valid_fps(fps: float) -> bool:
    return bool(0.01 <= fps <= 1000)  # also False for NaN


def fit(rgb: np.ndarray, max_side: int | None) -> np.ndarray:
    import cv2

    h, w = rgb.shape[:2]
    if max_side is None or max(h, w) <= max_side:
        return rgb
    scale = max_side / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return cv2.resize(rgb, size, interpolation=cv2.INTER_AREA)


def make_frame(index: int, timestamp: float | None, rgb: np.ndarray, name: str,
           max_side: int | None, source: str | None = None) -> Frame:
    if source is None:
        source = f"{name}@{timestamp:.1f}s" if timestamp is not None else f"{name}#{index}"
    return Frame(index, timestamp, Image(np.ascontiguousarray(fit(rgb, max_side)), source))
