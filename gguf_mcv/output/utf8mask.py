"""Which tokens keep constrained text valid UTF-8: a per-vocabulary table for the sampler.

llama.cpp's grammar decodes UTF-8 loosely: it does not check continuation bytes, takes
0xC0/0xC1 and 0xF5-0xFF as lead bytes, and lets overlong forms and surrogates through.
Under a grammar the engine therefore tracks where the text stands in the UTF-8 automaton
(:data:`ACCEPT`, or a character begun) and samples only tokens whose bytes continue it
validly. The table holds, for every token and every state, the state after the token's
bytes (:data:`REJECT` where they break UTF-8); it is computed once per vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: Between characters; the states 1-7 are inside one; REJECT absorbs.
ACCEPT, REJECT = 0, 8
N_STATES = 8  # the states a token may start from (REJECT is never one)


def transitions() -> np.ndarray:
    """The strict UTF-8 automaton (RFC 3629): ``[state, byte] -> state``."""
    t = np.full((N_STATES + 1, 256), REJECT, dtype=np.uint8)
    t[ACCEPT, 0x00:0x80] = ACCEPT
    t[ACCEPT, 0xC2:0xE0] = 1  # one continuation byte to come
    t[ACCEPT, 0xE0] = 3  # then A0-BF (no overlong form)
    t[ACCEPT, 0xE1:0xED] = 2
    t[ACCEPT, 0xED] = 4  # then 80-9F (no surrogate)
    t[ACCEPT, 0xEE:0xF0] = 2
    t[ACCEPT, 0xF0] = 6  # then 90-BF (no overlong form)
    t[ACCEPT, 0xF1:0xF4] = 5
    t[ACCEPT, 0xF4] = 7  # then 80-8F (nothing past U+10FFFF)
    t[1, 0x80:0xC0] = ACCEPT
    t[2, 0x80:0xC0] = 1
    t[3, 0xA0:0xC0] = 1
    t[4, 0x80:0xA0] = 1
    t[5, 0x80:0xC0] = 2
    t[6, 0x90:0xC0] = 2
    t[7, 0x80:0x90] = 2
    return t


def token_table(answer_bytes: Sequence[bytes], grammar_pieces: Sequence[bytes], eog: np.ndarray) -> np.ndarray:
    """``[token, state] -> state`` after the token (uint8, :data:`REJECT` where it breaks UTF-8).

    ``answer_bytes`` are what each token adds to the answer, ``grammar_pieces`` what the
    grammar reads for it: a token whose two differ (a control token reads as ``<unk>`` but
    adds nothing) or that adds nothing is refused too, else the grammar counts text the
    answer does not hold. End-of-generation tokens (``eog``, a bool per token) are allowed
    between characters only.
    """
    n = len(answer_bytes)
    width = max((len(b) for b in answer_bytes), default=0) or 1
    data = np.zeros((n, width), dtype=np.uint8)
    lengths = np.zeros(n, dtype=np.int64)
    for i, b in enumerate(answer_bytes):
        data[i, :len(b)] = np.frombuffer(b, dtype=np.uint8)
        lengths[i] = len(b)
    t = transitions()
    state = np.tile(np.arange(N_STATES, dtype=np.uint8), (n, 1))
    for j in range(width):
        going = (j < lengths)[:, None]
        state = np.where(going, t[state, data[:, j:j + 1]], state)
    differs = np.array([a != g or not a for a, g in zip(answer_bytes, grammar_pieces, strict=True)], dtype=bool)
    state[differs] = REJECT
    state[eog] = REJECT
    state[eog, ACCEPT] = ACCEPT
    return state
