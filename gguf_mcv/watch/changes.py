"""Which of a frame's slices changed since they were last encoded.

MiniCPM-V's encoder sees an image as an overview (index 0, the whole picture) and a grid
of slices (indexes 1…, row by row, as libmtmd orders its chunks). Each frame is reduced to
:data:`CELL`×:data:`CELL`-pixel block averages of each colour channel (red, green, blue); a
block changed when any of its channels moved by more than ``level`` since the version last
encoded, so a change of colour counts even where the brightness stays (a red light turning a
green of the same luminance). Averaging a block divides sensor noise by :data:`CELL` (a noise
of σ 8 levels per pixel and channel leaves σ 1 per block), so noise never moves a block by the
default :data:`DEFAULT_LEVEL`, while anything larger than a block and of visible contrast does.
A slice is stale when more than ``threshold`` of its blocks changed; the overview when any slice
is, or when more than ``threshold`` of the whole picture changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..options import check_number

#: Side, in pixels, of the blocks compared.
CELL = 8
#: Levels (0-255) one of a block's channel averages must move for the block to count as changed.
DEFAULT_LEVEL = 12.0
#: Fraction of a slice's blocks that must change for it to be encoded again: 0.002 is about a
#: 20×20-pixel object in a 448-pixel slice (conservative: a slice is rather encoded once too often).
DEFAULT_THRESHOLD = 0.002
#: Blocks around a slice's own that also count for it: libmtmd resamples the whole picture
#: before cutting it, so a change just across a border can reach a slice's edge pixels.
MARGIN_CELLS = 1


def check_threshold(value: object) -> float:
    """``threshold`` checked: a fraction in [0, 1) (0: any changed block re-encodes its slice)."""
    if isinstance(value, int) and not isinstance(value, bool) and value != 0:  # 10**400 too: no float
        raise ConfigError(f"threshold is the fraction of a slice that must change, in [0, 1), not the integer "
                          f"{value if abs(value) < 10**12 else 'of ' + str(len(str(abs(value)))) + ' digits'}.")
    number = check_number("threshold", value)
    if not 0 <= number < 1:
        raise ConfigError(f"threshold is the fraction of a slice that must change, in [0, 1), not {number:g}.")
    return number


def colour_cells(rgb: np.ndarray, cell: int = CELL) -> np.ndarray:
    """``rgb`` (H×W×3 uint8) as block averages of each channel (⌈H/cell⌉×⌈W/cell⌉×3 float32)."""
    import cv2  # lazy: `import gguf_mcv` does not load OpenCV

    h, w = rgb.shape[:2]
    size = (max(1, -(-w // cell)), max(1, -(-h // cell)))
    cells = cv2.resize(rgb, size, interpolation=cv2.INTER_AREA).astype(np.float32)
    return cells.reshape(size[1], size[0], 3)  # a 1-pixel-wide result keeps its channel axis


def slice_boxes(width: int, height: int, grid: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """(x0, y0, x1, y1) in pixels of the overview (index 0: the whole picture) and of each slice
    of a ``grid`` of (columns, rows), row by row, as libmtmd orders an image's chunks."""
    cols, rows = grid
    boxes = [(0, 0, width, height)]
    for r in range(rows):
        for c in range(cols):
            boxes.append((c * width // cols, r * height // rows, (c + 1) * width // cols, (r + 1) * height // rows))
    return boxes


@dataclass(frozen=True)
class Changes:
    """What a frame changed: ``fraction`` of the whole picture, per-box ``fractions`` (overview
    first), and the indexes of the boxes to encode again (``stale``, overview first)."""

    fraction: float
    fractions: tuple[float, ...]
    stale: tuple[int, ...]


class ChangeTracker:
    """Remembers each box as it was last encoded and says which boxes a new frame makes stale."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, level: float = DEFAULT_LEVEL,
                 cell: int = CELL) -> None:
        self.threshold = check_threshold(threshold)
        self.level = check_number("level", level)
        if not 0 < self.level < 255:
            raise ConfigError(f"level is a difference of channel levels between 0 and 255, not {self.level:g}.")
        self.cell = cell
        self._layout: tuple[tuple[int, int], tuple[int, int]] | None = None
        self._regions: list[tuple[slice, slice]] = []  # per box: its cells (rows, columns), margin included
        self._ref: list[np.ndarray | None] = []  # per box: the frame's cells when the box was last encoded

    def compare(self, cells: np.ndarray, size: tuple[int, int], grid: tuple[int, int]) -> Changes:
        """Which boxes of a frame of ``size`` (width, height) cut in ``grid`` changed; ``cells``
        are its :func:`colour_cells`. A new size or grid makes every box stale."""
        if (size, grid) != self._layout:
            self._layout = (size, grid)
            self._regions = [self._region(i, box) for i, box in enumerate(slice_boxes(*size, grid))]
            self._ref = [None] * len(self._regions)
        fractions = []
        for region, ref in zip(self._regions, self._ref, strict=True):
            if ref is None:
                fractions.append(1.0)
            else:
                moved = np.abs(cells[region] - ref[region]).max(axis=2)  # the channel that moved most
                fractions.append(float(np.mean(moved > self.level)))
        stale = [i for i in range(1, len(fractions)) if fractions[i] > self.threshold]
        if stale or fractions[0] > self.threshold:
            stale.insert(0, 0)
        return Changes(fractions[0], tuple(fractions), tuple(stale))

    def encoded(self, cells: np.ndarray, indexes: tuple[int, ...] | list[int]) -> None:
        """Remember ``cells`` as what boxes ``indexes`` (of the last :meth:`compare`) were encoded from."""
        for i in indexes:
            ref = self._ref[i]
            if ref is None:
                self._ref[i] = cells.copy()
            else:
                ref[self._regions[i]] = cells[self._regions[i]]

    def forget(self, index: int) -> None:
        """Make box ``index`` stale for the next frame (its embedding is no longer at hand)."""
        if 0 <= index < len(self._ref):
            self._ref[index] = None

    def _region(self, index: int, box: tuple[int, int, int, int]) -> tuple[slice, slice]:
        x0, y0, x1, y1 = box
        m = MARGIN_CELLS if index else 0
        c = self.cell
        return (slice(max(0, y0 // c - m), -(-y1 // c) + m), slice(max(0, x0 // c - m), -(-x1 // c) + m))
