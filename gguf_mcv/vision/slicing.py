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

from ..errors import ConfigError
from ..options import DETAILS
from .media import Image

MAX_SLICES = 9  # hard-coded in libmtmd for MiniCPM-V
#: slice budget of detail="auto": each slice is one vision-encoder pass (~9 s for
#: MiniCPM-V's SigLIP on 2 CPU cores), so on a CPU large images get at most 4 slices
#: plus the overview; with the encoder on a GPU, libmtmd's own maximum of 9.
AUTO_MAX_SLICES_CPU = 4
AUTO_MAX_SLICES_GPU = 9
#: Images more elongated than this (long side : short side) are fitted in one slice, as
#: ``detail="low"`` does, whatever the detail: for them libmtmd's overview and slice sizes
#: grow past its 65536-pixel resize limit (from about 2000:1, e.g. 1×100000 → a 14×100002
#: overview) and cost many times a normal slice's patches before that.
MAX_SLICED_ASPECT = 500


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


def apply_detail(image: Image, *, detail: str = "auto", max_slices: int | None = None,
                 slice_size: int = 448, vision_gpu: bool = False) -> Image:
    """``image`` sized for the vision encoder according to ``detail`` / ``max_slices``.

    ``"high"`` keeps it (up to 9 slices plus the overview), ``"low"`` fits it in one
    slice, ``"auto"`` allows :data:`AUTO_MAX_SLICES_CPU` slices on a CPU encoder and
    :data:`AUTO_MAX_SLICES_GPU` on a GPU; ``max_slices=N`` sets the budget directly.
    An image more elongated than :data:`MAX_SLICED_ASPECT` is fitted in one slice.
    """
    return image.resized_to(*detail_size(image.width, image.height, detail=detail, max_slices=max_slices,
                                         slice_size=slice_size, vision_gpu=vision_gpu))


def detail_size(width: int, height: int, *, detail: str = "auto", max_slices: int | None = None,
                slice_size: int = 448, vision_gpu: bool = False) -> tuple[int, int]:
    """The size :func:`apply_detail` gives a ``width``×``height`` image (the same when it keeps it)."""
    if detail not in DETAILS:
        raise ConfigError(f"detail must be one of {', '.join(DETAILS)}, not {detail!r}.")
    if max_slices is not None and not 0 <= max_slices <= MAX_SLICES:
        raise ConfigError(f"max_slices must be between 0 and {MAX_SLICES}, not {max_slices}.")
    if detail == "low" or _too_elongated(width, height):
        max_slices = 0
    elif max_slices is None and detail == "auto":
        max_slices = AUTO_MAX_SLICES_GPU if vision_gpu else AUTO_MAX_SLICES_CPU
    if max_slices is None:
        return width, height
    return fit_slices(width, height, max_slices, slice_size)


def _too_elongated(width: int, height: int) -> bool:
    return max(width, height) > MAX_SLICED_ASPECT * min(width, height)
