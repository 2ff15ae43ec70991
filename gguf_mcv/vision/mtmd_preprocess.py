"""libmtmd's MiniCPM-V image preprocessing, in numpy: the pixel tensors of each slice.

An image becomes an overview plus a grid of slices (``gguf_mcv.vision.slicing`` has the grid
rule), each resized with Pillow's bicubic filter (libmtmd's resizer is a port of
Pillow's fixed-point resampler), scaled to [0, 1] and normalised with the mmproj's
mean and std. The order is libmtmd's chunk order: the overview first, then the slices
row by row — slice ``i`` of :func:`slice_pixels` is the ``i``-th image chunk
``mtmd_tokenize`` makes for the image. Source: ``mtmd_image_preprocessor_llava_uhd``
and ``mtmd_image_preprocessor_minicpmv`` in llama.cpp's ``tools/mtmd/mtmd-image.cpp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import PIL.Image

from .slicing import slice_grid


@dataclass(frozen=True)
class PreprocessParams:
    """What the preprocessing reads from the mmproj header."""

    image_size: int = 448
    patch_size: int = 14
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    n_merge: int = 1  #: minicpmv4_6: patches merged per side (the slices align to patch_size * n_merge)


@dataclass(frozen=True)
class SliceBox:
    """Where one slice comes from: the image resized to ``resize``, then ``crop`` (x, y, w, h) of it."""

    resize: tuple[int, int]
    crop: tuple[int, int, int, int]
    pad: bool  #: resized with the aspect kept and padded black (libmtmd's PAD_CEIL), else stretched


def _round(x: float) -> int:
    """C's ``std::round`` (half away from zero) for positive values."""
    return int(math.floor(x + 0.5))


def _ensure_divide(length: int, multiple: int) -> int:
    return max(_round(float(np.float32(length) / np.float32(multiple))) * multiple, multiple)


def best_resize(width: int, height: int, scale: int, multiple: int, allow_upscale: bool) -> tuple[int, int]:
    """libmtmd's ``get_best_resize``: about ``scale``² pixels, aspect kept, sides multiples of ``multiple``."""
    if width * height > scale * scale or allow_upscale:
        r = np.float32(width) / np.float32(height)
        height = int(np.float32(scale) / np.sqrt(r))
        width = int(np.float32(height) * r)
    return _ensure_divide(width, multiple), _ensure_divide(height, multiple)


def slice_boxes(width: int, height: int, p: PreprocessParams) -> list[SliceBox]:
    """The overview's and each slice's box, in libmtmd's chunk order."""
    size, multiple = p.image_size, p.patch_size * p.n_merge
    sliced = width > size or height > size
    if not sliced:
        ratio = np.float32(width) * np.float32(height) / np.float32(size * size)
        if p.n_merge == 2 and ratio <= 1.0:  # minicpmv4_6 at 4x merge: aspect kept, no slices
            ov = best_resize(width, height, size, multiple, True)
            return [SliceBox(ov, (0, 0, *ov), False)]
        return [SliceBox((size, size), (0, 0, size, size), False)]
    ov = best_resize(width, height, size, multiple, False)
    boxes = [SliceBox(ov, (0, 0, *ov), False)]
    cols, rows = slice_grid(width, height, size)
    cell = best_resize(_ensure_divide(width, cols) // cols, _ensure_divide(height, rows) // rows,
                       size, multiple, True)
    refined = (cell[0] * cols, cell[1] * rows)
    gx, gy = refined[0] // cols, refined[1] // rows
    for r in range(rows):
        for c in range(cols):
            boxes.append(SliceBox(refined, (c * gx, r * gy, gx, gy), True))
    return boxes


def _resize(rgb: np.ndarray, size: tuple[int, int], pad: bool) -> np.ndarray:
    h, w = rgb.shape[:2]
    if (w, h) == size:
        return rgb
    image = PIL.Image.fromarray(rgb)
    if not pad:
        return np.asarray(image.resize(size, PIL.Image.Resampling.BICUBIC))
    scale = min(np.float32(size[0]) / np.float32(w), np.float32(size[1]) / np.float32(h))
    new_w = min(int(math.ceil(np.float32(w) * scale)), size[0])
    new_h = min(int(math.ceil(np.float32(h) * scale)), size[1])
    out = np.zeros((size[1], size[0], 3), np.uint8)
    x0, y0 = (size[0] - new_w) // 2, (size[1] - new_h) // 2
    out[y0:y0 + new_h, x0:x0 + new_w] = np.asarray(image.resize((new_w, new_h), PIL.Image.Resampling.BICUBIC))
    return out


def slice_pixels(rgb: np.ndarray, p: PreprocessParams) -> list[np.ndarray]:
    """The normalised pixels (3×H×W float32) of the overview and each slice, in chunk order."""
    height, width = rgb.shape[:2]
    mean = np.asarray(p.mean, np.float32)
    std = np.asarray(p.std, np.float32)
    resized: dict[tuple[tuple[int, int], bool], np.ndarray] = {}
    out = []
    for box in slice_boxes(width, height, p):
        key = (box.resize, box.pad)
        if key not in resized:
            resized[key] = _resize(rgb, box.resize, box.pad)
        x, y, w, h = box.crop
        crop = resized[key][y:y + h, x:x + w].astype(np.float32) / np.float32(255.0)
        out.append(np.ascontiguousarray(((crop - mean) / std).transpose(2, 0, 1)))
    return out
