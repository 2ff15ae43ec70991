"""Schema patterns: what is refused, how big their grammar may grow, and linear-time matching."""

from __future__ import annotations

import time

import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.output import patterns


@pytest.mark.parametrize("pattern, what", [
    ("^(?=a)a$", "lookahead"),
    ("^(a)\\1$", "backreference"),
    ("^a\\b$", "anchor"),
    ("^a|$", "anchor"),
    ("(?i)^a$", "flags"),
    ("^(a{100}){200}$", "repeats"),
    ("(", "not a valid regular expression"),
    (5, "must be a string"),
])
def test_patterns_the_grammar_cannot_follow_are_refused_naming_the_path(pattern, what) -> None:
    with pytest.raises(ConfigError) as err:
        patterns.check(pattern, "$.properties.code")
    assert "$.properties.code.pattern" in str(err.value) and what in str(err.value)


def test_stray_closing_brackets_are_literals() -> None:
    assert '[\\x5D] "\\""' in '[a-z] ' + patterns.to_gbnf("^[a-z]+]$") + ' "\\""'
    assert "[\\x7D]" in patterns.to_gbnf("^a}$")


def test_dot_and_negated_classes_never_write_a_raw_quote_backslash_or_control_character() -> None:
    for pattern in ("^.$", "^[^a]$", "^\\D$", "^[\\W]$"):
        grammar = patterns.to_gbnf(pattern)
        # a single class: from the space on, '"' (0x22), '\\' (0x5C), DEL and surrogates left out
        assert grammar.startswith("[\\x20-\\x21\\x23-") and grammar.count("[") == 1, (pattern, grammar)
        assert "\\x5B\\x5D-" in grammar and "\\x7E\\x80-" in grammar and "\\uD7FF\\uE000" in grammar


def test_special_characters_the_pattern_names_are_written_escaped() -> None:
    grammar = patterns.to_gbnf('^["\\\\\\n]$')
    assert '"\\x5C\\x22"' in grammar and '"\\x5C\\x5C"' in grammar and '"\\x5Cn"' in grammar


def test_matching_is_linear_in_time() -> None:
    start = time.monotonic()
    assert not patterns.matches("^(a+)+$", "a" * 5000 + "!")
    assert patterns.matches("b", "abc") and not patterns.matches("^b", "abc")
    assert time.monotonic() - start < 30  # generous: backtracking over 5000 characters never ends
