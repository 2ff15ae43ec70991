"""Sizes read from what people type and written for people to read (more cases in test_hardware.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_mcv.errors import ConfigError
from gguf_mcv.units import MAX_SIZE, format_size, parse_size

UNITS = ["", "B", "k", "KB", "M", "MiB", "G", "GB", "GiB", "T", "TB", "TiB"]


@given(number=st.integers(min_value=0, max_value=10**600), unit=st.sampled_from(UNITS),
       as_text=st.booleans())
@settings(max_examples=300, deadline=None)
def test_any_size_is_read_up_to_1_eb_and_refused_beyond_it(number: int, unit: str, as_text: bool) -> None:
    """Any number, however large, with any unit: its bytes up to MAX_SIZE, above it a ConfigError
    (never an OverflowError), and what is read can always be written back."""
    value: int | str = f"{number}{unit}" if as_text else number
    try:
        size = parse_size(value)
    except ConfigError as exc:
        assert "1 EB" in str(exc)
        scale = parse_size(f"1{unit}") if as_text else 1
        assert number * scale > MAX_SIZE
        return
    assert 0 <= size <= MAX_SIZE
    assert format_size(size)


@pytest.mark.parametrize("value", ["1" + "0" * 30 + "GB", "9" * 5000, 10**5000, MAX_SIZE + 1, "1000001TB"],
                         ids=["31 digits GB", "5000 nines", "a 5001-digit int", "1 EB + 1", "1000001TB"])
def test_huge_sizes_are_refused_with_the_allowed_range(value: int | str) -> None:
    with pytest.raises(ConfigError, match=r"from 0 to 1 EB \(10\*\*18 bytes\)"):
        parse_size(value)
    assert parse_size(MAX_SIZE) == MAX_SIZE == parse_size("1000000TB")
