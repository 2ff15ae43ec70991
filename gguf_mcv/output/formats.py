"""String ``format``\\ s: the GBNF that writes each one, and the check that validates an answer.

The grammar and the check are made together so that they promise the same thing:
``date`` (``YYYY-MM-DD``, months 01-12, days up to the month's length; February 29 in a
year that is not a leap year is refused by the check only), ``time`` and ``date-time``
(RFC 3339: ``HH:MM:SS``, optional fraction, ``Z`` or an offset), ``uuid`` (8-4-4-4-12 hex
digits), ``ipv4`` (four 0-255 parts without leading zeros) and ``email`` (a dotted local
part, ``@``, a domain of dotted labels). Other formats are neither written nor checked.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import uuid
from typing import Any, Callable

_YEAR = '([1-9] [0-9]{3} | "0" ([1-9] [0-9]{2} | "0" ([1-9] [0-9] | "0" [1-9])))'
_MONTH_DAY = ('("02-" ("0" [1-9] | [12] [0-9]) | ("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30") '
              '| ("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]))')
_DATE = f'{_YEAR} "-" {_MONTH_DAY}'
_TIME = ('([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{1,9})? '
         '("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])')
_HEX = "[0-9a-fA-F]"
_OCTET = '("25" [0-5] | "2" [0-4] [0-9] | "1" [0-9]{2} | [1-9] [0-9] | [0-9])'
_ATOM = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,32}"
_LABEL = "[A-Za-z0-9] ([A-Za-z0-9-]{0,30} [A-Za-z0-9])?"

#: The characters between the quotes of each format's string, as GBNF.
GRAMMARS: dict[str, str] = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f'{_DATE} "T" {_TIME}',
    "uuid": ' "-" '.join(f"{_HEX}{{{n}}}" for n in (8, 4, 4, 4, 12)),
    "ipv4": ' "." '.join([_OCTET] * 4),
    "email": f'{_ATOM} ("." {_ATOM}){{0,3}} "@" {_LABEL} ("." {_LABEL}){{1,3}}',
}

_TIME_RE = re.compile(r"([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]{1,9})?(Z|z|[+-][0-9]{2}:[0-9]{2})")
_DATE_RE = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})")
_EMAIL_RE = re.compile(r"[^@\s\"]+@[^@\s\"]+\.[^@\s\"]+")
_UUID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def _is_date(text: str) -> bool:
    match = _DATE_RE.fullmatch(text)
    if match is None:
        return False
    try:
        datetime.date(*map(int, match.groups()))
    except ValueError:
        return False
    return True


def _is_time(text: str) -> bool:
    match = _TIME_RE.fullmatch(text)
    if match is None:
        return False
    hour, minute, second = map(int, match.groups()[:3])
    zone = match.group(5)
    if zone not in ("Z", "z") and (int(zone[1:3]) > 23 or int(zone[4:]) > 59):
        return False
    return hour <= 23 and minute <= 59 and second <= 60  # RFC 3339 allows a leap second


def _is_date_time(text: str) -> bool:
    date, sep, time = text[:10], text[10:11], text[11:]
    return sep in ("T", "t") and _is_date(date) and _is_time(time)


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def _is_uuid(text: str) -> bool:
    if _UUID_RE.fullmatch(text) is None:
        return False
    uuid.UUID(text)
    return True


def _is_email(text: str) -> bool:
    return _EMAIL_RE.fullmatch(text) is not None


#: The check of each format in :data:`GRAMMARS`: whether a string is one.
CHECKS: dict[str, Callable[[str], bool]] = {
    "date": _is_date, "time": _is_time, "date-time": _is_date_time, "uuid": _is_uuid,
    "ipv4": _is_ipv4, "email": _is_email,
}


def format_checker() -> Any:
    """A ``jsonschema.FormatChecker`` that checks exactly the formats of :data:`CHECKS`."""
    import jsonschema  # lazy: only answers under a schema need it

    checker = jsonschema.FormatChecker(formats=())
    for name, check in CHECKS.items():
        checker.checks(name)(_strings_only(check))
    return checker


def _strings_only(check: Callable[[str], bool]) -> Callable[[Any], bool]:
    """A format applies to strings; any other value passes it (JSON Schema's rule)."""
    return lambda value: not isinstance(value, str) or check(value)
