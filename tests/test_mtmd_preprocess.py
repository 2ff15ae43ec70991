"""libmtmd's MiniCPM-V preprocessing in numpy: slice count, sizes and order (pure, no native code).
That the pixels are libmtmd's is checked through the encoder in tests/test_onnx_graph.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_mcv.vision.mtmd_preprocess import PreprocessParams, best_resize, slice_boxes, slice_pixels
from gguf_mcv.vision.slicing import count_slices

P = PreprocessParams()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000))
def test_one_box_per_chunk_libmtmd_makes(width: int, height: int) -> None:
    boxes = slice_boxes(width, height, P)
    assert len(boxes) == 1 + count_slices(width, height)
    for box in boxes:
        x, y, w, h = box.crop
        assert w % 14 == 0 and h % 14 == 0 and w > 0 and h > 0  # whole patches
        assert x + w <= box.resize[0] and y + h <= box.resize[1]


def test_small_images_are_stretched_to_one_full_slice() -> None:
    (box,) = slice_boxes(300, 200, P)
    assert box.resize == (448, 448) and box.crop == (0, 0, 448, 448) and not box.pad


def test_a_grid_is_read_row_by_row_after_the_overview() -> None:
    boxes = slice_boxes(1344, 1344, P)
    assert len(boxes) == 10 and boxes[0].resize == (448, 448)
    assert [b.crop[:2] for b in boxes[1:4]] == [(0, 0), (448, 0), (896, 0)]
    assert boxes[4].crop[:2] == (0, 448)


def test_best_resize_rounds_half_away_from_zero() -> None:
    # 7 / 14 = 0.5: std::round gives 1 (Python's round would give 0), and never below one patch
    assert best_resize(7, 7, 448, 14, allow_upscale=False) == (14, 14)
    assert best_resize(21, 448, 448, 14, allow_upscale=False) == (28, 448)


def test_pixels_are_normalised_channels_first() -> None:
    rgb = np.zeros((100, 100, 3), np.uint8)
    rgb[..., 0] = 255
    (pixels,) = slice_pixels(rgb, P)
    assert pixels.shape == (3, 448, 448) and pixels.dtype == np.float32
    assert pixels[0].min() == pytest.approx(1.0) and pixels[1].max() == pytest.approx(-1.0)


def test_padding_is_black_and_centred() -> None:
    rgb = np.full((450, 3000, 3), 255, np.uint8)
    boxes = slice_boxes(3000, 450, P)
    pixels = slice_pixels(rgb, P)
    assert len(pixels) == len(boxes) and all(b.pad for b in boxes[1:])
    assert all(np.isfinite(p).all() for p in pixels)
