"""Token bytes become safe text pieces: UTF-8 boundaries, stop strings, reasoning blocks."""

from __future__ import annotations

from gguf_mcv.runtime.textstream import ReasoningFilter, TextAssembler


def feed_all(assembler: TextAssembler, chunks: list[bytes]) -> str:
    return "".join(assembler.feed(c) for c in chunks) + assembler.finish()


def test_multibyte_characters_split_across_tokens() -> None:
    data = "héllo 🙂".encode()
    assert feed_all(TextAssembler(), [data[i:i + 1] for i in range(len(data))]) == "héllo 🙂"


def test_stop_string_across_tokens_is_cut_and_never_shown() -> None:
    a = TextAssembler(stop=["END"])
    shown = [a.feed(b"abc E"), a.feed(b"N"), a.feed(b"D more")]
    assert "".join(shown) == "abc " and a.stopped and a.text == "abc "


def test_text_that_only_looks_like_a_stop_is_released() -> None:
    a = TextAssembler(stop=["STOP"])
    assert a.feed(b"ST") == ""
    assert a.feed(b"ART") == "START"
    assert a.finish() == ""


def test_reasoning_filter_separates_a_think_block() -> None:
    f = ReasoningFilter(active=True)
    out = "".join(f.feed(p) for p in ["<th", "ink>let me ", "see</th", "ink>\n\nA cat."]) + f.finish()
    assert out == "A cat." and f.reasoning == "let me see"


def test_reasoning_filter_passes_answers_without_thinking() -> None:
    f = ReasoningFilter(active=True)
    assert f.feed("A") + f.feed(" dog") + f.finish() == "A dog" and f.reasoning == ""


def test_reasoning_filter_when_the_prompt_opened_the_block() -> None:
    f = ReasoningFilter(active=True, inside=True)
    assert f.feed("hmm…") == "" and f.feed("</think>Yes") == "Yes"
    assert f.reasoning == "hmm…"


def test_unclosed_reasoning_is_kept_as_reasoning() -> None:
    f = ReasoningFilter(active=True)
    assert f.feed("<think>still going") + f.finish() == ""
    assert f.reasoning == "still going"


def test_inactive_filter_changes_nothing() -> None:
    f = ReasoningFilter(active=False)
    assert f.feed("<think>x</think>y") == "<think>x</think>y"
