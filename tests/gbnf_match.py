"""Whether llama.cpp's own grammar sampler admits a string: no model is evaluated.

A vocabulary-only load of a byte-level model gives one token per byte; the string's
bytes are offered one by one to the grammar sampler (a token it refuses gets -inf), and
at the end an end-of-generation token must be allowed (the grammar is complete).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np


class Matcher:
    """Membership of strings in GBNF grammars, by llama.cpp's grammar sampler."""

    def __init__(self, model_path: Path) -> None:
        import llama_cpp

        self._lc = llama_cpp
        self._llama = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
        self._vocab = llama_cpp.llama_model_get_vocab(self._llama.model)
        self._byte_token: dict[int, int] = {}
        buf = ctypes.create_string_buffer(64)
        for token in range(self._llama.n_vocab()):
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
            if n == 1 and buf.raw[0] not in self._byte_token:
                self._byte_token[buf.raw[0]] = token
        assert len(self._byte_token) == 256, "the model's vocabulary lacks some byte tokens"
        self._eog = int(llama_cpp.llama_vocab_eos(self._vocab))
        self._samplers: dict[str, Any] = {}

    def _sampler(self, grammar: str) -> Any:
        if grammar not in self._samplers:
            sampler = self._lc.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
            assert sampler, f"llama.cpp refused the grammar:\n{grammar}"
            self._samplers[grammar] = sampler
        sampler = self._samplers[grammar]
        self._lc.llama_sampler_reset(sampler)
        return sampler

    def _allowed(self, sampler: Any, token: int) -> bool:
        one = (self._lc.llama_token_data * 1)(self._lc.llama_token_data(token, 0.0, 0.0))
        single = self._lc.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
        self._lc.llama_sampler_apply(sampler, ctypes.byref(single))
        return bool(one[0].logit != -np.inf)

    def admits(self, grammar: str, text: str) -> bool:
        """Whether ``grammar`` (root rule ``root``) generates exactly ``text``."""
        sampler = self._sampler(grammar)
        for byte in text.encode("utf-8"):
            token = self._byte_token[byte]
            if not self._allowed(sampler, token):
                return False
            self._lc.llama_sampler_accept(sampler, token)
        return self._allowed(sampler, self._eog)

    def close(self) -> None:
        for sampler in self._samplers.values():
            self._lc.llama_sampler_free(sampler)
        self._samplers.clear()
        self._llama.close()
