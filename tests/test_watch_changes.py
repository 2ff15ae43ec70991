"""gguf_mcv.watch.changes: which slices a frame makes stale (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.vision.slicing import slice_grid
from gguf_mcv.watch.changes import DEFAULT_THRESHOLD, ChangeTracker, check_threshold, colour_cells, slice_boxes

W, H = 1280, 720
GRID = slice_grid(W, H)  # (3, 2): overview + 6 slices


def _scene(seed: int = 0) -> np.ndarray:
    """A textured scene: smooth gradients plus some objects (no flat areas a test could rely on)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:H, 0:W]
    rgb = np.stack([(x * 255 // W), (y * 255 // H), ((x + y) * 127 // (W + H))], axis=2).astype(np.uint8)
    for _ in range(12):
        cx, cy, r = rng.integers(0, W), rng.integers(0, H), rng.integers(10, 60)
        rgb[max(0, cy - r):cy + r, max(0, cx - r):cx + r] = rng.integers(0, 255, 3)
    return rgb


def _noisy(rgb: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0, sigma, rgb.shape)
    return np.clip(rgb + noise, 0, 255).astype(np.uint8)


def _tracked(rgb: np.ndarray, **kw) -> ChangeTracker:
    tracker = ChangeTracker(**kw)
    first = tracker.compare(colour_cells(rgb), (W, H), GRID)
    assert first.stale == tuple(range(7)) and first.fraction == 1.0  # nothing seen yet: all stale
    tracker.encoded(colour_cells(rgb), first.stale)
    return tracker


def test_boxes_are_the_overview_then_the_slices_row_by_row() -> None:
    assert GRID == (3, 2)
    boxes = slice_boxes(W, H, GRID)
    assert boxes[0] == (0, 0, W, H)
    assert boxes[1:4] == [(0, 0, 426, 360), (426, 0, 853, 360), (853, 0, W, 360)]
    assert boxes[4] == (0, 360, 426, H)
    assert slice_boxes(400, 300, (0, 0)) == [(0, 0, 400, 300)]  # unsliced: the overview alone


def test_colour_cells_average_blocks_per_channel() -> None:
    rgb = np.zeros((20, 33, 3), np.uint8)
    rgb[:8, :8] = (255, 0, 128)
    cells = colour_cells(rgb)
    assert cells.shape == (3, 5, 3) and cells.dtype == np.float32
    assert cells[0, 0].tolist() == pytest.approx([255, 0, 128], abs=1) and cells[2, 4].tolist() == [0, 0, 0]
    assert colour_cells(np.zeros((5, 1, 3), np.uint8)).shape == (1, 1, 3)  # thinner than a block


@pytest.mark.parametrize("before, after", [((200, 0, 0), (0, 102, 0)), ((0, 0, 255), (95, 0, 0))])
def test_a_colour_change_of_equal_brightness_is_a_change(before: tuple, after: tuple) -> None:
    """Red to a green (or blue to a red) of the same grey level: the whole frame, then one light."""
    grey = np.array([[before], [after]], np.uint8)
    import cv2

    levels = cv2.cvtColor(grey, cv2.COLOR_RGB2GRAY).ravel()
    assert abs(int(levels[0]) - int(levels[1])) <= 1  # the same brightness: a grey comparison sees nothing
    tracker = _tracked(np.full((H, W, 3), before, np.uint8))
    whole = tracker.compare(colour_cells(np.full((H, W, 3), after, np.uint8)), (W, H), GRID)
    assert whole.stale == tuple(range(7)) and whole.fraction == 1.0
    scene = _scene()
    scene[500:540, 600:640] = before
    tracker = _tracked(scene)
    light = scene.copy()
    light[500:540, 600:640] = after  # a traffic light in slice 5 changes colour
    assert tracker.compare(colour_cells(light), (W, H), GRID).stale == (0, 5)


@pytest.mark.parametrize("sigma", [2.0, 5.0, 8.0])
def test_sensor_noise_stays_below_the_threshold(sigma: float) -> None:
    scene = _scene()
    tracker = _tracked(_noisy(scene, sigma, 0))
    for seed in range(1, 6):
        changes = tracker.compare(colour_cells(_noisy(scene, sigma, seed)), (W, H), GRID)
        assert changes.stale == (), (sigma, changes.fractions)
        assert changes.fraction <= DEFAULT_THRESHOLD


def test_one_region_changes_only_its_slice_and_the_overview() -> None:
    scene = _scene()
    tracker = _tracked(scene)
    moved = scene.copy()
    moved[500:560, 600:660] = (255, 0, 0)  # inside slice 5 (row 2, column 2: x 426-853, y 360-720)
    changes = tracker.compare(colour_cells(moved), (W, H), GRID)
    assert changes.stale == (0, 5)
    assert 0 < changes.fraction < 0.01
    tracker.encoded(colour_cells(moved), changes.stale)
    assert tracker.compare(colour_cells(moved), (W, H), GRID).stale == ()  # compared with what was encoded


def test_a_change_across_a_border_makes_both_slices_stale() -> None:
    tracker = _tracked(_scene())
    moved = _scene()
    moved[100:160, 400:450] = 0  # straddles x = 426, between slices 1 and 2
    assert tracker.compare(colour_cells(moved), (W, H), GRID).stale == (0, 1, 2)


def test_slow_drift_adds_up_against_the_last_encoded_version() -> None:
    scene = _scene()
    tracker = _tracked(scene)
    drifted = scene.astype(np.int16)
    stale: tuple[int, ...] = ()
    for _ in range(10):  # 5 grey levels a frame: never enough between two frames, enough in total
        drifted[50:300, 50:380] += 5
        stale = tracker.compare(colour_cells(np.clip(drifted, 0, 255).astype(np.uint8)), (W, H), GRID).stale
        if stale:
            break
    assert stale == (0, 1)


def test_a_new_size_or_grid_makes_everything_stale() -> None:
    tracker = _tracked(_scene())
    small = _scene()[:448, :448]
    assert tracker.compare(colour_cells(small), (448, 448), (0, 0)).stale == (0,)


def test_a_forgotten_box_is_stale() -> None:
    tracker = _tracked(_scene())
    tracker.forget(3)
    tracker.forget(99)  # out of range: nothing
    assert tracker.compare(colour_cells(_scene()), (W, H), GRID).stale == (0, 3)


def test_threshold_zero_counts_any_changed_block() -> None:
    tracker = _tracked(_scene(), threshold=0.0)
    moved = _scene()
    moved[10:26, 10:26] = 255 - moved[10:26, 10:26]
    assert tracker.compare(colour_cells(moved), (W, H), GRID).stale == (0, 1)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 5, float("nan"), float("inf"), "0.1", None, True])
def test_bad_thresholds_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="threshold"):
        check_threshold(bad)


@pytest.mark.parametrize("bad", [0, -1, 255, float("nan"), "12"])
def test_bad_levels_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="level"):
        ChangeTracker(level=bad)  # type: ignore[arg-type]
