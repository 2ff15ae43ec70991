"""A schema's ``pattern``: checked, turned into GBNF for a JSON string, and matched in linear time.

The regular expression is read by Python's own parser (``re._parser``), so what Python
accepts is read the way Python reads it (a stray ``]`` or ``}`` is a literal). Each
character the pattern admits is generated as JSON spells it inside a string: ``"`` and
``\\`` escaped, control characters as escapes, ``.`` and negated classes never a raw
``"``, ``\\`` or control character, and never a surrogate. Features a grammar cannot
express (lookaround, backreferences, ``\\b``, anchors inside the pattern, flags) are
refused with :class:`ConfigError`.

Answers are matched with pydantic-core's Rust regex engine (linear time, no
backtracking): a hostile pattern cannot hold the interpreter for hours.
"""

from __future__ import annotations

import importlib
import re
from functools import lru_cache
from typing import Any

from ..errors import ConfigError

try:  # Python's own regular-expression reader (private modules; public in 3.10)
    C: Any = importlib.import_module("re._constants")
    sre_parse: Any = importlib.import_module("re._parser")
except ImportError:  # Python 3.10
    C = importlib.import_module("sre_constants")
    sre_parse = importlib.import_module("sre_parse")

#: Repetitions a pattern may spell out in all (``{n}`` nested multiplies): llama.cpp expands them.
MAX_REPEATS = 10_000
#: A pattern longer than this is not a field's format.
MAX_PATTERN_CHARS = 4096
MAX_CODEPOINT = 0x10FFFF
#: What may stand raw in a JSON string the grammar writes: no ", \, control character or DEL,
#: and only Unicode scalar values (no surrogates).
_RAW_EXCLUDED = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F), (0xD800, 0xDFFF))
_SHORT_ESCAPES = {0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t", 0x22: '"', 0x5C: "\\"}
_CATEGORIES: dict[Any, list[tuple[int, int]]] = {
    C.CATEGORY_DIGIT: [(0x30, 0x39)],
    C.CATEGORY_WORD: [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    C.CATEGORY_SPACE: [(0x09, 0x0D), (0x20, 0x20)],
}
_NOT_CATEGORIES = {C.CATEGORY_NOT_DIGIT: C.CATEGORY_DIGIT, C.CATEGORY_NOT_WORD: C.CATEGORY_WORD,
                   C.CATEGORY_NOT_SPACE: C.CATEGORY_SPACE}
_ALLOWED_FLAGS = C.SRE_FLAG_UNICODE | C.SRE_FLAG_VERBOSE
#: An escaped character of a JSON string, as llama.cpp's converter admits them, less "\\uD800"
#: to "\\uDFFF" (half a surrogate pair is no character).
JSON_ESCAPE = '[\\\\] (["\\\\/bfnrt] | "u" ([0-9a-cA-Ce-fE-F] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2}))'


def check(pattern: Any, path: str) -> None:
    """Raise :class:`ConfigError` (naming ``path``) unless ``pattern`` can become a grammar."""
    to_gbnf(pattern, path)
    _matcher(pattern)


def to_gbnf(pattern: Any, path: str = "$") -> str:
    """GBNF for the characters of a JSON string (between its quotes) that ``pattern`` matches."""
    if not isinstance(pattern, str):
        raise ConfigError(f"{path}.pattern must be a string.")
    return _to_gbnf(pattern, path)


@lru_cache(maxsize=256)
def _to_gbnf(pattern: str, path: str) -> str:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ConfigError(f"{path}.pattern is longer than {MAX_PATTERN_CHARS} characters.")
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise ConfigError(f"{path}.pattern is not a valid regular expression: {exc}.") from None
    except (RecursionError, OverflowError, ValueError) as exc:
        raise ConfigError(f"{path}.pattern cannot be read: {exc}.") from None
    if parsed.state.flags & ~_ALLOWED_FLAGS:
        raise ConfigError(f"{path}.pattern sets flags ((?i), (?s), (?m)), which the grammar cannot follow: "
                          "spell the alternatives out instead.")
    items = list(parsed)
    head = bool(items) and items[0] in ((C.AT, C.AT_BEGINNING), (C.AT, C.AT_BEGINNING_STRING))
    tail = len(items) > int(head) and items[-1] in ((C.AT, C.AT_END), (C.AT, C.AT_END_STRING))
    body = items[int(head):len(items) - int(tail)]
    writer = _Writer(path)
    parts = [writer.sequence(body, 1)]
    # an unanchored pattern matches anywhere: any JSON characters may stand before or after it
    any_chars = f"({_chars([(0, MAX_CODEPOINT)], escapes=False)} | {JSON_ESCAPE})*"
    return " ".join(([] if head else [any_chars]) + parts + ([] if tail else [any_chars])) or '""'


class _Writer:
    def __init__(self, path: str) -> None:
        self.path = path
        self.repeats = 0

    def refuse(self, what: str) -> ConfigError:
        return ConfigError(f"{self.path}.pattern uses {what}, which the grammar cannot enforce: "
                           "rewrite the pattern without it (anchors only at its start and end).")

    def sequence(self, items: Any, times: int) -> str:
        out: list[str] = []
        for op, arg in items:
            out.append(self.item(op, arg, times))
        return " ".join(x for x in out if x)

    def item(self, op: Any, arg: Any, times: int) -> str:
        if op is C.LITERAL:
            return _chars([(arg, arg)])
        if op is C.NOT_LITERAL:
            return _chars(_complement([(arg, arg)]))
        if op is C.ANY:
            return _chars(_complement([(0x0A, 0x0A), (0x0D, 0x0D)]))
        if op is C.IN:
            return _chars(_class_ranges(arg, self))
        if op is C.BRANCH:
            return "(" + " | ".join(self.sequence(seq, times) or '""' for seq in arg[1]) + ")"
        if op is C.SUBPATTERN:
            group, add_flags, del_flags, seq = arg
            if add_flags & ~_ALLOWED_FLAGS or del_flags & ~_ALLOWED_FLAGS:
                raise self.refuse("inline flags")
            return "(" + (self.sequence(seq, times) or '""') + ")"
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):
            low, high, seq = arg
            count = low if high == C.MAXREPEAT else high
            self.repeats += times * max(count, 1)
            if self.repeats > MAX_REPEATS:
                raise ConfigError(f"{self.path}.pattern repeats parts {self.repeats} times or more in all (at "
                                  f"most {MAX_REPEATS}): use smaller {{m,n}} counts.")
            inner = self.sequence(seq, times * max(count, 1)) or '""'
            bound = f"{{{low},}}" if high == C.MAXREPEAT else f"{{{low},{high}}}"
            return f"({inner}){bound}"
        names = {C.AT: "an anchor or \\b inside the pattern", C.GROUPREF: "a backreference",
                 C.GROUPREF_EXISTS: "a conditional group", C.ASSERT: "a lookahead or lookbehind",
                 C.ASSERT_NOT: "a lookahead or lookbehind"}
        raise self.refuse(names.get(op, str(op).lower()))


def _class_ranges(items: Any, writer: _Writer) -> list[tuple[int, int]]:
    negate = bool(items) and items[0][0] is C.NEGATE
    ranges: list[tuple[int, int]] = []
    for op, arg in items[int(negate):]:
        if op is C.LITERAL:
            ranges.append((arg, arg))
        elif op is C.RANGE:
            ranges.append(arg)
        elif op is C.CATEGORY and arg in _CATEGORIES:
            ranges += _CATEGORIES[arg]
        elif op is C.CATEGORY and arg in _NOT_CATEGORIES:
            ranges += _complement(_CATEGORIES[_NOT_CATEGORIES[arg]])
        else:
            raise writer.refuse(f"{arg} in a character class")
    return _complement(ranges) if negate else _normal(ranges)


def _normal(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return merged


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for low, high in _normal(ranges):
        if low > start:
            out.append((start, low - 1))
        start = max(start, high + 1)
    return out + ([(start, MAX_CODEPOINT)] if start <= MAX_CODEPOINT else [])


def _chars(ranges: list[tuple[int, int]], escapes: bool = True) -> str:
    """GBNF for one character in ``ranges`` as JSON writes it: raw where it may, else escaped.

    Sets with many characters that need escapes (``.``, ``[^a]``) keep only their raw
    characters: a stricter grammar, still within the pattern, and not 30 alternatives.
    """
    raw = _normal([r for r in (_intersect(rng, ok) for rng in ranges for ok in _complement(list(_RAW_EXCLUDED)))
                   if r is not None])
    escaped = [cp for low, high in ranges for cp in range(low, min(high, 0x7F) + 1) if _needs_escape(cp)]
    if raw and (not escapes or len(escaped) > 8):
        escaped = []
    options = ([_class(raw)] if raw else []) + [_literal(_escape(cp)) for cp in escaped]
    if not options:
        raise ConfigError("The pattern admits no character a JSON string can hold here.")
    return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"


def _intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    low, high = max(a[0], b[0]), min(a[1], b[1])
    return (low, high) if low <= high else None


def _needs_escape(cp: int) -> bool:
    return cp < 0x20 or cp in (0x22, 0x5C, 0x7F)


def _escape(cp: int) -> str:
    return "\\" + _SHORT_ESCAPES[cp] if cp in _SHORT_ESCAPES else f"\\u{cp:04x}"




def _class(ranges: list[tuple[int, int]]) -> str:
    def one(cp: int) -> str:
        if chr(cp).isalnum() and cp < 0x80:
            return chr(cp)
        return f"\\x{cp:02X}" if cp < 0x100 else f"\\u{cp:04X}" if cp < 0x10000 else f"\\U{cp:08X}"
    return "[" + "".join(one(a) if a == b else f"{one(a)}-{one(b)}" for a, b in ranges) + "]"


def _literal(text: str) -> str:
    return '"' + "".join(f"\\x{ord(c):02X}" if not c.isalnum() else c for c in text) + '"'


# -- matching ---------------------------------------------------------------------


def matches(pattern: str, value: str) -> bool:
    """Whether ``pattern`` is found in ``value`` (JSON Schema's search semantics), in linear time."""
    return _matcher(pattern)(value)


@lru_cache(maxsize=256)
def _matcher(pattern: str) -> Any:
    from pydantic_core import SchemaError, SchemaValidator, ValidationError, core_schema

    try:
        validator = SchemaValidator(core_schema.str_schema(pattern=pattern))
    except SchemaError as exc:
        raise ConfigError(f"The pattern {pattern!r:.80} uses a feature answers cannot be checked with "
                          f"(lookaround, backreferences): {str(exc).splitlines()[-1]}"[:400]) from None

    def match(value: str) -> bool:
        try:
            validator.validate_python(value)
        except ValidationError:
            return False
        return True

    return match
