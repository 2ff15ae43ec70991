"""One answer: prefill a rendered prompt, generate, stream text pieces, build the Reply.

Streaming is the only code path; a non-streaming call drains the same
:class:`Stream`.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Callable, Generator, Iterator, Sequence

from .engine import Engine, PrefillStats, Sampling
from .media import Image
from .reply import Reply, Timings, Usage
from .templates import THINK_OPEN
from .textstream import ReasoningFilter, TextAssembler


class Stream(Iterator[str]):
    """Text pieces of an answer as they are generated; :attr:`reply` once it has ended.

    Closing the stream early (``close()``, ``break`` out of a loop and dropping it)
    stops generation and leaves the model ready for the next question.
    """

    def __init__(self, pieces: Generator[str, None, Reply]) -> None:
        self._pieces = pieces
        self.reply: Reply | None = None

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        try:
            return next(self._pieces)
        except StopIteration as done:
            self.reply = done.value
            raise

    def close(self) -> None:
        """Stop generating now."""
        self._pieces.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def text(self) -> Reply:
        """Drain the stream and return the whole :class:`Reply`."""
        for _ in self:
            pass
        assert self.reply is not None
        return self.reply


def respond(
    engine: Engine,
    prompt_text: str,
    images: Sequence[Image],
    *,
    sampling: Sampling,
    max_tokens: int,
    stop: Sequence[str] = (),
    reasoning: bool = False,
    lock: threading.RLock | None = None,
    progress: Callable[[int, int], None] | None = None,
    on_prefill: Callable[[PrefillStats], None] | None = None,
) -> Generator[str, None, Reply]:
    """Generate the answer to ``prompt_text``; yields text pieces, returns the Reply.

    With ``reasoning`` on, text up to ``</think>`` is kept apart (``Reply.reasoning``)
    and only the answer is yielded. ``progress(done, total)`` follows image encoding;
    ``on_prefill`` receives the prefill's statistics.
    """
    with lock if lock is not None else nullcontext():
        start = time.perf_counter()
        with engine.tokenize(prompt_text, images) as prompt:
            stats = engine.prefill(prompt, reserve=1, progress=progress)
        if on_prefill is not None:
            on_prefill(stats)
        assembler = TextAssembler(stop)
        thinking = ReasoningFilter(active=reasoning, inside=prompt_text.rstrip().endswith(THINK_OPEN))
        answer: list[str] = []
        first_token_at = None
        n_generated = 0
        for token in engine.generate(sampling, max_tokens):
            n_generated += 1
            first_token_at = first_token_at or time.perf_counter()
            piece = thinking.feed(assembler.feed(engine.token_bytes(token)))
            if piece:
                answer.append(piece)
                yield piece
            if assembler.stopped:
                break
        piece = thinking.feed(assembler.finish()) + thinking.finish()
        if piece:
            answer.append(piece)
            yield piece
        end = time.perf_counter()
        first = first_token_at or end
        usage = Usage(
            prompt_tokens=stats.prompt_tokens,
            image_tokens=stats.image_tokens,
            completion_tokens=n_generated,
            cached_tokens=stats.reused_tokens,
        )
        timings = Timings(
            encode_ms=stats.encode_ms,
            prefill_ms=stats.prefill_ms,
            ttft_ms=(first - start) * 1000.0,
            decode_ms=(end - first) * 1000.0,
            total_ms=(end - start) * 1000.0,
            slices_encoded=stats.slices_encoded,
            slices_from_cache=stats.slices_from_cache,
            completion_tokens=n_generated,
        )
        finish = "stop" if assembler.stopped else engine.finish_reason
        return Reply(
            "".join(answer), usage=usage, timings=timings,
            reasoning=thinking.reasoning, finish_reason=finish,
        )
