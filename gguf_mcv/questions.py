"""The questions a loaded model answers: :class:`Questions`, the part of :class:`~gguf_mcv.model.Model`
that turns a prompt with images (:meth:`~Questions.ask`), a video (:meth:`~Questions.ask_video`) or
OpenAI-style messages (:meth:`~Questions.chat_completion`) into built turns, and answers them
(:meth:`~Questions.answer`) as a :class:`~gguf_mcv.runtime.generation.Stream`."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Generator, Literal, Sequence, overload

from .errors import ConfigError
from .options import (
    DEFAULT_MAX_TOKENS,
    Sampling,
    SamplingKeywords,
    check_max_tokens,
    check_text,
    stop_list,
)
from .output import structured
from .output.structured import Constraint
from .prompt import tool_calls as tooling
from .prompt.messages import MediaPolicy, convert
from .prompt.turns import FrameCounts, Images, Turn, TurnBuilder, Video, VideoOptions
from .reply import Reply, VideoStats
from .runtime.generation import AnswerLock, ProgressCallback, SharedAnswerLock, Stream, respond
from .vision.video import VideoInput

if TYPE_CHECKING:
    from .runtime.engine import Engine
    from .runtime.slots import Scheduler

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # a dependency on 3.10 (pyproject.toml)
    from typing_extensions import Unpack


class Questions:
    """Asking and answering, for a class that has a model's engine, sampling defaults, turn builder,
    answer lock and (with parallel slots) scheduler: :class:`~gguf_mcv.model.Model`."""

    sampling: Sampling
    turns: TurnBuilder
    scheduler: Scheduler | None
    _lock: AnswerLock | SharedAnswerLock

    @property
    def engine(self) -> Engine:
        raise NotImplementedError  # the model's

    @overload
    def ask(self, prompt: str, images: Images = ..., *, stream: Literal[False] = ..., max_tokens: int = ...,
            stop: str | Sequence[str] | None = ..., system: str | None = ..., thinking: bool | None = ...,
            detail: str = ..., max_slices: int | None = ..., on_progress: ProgressCallback | None = ...,
            schema: Any = ..., format: str | dict[str, Any] | None = ...,
            **sampling: Unpack[SamplingKeywords]) -> Reply: ...

    @overload
    def ask(self, prompt: str, images: Images = ..., *, stream: Literal[True], max_tokens: int = ...,
            stop: str | Sequence[str] | None = ..., system: str | None = ..., thinking: bool | None = ...,
            detail: str = ..., max_slices: int | None = ..., on_progress: ProgressCallback | None = ...,
            schema: Any = ..., format: str | dict[str, Any] | None = ...,
            **sampling: Unpack[SamplingKeywords]) -> Stream: ...

    @overload
    def ask(self, prompt: str, images: Images = ..., *, stream: bool = ..., max_tokens: int = ...,
            stop: str | Sequence[str] | None = ..., system: str | None = ..., thinking: bool | None = ...,
            detail: str = ..., max_slices: int | None = ..., on_progress: ProgressCallback | None = ...,
            schema: Any = ..., format: str | dict[str, Any] | None = ...,
            **sampling: Unpack[SamplingKeywords]) -> Reply | Stream: ...

    def ask(
        self,
        prompt: str,
        images: Images = (),
        *,
        stream: bool = False,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop: str | Sequence[str] | None = None,
        system: str | None = None,
        thinking: bool | None = None,
        detail: str = "auto",
        max_slices: int | None = None,
        on_progress: ProgressCallback | None = None,
        schema: Any = None,
        format: str | dict[str, Any] | None = None,
        **sampling: Unpack[SamplingKeywords],
    ) -> Reply | Stream:
        """Answer ``prompt`` about ``images``; a :class:`Reply` (a ``str``), or a :class:`Stream`.

        ``images`` is one image or a sequence of them: paths, bytes, data URIs, PIL
        images or H×W×3 uint8 arrays. Sampling settings default to the model's
        recommended ones; the sampling keywords (:class:`~gguf_mcv.options.SamplingKeywords`:
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repeat_penalty``, ``seed``) override
        them, and an unknown keyword raises :class:`ConfigError` naming it. ``detail`` and
        ``max_slices`` bound how many 448-pixel slices each image is cut into (see
        :meth:`prepare_image`). ``on_progress`` receives a :class:`~gguf_mcv.reply.Progress` as
        image slices are encoded.
        ``schema`` (a JSON-schema dict, a pydantic model class or a dataclass) or
        ``format="json"`` constrains the answer to JSON; ``reply.parsed`` holds the value.
        """
        settings = self.sampling.with_overrides(**sampling)
        shape = self.constraint(schema, format)
        parts = self.turns.user_parts(prompt, images, detail=detail, max_slices=max_slices)
        turns = self.turns.system(system) + [self.turns.turn("user", parts)]
        return deliver(self.answer(turns, thinking=thinking, max_tokens=max_tokens, stop=stop,
                                    sampling=settings, on_progress=on_progress, constraint=shape), stream)

    @overload
    def ask_video(self, prompt: str, video: VideoInput, *, stream: Literal[False] = ...,
        max_frames: int | None = ..., fps: float | None = ..., dedupe: bool = ..., timestamps: bool = ...,
        max_tokens: int = ..., stop: str | Sequence[str] | None = ..., system: str | None = ...,
        thinking: bool | None = ...,
        on_progress: ProgressCallback | None = ..., schema: Any = ...,
        format: str | dict[str, Any] | None = ..., **sampling: Unpack[SamplingKeywords],
    ) -> Reply: ...

    @overload
    def ask_video(self, prompt: str, video: VideoInput, *, stream: Literal[True],
        max_frames: int | None = ..., fps: float | None = ..., dedupe: bool = ..., timestamps: bool = ...,
        max_tokens: int = ..., stop: str | Sequence[str] | None = ..., system: str | None = ...,
        thinking: bool | None = ...,
        on_progress: ProgressCallback | None = ..., schema: Any = ...,
        format: str | dict[str, Any] | None = ..., **sampling: Unpack[SamplingKeywords],
    ) -> Stream: ...

    @overload
    def ask_video(self, prompt: str, video: VideoInput, *, stream: bool = ...,
        max_frames: int | None = ..., fps: float | None = ..., dedupe: bool = ..., timestamps: bool = ...,
        max_tokens: int = ..., stop: str | Sequence[str] | None = ..., system: str | None = ...,
        thinking: bool | None = ...,
        on_progress: ProgressCallback | None = ..., schema: Any = ...,
        format: str | dict[str, Any] | None = ..., **sampling: Unpack[SamplingKeywords],
    ) -> Reply | Stream: ...

    def ask_video(
        self,
        prompt: Any,
        video: Any,
        *,
        max_frames: int | None = None,
        fps: float | None = 1.0,
        dedupe: bool = True,
        timestamps: bool = True,
        stream: bool = False,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop: str | Sequence[str] | None = None,
        system: str | None = None,
        thinking: bool | None = None,

        on_progress: ProgressCallback | None = None,
        schema: Any = None,
        format: str | dict[str, Any] | None = None,
        **sampling: Unpack[SamplingKeywords],
    ) -> Reply | Stream:
        """Answer ``prompt`` about a video (a file, GIF, folder or list of images, or frames array).

        Frames are sampled about ``fps`` per second (at most ``max_frames``, default from
        :func:`~gguf_mcv.vision.video.default_max_frames`), near-duplicates dropped
        (``dedupe``), each fed as one 448-pixel slice, with its time in the prompt when
        ``timestamps``. If the frames do not fit in the context they are thinned
        uniformly — unless ``max_frames`` was given, then :class:`ContextOverflowError`
        is raised before anything is encoded. ``on_progress`` follows the encoding. Sampling keywords
        (:class:`~gguf_mcv.options.SamplingKeywords`) as in :meth:`ask`; ``reply.video`` counts the
        frames; ``schema``/``format`` as in :meth:`ask`.

        The argument order matches :meth:`ask` (prompt first); the older
        ``ask_video(video, prompt)`` still works, with a ``DeprecationWarning``.
        """
        if _video_first(prompt, video):
            warnings.warn("ask_video(video, prompt) is deprecated: pass the prompt first, "
                          "ask_video(prompt, video)", DeprecationWarning, stacklevel=2)
            prompt, video = video, prompt
        options = VideoOptions(max_frames, fps, dedupe, timestamps)
        check_text("prompt", prompt)
        settings = self.sampling.with_overrides(**sampling)
        shape = self.constraint(schema, format)
        head = self.turns.system(system)
        user, counts = self.turns.user_turn([Video(video), prompt], history=head, options=options,
                                            max_tokens=check_max_tokens(max_tokens), thinking=thinking)
        return deliver(self.answer(head + [user], thinking=thinking, max_tokens=max_tokens, stop=stop,
                                    sampling=settings, on_progress=on_progress,
                                    frames=counts, constraint=shape), stream)

    @overload
    def chat_completion(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        stream: Literal[False] = ...,
        max_tokens: int = ...,
        stop: str | Sequence[str] | None = ...,
        thinking: bool | None = ...,
        policy: MediaPolicy = ...,
        video_options: VideoOptions = ...,

        on_progress: ProgressCallback | None = ...,
        truncate: bool = ...,
        schema: Any = ...,
        format: str | dict[str, Any] | None = ...,
        grammar: Constraint | None = ...,
        tools: Sequence[dict[str, Any]] | None = ...,
        tool_choice: Any = ...,
        **sampling: Unpack[SamplingKeywords],
    ) -> Reply: ...

    @overload
    def chat_completion(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        stream: Literal[True],
        max_tokens: int = ...,
        stop: str | Sequence[str] | None = ...,
        thinking: bool | None = ...,
        policy: MediaPolicy = ...,
        video_options: VideoOptions = ...,

        on_progress: ProgressCallback | None = ...,
        truncate: bool = ...,
        schema: Any = ...,
        format: str | dict[str, Any] | None = ...,
        grammar: Constraint | None = ...,
        tools: Sequence[dict[str, Any]] | None = ...,
        tool_choice: Any = ...,
        **sampling: Unpack[SamplingKeywords],
    ) -> Stream: ...

    @overload
    def chat_completion(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        stream: bool = ...,
        max_tokens: int = ...,
        stop: str | Sequence[str] | None = ...,
        thinking: bool | None = ...,
        policy: MediaPolicy = ...,
        video_options: VideoOptions = ...,

        on_progress: ProgressCallback | None = ...,
        truncate: bool = ...,
        schema: Any = ...,
        format: str | dict[str, Any] | None = ...,
        grammar: Constraint | None = ...,
        tools: Sequence[dict[str, Any]] | None = ...,
        tool_choice: Any = ...,
        **sampling: Unpack[SamplingKeywords],
    ) -> Reply | Stream: ...

    def chat_completion(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        stream: bool = False,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop: str | Sequence[str] | None = None,
        thinking: bool | None = None,
        policy: MediaPolicy = MediaPolicy(),
        video_options: VideoOptions = VideoOptions(),

        on_progress: ProgressCallback | None = None,
        truncate: bool = False,
        schema: Any = None,
        format: str | dict[str, Any] | None = None,
        grammar: Constraint | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        **sampling: Unpack[SamplingKeywords],
    ) -> Reply | Stream:
        """Answer OpenAI-style ``messages`` (``text``, ``image_url`` and ``video_url`` parts).

        ``policy`` says whether local paths and remote URLs may be named (a server
        refuses both by default). Videos are sampled and fitted to the context as in
        :meth:`ask_video`, with ``video_options``. The messages are answered as given;
        with ``truncate`` the oldest questions (with their answers) are dropped, whole,
        until the prompt and room for the answer fit, as :class:`Chat` does
        (``reply.dropped_turns`` counts them) and, as :class:`Chat`'s default ``context_shift``
        does, shifted out of the KV cache instead of evaluating the kept ones again.
        ``schema``/``format`` as in :meth:`ask`;
        ``grammar`` is an already-made :class:`~gguf_mcv.output.structured.Constraint`. ``tools``
        (OpenAI-style function dicts) and ``tool_choice`` (``auto``, ``none``, ``required`` or
        a function) let the model call a function (:mod:`gguf_mcv.prompt.tool_calls`): ``reply.tool_calls``;
        ``role: "tool"`` messages carry the results back. Sampling keywords as in :meth:`ask`.
        """
        settings = self.sampling.with_overrides(**sampling)
        box = tooling.toolbox(tools, tool_choice)
        if box is not None and (schema is not None or format or grammar is not None):
            raise ConfigError("Give tools or a schema/format/grammar, not both.")
        messages = tooling.prompt_messages(messages, box)
        if box is not None:
            grammar = box.constraint()
        shape = self.constraint(schema, format) if grammar is None else self.checked(grammar)
        check_max_tokens(max_tokens)
        pairs = convert(messages, policy=policy,
                        prepare_image=lambda url, detail: self.turns.image(url, detail=detail))
        turns, counts = self.turns.conversation(pairs, options=video_options, max_tokens=max_tokens,
                                                thinking=thinking)
        dropped = 0
        if truncate:
            turns, dropped = self.turns.fit(turns, max_tokens=max_tokens, thinking=thinking)
        answer = self.answer(turns, thinking=thinking, max_tokens=max_tokens, stop=stop, sampling=settings,
                             on_progress=on_progress, frames=counts, constraint=shape,
                             shift=dropped > 0)
        if dropped:
            answer = Stream(_with_dropped(answer, dropped), cancel=answer.cancel)
        return deliver(answer, stream)

    def answer(self, turns: Sequence[Turn], *, thinking: bool | None = None,
               max_tokens: int = DEFAULT_MAX_TOKENS, stop: str | Sequence[str] | None = None,
               sampling: Sampling | None = None, on_progress: ProgressCallback | None = None,
               frames: FrameCounts | None = None, constraint: Constraint | None = None,
               shift: bool = False, cancel: threading.Event | None = None) -> Stream:
        """Answer a conversation of built turns (see :attr:`turns`); a :class:`Stream`.

        The lower-level door every question goes through: nothing is evaluated until
        the stream's first piece is read. ``constraint`` comes from :meth:`constraint`.
        ``shift`` allows shifting a stretch these turns no longer have (dropped turns) out of
        the KV cache instead of evaluating what follows it again — faster, but the kept
        turns' cached states still saw the dropped ones. Setting ``cancel`` (what
        :meth:`Stream.close` does) stops the answer, within one image slice or slot chunk.
        """
        rendered = self.turns.render(turns, thinking)
        encoded: list[str] = []
        cancel = cancel if cancel is not None else threading.Event()
        pieces = respond(
            self.engine, rendered.text, rendered.images, sampling=sampling or self.sampling,
            max_tokens=check_max_tokens(max_tokens), stop=stop_list(stop), reasoning=rendered.reasoning,
            lock=self._lock, on_progress=on_progress, shift=shift,
            on_prefill=lambda stats: encoded.extend(stats.encoded_keys), constraint=constraint,
            scheduler=self.scheduler, cancel=cancel,
        )
        if frames is not None and frames.keys:
            pieces = _count_frames(pieces, frames, encoded)
        return Stream(pieces, cancel=cancel.set)

    def constraint(self, schema: Any = None, format: str | dict[str, Any] | None = None) -> Constraint | None:
        """The checked :class:`~gguf_mcv.output.structured.Constraint` for ``schema`` or ``format``
        (None for neither); :class:`ConfigError` for an invalid schema, before anything runs."""
        made = structured.constraint(schema, format)
        return None if made is None else self.checked(made)

    def checked(self, made: Constraint) -> Constraint:
        """``made``, once llama.cpp has parsed its grammar (ConfigError if it cannot)."""
        self.engine.check_grammar(made.grammar)
        return made


def _video_first(prompt: Any, video: Any) -> bool:
    """Whether ``ask_video`` was called the old way round, ``(video, prompt)``."""
    if not isinstance(prompt, str):
        return isinstance(video, str)  # a Path, array or list of frames came first
    if not isinstance(video, str):
        return False
    looks_like_file = lambda s: os.path.exists(s) or "://" in s[:16] or s.startswith("data:")  # noqa: E731
    return looks_like_file(prompt) and not looks_like_file(video)


def _count_frames(pieces: Generator[str, None, Reply], counts: FrameCounts,
                  encoded: list[str]) -> Generator[str, None, Reply]:
    """Pass ``pieces`` through; attach :class:`VideoStats` to the reply at the end."""
    reply = yield from pieces
    done = set(encoded)
    reply.video = VideoStats(sampled=counts.sampled, dropped=counts.dropped, thinned=counts.thinned,
                             used=len(counts.keys), encoded=sum(k in done for k in counts.keys))
    return reply


def _with_dropped(pieces: Stream, dropped: int) -> Generator[str, None, Reply]:
    """Pass ``pieces`` through; note on the reply how many questions were dropped."""
    yield from pieces
    assert pieces.reply is not None
    pieces.reply.dropped_turns = dropped
    return pieces.reply


def deliver(stream: Stream, as_stream: bool) -> Reply | Stream:
    """The stream, or (not ``as_stream``) the reply it ends with."""
    return stream if as_stream else stream.result()
