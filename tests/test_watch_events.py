"""gguf_mcv.watch.events: a followed value becomes events when it changes and holds: debounce,
cooldown, field paths, and values that are missing or of another type."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_mcv.errors import ConfigError
from gguf_mcv.watch.events import EventDetector, EventRule, check_event_rule, something
from gguf_mcv.watch.observe import Observation


def seen(i: int, parsed: Any = None, answer: str = "", t: float | None = None) -> Observation:
    return Observation(time=float(i) if t is None else t, frame_index=i, changed=0.0, slices_encoded=0,
                       slices_reused=0, answer=answer,  # type: ignore[arg-type]  (only its text is read)
                       parsed=parsed, asked=True, latency_s=0.0, frames_skipped=0, ticks_skipped=0, reconnects=0)


def run(rule: EventRule, values: list[Any], *, field: str = "present", times: list[float] | None = None) -> list:
    detector = EventDetector(rule)
    out = []
    for i, v in enumerate(values):
        obs = seen(i, {field: v}, t=None if times is None else times[i])
        change = detector.update(obs)
        if change is not None:
            out.append((i, *change))
    return out


def test_a_value_that_comes_and_goes_starts_and_ends_one_event_each() -> None:
    got = run(EventRule("present"), [False, False, True, True, False, False])
    assert got == [(2, "started", False, True), (4, "ended", True, False)]


def test_something_there_at_the_start_is_a_started_event_and_nothing_there_is_none() -> None:
    assert run(EventRule("present"), [True, True]) == [(0, "started", None, True)]
    assert run(EventRule("present"), [False, False]) == []


def test_hold_debounces_a_flicker() -> None:
    values = [False, True, False, True, True, True, False, True, False, False, False]
    assert run(EventRule("present", hold=3), values) == [(5, "started", False, True), (10, "ended", True, False)]


def test_cooldown_keeps_a_flapping_value_from_firing_again_too_soon() -> None:
    values = [True, False, True, False, True, True, True]
    times = [0.0, 1.0, 2.0, 3.0, 12.0, 13.0, 14.0]
    got = run(EventRule("present", cooldown_s=10.0), values, times=times)
    # flapping within 10 s of the first event changes nothing; the value there after it is reported
    assert got == [(0, "started", None, True)]
    got = run(EventRule("present", cooldown_s=10.0), [True, False, False, False], times=[0.0, 1.0, 5.0, 11.0])
    assert got == [(0, "started", None, True), (3, "ended", True, False)]


def test_a_value_changing_between_somethings_is_a_changed_event() -> None:
    got = run(EventRule("count"), [0, 2, 3, 3, 0], field="count")
    assert got == [(1, "started", 0, 2), (2, "changed", 2, 3), (4, "ended", 3, 0)]


def test_one_and_true_are_different_values_and_lists_compare_by_content() -> None:
    assert [k for _, k, *_ in run(EventRule("v"), [1, True, 1], field="v")] == ["started", "changed", "changed"]
    assert run(EventRule("v"), [["a"], ["a"], []], field="v") == [(0, "started", None, ["a"]), (2, "ended", ["a"], [])]


def test_a_nested_field_is_followed_by_its_path() -> None:
    detector = EventDetector(check_event_rule("door.open", structured=True))
    assert detector.update(seen(0, {"door": {"open": True}})) == ("started", None, True)
    assert detector.update(seen(1, {"door": {"open": False}})) == ("ended", True, False)


@pytest.mark.parametrize("parsed, why", [
    (None, "did not parse"),
    ({}, "has no field 'present'"),
    ({"present": {"nested": 1}, "other": 1}, None),  # a value of another type is a value
    ([1, 2], "has no field"),
    ("text", "has no field"),
])
def test_a_missing_or_mistyped_value_changes_nothing_and_says_why(parsed: Any, why: str | None) -> None:
    detector = EventDetector(EventRule("present"))
    detector.update(seen(0, {"present": False}))
    change = detector.update(seen(1, parsed))
    if why is None:
        assert change is not None and change[0] == "started"
    else:
        assert change is None and why in (detector.warning or "")
        assert detector.update(seen(2, {"present": False})) is None  # the value from before still holds


def test_an_unreadable_tick_breaks_a_run_of_holds() -> None:
    detector = EventDetector(EventRule("present", hold=2))
    detector.update(seen(0, {"present": False}))
    assert detector.update(seen(1, {"present": True})) is None
    assert detector.update(seen(2, {})) is None
    assert detector.update(seen(3, {"present": True})) is None  # one in a row again
    assert detector.update(seen(4, {"present": True})) == ("started", False, True)


def test_the_answers_text_is_followed_and_a_plain_no_means_nothing() -> None:
    detector = EventDetector(EventRule())
    answers = ["No.", "no", "Yes, a cat.", "Yes,  a cat.", "A dog.", "NONE"]
    got = [detector.update(seen(i, answer=a)) for i, a in enumerate(answers)]
    assert [g and g[0] for g in got] == [None, None, "started", None, "changed", "ended"]
    assert not something("  No! ") and something("yes") and not something(0.0) and something(-1)


@pytest.mark.parametrize("on, hold, cooldown, structured, match", [
    ("present", 1, 0, False, "give schema="),
    (3, 1, 0, True, "must be 'answer'"),
    ("a..b", 1, 0, True, "not a field path"),
    (".".join("x" * 17), 1, 0, True, "not a field path"),
    ("answer", 0, 0, False, "hold"),
    ("answer", True, 0, False, "hold"),
    ("answer", 10**9, 0, False, "hold"),
    ("answer", 1, -1, False, "cooldown_s"),
    ("answer", 1, float("nan"), False, "cooldown_s"),
    ("answer", 1, 10**400, False, "cooldown_s"),
    ("answer", 1, "5", False, "cooldown_s"),
])
def test_bad_rules_are_refused(on: Any, hold: Any, cooldown: Any, structured: bool, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_event_rule(on, hold, cooldown, structured=structured)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=40), st.integers(1, 4))
def test_events_alternate_and_each_follows_a_run_of_hold_equal_values(values: list[bool], hold: int) -> None:
    """Whatever the sequence: started and ended alternate, starting with started; each event's
    value was seen ``hold`` ticks in a row ending at its tick, but for the starting point (the
    first value, taken at once); there is an event exactly when something was there at the start
    or held for ``hold`` ticks."""
    got = run(EventRule("present", hold=hold), values)
    kinds = [k for _, k, *_ in got]
    assert kinds == ["started", "ended"] * (len(kinds) // 2) + ["started"] * (len(kinds) % 2)
    for i, _kind, _before, after in got:
        assert i == 0 or (i + 1 >= hold and values[i + 1 - hold:i + 1] == [after] * hold)
    runs_of_true = any(values[j:j + hold] == [True] * hold for j in range(len(values) - hold + 1))
    assert bool(got) == (runs_of_true or values[:1] == [True])
