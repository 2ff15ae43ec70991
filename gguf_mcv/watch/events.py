"""Events from a watch: one value of each answer that changes and holds.

The value is the answer itself (``on="answer"``: its text, whitespace collapsed) or one field of
the answer parsed under ``schema=`` (``on="present"``, ``on="door.open"`` for a nested object).
A new value becomes the watch's value once it has been seen ``hold`` ticks in a row (a value
that flickers for fewer ticks changes nothing), and no sooner than ``cooldown_s`` seconds after
the previous event (a value that flaps fires once per cooldown, once it holds after it). The
first value read is the starting point at once, without waiting for ``hold``.

Each accepted change is one :class:`Event`, of a kind that says which way it went:

- ``started``: from nothing to something (a true value, a number other than 0, a non-empty text
  other than a plain no: "no", "false", "none", "0");
- ``ended``: from something to nothing;
- ``changed``: from one something to another.

The first value a watch sees is its starting point: something there is a ``started`` event, and
nothing there no event. A parsed answer without the field, or that did not parse, changes
nothing and says why (:attr:`EventDetector.warning`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..options import check_int
from ..reply import parsed_as_json

if TYPE_CHECKING:
    from .observe import Observation

#: The kinds of event, in the order a thing comes and goes.
EVENT_KINDS = ("started", "changed", "ended")
#: ``on`` value naming the answer's own text.
ANSWER = "answer"
#: Most ticks ``hold`` may ask for.
MAX_HOLD = 10_000
#: Longest ``cooldown_s`` accepted (a day).
MAX_COOLDOWN_S = 86_400.0
#: Most parts a field path may have (``a.b.c``).
MAX_FIELD_DEPTH = 16
#: Answers that mean "nothing" when the value is the answer's text (compared without case, end
#: punctuation or surrounding space).
NOTHING_WORDS = frozenset({"", "no", "false", "none", "0", "nothing", "n"})

_FIELD_PART = re.compile(r"[^.\s][^.]*")


@dataclass(frozen=True)
class EventRule:
    """What makes an event: the value followed (``on``), the ticks it must hold, the cooldown."""

    on: str = ANSWER
    hold: int = 1
    cooldown_s: float = 0.0

    @property
    def field(self) -> tuple[str, ...] | None:
        """The path of the parsed field followed, or None for the answer's text."""
        return None if self.on == ANSWER else tuple(self.on.split("."))


def check_event_rule(on: Any, hold: Any = 1, cooldown_s: Any = 0.0, *, structured: bool = False) -> EventRule:
    """The rule checked: ``on`` is ``"answer"`` or a field path (which needs ``schema=``: the
    parsed answer); ``hold`` a number of ticks from 1 to :data:`MAX_HOLD`; ``cooldown_s`` seconds
    from 0 to :data:`MAX_COOLDOWN_S`."""
    if not isinstance(on, str):
        raise ConfigError(f"event_on must be 'answer' or the name of a field of the parsed answer, not "
                          f"{type(on).__name__} {on!r}.")
    if on != ANSWER:
        parts = on.split(".")
        if len(parts) > MAX_FIELD_DEPTH or not all(_FIELD_PART.fullmatch(p) for p in parts):
            raise ConfigError(f"event_on={on[:80]!r} is not a field path: give a field name, or names joined "
                              f"by '.' for a nested field (at most {MAX_FIELD_DEPTH}), e.g. 'present' or "
                              "'door.open'.")
        if not structured:
            raise ConfigError(f"event_on={on!r} names a field of the parsed answer: give schema= too (or "
                              "event_on='answer' to follow the answer's text).")
    hold = check_int("hold", hold, low=1, high=MAX_HOLD)
    if isinstance(cooldown_s, bool) or not isinstance(cooldown_s, (int, float)):
        raise ConfigError(f"cooldown_s must be a number of seconds, not {type(cooldown_s).__name__} {cooldown_s!r}.")
    if isinstance(cooldown_s, int) and not 0 <= cooldown_s <= MAX_COOLDOWN_S:
        raise ConfigError(f"cooldown_s must be between 0 and {MAX_COOLDOWN_S:g} seconds.")
    cooldown = float(cooldown_s)
    if not (math.isfinite(cooldown) and 0 <= cooldown <= MAX_COOLDOWN_S):
        raise ConfigError(f"cooldown_s must be between 0 and {MAX_COOLDOWN_S:g} seconds, not {cooldown_s!r}.")
    return EventRule(on, hold, cooldown)


def check_events(on: Any, hold: Any = 1, cooldown_s: Any = 0.0, *, structured: bool = False,
                 shaping: Mapping[str, bool] | None = None, on_name: str = "event_on") -> EventRule | None:
    """The rule of a watch's events (:func:`check_event_rule`), or None without ``on``: then a
    setting that only acts on events (``shaping``: its name, whether it is set) is refused."""
    if on is None:
        given = [name for name, is_set in (shaping or {}).items() if is_set]
        if given:
            raise ConfigError(f"{', '.join(given)} act on events: give {on_name} too ('answer', or a field of "
                              "the parsed answer).")
        return None
    return check_event_rule(on, hold, cooldown_s, structured=structured)


@dataclass(frozen=True)
class Event:
    """One accepted change of the followed value.

    ``snapshot`` is the path of the frame (or the zone) written when it fired, None without a
    snapshot folder; ``warning`` says why a snapshot was not written.
    """

    kind: str  #: "started", "changed" or "ended"
    before: Any  #: the value before (None at a watch's first value)
    after: Any  #: the value now
    observation: Observation
    on: str = ANSWER
    zone: str | None = None
    snapshot: str | None = None
    warning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The event as JSON data (what the sinks send)."""
        seen = self.observation
        return {"event": self.kind, "on": self.on, "before": _json_value(self.before), "after": _json_value(self.after),
                "zone": self.zone, "time": round(seen.time, 3), "frame": seen.frame_index,
                "answer": str(seen.answer), "parsed": parsed_as_json(seen.parsed), "snapshot": self.snapshot,
                "warning": self.warning}


class EventDetector:
    """Turns a watch's observations into events under one :class:`EventRule`."""

    def __init__(self, rule: EventRule) -> None:
        self.rule = rule
        self._current: Any = _NONE  # the accepted value (its comparison key)
        self._current_value: Any = None
        self._candidate: Any = _NONE
        self._count = 0
        self._last_event: float | None = None
        #: Why the last observation's value could not be read (None when it could).
        self.warning: str | None = None

    def update(self, seen: Observation) -> tuple[str, Any, Any] | None:
        """The change ``seen`` completes, as (kind, before, after), or None."""
        found = self._value(seen)
        if found is _NONE:
            self._candidate, self._count = _NONE, 0  # an unreadable tick breaks a run of holds
            return None
        key = _key(found)
        if key == self._current:
            self._candidate, self._count = _NONE, 0
            return None
        if key == self._candidate:
            self._count += 1
        else:
            self._candidate, self._count = key, 1
        first = self._current is _NONE
        if self._count < self.rule.hold and not first:  # the starting point needs no run
            return None
        if self._last_event is not None and seen.time - self._last_event < self.rule.cooldown_s:
            return None  # still held when the cooldown ends: it fires then
        before = None if first else self._current_value
        self._current, self._current_value = key, found
        self._candidate, self._count = _NONE, 0
        kind = _kind(before, found, first)
        if kind is None:
            return None  # the starting point, with nothing there
        self._last_event = seen.time
        return kind, before, found

    def _value(self, seen: Observation) -> Any:
        field = self.rule.field
        if field is None:
            self.warning = None
            return " ".join(str(seen.answer).split())
        value = parsed_as_json(seen.parsed)  # a pydantic model or dataclass as its fields
        if value is None:
            self.warning = "the answer did not parse under the schema"
            return _NONE
        for depth, part in enumerate(field):
            if not isinstance(value, dict) or part not in value:
                where = ".".join(field[:depth]) or "the parsed answer"
                self.warning = f"{where} has no field {part!r}"
                return _NONE
            value = value[part]
        self.warning = None
        return value


_NONE = object()


def _key(value: Any) -> Any:
    """A comparison key: JSON text for lists and objects, the value itself otherwise (1 and True differ)."""
    if isinstance(value, (dict, list)):
        return ("json", json.dumps(parsed_as_json(value), sort_keys=True))
    return (type(value).__name__ if isinstance(value, bool) else "value", value)


def something(value: Any) -> bool:
    """Whether ``value`` means something is there (see the module's doc)."""
    if value is None or value is False:
        return False
    if isinstance(value, str):
        return value.strip().strip(".!").strip().lower() not in NOTHING_WORDS
    if isinstance(value, (int, float)):
        return value != 0
    if isinstance(value, (list, dict)):
        return len(value) > 0
    return True


def _kind(before: Any, after: Any, first: bool) -> str | None:
    was, now = (False if first else something(before)), something(after)
    if not was:
        return "started" if now else None
    return "changed" if now else "ended"


def _json_value(value: Any) -> Any:
    return parsed_as_json(value) if isinstance(value, (dict, list)) else value
