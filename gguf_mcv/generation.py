"""One answer: prefill a rendered prompt, generate, stream text pieces, build the Reply.

Streaming is the only code path; a non-streaming call drains the same
:class:`Stream`. An :class:`AnswerLock` lets one answer at a time use a model.
"""

from __future__ import annotations

import threading
import time
import warnings
from contextlib import contextmanager
from typing import Callable, Generator, Iterator, Sequence, cast

from .engine import Engine, PrefillStats
from .errors import ModelBusyError, ModelClosedError
from .media import Image
from .options import Sampling
from .reply import Progress, Reply, Timings, Usage
from .structured import Constraint
from .templates import THINK_OPEN
from .textstream import ReasoningFilter, TextAssembler

ProgressCallback = Callable[[Progress], None]


class AnswerLock:
    """One answer at a time per model, and native memory freed only when no answer needs it.

    Not re-entrant: an answer started in the thread that is streaming another one
    raises :class:`ModelBusyError` (two answers sharing one KV cache would both be
    wrong); other threads wait their turn. The lock is released by whichever thread
    ends the answer, so a stream finished or dropped on another thread never strands it.
    After :meth:`close` new answers raise :class:`ModelClosedError`; the native
    memory is freed at once, or when the answer in progress ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = threading.Lock()  # guards the fields below
        self._owner: int | None = None  # the thread that last advanced the answer
        self._closed = False
        self._free: Callable[[], None] | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def hold(self) -> Iterator["AnswerLock"]:
        """Hold the model for one answer (or one step that touches native state)."""
        if self._owner == threading.get_ident():
            raise ModelBusyError(
                "This thread is still streaming another answer from this model: finish or close "
                "that stream first (or use a second model for a second conversation at once)."
            )
        self._lock.acquire()
        if self._closed:
            self._release()
            raise ModelClosedError(
                "The model was closed before this question (or stream) ran: read streams before "
                "closing the model, or load it again."
            )
        self._owner = threading.get_ident()
        try:
            yield self
        finally:
            self._release()

    def touch(self) -> None:
        """Note that the current thread is now the one advancing the answer."""
        self._owner = threading.get_ident()

    def close(self, free: Callable[[], None]) -> None:
        """Refuse new answers; run ``free`` now, or when the answer in progress ends."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            if not self._lock.acquire(blocking=False):
                self._free = free
                return
        try:
            free()
        finally:
            self._lock.release()

    def _release(self) -> None:
        with self._state:
            self._owner = None
            free, self._free = self._free, None
        try:
            if free is not None:
                free()
        finally:
            self._lock.release()


class Stream(Iterator[str]):
    """Text pieces of an answer as they are generated; :attr:`reply` once it has ended.

    Closing the stream early (``close()``, ``break`` out of a loop and dropping it)
    stops generation and leaves the model ready for the next question. Pieces may be
    pulled from several threads; they are handed out one at a time.
    """

    def __init__(self, pieces: Generator[str, None, Reply]) -> None:
        self._pieces = pieces
        self._turn = threading.Lock()
        self.reply: Reply | None = None

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        with self._turn:
            try:
                return next(self._pieces)
            except StopIteration as done:
                if self.reply is None:  # a second reader past the end gets no value
                    self.reply = done.value
                raise

    def close(self) -> None:
        """Stop generating now."""
        with self._turn:
            self._pieces.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def result(self) -> Reply:
        """Read the rest of the stream and return the whole :class:`Reply`."""
        for _ in self:
            pass
        assert self.reply is not None
        return self.reply

    def text(self) -> Reply:
        """Deprecated name of :meth:`result` (it returns the Reply, not only its text)."""
        warnings.warn("Stream.text() is deprecated: use Stream.result()", DeprecationWarning, stacklevel=2)
        return self.result()


def respond(
    engine: Engine,
    prompt_text: str,
    images: Sequence[Image],
    *,
    sampling: Sampling,
    max_tokens: int,
    lock: AnswerLock,
    stop: Sequence[str] = (),
    reasoning: bool = False,
    on_progress: ProgressCallback | None = None,
    on_prefill: Callable[[PrefillStats], None] | None = None,
    shift: bool = False,
    constraint: Constraint | None = None,
) -> Generator[str, None, Reply]:
    """Generate the answer to ``prompt_text``; yields text pieces, returns the Reply.

    With ``reasoning`` on, text up to ``</think>`` is kept apart (``Reply.reasoning``)
    and only the answer is yielded. ``on_progress`` follows image encoding;
    ``on_prefill`` receives the prefill's statistics. ``shift`` lets the prefill shift a
    stretch the prompt dropped out of the KV cache (see :meth:`Engine.prefill`). A
    ``constraint`` (checked by the caller) holds the answer to its grammar and fills
    ``Reply.parsed``; with ``reasoning`` on, a think block (opened by the prompt, or by the
    model as its first words) stays free and the grammar starts after ``</think>``.
    """
    with lock.hold():
        start = time.perf_counter()
        with engine.tokenize(prompt_text, images) as prompt:
            stats = engine.prefill(prompt, reserve=1, shift=shift, progress=_progress(on_progress, start))
        if on_prefill is not None:
            on_prefill(stats)
        assembler = TextAssembler(stop)
        inside = reasoning and prompt_text.rstrip().endswith(THINK_OPEN)
        thinking = ReasoningFilter(active=reasoning, inside=inside)
        answer: list[str] = []
        first_token_at = None
        n_generated = 0
        grammar = constraint.grammar if constraint is not None else None
        tokens = engine.generate(sampling, max_tokens, grammar=grammar,  # a generator: closed below
                                 grammar_after=_grammar_after(constraint, reasoning),
                                 may_open=None if inside or _tool_auto(constraint) else THINK_OPEN,
                                 must_answer=not _tool_auto(constraint))
        try:
            for token in tokens:
                n_generated += 1
                first_token_at = first_token_at or time.perf_counter()
                piece = thinking.feed(assembler.feed(_token_text(engine, token, reasoning)))
                if piece:
                    answer.append(piece)
                    yield piece
                    lock.touch()
                if assembler.stopped:
                    break
        finally:
            tokens.close()  # frees the sampler while the model is certainly alive
        piece = thinking.feed(assembler.finish()) + thinking.finish()
        if piece:
            answer.append(piece)
            yield piece
            lock.touch()
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
            vision_backend=engine.vision_backend,
        )
        finish = "stop" if assembler.stopped else engine.finish_reason
        reply = Reply(
            "".join(answer), usage=usage, timings=timings,
            reasoning=thinking.reasoning, finish_reason=finish,
        )
        if constraint is not None:
            reply = _read_back(reply, constraint)
        return reply


def _token_text(engine: Engine, token: int, reasoning: bool) -> bytes:
    """A token's bytes; with reasoning on, think tags that the vocabulary made control tokens too
    (the reasoning filter must see where the reasoning ends)."""
    data = engine.token_bytes(token)
    if not data and reasoning:
        markup = engine.token_markup(token)
        if markup in (_OPEN, _CLOSE):
            return markup
    return data


_OPEN, _CLOSE = ReasoningFilter.OPEN.encode(), ReasoningFilter.CLOSE.encode()


def _grammar_after(constraint: Constraint | None, reasoning: bool) -> str | None:
    """The text after which the grammar starts: a tool call's tag, the end of the reasoning, or none."""
    if _tool_auto(constraint):
        return cast(Constraint, constraint).after
    return ReasoningFilter.CLOSE if reasoning else None


def _tool_auto(constraint: Constraint | None) -> bool:
    return constraint is not None and constraint.after is not None


def _read_back(reply: Reply, constraint: Constraint) -> Reply:
    """``reply`` with its parsed value, or its tool calls taken out of the text."""
    if constraint.tools is None:
        reply.parsed, reply.parse_error = constraint.parse(reply, reply.finish_reason)
        return reply
    text, calls = constraint.tools.calls(str(reply))
    if not calls:
        return reply
    out = Reply(text, usage=reply.usage, timings=reply.timings, reasoning=reply.reasoning,
                finish_reason="tool_calls")
    out.tool_calls = calls
    return out


def _progress(callback: ProgressCallback | None, start: float) -> Callable[[int, int, int], None] | None:
    """The engine's (done, total, cached) calls as :class:`Progress` values with timing."""
    if callback is None:
        return None

    def report(done: int, total: int, cached: int) -> None:
        elapsed = time.perf_counter() - start
        encoded = done - cached
        eta = elapsed / encoded * (total - done) if encoded > 0 else None
        callback(Progress(done=done, total=total, cached=cached, elapsed_s=elapsed, eta_s=eta))

    return report
