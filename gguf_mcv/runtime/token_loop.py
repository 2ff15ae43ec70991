"""The token loop: sample a token, hand it out, evaluate it, until the answer ends.

Under a grammar the loop may let the model write freely first: ``grammar_after`` (the tag that
closes a reasoning block) holds the grammar back until the tag is written, and ``may_open`` (the
tag that opens one) lets the model choose between the grammar's answer and such a block.
"""

from __future__ import annotations

from typing import Callable, Generator, Protocol, cast

import numpy as np

from ..options import GenerationOptions
from ..output import utf8mask
from .sampling import TokenSampler

#: the root rule of "the grammar's answer, or the opening of a free block" (a name no converter makes)
_GRAMMAR_OR_OPENER = "gguf-mcv-answer-or-opener"


class SequenceView(Protocol):
    """Where :func:`generate_tokens` generates: one sequence of the llama.cpp context.

    ``eval_token`` is called once after each token is yielded, before the next is sampled;
    sampling reads the logits in output row ``logits_index`` of the last evaluation.
    """

    finish_reason: str

    @property
    def n_past(self) -> int: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def logits_index(self) -> int: ...

    def eval_token(self, token: int) -> None: ...


def generate_tokens(sampler: TokenSampler, view: SequenceView, options: GenerationOptions, *,
                    piece: Callable[[int], bytes],
                    markup: Callable[[bytes], list[int]]) -> Generator[int, None, None]:
    """Yield tokens sampled into ``view`` until an end-of-generation token, ``options.max_tokens``
    or a full context; ``view.finish_reason`` says why it ended.

    ``piece(token)`` is a token's text (control tokens included) and ``markup(text)`` the
    tokens of template markup (special tokens parsed): they find and write the free block's tags.
    """
    sampling, max_tokens, grammar = options.sampling, options.max_tokens, options.grammar
    grammar_after, may_open, must_answer = options.grammar_after, options.may_open, options.must_answer
    opener = may_open.encode() if grammar and grammar_after and may_open else None
    waiting = grammar_after.encode() if grammar and grammar_after and not opener else None
    chain = sampler.chain(sampling)
    constrain = None
    utf8 = sampler.utf8_table() if grammar is not None else None
    state = utf8mask.ACCEPT  # where the constrained text stands in UTF-8 (see utf8mask)
    if grammar is not None and opener is not None:
        either = f'{grammar}\n{_GRAMMAR_OR_OPENER} ::= "{may_open}" | root'
        constrain = sampler.grammar(either, root=_GRAMMAR_OR_OPENER)
    elif grammar is not None and waiting is None:
        constrain = sampler.grammar(grammar)
    recent = b""  # the end of the text so far, to spot `may_open` and `grammar_after`
    view.finish_reason = "length"
    try:
        for _ in range(max_tokens):
            token = sampler.sample(chain, constrain, view.logits_index, state)
            if sampler.is_end(token):
                if waiting is None or not must_answer or view.n_past + len(waiting) >= view.n_ctx:
                    view.finish_reason = "stop"
                    return
                # the reasoning ended without its closing tag: close it, then the answer
                for closing in markup(waiting):
                    yield closing
                    view.eval_token(closing)
                waiting, recent, state = None, b"", utf8mask.ACCEPT
                constrain = sampler.grammar(cast(str, grammar))
                continue
            if constrain is not None:
                state = int(cast(np.ndarray, utf8)[token, state])
            yield token
            if view.n_past >= view.n_ctx:
                return
            view.eval_token(token)
            if opener is None and waiting is None:
                continue
            recent = (recent + piece(token))[-2 * len(opener or waiting or b"") - 64:]
            if opener is not None and opener in recent:  # a free block opened: the grammar waits
                sampler.free(constrain)
                constrain, opener, waiting, recent = None, None, grammar_after.encode(), b""  # type: ignore[union-attr]
            elif opener is not None and not opener.startswith(recent.lstrip()):
                opener = None  # the answer itself began
            elif waiting is not None and waiting in recent:  # the free block ended
                waiting, state = None, utf8mask.ACCEPT
                constrain = sampler.grammar(cast(str, grammar))
    finally:
        sampler.free(chain)
        if constrain is not None:
            sampler.free(constrain)
