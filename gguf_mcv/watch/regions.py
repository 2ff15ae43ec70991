"""A watch's region: the rectangle of each frame that is asked about (and encoded), in pixels or
as fractions of the frame.

``(x, y, w, h)`` of ints is in pixels from the top left corner; of floats, each in [0, 1], in
fractions of the frame's width and height (``(0.5, 0.0, 0.5, 1.0)``: the right half, whatever the
camera's resolution). A region reaching past the frame is cut at its edges; one with nothing
inside the frame is a :class:`~gguf_mcv.errors.SourceError` at the first frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, SourceError

#: Largest pixel coordinate or size accepted (far beyond any camera; keeps arithmetic small).
MAX_PIXELS = 1 << 20


@dataclass(frozen=True)
class Region:
    """A rectangle ``(x, y, w, h)``, in pixels (``fractions`` False) or fractions of the frame."""

    x: float
    y: float
    w: float
    h: float
    fractions: bool

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) in a ``width`` × ``height`` frame, cut at its edges."""
        if self.fractions:
            left, top = round(self.x * width), round(self.y * height)
            right, bottom = round((self.x + self.w) * width), round((self.y + self.h) * height)
        else:
            left, top, right, bottom = int(self.x), int(self.y), int(self.x + self.w), int(self.y + self.h)
        left, right = max(0, min(left, width)), max(0, min(right, width))
        top, bottom = max(0, min(top, height)), max(0, min(bottom, height))
        if right - left < 1 or bottom - top < 1:
            raise SourceError(f"region {self.describe()} has nothing inside the {width}×{height} frame: give "
                              "one that overlaps the picture.")
        return left, top, right, bottom

    def crop(self, rgb: np.ndarray) -> np.ndarray:
        """The region of an H×W×3 frame (a copy, contiguous)."""
        left, top, right, bottom = self.box(rgb.shape[1], rgb.shape[0])
        return np.ascontiguousarray(rgb[top:bottom, left:right])

    def describe(self) -> str:
        if self.fractions:
            return f"({self.x:g}, {self.y:g}, {self.w:g}, {self.h:g}) of the frame"
        return f"{int(self.w)}×{int(self.h)} at ({int(self.x)}, {int(self.y)})"


def check_region(value: Any) -> Region | None:
    """``value`` (None, or four numbers ``x, y, w, h``: all ints for pixels, all floats in [0, 1] for
    fractions) as a :class:`Region`; ConfigError saying what is wrong otherwise."""
    if value is None or isinstance(value, Region):
        return value
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 4:
        raise ConfigError(f"region must be four numbers (x, y, w, h), not {_shown(value)}.")
    parts = list(value)
    if any(isinstance(p, bool) or not isinstance(p, (int, float)) for p in parts):
        raise ConfigError(f"region must be four numbers (x, y, w, h), not {_shown(value)}.")
    if all(isinstance(p, int) for p in parts):
        if not all(0 <= p <= MAX_PIXELS for p in parts) or parts[2] < 1 or parts[3] < 1:
            raise ConfigError(f"region in pixels needs x, y from 0 and w, h from 1, at most {MAX_PIXELS} each, "
                              f"not {_shown(value)}.")
        x, y, w, h = (float(p) for p in parts)
        return Region(x, y, w, h, fractions=False)
    if any(isinstance(p, int) and not 0 <= p <= 1 for p in parts):
        raise ConfigError(f"region mixes pixels (ints) and fractions (floats): {_shown(value)}; give four ints "
                          "for pixels or four numbers in [0, 1] for fractions.")
    floats = [float(p) for p in parts]
    if not all(math.isfinite(p) and 0.0 <= p <= 1.0 for p in floats) or floats[2] <= 0 or floats[3] <= 0:
        raise ConfigError(f"region in fractions of the frame needs four numbers in [0, 1] (w and h above 0), "
                          f"not {_shown(value)}; give ints for pixels.")
    return Region(floats[0], floats[1], floats[2], floats[3], fractions=True)


def parse_region(text: str) -> Region:
    """``x,y,w,h`` from the command line: ints are pixels, numbers with a point fractions."""
    pieces = [p.strip() for p in str(text).split(",")]
    if len(pieces) != 4:
        raise ConfigError(f"--region must be x,y,w,h (pixels, or fractions such as 0.5,0,0.5,1), not {text!r}.")
    try:
        numbers = [float(p) if any(c in p for c in ".eE") else int(p) for p in pieces]
    except ValueError:
        raise ConfigError(f"--region must be four numbers x,y,w,h, not {text!r}.") from None
    region = check_region(numbers)
    assert region is not None
    return region


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
