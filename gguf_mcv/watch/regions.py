"""A watch's region: the rectangle of each frame that is asked about (and encoded), in pixels or
as fractions of the frame.

``(x, y, w, h)`` of ints is in pixels from the top left corner; of floats, each in [0, 1], in
fractions of the frame's width and height (``(0.5, 0.0, 0.5, 1.0)``: the right half, whatever the
camera's resolution). A region reaching past the frame is cut at its edges; one with nothing
inside the frame is a :class:`~gguf_mcv.errors.SourceError` at the first frame.

A :class:`Zone` is a named region with a question of its own: a watch with several zones asks
each of them about the same frame, each compared, encoded and followed for events on its own.
Zones may overlap; each keeps its own slice embeddings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, SourceError

#: Largest pixel coordinate or size accepted (far beyond any camera; keeps arithmetic small).
MAX_PIXELS = 1 << 20
#: Most zones on one watch: each one is a question at every tick.
MAX_ZONES = 16
#: A zone's name: what file names, MQTT topics and JSON keys can all carry.
ZONE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")


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


def parse_region(text: str, *, flag: str = "--region") -> Region:
    """``x,y,w,h`` from the command line: ints are pixels, numbers with a point fractions."""
    pieces = [p.strip() for p in str(text).split(",")]
    if len(pieces) != 4:
        raise ConfigError(f"{flag} needs x,y,w,h (pixels, or fractions such as 0.5,0,0.5,1), not {_shown(text)}.")
    try:
        numbers = [float(p) if any(c in p for c in ".eE") else int(p) for p in pieces]
    except ValueError:
        raise ConfigError(f"{flag} needs four numbers x,y,w,h, not {_shown(text)}.") from None
    region = check_region(numbers)
    assert region is not None
    return region


@dataclass(frozen=True)
class Zone:
    """A named :class:`Region` of the frame, asked its own ``prompt`` (None: the watch's)."""

    name: str
    region: Region
    prompt: str | None = None


def check_zones(value: Any) -> list[Zone] | None:
    """``zones`` (None, or a mapping of name to a region, to ``(region, prompt)`` or to a
    :class:`Zone`) as a list of zones in the mapping's order; ConfigError saying what is wrong."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"zones must be a non-empty mapping of name to region (x, y, w, h) or to (region, "
                          f"prompt), not {_shown(value)}.")
    if len(value) > MAX_ZONES:
        raise ConfigError(f"zones: {len(value)} given, at most {MAX_ZONES} (each is a question at every tick).")
    zones = []
    for name, spec in value.items():
        if not isinstance(name, str) or not ZONE_NAME.fullmatch(name):
            raise ConfigError(f"zone name {_shown(name)}: use 1 to 32 letters, digits, '_' or '-', starting with a "
                              "letter or digit.")
        prompt = None
        if isinstance(spec, Zone):
            region, prompt = spec.region, spec.prompt
        elif isinstance(spec, (tuple, list)) and len(spec) == 2:
            region, prompt = spec
        else:
            region = spec
        if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
            raise ConfigError(f"zone {name}: its prompt must be a non-empty string, not {_shown(prompt)}.")
        try:
            checked = check_region(region)
        except ConfigError as exc:
            raise ConfigError(f"zone {name}: {exc}") from None
        if checked is None:
            raise ConfigError(f"zone {name} needs a region (x, y, w, h).")
        zones.append(Zone(name, checked, prompt))
    return zones


def parse_zone(text: str) -> tuple[str, tuple[Region, str | None]]:
    """``NAME=x,y,w,h[:QUESTION]`` from the command line: the zone's name and (region, question)."""
    name, sep, rest = str(text).partition("=")
    if not sep or not ZONE_NAME.fullmatch(name.strip()):
        raise ConfigError(f"--zone must be NAME=x,y,w,h[:QUESTION] (NAME: letters, digits, '_' or '-'), "
                          f"not {_shown(text)}.")
    box, colon, question = rest.partition(":")
    if colon and not question.strip():
        raise ConfigError(f"--zone {name}: the question after ':' is empty; leave out ':' to ask --prompt.")
    region = parse_region(box, flag="--zone")
    return name.strip(), (region, question.strip() or None)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
