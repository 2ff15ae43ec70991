"""String formats (gguf_mcv.output.formats): what the grammar writes (through llama.cpp's grammar
sampler, no model evaluated) and what validation accepts agree."""

from __future__ import annotations

import datetime
import json
import uuid

import pytest
from gbnf_match import Matcher
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_mcv.output import formats, structured

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def matcher(byte_vocab):
    m = Matcher(byte_vocab.f16)
    yield m
    m.close()


def grammar(kind: str) -> str:
    return structured.constraint({"type": "string", "format": kind}).grammar


def written(matcher: Matcher, kind: str, text: str) -> bool:
    return matcher.admits(grammar(kind), json.dumps(text))


def valid(kind: str, text: str) -> bool:
    try:
        structured.validate(text, {"type": "string", "format": kind})
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("kind, good, bad", [
    ("date", ["2024-02-29", "0001-01-01", "9999-12-31", "2023-04-30"],
     ["7909-06-31", "2023-02-30", "2023-13-01", "2023-00-10", "0000-01-01", "2023-1-01", "20230101"]),
    ("time", ["23:59:59Z", "00:00:00+05:30", "12:34:56.789-01:00", "08:00:00.1Z"],
     ["24:00:00Z", "12:60:00Z", "12:00:00", "12:00Z", "12:00:00+24:00"]),
    ("date-time", ["2024-02-29T23:59:59Z", "1999-12-31T00:00:00.000001+01:00"],
     ["2024-02-30T00:00:00Z", "2024-02-29 23:59:59Z", "2024-02-29T25:00:00Z"]),
    ("uuid", ["123e4567-e89b-12d3-a456-426614174000", "ABCDEF01-2345-6789-ABCD-EF0123456789"],
     ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g",
      "{123e4567-e89b-12d3-a456-426614174000}"]),
    ("ipv4", ["0.0.0.0", "255.255.255.255", "192.168.1.10"],
     ["256.1.1.1", "1.2.3", "01.2.3.4", "1.2.3.4.5", "1.2.3.-4"]),
    ("email", ["a@b.co", "first.last+tag@mail.example.org"], ["a@b", "@b.co", "a b@c.de", "a@@b.co"]),
])
def test_each_format_is_written_and_checked(matcher, kind, good, bad) -> None:
    for text in good:
        assert written(matcher, kind, text) and valid(kind, text), text
    for text in bad:
        assert not written(matcher, kind, text), text
        assert not valid(kind, text), text


def test_february_29_of_a_common_year_is_refused_by_validation_only(matcher) -> None:
    # documented: the grammar knows each month's length, the calendar is left to validation
    assert written(matcher, "date", "2023-02-29") and not valid("date", "2023-02-29")


@PROPERTY
@given(day=st.dates(min_value=datetime.date(1, 1, 1)))
def test_every_real_date_is_written_and_valid(matcher, day) -> None:
    text = day.isoformat()
    assert written(matcher, "date", text) and valid("date", text)


@PROPERTY
@given(text=st.from_regex(r"\A[0-9]{4}-[0-9]{2}-[0-9]{2}\Z"))
def test_a_date_the_grammar_writes_is_valid_unless_it_is_a_leap_day(matcher, text) -> None:
    if written(matcher, "date", text):
        assert valid("date", text) or text.endswith("-02-29"), text
    if valid("date", text):
        assert written(matcher, "date", text), text


@PROPERTY
@given(moment=st.datetimes(timezones=st.timezones()), digits=st.integers(0, 6))
def test_every_real_date_time_is_written_and_valid(matcher, moment, digits) -> None:
    moment = moment.replace(microsecond=moment.microsecond // 10 ** (6 - digits) * 10 ** (6 - digits))
    offset = moment.utcoffset()
    if offset is not None and offset.seconds % 60:  # RFC 3339 offsets are whole minutes
        return
    text = moment.isoformat(timespec="microseconds" if digits else "seconds")
    if moment.tzinfo is None:
        text += "Z"
    text = text.replace("+00:00", "Z") if digits % 2 else text
    assert written(matcher, "date-time", text) and valid("date-time", text), text


@PROPERTY
@given(address=st.ip_addresses(v=4), value=st.uuids())
def test_every_ipv4_and_uuid_is_written_and_valid(matcher, address, value: uuid.UUID) -> None:
    assert written(matcher, "ipv4", str(address)) and valid("ipv4", str(address))
    assert written(matcher, "uuid", str(value)) and valid("uuid", str(value))


def test_formats_apply_to_strings_only() -> None:
    structured.validate(5, {"format": "date"})
    with pytest.raises(ValueError, match="date"):
        structured.validate({"d": "7909-06-31"}, {"type": "object", "properties": {"d": {"format": "date"}}})
    assert set(formats.CHECKS) == set(formats.GRAMMARS)
