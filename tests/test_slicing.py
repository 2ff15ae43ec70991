"""The slice rule matches libmtmd's, and slice budgets hold."""

from __future__ import annotations

import numpy as np
import pytest

from gguf_mcv.vision.media import Image
from gguf_mcv.vision.slicing import count_slices, fit_slices, slice_grid

SIZES = [(448, 448), (449, 448), (640, 480), (1344, 1344), (1920, 1080), (1080, 1920),
         (4000, 20), (20, 4000), (900, 600), (3000, 1000), (500, 500), (1000, 1000), (2000, 1500)]


def test_known_grids() -> None:
    assert slice_grid(448, 448) == (0, 0)
    assert slice_grid(1344, 1344) == (3, 3)
    assert slice_grid(640, 480) == (2, 1)
    assert count_slices(1920, 1080) == 8


@pytest.mark.parametrize("size", SIZES)
def test_rule_matches_libmtmd(tiny_model, size: tuple[int, int]) -> None:
    image = Image(np.zeros((size[1], size[0], 3), dtype=np.uint8), "test")
    tokens = tiny_model.engine.count_image_tokens(image)
    assert tokens == 64 * (1 + count_slices(*size))


@pytest.mark.parametrize("budget", range(0, 10))
@pytest.mark.parametrize("size", [(1344, 1344), (1920, 1080), (3000, 1000), (640, 480)])
def test_fit_slices_respects_the_budget_and_aspect(size: tuple[int, int], budget: int) -> None:
    w, h = fit_slices(*size, budget)
    assert count_slices(w, h) <= budget
    assert w <= size[0] and h <= size[1]
    assert abs(w / h - size[0] / size[1]) / (size[0] / size[1]) < 0.05


def test_fit_slices_keeps_images_already_within_budget() -> None:
    assert fit_slices(1344, 1344, 9) == (1344, 1344)
    assert fit_slices(300, 200, 0) == (300, 200)
    with pytest.raises(ValueError):
        fit_slices(10, 10, -1)


def test_detail_auto_low_and_max_slices_on_a_model(tiny_model) -> None:
    big = np.zeros((1344, 1344, 3), dtype=np.uint8)
    assert tiny_model.ask("?", big, max_tokens=1).usage.image_tokens == 64 * 5  # auto on CPU: 4 slices
    assert tiny_model.ask("?", big, max_tokens=1, detail="low").usage.image_tokens == 64
    assert tiny_model.ask("?", big, max_tokens=1, max_slices=2).usage.image_tokens == 64 * 3
    assert tiny_model.ask("?", big, max_tokens=1, detail="high").usage.image_tokens == 640
