"""gguf_mcv.watch.regions: the rectangle of each frame a watch asks about, in pixels or fractions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_mcv.errors import ConfigError, SourceError
from gguf_mcv.watch.regions import MAX_ZONES, Region, Zone, check_region, check_zones, parse_region, parse_zone


def frame(w: int = 640, h: int = 480) -> np.ndarray:
    return np.arange(w * h * 3, dtype=np.uint32).reshape(h, w, 3).astype(np.uint8)


def test_pixels_and_fractions_crop_the_same_rectangle() -> None:
    rgb = frame()
    by_pixels = check_region((320, 0, 320, 480)).crop(rgb)  # type: ignore[union-attr]
    by_fractions = check_region((0.5, 0.0, 0.5, 1.0)).crop(rgb)  # type: ignore[union-attr]
    assert by_pixels.shape == by_fractions.shape == (480, 320, 3)
    assert np.array_equal(by_pixels, rgb[:, 320:]) and np.array_equal(by_fractions, rgb[:, 320:])
    assert by_pixels.flags["C_CONTIGUOUS"]


def test_a_region_past_the_edges_is_cut_and_one_outside_the_frame_is_refused() -> None:
    huge = check_region((600, 400, 1 << 20, 1 << 20))
    assert huge is not None and huge.crop(frame()).shape == (80, 40, 3)
    outside = check_region((700, 0, 10, 10))
    assert outside is not None
    with pytest.raises(SourceError, match="nothing inside the 640×480 frame"):
        outside.crop(frame())


@pytest.mark.parametrize("value", [
    "0,0,1,1", (0, 0, 1), (0, 0, 1, 1, 1), (0, 0, 0, 5), (-1, 0, 5, 5), (0, 0, 5, True), (0, 0, 1.5, 0.5),
    (0, 0, float("nan"), 0.5), (0.1, 0.1, 0.0, 0.5), (0, 0, 10**400, 5), (0, 0, 0.5, 10**400), (0, 0, "5", 5),
    {"x": 0}, 3,
])
def test_bad_regions_are_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match="region"):
        check_region(value)


def test_the_command_lines_form() -> None:
    assert parse_region("10, 20, 30, 40") == Region(10, 20, 30, 40, fractions=False)
    assert parse_region("0.5,0,0.5,1") == Region(0.5, 0.0, 0.5, 1.0, fractions=True)
    for bad in ("1,2,3", "a,b,c,d", "1,2,3,4,5", ""):
        with pytest.raises(ConfigError, match="--region|region"):
            parse_region(bad)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.floats(0, 1), st.floats(0, 1), st.floats(0.001, 1),
       st.floats(0.001, 1))
def test_any_fraction_region_crops_inside_the_frame_or_says_it_is_outside(w: int, h: int, x: float, y: float,
                                                                           rw: float, rh: float) -> None:
    region = check_region((x, y, rw, rh))
    assert region is not None
    try:
        left, top, right, bottom = region.box(w, h)
    except SourceError:
        return
    assert 0 <= left < right <= w and 0 <= top < bottom <= h


def test_zones_keep_their_order_prompts_and_regions() -> None:
    zones = check_zones({"door": (0, 0, 10, 10), "shelf": ((0.5, 0.0, 0.5, 1.0), "Is it empty?"),
                         "desk": Zone("ignored", check_region((1, 1, 2, 2)), "Anyone?")})  # type: ignore[arg-type]
    assert zones is not None
    assert [(z.name, z.prompt) for z in zones] == [("door", None), ("shelf", "Is it empty?"), ("desk", "Anyone?")]
    assert zones[1].region == check_region((0.5, 0.0, 0.5, 1.0)) and check_zones(None) is None


@pytest.mark.parametrize("value, match", [
    ({}, "non-empty mapping"), ([("a", (0, 0, 1, 1))], "mapping"), ({"": (0, 0, 1, 1)}, "zone name"),
    ({"-a": (0, 0, 1, 1)}, "zone name"), ({"a/b": (0, 0, 1, 1)}, "zone name"), ({"x" * 33: (0, 0, 1, 1)}, "zone name"),
    ({3: (0, 0, 1, 1)}, "zone name"), ({"a": (0, 0, 1)}, "zone a: region"), ({"a": ((0, 0, 1, 1), " ")}, "prompt"),
    ({"a": None}, "zone a needs a region"), ({f"z{i}": (0, 0, 1, 1) for i in range(MAX_ZONES + 1)}, "at most"),
])
def test_bad_zones_are_refused(value: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_zones(value)


def test_the_command_lines_zone() -> None:
    assert parse_zone("door=0,0,0.5,1:Is the door open?") == ("door", (check_region((0.0, 0.0, 0.5, 1.0)),
                                                                      "Is the door open?"))
    assert parse_zone("shelf=10,20,30,40") == ("shelf", (check_region((10, 20, 30, 40)), None))
    assert parse_zone("a=0,0,1,1:What: this?")[1][1] == "What: this?"  # only the first ':' splits
    for bad, match in (("door", "NAME="), ("a b=0,0,1,1", "NAME="), ("a=0,0,1", "--zone needs x,y,w,h"),
                       ("a=0,0,1,1:", "empty"), ("a=x,0,1,1", "four numbers")):
        with pytest.raises(ConfigError, match=match):
            parse_zone(bad)
