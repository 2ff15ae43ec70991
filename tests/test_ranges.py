"""Digit-wise numeric ranges (gguf_mcv.output.ranges), checked by llama.cpp's own grammar sampler.

No model is evaluated: :class:`gbnf_match.Matcher` offers a string's bytes to the grammar
sampler one by one. Integers: the grammar admits a number exactly when it is inside the
bounds. Numbers: it admits only values inside the bounds (as ``json.loads`` and jsonschema
read them), admits every in-range value written on its grid, and no exponent.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal

import pytest
from gbnf_match import Matcher
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_mcv.errors import ConfigError
from gguf_mcv.output import ranges, structured

INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def matcher(byte_vocab):
    m = Matcher(byte_vocab.f16)
    yield m
    m.close()


def grammar(schema: dict) -> str:
    return f"root ::= {ranges.range_rule(ranges.bounds_range(schema))}\n"


def in_bounds(value, schema: dict) -> bool:
    import jsonschema

    return not list(jsonschema.Draft202012Validator(schema).iter_errors(value))


@st.composite
def integer_schemas(draw) -> dict:
    ends = draw(st.sampled_from([INT64, UINT64, st.integers(-50, 50), st.integers(-(10**12), 10**12)]))
    low, high = sorted([draw(ends), draw(ends)])
    schema: dict = {"type": "integer"}
    if draw(st.booleans()):
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = low
    if draw(st.booleans()) or len(schema) == 1:
        schema["exclusiveMaximum" if draw(st.booleans()) else "maximum"] = high
    if draw(st.booleans()) and "minimum" in schema:  # a float bound on an integer
        schema["minimum"] = float(schema["minimum"]) + draw(st.sampled_from([0.0, 0.5, -0.25]))
    return schema


def _near(schema: dict, draw) -> list[int]:
    values = []
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if key in schema:
            centre = int(schema[key])
            values += [centre + d for d in (-2, -1, 0, 1, 2)]
    values += draw(st.lists(st.integers(-(2**65), 2**65), min_size=4, max_size=4))
    return values


@PROPERTY
@given(data=st.data())
def test_integer_ranges_admit_exactly_the_values_inside(matcher, data) -> None:
    schema = data.draw(integer_schemas())
    low, high = interval(schema)
    if low > high:
        with pytest.raises(ConfigError, match="no integer"):
            grammar(schema)
        return
    rule = grammar(schema)
    for value in _near(schema, data.draw):
        inside = in_bounds(value, schema) and abs(value) < 10**ranges.INTEGER_DIGITS
        assert matcher.admits(rule, str(value)) == inside, (schema, value, rule)
    for text in ("01", "-0", "1.0", "1e2", "+1", "", "-", "1 1"):
        assert not matcher.admits(rule, text), (schema, text)


def interval(schema: dict) -> tuple[float, float]:
    """The smallest and largest integer inside an integer schema's bounds (±inf: unbounded)."""
    low: float = -math.inf
    high: float = math.inf
    if "minimum" in schema:
        low = max(low, math.ceil(Decimal(schema["minimum"])))
    if "exclusiveMinimum" in schema:
        low = max(low, math.floor(Decimal(schema["exclusiveMinimum"])) + 1)
    if "maximum" in schema:
        high = min(high, math.floor(Decimal(schema["maximum"])))
    if "exclusiveMaximum" in schema:
        high = min(high, math.ceil(Decimal(schema["exclusiveMaximum"])) - 1)
    return low, high


@st.composite
def number_schemas(draw) -> dict:
    scale = draw(st.sampled_from([0, 1, 2, 3, 6]))
    ends = st.integers(-(10**7), 10**7).map(lambda n: float(Decimal(n).scaleb(-scale)))
    low, high = sorted([draw(ends), draw(ends)])
    schema: dict = {"type": "number"}
    if draw(st.booleans()):
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = low
    if draw(st.booleans()) or len(schema) == 1:
        schema["exclusiveMaximum" if draw(st.booleans()) else "maximum"] = high
    return schema


def _spellings(value: Decimal, fraction: int) -> list[str]:
    """``value`` written as JSON without an exponent, with 0..fraction digits after the point."""
    out = []
    for digits in range(fraction + 1):
        if value == value.quantize(Decimal(1).scaleb(-digits)):
            out.append(f"{value:.{digits}f}")
    return [t for t in out if not (t.startswith("-") and Decimal(t) == 0)]


@PROPERTY
@given(data=st.data())
def test_number_ranges_admit_only_values_inside_and_all_on_the_grid(matcher, data) -> None:
    schema = data.draw(number_schemas())
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if low is not None and low == high and ("exclusiveMinimum" in schema or "exclusiveMaximum" in schema):
        with pytest.raises(ConfigError, match="no number"):
            ranges.bounds_range(schema)
        return
    span = ranges.bounds_range(schema)
    rule = grammar(schema)
    step = Decimal(1).scaleb(-span.fraction)
    candidates = set()
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if key in schema:
            exact = Decimal(repr(schema[key]))
            candidates |= {exact + k * step for k in range(-2, 3)} | {exact + k * Decimal("0.5") for k in (-1, 1)}
    candidates |= {Decimal(v).quantize(step) for v in data.draw(st.lists(
        st.floats(-2e7, 2e7, allow_nan=False), min_size=3, max_size=3))}
    for value in candidates:
        for text in _spellings(value, span.fraction):
            inside = in_bounds(json.loads(text), schema) and abs(value) < 10**ranges.NUMBER_DIGITS
            assert matcher.admits(rule, text) == inside, (schema, text, rule)
        for text in (f"{value:.0f}e0", f"{value}E+00", f"{value}e-0"):
            assert not matcher.admits(rule, text), (schema, text)


@pytest.mark.parametrize("schema, inside, outside", [
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
     ["0.5", "0.00000000000001", "0.99999999999999"], ["0", "0.0", "1", "1.0", "1.00", "1e0", "-0.5", "0e0"]),
    ({"type": "number", "minimum": 0.5, "maximum": 0.7}, ["0.5", "0.50", "0.7", "0.700", "0.6123"],
     ["0.4999", "0.70001", "0.71", "5e-1", "1"]),
    ({"type": "number", "minimum": -40.5, "maximum": -3.25}, ["-40.5", "-40.50", "-3.25", "-4", "-10.125"],
     ["-40.51", "-3.2", "-3.249", "3.25", "-41"]),
    ({"type": "number", "minimum": 0.1}, ["0.1", "0.10", "12345678901234"], ["0.09", "0.0999"]),
    ({"type": "integer", "minimum": 0, "maximum": 9999}, ["0", "9999", "500"], ["10000", "-1", "00", "5.0"]),
    ({"type": "integer", "minimum": 10**6, "maximum": 2 * 10**9}, ["1000000", "2000000000", "54321987"],
     ["999999", "2000000001", "1e6"]),
    ({"type": "integer", "minimum": -40, "maximum": -3}, ["-40", "-3", "-17"], ["-41", "-2", "0", "3"]),
    ({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}, [str(-(2**63)), str(2**63 - 1), "0"],
     [str(2**63), str(-(2**63) - 1)]),
    ({"type": "integer", "exclusiveMinimum": 2**64 - 2}, [str(2**64 - 1), "99999999999999999999"],
     [str(2**64 - 2), "100000000000000000000"]),
])
def test_the_ranges_of_the_issue(matcher, schema, inside, outside) -> None:
    rule = grammar(schema)
    for text in inside:
        assert matcher.admits(rule, text), (text, rule)
    for text in outside:
        assert not matcher.admits(rule, text), (text, rule)


def test_any_64_bit_range_is_a_compact_grammar() -> None:
    rule = grammar({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1})
    assert len(rule) < 2000  # spelled out, it would be 2**64 alternatives
    assert len(grammar({"type": "number", "exclusiveMinimum": -1e14, "exclusiveMaximum": 1e-14})) < 4000


@pytest.mark.parametrize("schema", [
    {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4},
    {"type": "integer", "minimum": 5, "maximum": 4},
    {"type": "integer", "minimum": 0.5, "maximum": 0.75},
    {"type": "integer", "minimum": 10**20},
    {"type": "number", "exclusiveMinimum": 1, "maximum": 1},
    {"type": "number", "minimum": 1e15},
    {"type": "number", "exclusiveMaximum": -1e300},
])
def test_bounds_that_leave_nothing_are_config_errors(schema) -> None:
    with pytest.raises(ConfigError, match="no (integer|number)"):
        ranges.bounds_range(schema)
    with pytest.raises(ConfigError, match=r"\$\.properties\.v"):
        structured.check_schema({"type": "object", "properties": {"v": schema}})


def test_bounds_past_what_the_grammar_writes_are_no_bound() -> None:
    span = ranges.bounds_range({"type": "number", "minimum": -1e300, "maximum": 1e300})
    assert span.low == span.high.copy_negate() and span.high < 10**ranges.NUMBER_DIGITS and span.fraction > 0
