"""Numeric bounds as GBNF, built digit by digit: a compact rule for any range, never a list of values.

An integer range ``[low, high]`` splits by digit count: whole lengths in the middle are
``[1-9] [0-9]{m,n}``, and a boundary length is a fixed-length range read left to right
(the shared prefix, then one digit above the low bound's or below the high bound's
followed by anything, or the bound's own digit followed by a tighter range). A decimal
range does the same for the whole part and, at the boundary whole parts, reads the
fraction digits as a string compared digit by digit (``0.5`` ≤ ``0.50`` ≤ ``0.7``).

Bounded numbers are written without an exponent, so a bound has one spelling to compare
with (``1.0``, ``1.00`` and ``1e0`` are not three ways past an exclusive ``1``), with at
most :data:`NUMBER_DIGITS` digits before the point, and on a grid of ``10**-fraction``
chosen so that a number near a bound has at most 15 significant digits: every such
decimal parses to its own double, so the grammar admits exactly the grid's decimals
whose parsed value lies inside the bounds (Python's and jsonschema's comparisons, on the
int or float that ``json.loads`` makes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal, localcontext

from ..errors import ConfigError

#: Integers may have this many digits (enough for any 64-bit value, signed or not).
INTEGER_DIGITS = 20
#: Bounded numbers have at most this many digits before the point (below 2**53, so every
#: whole number parses exactly) and at most this many significant digits near a bound.
NUMBER_DIGITS = 15
SIGNIFICANT_DIGITS = 15
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
#: Decimal digits kept in arithmetic: a double's exact value has at most 767 significant digits.
_PRECISION = 2000


@dataclass(frozen=True)
class Range:
    """The values a bounded schema admits: ``low``..``high`` (inclusive, both on the grid of
    ``10**-fraction``; ``fraction`` is 0 for integers)."""

    low: Decimal
    high: Decimal
    fraction: int


def has_bounds(schema: dict) -> bool:
    """Whether ``schema`` is an integer or number schema with any of the four bound keywords."""
    return schema.get("type") in ("integer", "number") and any(k in schema for k in _BOUNDS)


def bounds_range(schema: dict, path: str = "$") -> Range:
    """The :class:`Range` an integer or number schema's bounds admit; :class:`ConfigError`
    when no value the grammar can write lies inside them."""
    with localcontext() as ctx:
        ctx.prec = _PRECISION
        return _bounds_range(schema, path)


def _bounds_range(schema: dict, path: str) -> Range:
    integer = schema.get("type") == "integer"
    low, low_open, high, high_open = _tightest(schema)
    reach = Decimal(10) ** (INTEGER_DIGITS if integer else NUMBER_DIGITS)
    kind = "integer" if integer else f"number (at most {NUMBER_DIGITS} digits before the point, no exponent)"
    if (low is not None and low >= reach) or (high is not None and high <= -reach) or (
            low is not None and high is not None and low > high):
        raise _empty(schema, path, kind)
    low = None if low is not None and low <= -reach else low  # past what the grammar writes anyway
    high = None if high is not None and high >= reach else high
    if integer:
        fraction = 0
    else:
        whole_digits = max((len(str(int(abs(b)))) for b in (low, high) if b is not None), default=1)
        fraction = max(0, SIGNIFICANT_DIGITS - whole_digits)
    limit = reach - Decimal(1).scaleb(-fraction)
    first = -limit if low is None else _grid_low(low, low_open, fraction)
    last = limit if high is None else _grid_high(high, high_open, fraction)
    first, last = max(first, -limit), min(last, limit)
    if first > last:
        raise _empty(schema, path, kind)
    return Range(first, last, fraction)


def _empty(schema: dict, path: str, kind: str) -> ConfigError:
    given = ", ".join(f"{path}.{k} = {schema[k]!r:.30}" for k in _BOUNDS if k in schema)
    return ConfigError(f"The bounds {given} leave no {kind} inside them: check minimum/maximum and their "
                       "exclusive forms.")


def range_rule(span: Range) -> str:
    """A GBNF expression (without the trailing ``space``) for the numbers in ``span``."""
    with localcontext() as ctx:
        ctx.prec = _PRECISION
        return _signed(span)


def _signed(span: Range) -> str:
    step = Decimal(1).scaleb(-span.fraction)
    alternatives = []
    if span.high >= 0:
        alternatives.append(_magnitude(max(span.low, Decimal(0)), span.high, span.fraction))
    if span.low < 0:
        alternatives.append('"-" ' + _magnitude(max(-span.high, step), -span.low, span.fraction))
    return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"


def _tightest(schema: dict) -> tuple[Decimal | None, bool, Decimal | None, bool]:
    """(low, low is exclusive, high, high is exclusive) as exact decimals; None when absent."""
    low: Decimal | None = None
    high: Decimal | None = None
    low_open = high_open = False
    if "minimum" in schema:
        low = Decimal(schema["minimum"])
    if "exclusiveMinimum" in schema and (low is None or Decimal(schema["exclusiveMinimum"]) >= low):
        low, low_open = Decimal(schema["exclusiveMinimum"]), True
    if "maximum" in schema:
        high = Decimal(schema["maximum"])
    if "exclusiveMaximum" in schema and (high is None or Decimal(schema["exclusiveMaximum"]) <= high):
        high, high_open = Decimal(schema["exclusiveMaximum"]), True
    return low, low_open, high, high_open


def _admits(value: Decimal, bound: Decimal, is_open: bool, above: bool, fraction: int) -> bool:
    """Whether the answer ``value`` (written with ``fraction`` digits after the point, parsed
    as an int when there are none and as a float otherwise) passes the bound."""
    parsed: float | int = int(value) if fraction == 0 else float(value)
    exact = Decimal(parsed)
    if above:
        return exact > bound if is_open else exact >= bound
    return exact < bound if is_open else exact <= bound


def _grid_low(bound: Decimal, is_open: bool, fraction: int) -> Decimal:
    """The smallest grid value that passes a lower bound."""
    step = Decimal(1).scaleb(-fraction)
    value = bound.scaleb(fraction).to_integral_value(rounding="ROUND_CEILING").scaleb(-fraction)
    while not _admits(value, bound, is_open, True, fraction):
        value += step
    while _admits(value - step, bound, is_open, True, fraction):  # 0.1 parses to float(0.1)
        value -= step
    return value


def _grid_high(bound: Decimal, is_open: bool, fraction: int) -> Decimal:
    """The largest grid value that passes an upper bound."""
    return _grid_low(bound.copy_negate(), is_open, fraction).copy_negate()


# -- the grammar --------------------------------------------------------------------


def _magnitude(low: Decimal, high: Decimal, fraction: int) -> str:
    """Non-negative numbers from ``low`` to ``high`` (grid values, low <= high): a whole part
    without leading zeros and, for ``fraction`` > 0, an optional point and 1..fraction digits."""
    low_whole, high_whole = int(low), int(high)
    if fraction == 0:
        return integers(low_whole, high_whole)
    low_digits = _fraction_digits(low - low_whole, fraction)
    high_digits = _fraction_digits(high - high_whole, fraction)
    if low_whole == high_whole:
        return _group([f'"{low_whole}" {_fraction(low_digits, high_digits, fraction)}'])
    parts = [f'"{low_whole}" {_fraction(low_digits, None, fraction)}']
    if high_whole - low_whole > 1:
        parts.append(f"{integers(low_whole + 1, high_whole - 1)} {_fraction(None, None, fraction)}")
    parts.append(f'"{high_whole}" {_fraction(None, high_digits, fraction)}')
    return _group(parts)


def _fraction_digits(part: Decimal, fraction: int) -> str:
    return str(int(part.scaleb(fraction))).zfill(fraction)


def _fraction(low: str | None, high: str | None, fraction: int) -> str:
    """The optional point and digits after it, whose value (read as ``0.digits``) is at least
    ``low`` and at most ``high`` (each ``fraction`` digits long; None: no such bound)."""
    empty_ok = low is None or not low.strip("0")
    digits = _digits_between(low, high, fraction)
    body = f'"." {digits}' if digits else ""
    if not body:
        return ""
    return f"({body})?" if empty_ok else f"({body})"


def _digits_between(low: str | None, high: str | None, room: int) -> str:
    """1..``room`` digits whose zero-padded value lies between ``low`` and ``high`` (strings
    of ``room`` digits, or None); "" when no non-empty string does."""
    if room == 0:
        return ""
    low = None if low is None or not low.strip("0") else low  # no bound left
    high = None if high is None or not high.strip("9") else high
    if low is None and high is not None and not high.strip("0"):
        return f'"0"{_count(1, room)}'
    if low is None and high is None:
        return f"[0-9]{_count(1, room)}"
    alternatives = []
    for digit, rest_low, rest_high in _first_digits(low, high):
        rest = _digits_between(rest_low, rest_high, room - 1)
        stop_ok = rest_low is None or not rest_low.strip("0")
        if not rest and not stop_ok:
            continue
        tail = "" if not rest else (f" ({rest})?" if stop_ok else f" ({rest})")
        alternatives.append(digit + tail)
    return _group(alternatives)


def _first_digits(low: str | None, high: str | None) -> list[tuple[str, str | None, str | None]]:
    """The first digit's choices: (GBNF, the low bound left for the rest, the high bound left)."""
    first_low = int(low[0]) if low is not None else 0
    first_high = int(high[0]) if high is not None else 9
    if low is not None and high is not None and first_low == first_high:
        return [(f'"{first_low}"', low[1:], high[1:])]
    choices: list[tuple[str, str | None, str | None]] = []
    if low is not None:
        choices.append((f'"{first_low}"', low[1:], None))
        first_low += 1
    if high is not None:
        first_high -= 1
    if first_low <= first_high:
        choices.append((_digit_class(first_low, first_high), None, None))
    if high is not None:
        choices.append((f'"{high[0]}"', None, high[1:]))
    return choices


def integers(low: int, high: int) -> str:
    """Whole numbers ``low``..``high`` (``0 <= low <= high``) without leading zeros."""
    alternatives = []
    low_length, high_length = len(str(low)), len(str(high))
    if low_length == high_length:
        return _same_length(str(low), str(high))
    alternatives.append(_same_length(str(low), "9" * low_length))
    if high_length - low_length > 1:
        alternatives.append(f"[1-9] [0-9]{_count(low_length, high_length - 2)}")
    alternatives.append(_same_length("1" + "0" * (high_length - 1), str(high)))
    return _group(alternatives)


def _same_length(low: str, high: str) -> str:
    """Digit strings of one length from ``low`` to ``high``."""
    if not low:
        return ""
    if low == high:
        return f'"{low}"'
    prefix = 0
    while low[prefix] == high[prefix]:
        prefix += 1
    head = f'"{low[:prefix]}" ' if prefix else ""
    low, high = low[prefix:], high[prefix:]
    rest = len(low) - 1
    if not low[1:].strip("0") and not high[1:].strip("9"):  # every digit string between
        return head + f"{_digit_class(int(low[0]), int(high[0]))} {_any(rest)}".rstrip()
    alternatives = [f'"{low[0]}" {_at_least(low[1:])}'.rstrip()]
    if int(high[0]) - int(low[0]) > 1:
        alternatives.append(f"{_digit_class(int(low[0]) + 1, int(high[0]) - 1)} {_any(rest)}".rstrip())
    alternatives.append(f'"{high[0]}" {_at_most(high[1:])}'.rstrip())
    return head + _group(alternatives)


def _at_least(low: str) -> str:
    """Digit strings of ``len(low)`` digits that are >= ``low``."""
    if not low or not low.strip("0"):
        return _any(len(low))
    alternatives = [f'"{low[0]}" {_at_least(low[1:])}'.rstrip()]
    if low[0] != "9":
        alternatives.append(f"{_digit_class(int(low[0]) + 1, 9)} {_any(len(low) - 1)}".rstrip())
    return _group(alternatives)


def _at_most(high: str) -> str:
    """Digit strings of ``len(high)`` digits that are <= ``high``."""
    if not high or not high.strip("9"):
        return _any(len(high))
    alternatives = [f'"{high[0]}" {_at_most(high[1:])}'.rstrip()]
    if high[0] != "0":
        alternatives.append(f"{_digit_class(0, int(high[0]) - 1)} {_any(len(high) - 1)}".rstrip())
    return _group(alternatives)


def _any(length: int) -> str:
    return f"[0-9]{_count(length, length)}" if length else ""


def _count(low: int, high: int) -> str:
    return "" if low == high == 1 else (f"{{{low}}}" if low == high else f"{{{low},{high}}}")


def _digit_class(low: int, high: int) -> str:
    return f'"{low}"' if low == high else f"[{low}-{high}]"


def _group(alternatives: list[str]) -> str:
    alternatives = [a for a in alternatives if a]
    if not alternatives:
        return ""
    return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"


def is_finite_bound(value: object) -> bool:
    """Whether ``value`` can be a bound: an int or a finite float (not a bool)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
