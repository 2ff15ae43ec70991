"""How many slices libmtmd cuts a MiniCPM-V image into, and how to bound that number.

MiniCPM-V encodes an image as an overview plus a grid of slices (at most 9), each
one 448-pixel vision-encoder pass. ``slice_grid`` repeats libmtmd's own rule
(``mtmd_image_preprocessor_llava_uhd::get_slice_instructions`` and
``get_best_grid`` in llama.cpp's ``tools/mtmd/mtmd-image.cpp``) so the cost of an
image is known before it is encoded, and ``fit_slices`` finds the largest size
(aspect ratio kept) that stays within a slice budget. A test checks the rule
against libmtmd's actual token counts.
"""

from __future__ import annotations

import math

import numpy as np

MAX_SLICES = 9  # hard-coded in libmtmd for MiniCPM-V


def slice_grid(width: int, height: int, slice_size: int = 448) -> tuple[int, int]:
    """(columns, rows) of the slice grid libmtmd uses; (0, 0) when the image is not sliced."""
    if width <= slice_size and height <= slice_size:
        return 0, 0
    log_ratio = float(np.float32(math.log(width / height)))  # libmtmd computes it in float
    ratio = width * height / (slice_size * slice_size)
    multiple = min(math.ceil(ratio), MAX_SLICES)
    best, best_error = (1, 1), math.inf
    for n in (multiple - 1, multiple, multiple + 1):
        if n == 1 or n > MAX_SLICES:
            continue
        for cols in range(1, n + 1):
            if n % cols:
                continue
            error = abs(log_ratio - math.log(cols / (n // cols)))
            if error < best_error:
                best, best_error = (cols, n // cols), error
    return best


def count_slices(width: int, height: int, slice_size: int = 448) -> int:
    """Slices besides the overview (0 for an image that fits in one slice)."""
    cols, rows = slice_grid(width, height, slice_size)
    return cols * rows


def fit_slices(width: int, height: int, max_slices: int, slice_size: int = 448) -> tuple[int, int]:
    """The largest (width, height) with the same aspect whose slice count is at most ``max_slices``.

    ``max_slices=0`` fits the image into a single slice (overview only).
    """
    if max_slices < 0:
        raise ValueError("max_slices must be >= 0")
    if count_slices(width, height, slice_size) <= max_slices:
        return width, height
    if max_slices == 0:
        scale = slice_size / max(width, height)
        return max(1, int(width * scale)), max(1, int(height * scale))
    scale = 1.0
    while scale > 0.01:
        scale *= 0.98
        size = max(1, int(width * scale)), max(1, int(height * scale))
        if count_slices(*size, slice_size) <= max_slices:
            return size
    return fit_slices(width, height, 0, slice_size)
