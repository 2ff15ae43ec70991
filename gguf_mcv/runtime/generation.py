"""One answer: prefill a rendered prompt, generate, stream text pieces, build the Reply.

Streaming is the only code path; a non-streaming call drains the same
:class:`Stream`. An :class:`AnswerLock` lets one answer at a time use a model.
"""

from __future__ import annotations

import threading
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Generator, Iterator, Protocol, Sequence, cast

from ..errors import AnswerCancelled, ModelBusyError, ModelClosedError
from ..options import GenerationOptions, Sampling
from ..output.structured import Constraint
from ..prompt.templates import THINK_OPEN
from ..reply import Progress, Reply, Timings, Usage
from ..vision.media import Image
from .engine import Engine, PrefillStats
from .slots import Job, Scheduler
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


class SharedAnswerLock(AnswerLock):
    """Any number of answers at once (a model with parallel slots, whose scheduler queues
    them); native memory freed only when none needs it. After :meth:`close` new answers
    raise :class:`ModelClosedError`; the memory is freed at once, or when the last answer
    in progress ends."""

    def __init__(self) -> None:
        super().__init__()
        self._active = 0

    @contextmanager
    def hold(self) -> Iterator["AnswerLock"]:
        with self._state:
            if self._closed:
                raise ModelClosedError(
                    "The model was closed before this question (or stream) ran: read streams "
                    "before closing the model, or load it again."
                )
            self._active += 1
        try:
            yield self
        finally:
            with self._state:
                self._active -= 1
                free = self._free if self._active == 0 else None
                if free is not None:
                    self._free = None
            if free is not None:
                free()

    def touch(self) -> None:
        pass

    def close(self, free: Callable[[], None]) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            if self._active:
                self._free = free
                return
        free()


class Stream(Iterator[str]):
    """Text pieces of an answer as they are generated; :attr:`reply` once it has ended.

    Closing the stream early (``close()``, ``break`` out of a loop and dropping it)
    stops generation and leaves the model ready for the next question. Pieces may be
    pulled from several threads; they are handed out one at a time.
    """

    def __init__(self, pieces: Generator[str, None, Reply],
                 cancel: Callable[[], None] | None = None) -> None:
        self._pieces = pieces
        self._cancel = cancel
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
        """Stop generating now.

        From another thread too: an answer still evaluating its prompt stops after the image
        slice (or, with parallel slots, the prompt chunk) in progress, and the thread reading
        it gets :class:`~gguf_mcv.errors.AnswerCancelled`.
        """
        self.cancel()
        with self._turn:
            self._pieces.close()

    def cancel(self) -> None:
        """Ask the answer to stop, without waiting for a piece being produced (see :meth:`close`)."""
        if self._cancel is not None:
            self._cancel()

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
    scheduler: Scheduler | None = None,
    cancel: threading.Event | None = None,
) -> Generator[str, None, Reply]:
    """Generate the answer to ``prompt_text``; yields text pieces, returns the Reply.

    With ``reasoning`` on, text up to ``</think>`` is kept apart (``Reply.reasoning``)
    and only the answer is yielded. ``on_progress`` follows image encoding;
    ``on_prefill`` receives the prefill's statistics. ``shift`` lets the prefill shift a
    stretch the prompt dropped out of the KV cache (see :meth:`Engine.prefill`). A
    ``constraint`` (checked by the caller) holds the answer to its grammar and fills
    ``Reply.parsed``; with ``reasoning`` on, a think block (opened by the prompt, or by the
    model as its first words) stays free and the grammar starts after ``</think>``.
    With a ``scheduler`` the answer runs in one of its parallel slots (shifting that slot's
    cache), else on the engine's own sequence. Once ``cancel`` is set, the prompt's
    evaluation stops after the image slice (or slot chunk) in progress and
    :class:`AnswerCancelled` is raised.
    """
    with lock.hold():
        start = time.perf_counter()
        inside = reasoning and prompt_text.rstrip().endswith(THINK_OPEN)
        options = GenerationOptions(sampling, max_tokens,
                                    grammar=constraint.grammar if constraint is not None else None,
                                    grammar_after=_grammar_after(constraint, reasoning),
                                    may_open=None if inside or _tool_auto(constraint) else THINK_OPEN,
                                    must_answer=not _tool_auto(constraint))
        progress = _progress(on_progress, start, cancel)
        source: _Tokens
        if scheduler is None:
            source = _Serial(engine, prompt_text, images, progress, shift=shift)
        else:
            source = _Scheduled(scheduler, engine, prompt_text, images, progress, cancel, shift=shift)
        stats = source.prefill(options)
        if on_prefill is not None:
            on_prefill(stats)
        assembler = TextAssembler(stop)
        thinking = ReasoningFilter(active=reasoning, inside=inside)
        answer: list[str] = []
        first_token_at = None
        n_generated = 0
        tokens = source.tokens()  # a generator: closed below
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
            tokens.close()  # frees the sampler (or the slot) while the model is certainly alive
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
        finish = "stop" if assembler.stopped else source.finish_reason
        reply = Reply(
            "".join(answer), usage=usage, timings=timings,
            reasoning=thinking.reasoning, finish_reason=finish,
        )
        if constraint is not None:
            reply = _read_back(reply, constraint)
        return reply


class _Tokens(Protocol):
    """Where an answer's tokens come from: its prompt evaluated, then its tokens; why it ended."""

    @property
    def finish_reason(self) -> str: ...

    def prefill(self, options: GenerationOptions) -> PrefillStats: ...

    def tokens(self) -> Generator[int, None, None]: ...


class _Serial:
    """The engine's own sequence, evaluated on the calling thread."""

    def __init__(self, engine: Engine, prompt_text: str, images: Sequence[Image],
                 progress: Callable[[int, int, int], None], *, shift: bool) -> None:
        self._engine, self._text, self._images = engine, prompt_text, images
        self._progress, self._shift = progress, shift
        self._generate: Callable[[], Generator[int, None, None]] | None = None

    @property
    def finish_reason(self) -> str:
        return self._engine.finish_reason

    def prefill(self, options: GenerationOptions) -> PrefillStats:
        with self._engine.tokenize(self._text, self._images) as prompt:
            stats = self._engine.prefill(prompt, reserve=1, shift=self._shift, progress=self._progress)
        self._generate = lambda: self._engine.generate(options)
        return stats

    def tokens(self) -> Generator[int, None, None]:
        assert self._generate is not None, "prefill first"
        return self._generate()


class _Scheduled:
    """A slot of ``scheduler``: the prompt is tokenized on the calling thread, evaluated and
    answered on the scheduler's; its events are read here."""

    def __init__(self, scheduler: Scheduler, engine: Engine, prompt_text: str, images: Sequence[Image],
                 progress: Callable[[int, int, int], None], cancel: threading.Event | None, *,
                 shift: bool = False) -> None:
        self._scheduler, self._engine, self._text, self._images = scheduler, engine, prompt_text, images
        self._progress, self._cancel, self._shift = progress, cancel, shift
        self._job: Job | None = None
        self._events: Iterator[tuple[str, Any]] = iter(())
        self.finish_reason = "length"

    def prefill(self, options: GenerationOptions) -> PrefillStats:
        prompt = self._engine.tokenize(self._text, self._images)
        job = Job(prompt, options, shift=self._shift)
        if self._cancel is not None:
            job.cancelled = self._cancel
        try:
            self._scheduler.submit(job)
        except BaseException:
            prompt.close()
            raise
        self._job = job
        self._events = self._scheduler.events(job, self._progress)
        try:
            kind, stats = next(self._events)  # "prefilled" comes first; errors are raised
        except BaseException:
            job.cancel()
            raise
        assert kind == "prefilled", kind
        return cast(PrefillStats, stats)

    def tokens(self) -> Generator[int, None, None]:
        job = cast(Job, self._job)
        try:
            for kind, value in self._events:
                if kind == "token":
                    yield value
                else:
                    self.finish_reason = value
        finally:
            job.cancel()  # frees the slot when the answer is closed early (no-op once ended)


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
    """``reply`` with its parsed value, or its tool calls taken out of the text (a call whose
    arguments do not match its parameters is left in the text, with ``parse_error``)."""
    if constraint.tools is None:
        reply.parsed, reply.parse_error = constraint.parse(reply, reply.finish_reason)
        return reply
    text, calls, problem = constraint.tools.read(str(reply))
    if not calls:
        reply.parse_error = problem
        return reply
    out = Reply(text, usage=reply.usage, timings=reply.timings, reasoning=reply.reasoning,
                finish_reason="tool_calls")
    out.tool_calls = calls
    return out


def _progress(callback: ProgressCallback | None, start: float,
              cancel: threading.Event | None = None) -> Callable[[int, int, int], None]:
    """The engine's (done, total, cached) calls as :class:`Progress` values with timing;
    :class:`AnswerCancelled` instead once ``cancel`` is set (the engine calls this after
    each image slice, so a cancelled answer stops within one)."""

    def report(done: int, total: int, cached: int) -> None:
        if cancel is not None and cancel.is_set():
            raise AnswerCancelled("The answer was cancelled while its prompt was evaluated.")
        if callback is None:
            return
        elapsed = time.perf_counter() - start
        encoded = done - cached
        eta = elapsed / encoded * (total - done) if encoded > 0 else None
        callback(Progress(done=done, total=total, cached=cached, elapsed_s=elapsed, eta_s=eta))

    return report
