"""A conversation with a loaded model: :class:`Chat` keeps the turns, reuses what the previous ones
evaluated, drops the oldest when the context fills, and saves itself (:meth:`Chat.save`)."""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Generator, Literal, Sequence, overload

from .errors import ConfigError, ContextOverflowError, SavedChatError
from .options import DEFAULT_MAX_TOKENS, SamplingKeywords, check_int, check_max_tokens, check_text
from .prompt import tool_calls as tooling
from .prompt.turns import FrameCounts, Images, Turn, VideoOptions
from .questions import deliver
from .reply import Reply
from .runtime import saved_chat
from .runtime.generation import ProgressCallback, Stream
from .vision.video import VideoInput

if TYPE_CHECKING:
    from .model import Model

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # a dependency on 3.10 (pyproject.toml)
    from typing_extensions import Unpack

#: Positions a turn's template markup may add beyond its text and images (role headers, ends).
TEMPLATE_SLACK = 16


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
             on_progress: ProgressCallback | None = ...,
             schema: Any = ..., format: str | dict[str, Any] | None = ...,
             tools: Sequence[dict[str, Any]] | None = ..., tool_choice: Any = ..., tool_result: bool = ...,
             **sampling: Unpack[SamplingKeywords]) -> Reply: ...

    @overload
    def send(self, prompt: str, images: Images = ..., *, stream: Literal[True], max_tokens: int = ...,
             stop: str | Sequence[str] | None = ..., detail: str = ..., max_slices: int | None = ...,
             videos: VideoInput | Sequence[VideoInput] = ..., video_options: VideoOptions = ...,
             on_progress: ProgressCallback | None = ...,
             schema: Any = ..., format: str | dict[str, Any] | None = ...,
             tools: Sequence[dict[str, Any]] | None = ..., tool_choice: Any = ..., tool_result: bool = ...,
             **sampling: Unpack[SamplingKeywords]) -> Stream: ...

    @overload
    def send(self, prompt: str, images: Images = ..., *, stream: bool = ..., max_tokens: int = ...,
             stop: str | Sequence[str] | None = ..., detail: str = ..., max_slices: int | None = ...,
             videos: VideoInput | Sequence[VideoInput] = ..., video_options: VideoOptions = ...,
             on_progress: ProgressCallback | None = ...,
             schema: Any = ..., format: str | dict[str, Any] | None = ...,
             tools: Sequence[dict[str, Any]] | None = ..., tool_choice: Any = ..., tool_result: bool = ...,
             **sampling: Unpack[SamplingKeywords]) -> Reply | Stream: ...

    def send(self, prompt: str, images: Images = (), *, stream: bool = False,
             max_tokens: int = DEFAULT_MAX_TOKENS, stop: str | Sequence[str] | None = None,
             detail: str = "auto", max_slices: int | None = None,
             videos: VideoInput | Sequence[VideoInput] = (), video_options: VideoOptions = VideoOptions(),

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
                            on_progress=on_progress, constraint=shape, cancel=cancel)
        return deliver(Stream(pieces, cancel=cancel.set), stream)

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
        return deliver(Stream(pieces), stream)

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


def chat_settings(raw: dict[str, Any], source: Any) -> dict[str, Any]:
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
