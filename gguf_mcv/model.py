"""The everyday API: a loaded :class:`Model` answers questions; :class:`Chat` keeps a conversation.

A ``Model`` owns one llama.cpp context. Calls from several Python threads are
serialised: one question is evaluated at a time, the others wait (a stream holds
the model from its first piece until it ends or is closed). A second answer
started in the thread that is still streaming the first raises
:class:`~gguf_mcv.errors.ModelBusyError` instead of mixing the two.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Literal, Sequence, cast, overload

from . import llama_log
from .errors import ConfigError, ContextOverflowError, EngineError, ModelClosedError, SavedChatError
from .options import (
    DEFAULT_MAX_TOKENS,
    Sampling,
    SamplingKeywords,
    check_int,
    check_max_tokens,
    check_text,
    stop_list,
)
from .output import structured
from .output.structured import Constraint
from .prompt import tool_calls as tooling
from .prompt.messages import MediaPolicy, convert
from .prompt.templates import ChatTemplate
from .prompt.turns import FrameCounts, Images, Turn, TurnBuilder, Video, VideoOptions, as_image_list
from .reply import Reply, VideoStats
from .runtime import kv_store, saved_chat
from .runtime.engine import Engine, file_identity
from .runtime.generation import AnswerLock, ProgressCallback, SharedAnswerLock, Stream, respond
from .runtime.slots import Scheduler
from .vision.media import Image, ImageInput
from .vision.video import VideoInput

if TYPE_CHECKING:
    from .planning.planner import Plan

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # a dependency on 3.10 (pyproject.toml)
    from typing_extensions import Unpack

__all__ = ["Chat", "Model", "ModelInfo", "VideoOptions", "DEFAULT_MAX_TOKENS"]

#: Positions a turn's template markup may add beyond its text and images (role headers, ends).
TEMPLATE_SLACK = 16


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded: names, files, and the model family's traits."""

    name: str
    model_path: str
    mmproj_path: str
    quant: str | None
    repo: str | None
    template_origin: str
    can_think: bool
    thinking_default: bool
    n_ctx: int
    slice_size: int
    vision_gpu: bool = False
    vision_backend: str = "llama.cpp"  #: "llama.cpp", "onnx-int8" or "onnx-fp32"
    vision_backend_reason: str = ""  #: why that backend (``vision_backend="auto"`` decides)
    parallel: int = 1  #: answers run at once (parallel slots; 1: one after another)
    plan: Plan | None = None  #: the plan this load carried out (:func:`gguf_mcv.plan`'s kind)


class Model:
    """A loaded MiniCPM-V model. Use :func:`gguf_mcv.load` to make one."""

    def __init__(
        self,
        engine: Engine,
        *,
        info: ModelInfo,
        template: ChatTemplate,
        sampling: Sampling,
        allow_remote_media: bool = False,
        verbose: bool = False,
        scheduler: Scheduler | None = None,
    ) -> None:
        self._engine = engine
        self.info = info
        self.template = template
        self.sampling = sampling
        self.allow_remote_media = allow_remote_media
        self._verbose = verbose
        #: the parallel slots (``load(..., parallel=N)`` with N > 1), else None
        self.scheduler = scheduler
        self._lock = AnswerLock() if scheduler is None else SharedAnswerLock()
        self._identity: dict[str, Any] | None = None
        #: builds the turns of every question (see :class:`gguf_mcv.prompt.turns.TurnBuilder`)
        self.turns = TurnBuilder(engine, template, n_ctx=info.n_ctx, can_think=info.can_think,
                                 thinking_default=info.thinking_default, vision_gpu=info.vision_gpu,
                                 allow_remote_media=allow_remote_media, name=info.name, lock=self._lock)

    # -- questions ------------------------------------------------------------

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
        return _deliver(self.answer(turns, thinking=thinking, max_tokens=max_tokens, stop=stop,
                                    sampling=settings, on_progress=on_progress, constraint=shape), stream)

    @overload
    def ask_video(self, prompt: str, video: VideoInput, *, stream: Literal[False] = ...,
        max_frames: int | None = ..., fps: float | None = ..., dedupe: bool = ..., timestamps: bool = ...,
        max_tokens: int = ..., stop: str | Sequence[str] | None = ..., system: str | None = ...,
        thinking: bool | None = ..., progress: Callable[[int, int], None] | None = ...,
        on_progress: ProgressCallback | None = ..., schema: Any = ...,
        format: str | dict[str, Any] | None = ..., **sampling: Unpack[SamplingKeywords],
    ) -> Reply: ...

    @overload
    def ask_video(self, prompt: str, video: VideoInput, *, stream: Literal[True],
        max_frames: int | None = ..., fps: float | None = ..., dedupe: bool = ..., timestamps: bool = ...,
        max_tokens: int = ..., stop: str | Sequence[str] | None = ..., system: str | None = ...,
        thinking: bool | None = ..., progress: Callable[[int, int], None] | None = ...,
        on_progress: ProgressCallback | None = ..., schema: Any = ...,
        format: str | dict[str, Any] | None = ..., **sampling: Unpack[SamplingKeywords],
    ) -> Stream: ...

    @overload
    def ask_video(self, prompt: str, video: VideoInput, *, stream: bool = ...,
        max_frames: int | None = ..., fps: float | None = ..., dedupe: bool = ..., timestamps: bool = ...,
        max_tokens: int = ..., stop: str | Sequence[str] | None = ..., system: str | None = ...,
        thinking: bool | None = ..., progress: Callable[[int, int], None] | None = ...,
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
        progress: Callable[[int, int], None] | None = None,
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
        is raised before anything is encoded. ``on_progress`` (or the older
        ``progress(done, total)``) follows the encoding. Sampling keywords
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
        return _deliver(self.answer(head + [user], thinking=thinking, max_tokens=max_tokens, stop=stop,
                                    sampling=settings, on_progress=_either(on_progress, progress),
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
        progress: Callable[[int, int], None] | None = ...,
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
        progress: Callable[[int, int], None] | None = ...,
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
        progress: Callable[[int, int], None] | None = ...,
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
        progress: Callable[[int, int], None] | None = None,
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
                             on_progress=_either(on_progress, progress), frames=counts, constraint=shape,
                             shift=dropped > 0)
        if dropped:
            answer = Stream(_with_dropped(answer, dropped), cancel=answer.cancel)
        return _deliver(answer, stream)

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

    def chat(self, system: str | None = None, thinking: bool | None = None, *,
             overflow: str = "drop_oldest", keep_first: int = 0, context_shift: bool = True) -> "Chat":
        """Start a conversation (see :class:`Chat` for ``overflow``, ``keep_first`` and
        ``context_shift``)."""
        return Chat(self, system=system, thinking=thinking, overflow=overflow, keep_first=keep_first,
                    context_shift=context_shift)

    def load_chat(self, path: str | os.PathLike) -> "Chat":
        """The conversation :meth:`Chat.save` wrote to ``path``, ready to continue.

        Its KV state is put back into this model's cache, so the next question evaluates
        only its own tokens (a file saved without a state evaluates the conversation again,
        images from the embedding cache when they are there). :class:`SavedChatError` when
        the file is damaged, truncated or not a saved chat (a turn's text holding control
        tokens, or media markers that are not its images', counts as damaged), or was saved
        with another text model, quant, projector or vision backend, or holds more than
        ``n_ctx`` positions.
        """
        engine = self.engine
        saved = saved_chat.read(path, n_vocab=int(engine.llama.n_vocab()), n_ctx=self.info.n_ctx)
        saved_chat.check_model(saved.model, self.identity(), path)
        saved_chat.check_turns(saved.turns, engine.marker, path)
        chat = Chat(self, **_chat_settings(saved.settings, path))
        chat._turns = [Turn(role, text, images) for role, text, images in saved.turns]
        if saved.kv is not None and self.scheduler is None:  # slots: the turns are evaluated again
            with self._lock.hold():
                try:
                    self.engine.restore_state(saved.kv)
                except (EngineError, ContextOverflowError) as exc:
                    raise SavedChatError(
                        f"{path}: this model's context cannot take the saved KV state ({exc}). Load the model "
                        "with the n_ctx, KV cache type and flash-attention setting it was saved with."
                    ) from exc
                chat._kv_units = self.engine.units
        return chat

    def keep_chats(self, directory: str | os.PathLike, *, max_bytes: int = kv_store.DEFAULT_MAX_BYTES,
                   min_positions: int = kv_store.MIN_POSITIONS) -> kv_store.KVStore:
        """Keep the KV state of a conversation in ``directory`` when another one is about to
        overwrite it (in a slot, or the single sequence), and restore it when a later prompt
        starts with more of it than the cache holds (see :mod:`gguf_mcv.runtime.kv_store`). The folder
        is capped at ``max_bytes`` (least recently used entries go first); states losing fewer
        than ``min_positions`` positions are not kept; :meth:`keep_idle` keeps what the cache
        holds now (a server calls it as it stops). Returns the store (its ``counts``);
        :class:`ConfigError` if the folder cannot be used or one is already attached."""
        engine = self.engine
        if engine.kv_store is not None:
            raise ConfigError("This model already keeps its conversations in "
                              f"{cast(kv_store.KVStore, engine.kv_store).directory}.")
        store = kv_store.KVStore(directory, self.identity(), n_vocab=int(engine.llama.n_vocab()),
                                 n_ctx=self.info.n_ctx, max_bytes=max_bytes, min_positions=min_positions)
        engine.kv_store = store
        if self.scheduler is not None:
            self.scheduler.store = store
        return store

    def keep_idle(self, timeout: float = 60.0) -> bool:
        """Hand every idle conversation's state to the store of :meth:`keep_chats` and wait until
        it is written (as a server stops); whether that finished within ``timeout`` seconds."""
        if self.closed or self._engine.kv_store is None:
            return False
        store = cast(kv_store.KVStore, self._engine.kv_store)
        if self.scheduler is not None:
            done = self.scheduler.keep_idle(timeout)
        else:  # on a thread of its own: an answer still running must not hang the caller (a server stopping)
            worker = threading.Thread(target=self._keep_own_sequence, name="gguf_mcv-keep-idle", daemon=True)
            worker.start()
            worker.join(timeout)
            done = not worker.is_alive()
        return store.flush(timeout) and done

    def _keep_own_sequence(self) -> None:
        try:
            with self._lock.hold():
                self._engine.keep_idle()
        except ModelClosedError:
            pass

    def identity(self) -> dict[str, Any]:
        """What a saved conversation must have been made with: text model file, quant,
        projector and vision backend (and the name, for messages)."""
        if self._identity is None:
            self._identity = {"name": self.info.name, "model": file_identity(self.info.model_path),
                              "quant": self.info.quant}
        engine = self.engine
        return {**self._identity, "projector": engine.mmproj_id, "backend": engine.vision_backend}

    def prepare_image(self, image: ImageInput, *, detail: str = "auto",
                      max_slices: int | None = None) -> Image:
        """Decode ``image`` and size it for the vision encoder (see :func:`slicing.apply_detail`).

        ``detail="high"`` keeps it as it is: libmtmd cuts a large image into up to 9
        448-pixel slices plus an overview (64 tokens each on 2.6-style models).
        ``"low"`` shrinks it to one slice. ``"auto"`` (default) allows 4 slices when
        the vision encoder runs on the CPU, 9 on a GPU. ``max_slices=N`` sets the
        budget directly (the image is scaled down, aspect kept, until it needs at most N).
        """
        return self.turns.image(image, detail=detail, max_slices=max_slices)

    # -- lifecycle ------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._lock.closed:
            raise ModelClosedError("This model has been closed; load it again.")
        return self._engine

    @property
    def closed(self) -> bool:
        return self._lock.closed

    def close(self) -> None:
        """Free the model's native memory; it cannot be used afterwards.

        A stream still being read keeps the model alive until it ends or is closed;
        a stream not started yet raises :class:`~gguf_mcv.errors.ModelClosedError`.
        """
        self._lock.close(self._free)

    def _free(self) -> None:
        engine = self._engine
        llama = engine.llama
        if self.scheduler is not None:
            self.scheduler.close()  # its thread uses the context: stopped first
        if isinstance(engine.kv_store, kv_store.KVStore):
            engine.kv_store.close()  # writes what is pending
        engine.close()
        llama.close()
        if self._verbose:
            llama_log.verbose_release()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"n_ctx={self.info.n_ctx}"
        return f"<gguf_mcv.Model {self.info.name} {self.info.quant or ''} {state}>"



class Chat:
    """A conversation with a :class:`Model`; each turn reuses what the previous ones evaluated.

    When the next turn would not fit (its prompt plus room for the answer), ``overflow=
    "drop_oldest"`` (the default) drops the oldest questions with their answers, whole turns
    at a time — never the system prompt, the first ``keep_first`` questions (say, the photo
    the conversation is about) or the newest one; ``reply.dropped_turns`` counts them. Where
    the model's cache can shift and ``context_shift`` is on (the default), the dropped span is
    removed from it and the rest shifted back instead of evaluated again (as llama.cpp's
    context shift does: the kept turns' cached states still saw the dropped ones, so an answer
    may differ from a fresh chat's); with ``context_shift=False`` the kept turns are evaluated
    again and the answer is exactly a fresh chat's. No image is encoded again because of a
    drop. ``overflow="error"`` raises :class:`ContextOverflowError` instead.
    One ``Chat`` holds one conversation and is meant for one thread at a time.
    """

    def __init__(self, model: Model, *, system: str | None = None, thinking: bool | None = None,
                 overflow: str = "drop_oldest", keep_first: int = 0, context_shift: bool = True) -> None:
        if overflow not in ("error", "drop_oldest"):
            raise ConfigError("overflow must be 'error' or 'drop_oldest'.")
        self.model = model
        self.system = system
        self.thinking = thinking
        self.overflow = overflow
        self.keep_first = check_int("keep_first", keep_first, low=0)
        self.context_shift = bool(context_shift)
        self._turns: list[Turn] = []
        self._used = 0  # positions the conversation filled after its last answer (0: unknown)
        self._tools: tooling.Toolbox | None = None  # the tools of the last answered turn
        self._kv_units: tuple | None = None  # what the model's KV cache held after our last answer

    @property
    def history(self) -> list[dict[str, Any]]:
        """The turns so far: ``{"role", "content", "images"}`` with images as :class:`Image`."""
        return [{"role": t.role, "content": t.content, "images": list(t.images)} for t in self._turns]

    @overload
    def send(self, prompt: str, images: Images = ..., *, stream: Literal[False] = ..., max_tokens: int = ...,
             stop: str | Sequence[str] | None = ..., detail: str = ..., max_slices: int | None = ...,
             videos: VideoInput | Sequence[VideoInput] = ..., video_options: VideoOptions = ...,
             progress: Callable[[int, int], None] | None = ..., on_progress: ProgressCallback | None = ...,
             schema: Any = ..., format: str | dict[str, Any] | None = ...,
             tools: Sequence[dict[str, Any]] | None = ..., tool_choice: Any = ..., tool_result: bool = ...,
             **sampling: Unpack[SamplingKeywords]) -> Reply: ...

    @overload
    def send(self, prompt: str, images: Images = ..., *, stream: Literal[True], max_tokens: int = ...,
             stop: str | Sequence[str] | None = ..., detail: str = ..., max_slices: int | None = ...,
             videos: VideoInput | Sequence[VideoInput] = ..., video_options: VideoOptions = ...,
             progress: Callable[[int, int], None] | None = ..., on_progress: ProgressCallback | None = ...,
             schema: Any = ..., format: str | dict[str, Any] | None = ...,
             tools: Sequence[dict[str, Any]] | None = ..., tool_choice: Any = ..., tool_result: bool = ...,
             **sampling: Unpack[SamplingKeywords]) -> Stream: ...

    @overload
    def send(self, prompt: str, images: Images = ..., *, stream: bool = ..., max_tokens: int = ...,
             stop: str | Sequence[str] | None = ..., detail: str = ..., max_slices: int | None = ...,
             videos: VideoInput | Sequence[VideoInput] = ..., video_options: VideoOptions = ...,
             progress: Callable[[int, int], None] | None = ..., on_progress: ProgressCallback | None = ...,
             schema: Any = ..., format: str | dict[str, Any] | None = ...,
             tools: Sequence[dict[str, Any]] | None = ..., tool_choice: Any = ..., tool_result: bool = ...,
             **sampling: Unpack[SamplingKeywords]) -> Reply | Stream: ...

    def send(self, prompt: str, images: Images = (), *, stream: bool = False,
             max_tokens: int = DEFAULT_MAX_TOKENS, stop: str | Sequence[str] | None = None,
             detail: str = "auto", max_slices: int | None = None,
             videos: VideoInput | Sequence[VideoInput] = (), video_options: VideoOptions = VideoOptions(),
             progress: Callable[[int, int], None] | None = None,
             on_progress: ProgressCallback | None = None, schema: Any = None,
             format: str | dict[str, Any] | None = None, tools: Sequence[dict[str, Any]] | None = None,
             tool_choice: Any = None, tool_result: bool = False,
             **sampling: Unpack[SamplingKeywords]) -> Reply | Stream:
        """Add a user turn and answer it (a :class:`Reply`, or a :class:`Stream` of pieces).

        ``videos`` (one video or a list) are sampled into frames as in
        :meth:`Model.ask_video`, with ``video_options``; images and videos of earlier
        turns stay in the conversation. ``schema``/``format`` as in :meth:`Model.ask`;
        ``tools``/``tool_choice`` as in :meth:`Model.chat_completion` (pass the same tools each
        turn: they are part of the system turn, so the KV cache is reused). ``tool_result=True``
        sends ``prompt`` as the result of the last call (a ``role: "tool"`` message). Sampling
        keywords as in :meth:`Model.ask`.
        """
        model = self.model
        settings = model.sampling.with_overrides(**sampling)
        box = tooling.toolbox(tools, tool_choice)
        if box is not None and (schema is not None or format):
            raise ConfigError("Give tools or a schema/format, not both.")
        shape = model.checked(box.constraint()) if box is not None else model.constraint(schema, format)
        if tool_result:
            prompt = tooling.plain_messages([{"role": "tool", "content": check_text("prompt", prompt)}])[0]["content"]
        parts = model.turns.user_parts(prompt, images, videos, detail=detail, max_slices=max_slices)
        user, counts = model.turns.user_turn(parts, history=self._all(box), options=video_options,
                                             max_tokens=check_max_tokens(max_tokens), thinking=self.thinking)
        dropped = self._make_room(user, check_max_tokens(max_tokens), box)
        cancel = threading.Event()
        pieces = self._turn(user, counts, dropped, tools=box, max_tokens=max_tokens, stop=stop, sampling=settings,
                            on_progress=_either(on_progress, progress), constraint=shape, cancel=cancel)
        return _deliver(Stream(pieces, cancel=cancel.set), stream)

    def _make_room(self, user: Turn, max_tokens: int, tools: tooling.Toolbox | None) -> int:
        """Drop the oldest turns until ``user`` and an answer fit; how many questions were dropped."""
        turns = self.model.turns
        if self.overflow != "drop_oldest" or not self._turns:
            return 0
        if self._used and (self._used + turns.positions_of(user) + TEMPLATE_SLACK
                           + turns.answer_room(max_tokens) <= turns.n_ctx):
            return 0  # surely fits: no need to measure the whole conversation
        head = self._head(tools)
        kept, dropped = turns.fit(head + self._turns + [user], max_tokens=max_tokens,
                                  thinking=self.thinking, keep_first=self.keep_first)
        self._turns = kept[len(head):-1]
        return dropped

    @overload
    def regenerate(self, *, stream: Literal[False] = ..., max_tokens: int = ...,
                   stop: str | Sequence[str] | None = ..., schema: Any = ...,
                   format: str | dict[str, Any] | None = ..., **sampling: Unpack[SamplingKeywords]) -> Reply: ...

    @overload
    def regenerate(self, *, stream: Literal[True], max_tokens: int = ...,
                   stop: str | Sequence[str] | None = ..., schema: Any = ...,
                   format: str | dict[str, Any] | None = ..., **sampling: Unpack[SamplingKeywords]) -> Stream: ...

    @overload
    def regenerate(self, *, stream: bool = ..., max_tokens: int = ...,
                   stop: str | Sequence[str] | None = ..., schema: Any = ...,
                   format: str | dict[str, Any] | None = ...,
                   **sampling: Unpack[SamplingKeywords]) -> Reply | Stream: ...

    def regenerate(self, *, stream: bool = False, max_tokens: int = DEFAULT_MAX_TOKENS,
                   stop: str | Sequence[str] | None = None, schema: Any = None,
                   format: str | dict[str, Any] | None = None,
                   **sampling: Unpack[SamplingKeywords]) -> Reply | Stream:
        """Answer the last question again (say, with another ``seed``), replacing its answer.

        The cache still holds everything up to that question, so only the answer is
        generated again (a hybrid model rewinds to its checkpoint near the question's end);
        no image is encoded again. The tools of the last question apply again. The old answer
        stays until the new one ends (a stream closed before any piece, or an error, keeps it).
        :class:`ConfigError` when there is no answered question to regenerate.
        """
        if len(self._turns) < 2 or self._turns[-1].role != "assistant" or self._turns[-2].role != "user":
            raise ConfigError("Nothing to regenerate: the conversation has no answered question yet.")
        model = self.model
        settings = model.sampling.with_overrides(**sampling)
        shape = model.checked(self._tools.constraint()) if self._tools is not None else model.constraint(schema, format)
        self._used = 0
        pieces = self._turn(self._turns[-2], FrameCounts(), 0, tools=self._tools, replace=True,
                            max_tokens=check_max_tokens(max_tokens), stop=stop, sampling=settings,
                            on_progress=None, constraint=shape)
        return _deliver(Stream(pieces), stream)

    def undo(self) -> None:
        """Drop the last user turn and its answer (the next turn reuses the cache up to there)."""
        self._used = 0
        while self._turns:
            if self._turns.pop().role == "user":
                break

    def undo_oldest(self) -> None:
        """Drop the oldest user turn and its answer (pinned turns included)."""
        self._drop_oldest(keep_first=0)

    def _droppable(self) -> bool:
        return sum(t.role == "user" for t in self._turns) > self.keep_first

    def _drop_oldest(self, keep_first: int | None = None) -> None:
        """Drop the oldest unpinned user turn and what follows it up to the next user turn."""
        pinned = self.keep_first if keep_first is None else keep_first
        users = [i for i, t in enumerate(self._turns) if t.role == "user"]
        if len(users) <= pinned:
            return
        first = users[pinned]
        end = users[pinned + 1] if len(users) > pinned + 1 else len(self._turns)
        del self._turns[first:end]
        self._used = 0

    def reset(self) -> None:
        """Forget the conversation."""
        self._turns.clear()
        self._used = 0
        self._kv_units = None

    def save(self, path: str | os.PathLike) -> bool:
        """Write this conversation to ``path`` (atomically) for :meth:`Model.load_chat`.

        The file holds the turns, their images, the settings and — when the model's KV
        cache still holds this conversation (no other question was answered since its
        last answer) — the KV state, so the conversation continues after a restart
        without evaluating it again. Returns whether the KV state was saved (without it,
        the loaded chat evaluates its turns again). :class:`SavedChatError` if the file
        cannot be written.
        """
        model = self.model
        kv = None
        with model._lock.hold():
            engine = model.engine
            # with parallel slots the conversation's cache is in one of the scheduler's sequences,
            # not the engine's own: its turns are saved, to be evaluated again when loaded
            if model.scheduler is None and self._kv_units is not None and engine.units == self._kv_units:
                kv = engine.save_state()
        saved_chat.write(path, saved_chat.SavedChat(
            model=model.identity(), settings=self._settings(), turns=saved_chat.pairs(self._turns), kv=kv))
        return kv is not None

    def _settings(self) -> dict[str, Any]:
        return {"system": self.system, "thinking": self.thinking, "overflow": self.overflow,
                "keep_first": self.keep_first, "context_shift": self.context_shift}

    def _head(self, tools: tooling.Toolbox | None) -> list[Turn]:
        """The system turn: the system prompt and, with ``tools``, their description."""
        system = self.system
        if tools is not None:
            system = f"{system}\n\n{tools.system_prompt()}" if system else tools.system_prompt()
        return self.model.turns.system(system)

    def _all(self, tools: tooling.Toolbox | None, *extra: Turn) -> list[Turn]:
        return self._head(tools) + self._turns + list(extra)

    def _turn(self, user: Turn, counts: FrameCounts, dropped: int, *, tools: tooling.Toolbox | None,
              replace: bool = False, **options: Any) -> Generator[str, None, Reply]:
        """Answer ``user`` under ``tools``; ``replace``: it is the last question, answered again.

        The turn (and its tools) is recorded when the answer ends or its stream is cancelled
        (a replaced question's: once some of the new answer came); an error records nothing,
        and a replaced question and its old answer come back.
        """
        def attempt() -> Stream:
            return self.model.answer(self._all(tools, user), thinking=self.thinking, frames=counts,
                                     shift=self.context_shift and dropped > 0, **options)

        # here, not in regenerate(): a stream closed before it starts never runs this
        replaced = self._turns[-2:] if replace else []
        del self._turns[len(self._turns) - len(replaced):]
        recorded = False
        produced: list[str] = []
        try:
            pieces = attempt()
            try:
                while True:
                    try:
                        piece = next(pieces)
                    except StopIteration:
                        reply = pieces.reply
                        assert reply is not None
                        reply.dropped_turns = dropped
                        self._remember(user, reply, tools)
                        recorded = True
                        self._used = reply.usage.prompt_tokens + reply.usage.completion_tokens
                        self._kv_units = self.model.engine.units
                        return reply
                    except ContextOverflowError:
                        # the measure before the answer keeps room for it; this is the last resort
                        # when the prompt itself came out longer (re-tokenized answers)
                        if produced or self.overflow != "drop_oldest" or not self._droppable():
                            raise
                        self._drop_oldest()
                        dropped += 1
                        pieces = attempt()
                        continue
                    produced.append(piece)
                    yield piece
            except GeneratorExit:
                # a cancelled stream: the partial answer is what the model said
                pieces.close()
                if produced or not replace:
                    self._remember(user, "".join(produced), tools)
                    recorded = True
                self._used = 0
                self._kv_units = None
                raise
        finally:
            if not recorded:
                self._turns += replaced

    def _remember(self, user: Turn, answer: str, tools: tooling.Toolbox | None) -> None:
        calls = [tooling.render_call(call) for call in getattr(answer, "tool_calls", ())]
        text = "\n".join([str(answer), *calls]).strip() if calls else str(answer)
        self._turns += [user, self.model.turns.turn("assistant", [text])]
        self._tools = tools


def _chat_settings(raw: dict[str, Any], source: Any) -> dict[str, Any]:
    """A saved chat's settings as :class:`Chat` arguments; SavedChatError if any is malformed."""
    kinds: dict[str, tuple[type, ...]] = {"system": (str, type(None)), "thinking": (bool, type(None)),
                                          "overflow": (str,), "keep_first": (int,), "context_shift": (bool,)}
    settings: dict[str, Any] = {}
    for name, kind in kinds.items():
        value = raw.get(name)
        if not isinstance(value, kind) or (kind == (int,) and isinstance(value, bool)):
            raise SavedChatError(f"{source}: the saved setting {name} is {str(value)[:40]!r}; the file is damaged.")
        settings[name] = value
    if settings["overflow"] not in ("error", "drop_oldest") or settings["keep_first"] < 0:
        raise SavedChatError(f"{source}: the saved settings are out of range; the file is damaged.")
    return settings


def _video_first(prompt: Any, video: Any) -> bool:
    """Whether ``ask_video`` was called the old way round, ``(video, prompt)``."""
    if not isinstance(prompt, str):
        return isinstance(video, str)  # a Path, array or list of frames came first
    if not isinstance(video, str):
        return False
    looks_like_file = lambda s: os.path.exists(s) or "://" in s[:16] or s.startswith("data:")  # noqa: E731
    return looks_like_file(prompt) and not looks_like_file(video)


def _either(on_progress: ProgressCallback | None,
            progress: Callable[[int, int], None] | None) -> ProgressCallback | None:
    """``on_progress``, or the older ``progress(done, total)`` adapted to it."""
    if on_progress is not None or progress is None:
        return on_progress
    return lambda p: progress(p.done, p.total) if p.done else None


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


def _deliver(stream: Stream, as_stream: bool) -> Reply | Stream:
    return stream if as_stream else stream.result()


def as_list(images: Images) -> list[ImageInput]:
    """One image or a sequence of them, as a list (kept for callers of the older name)."""
    return as_image_list(images)

