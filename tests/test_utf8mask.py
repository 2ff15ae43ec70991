"""The UTF-8 table the engine samples with under a grammar, against Python's strict decoder."""

from __future__ import annotations

import numpy as np

from gguf_mcv.output import utf8mask


def _valid(data: bytes) -> bool:
    try:
        data.decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        return False
    return True


def _complete_prefix(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8 or a valid start of it (some bytes could complete it)."""
    return any(_valid(data + tail) for tail in (b"", b"\x80", b"\x80\x80", b"\x80\x80\x80", b"\xa0\x80",
                                                 b"\x90\x80\x80", b"\xbf", b"\xbf\xbf", b"\x8f\x80\x80"))


def test_the_automaton_accepts_exactly_valid_utf8() -> None:
    rng = np.random.default_rng(0)
    t = utf8mask.transitions()
    samples = [rng.integers(0, 256, rng.integers(1, 7)).astype(np.uint8).tobytes() for _ in range(20000)]
    samples += ["é€𝄞".encode(), b"\xed\xa0\x80", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xf4\x90\x80\x80", b"\xf5"]
    for data in samples:
        state = utf8mask.ACCEPT
        for byte in data:
            state = t[state, byte]
        assert (state == utf8mask.ACCEPT) == _valid(data), data
        assert (state != utf8mask.REJECT) == _complete_prefix(data), data


def test_the_token_table_follows_tokens_across_states() -> None:
    tokens = [b"a", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac!", b"\xff", b"\xc1\x81", b"\xed\xa0", b"", b"<ctl>"]
    grammar = list(tokens)
    grammar[-1] = b"<|end|>"  # a control token the grammar reads as text the answer lacks
    eog = np.zeros(len(tokens), dtype=bool)
    eog[-2] = True
    table = utf8mask.token_table(tokens, grammar, eog)
    assert table.shape == (len(tokens), utf8mask.N_STATES)
    a, lead, tail, euro_head, euro_tail, ff, overlong, surrogate, end, control = range(len(tokens))
    start = utf8mask.ACCEPT
    assert table[a, start] == start and table[ff, start] == utf8mask.REJECT
    assert table[overlong, start] == table[surrogate, start] == utf8mask.REJECT
    after_lead = table[lead, start]
    assert after_lead not in (start, utf8mask.REJECT)
    assert table[tail, after_lead] == start and table[tail, start] == utf8mask.REJECT
    assert table[a, after_lead] == utf8mask.REJECT  # a character left unfinished
    assert table[euro_tail, table[euro_head, start]] == start
    assert table[end, start] == start and table[end, after_lead] == utf8mask.REJECT
    assert (table[control] == utf8mask.REJECT).all()
