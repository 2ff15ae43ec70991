"""What an answer carries besides its text: token usage, timings, reasoning."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Usage:
    """Token counts of one call.

    ``prompt_tokens`` counts every position of the prompt, image tokens included;
    ``cached_tokens`` of them were already in the KV cache and not evaluated again.
    """

    prompt_tokens: int
    image_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def evaluated_tokens(self) -> int:
        """Prompt positions evaluated by this call (the rest came from the KV cache)."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Timings:
    """Where the time of one call went, in milliseconds.

    ``encode_ms`` is vision-encoder time (part of ``prefill_ms``); ``ttft_ms`` runs
    from the call to the first generated token. ``slices_encoded`` counts vision
    encoder passes (one per 448-pixel slice, the overview included);
    ``slices_from_cache`` the slices whose embeddings came from the cache instead.
    """

    encode_ms: float
    prefill_ms: float
    ttft_ms: float
    decode_ms: float
    total_ms: float
    slices_encoded: int
    slices_from_cache: int
    completion_tokens: int
    vision_backend: str = "llama.cpp"  #: who ran the vision encoder (see ``Model.info``)

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second after the first one."""
        if self.completion_tokens < 2 or self.decode_ms <= 0:
            return 0.0
        return (self.completion_tokens - 1) / (self.decode_ms / 1000.0)


@dataclass(frozen=True)
class VideoStats:
    """What happened to the frames of the videos in a question.

    ``sampled``: frames decoded from the videos; ``dropped``: near-duplicates removed;
    ``thinned``: removed so the prompt fits in the context; ``used``: frames in the
    prompt; ``encoded``: of those, frames that went through the vision encoder in this
    call (the others came from the embedding cache or were already in the KV cache).
    """

    sampled: int
    dropped: int
    thinned: int
    used: int
    encoded: int


class Reply(str):
    """The answer text (a ``str``), with ``usage``, ``timings``, ``reasoning``, ``finish_reason``,
    ``dropped_turns`` and, for questions about videos, ``video`` (:class:`VideoStats`).

    With ``schema=`` or ``format="json"``, ``parsed`` holds the validated value (an instance
    of the pydantic model class or dataclass given) — or None, and ``parse_error`` says why
    (the answer was cut by ``max_tokens``, or did not validate). With ``tools=``, the calls
    the model made are in ``tool_calls`` (the text holds the rest) and ``finish_reason`` is
    ``"tool_calls"``.
    """

    usage: Usage
    timings: Timings
    reasoning: str
    finish_reason: str
    video: VideoStats | None = None
    dropped_turns: int = 0  #: older questions (with their answers) a Chat dropped to make room
    parsed: Any = None
    parse_error: str | None = None
    tool_calls: Sequence[Any] = ()  #: :class:`~gguf_mcv.prompt.tool_calls.ToolCall` values, when tools were given

    def __new__(
        cls, text: str, *, usage: Usage, timings: Timings, reasoning: str = "", finish_reason: str
    ) -> "Reply":
        self = super().__new__(cls, text)
        self.usage = usage
        self.timings = timings
        self.reasoning = reasoning
        self.finish_reason = finish_reason
        return self

    @property
    def text(self) -> str:
        return str(self)


@dataclass(frozen=True)
class Progress:
    """How far the vision encoder is with one question's images, for ``on_progress=``.

    ``done`` of ``total`` image slices are ready (``cached`` of them came from the
    embedding cache, at no cost); ``eta_s`` extrapolates from the slices encoded so
    far (None until one has been).
    """

    done: int
    total: int
    cached: int
    elapsed_s: float
    eta_s: float | None


def parsed_as_json(value: Any) -> Any:
    """A parsed answer (``Reply.parsed``) as JSON data: pydantic models and dataclasses become dicts."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value
