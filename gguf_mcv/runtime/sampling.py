"""Picking the next token from a llama.cpp context's logits: sampling chains, GBNF grammars,
and, under a grammar, the mask of tokens that would break UTF-8 (:mod:`gguf_mcv.output.utf8mask`).

The token loop (:func:`gguf_mcv.runtime.token_loop.generate_tokens`) asks a
:class:`TokenSampler` for each token; the sampler holds what is made once per vocabulary.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from .. import llama_log
from ..errors import ConfigError, EngineError
from ..options import Sampling
from ..output import utf8mask

#: how many recent tokens the repeat penalty looks at
PENALTY_LAST_N = 64


class TokenSampler:
    """Samples tokens of ``llama``'s vocabulary from its context's logits."""

    def __init__(self, llama: Any) -> None:
        import llama_cpp  # lazy: loads llama.cpp's native library

        self.llama = llama
        self._lc = llama_cpp
        self._vocab = llama_cpp.llama_model_get_vocab(llama.model)
        self._utf8: np.ndarray | None = None  # utf8mask.token_table of this vocabulary, made once
        self._utf8_refused: np.ndarray | None = None  # [state, token]: the token would break UTF-8
        self._utf8_lock = threading.Lock()

    def check_grammar(self, grammar: str) -> None:
        """Raise :class:`ConfigError` unless llama.cpp parses ``grammar`` (GBNF, root rule
        ``root``); the vocabulary's UTF-8 table is made here the first time."""
        self._lc.llama_sampler_free(self.grammar(grammar))
        self.utf8_table()

    def is_end(self, token: int) -> bool:
        """Whether ``token`` ends a generation (an end-of-generation token of this vocabulary)."""
        return bool(self._lc.llama_vocab_is_eog(self._vocab, token))

    def free(self, sampler: Any) -> None:
        """Free a chain or grammar sampler made here."""
        self._lc.llama_sampler_free(sampler)

    def grammar(self, grammar: str, root: str = "root") -> Any:
        """A llama.cpp grammar sampler for ``grammar`` (GBNF); :class:`ConfigError` if llama.cpp refuses it."""
        llama_log.clear_recent()
        sampler = self._lc.llama_sampler_init_grammar(self._vocab, grammar.encode("utf-8"), root.encode())
        if not sampler:  # llama.cpp logs why and returns NULL
            details = llama_log.recent_errors() or "no details logged"
            raise ConfigError(f"llama.cpp could not use the grammar: {details}."
                              " Check the schema (or GBNF) for rules that refer to themselves first.")
        return sampler

    def sample(self, chain: Any, constrain: Any, index: int = -1, utf8_state: int = utf8mask.ACCEPT) -> int:
        """The next token from ``chain``, within the grammar ``constrain`` when there is one.

        As llama.cpp's own common sampler does: sample as usual, check only that token
        against the grammar, and only if the grammar refuses it run the grammar over the
        whole vocabulary and sample again. Checking every token of a 150k vocabulary
        against the grammar costs more than the model's forward pass; most sampled tokens
        are allowed (a grammar only rules out what the model rarely wants). Under a grammar,
        tokens that would break UTF-8 from ``utf8_state`` are refused the same way (see
        :mod:`gguf_mcv.output.utf8mask`).
        """
        lc = self._lc
        if constrain is None:
            return int(lc.llama_sampler_sample(chain, self.llama.ctx, index))
        refused = cast(np.ndarray, self._utf8_refused)[utf8_state]
        candidates = self._candidates(index)
        lc.llama_sampler_apply(chain, ctypes.byref(candidates.array))
        token = int(candidates.array.data[candidates.array.selected].id)
        if refused[token]:  # sample again without the tokens that break UTF-8 (no grammar pass yet)
            candidates = self._masked_candidates(index, refused)
            lc.llama_sampler_apply(chain, ctypes.byref(candidates.array))
            token = int(candidates.array.data[candidates.array.selected].id)
        one = (lc.llama_token_data * 1)(lc.llama_token_data(token, 0.0, 0.0))
        single = lc.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
        lc.llama_sampler_apply(constrain, ctypes.byref(single))
        if one[0].logit == -np.inf:  # refused: constrain the whole vocabulary, then sample
            candidates = self._masked_candidates(index, refused)
            lc.llama_sampler_apply(constrain, ctypes.byref(candidates.array))
            if not np.isfinite(candidates.data["logit"]).any():
                # sampling on would pick a token the grammar refuses, and llama.cpp aborts
                raise EngineError("The grammar allows no token of this model's vocabulary here: "
                                  "simplify the schema (or GBNF).")
            lc.llama_sampler_apply(chain, ctypes.byref(candidates.array))
            token = int(candidates.array.data[candidates.array.selected].id)
        lc.llama_sampler_accept(constrain, token)
        lc.llama_sampler_accept(chain, token)
        return token

    def _masked_candidates(self, index: int, refused: np.ndarray) -> "_Candidates":
        """:meth:`_candidates` without the ``refused`` tokens (EngineError if none is left)."""
        candidates = self._candidates(index)
        candidates.data["logit"][refused] = -np.inf
        if not np.isfinite(candidates.data["logit"]).any():
            raise EngineError("Every token of this model's vocabulary would break UTF-8 here.")
        return candidates

    def utf8_table(self) -> np.ndarray:
        """This vocabulary's :func:`utf8mask.token_table`, made on first use (about a second
        for 150k tokens)."""
        with self._utf8_lock:
            if self._utf8 is None:
                lc, n_vocab = self._lc, self.llama.n_vocab()
                answer = [self._token_piece(t, special=False) for t in range(n_vocab)]
                grammar = [self._token_piece(t, special=True) for t in range(n_vocab)]
                eog = np.array([lc.llama_vocab_is_eog(self._vocab, t) for t in range(n_vocab)], dtype=bool)
                table = utf8mask.token_table(answer, grammar, eog)
                self._utf8_refused = np.ascontiguousarray((table == utf8mask.REJECT).T)
                self._utf8 = table
            return self._utf8

    def _token_piece(self, token: int, special: bool) -> bytes:
        """A token's bytes as llama.cpp writes them (the grammar reads them with ``special``)."""
        buf = ctypes.create_string_buffer(256)
        n = self._lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:max(n, 0)]

    def _candidates(self, index: int = -1) -> "_Candidates":
        """Every token with its logit from row ``index`` of the last evaluation's outputs, as a
        llama.cpp candidate array."""
        n_vocab = self.llama.n_vocab()
        logits = np.ctypeslib.as_array(self._lc.llama_get_logits_ith(self.llama.ctx, index), shape=(n_vocab,))
        data = np.empty(n_vocab, dtype=_TOKEN_DATA)
        data["id"] = np.arange(n_vocab, dtype=np.int32)
        data["logit"] = logits
        data["p"] = 0.0
        pointer = data.ctypes.data_as(ctypes.POINTER(self._lc.llama_token_data))
        array = self._lc.llama_token_data_array(data=pointer, size=n_vocab, selected=-1, sorted=False)
        return _Candidates(data, array)

    def chain(self, s: Sampling) -> Any:
        """A llama.cpp sampler chain for ``s`` (free it with ``llama_sampler_free``)."""
        # A grammar is not part of this chain: see sample(). (Inside it, it would have to come
        # first, on the whole vocabulary: after the top-k shortcut below, every candidate
        # left could be one the grammar forbids.)
        lc = self._lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        add = lambda smpl: lc.llama_sampler_chain_add(chain, smpl)  # noqa: E731
        keep = 1 if s.temperature <= 0 else s.top_k
        if s.repeat_penalty != 1.0:
            if s.repeat_penalty > 1.0 and keep > 0:
                # the penalty only lowers the last PENALTY_LAST_N tokens, so the final top
                # `keep` lies within the first `keep + PENALTY_LAST_N`: same result, without
                # a pass over the whole vocabulary (150k entries) for every token
                add(lc.llama_sampler_init_top_k(keep + PENALTY_LAST_N))
            add(lc.llama_sampler_init_penalties(self.llama.n_vocab(), PENALTY_LAST_N,
                                                s.repeat_penalty, 0.0, 0.0))
        if s.temperature <= 0:
            add(lc.llama_sampler_init_greedy())
            return chain
        add(lc.llama_sampler_init_top_k(s.top_k))
        add(lc.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0:
            add(lc.llama_sampler_init_min_p(s.min_p, 1))
        add(lc.llama_sampler_init_temp(s.temperature))
        seed = s.seed if s.seed is not None else lc.LLAMA_DEFAULT_SEED
        add(lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain


#: llama.cpp's ``llama_token_data``: id, logit, p
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


@dataclass
class _Candidates:
    """A candidate array for llama.cpp and the numpy buffer it points into (kept alive with it)."""

    data: np.ndarray
    array: Any
