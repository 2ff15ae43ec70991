"""OpenAI chat-completion response shapes built from a :class:`~gguf_mcv.reply.Reply` or a stream."""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Iterator

from .generation import Stream
from .reply import Reply


def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def usage(reply: Reply) -> dict[str, Any]:
    """OpenAI ``usage``, with image and cached prompt tokens in the details."""
    u = reply.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "image_tokens": u.image_tokens},
    }


def completion(reply: Reply, *, model: str) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": str(reply)}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    return {
        "id": new_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": reply.finish_reason}],
        "usage": usage(reply),
    }


def chunk_maker(model: str) -> Callable[..., dict[str, Any]]:
    """``chunk(delta, finish=None, **extra)``: one ``chat.completion.chunk`` of one answer (same id)."""
    base = {"id": new_id(), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}], **extra}

    return chunk


def completion_chunks(stream: Stream, *, model: str) -> Iterator[dict[str, Any]]:
    """``chat.completion.chunk`` objects: the role, one per text piece, then the finish (with usage)."""
    chunk = chunk_maker(model)
    try:
        yield chunk({"role": "assistant", "content": ""})
        for piece in stream:
            yield chunk({"content": piece})
        reply = stream.reply
        assert reply is not None
        yield chunk({}, reply.finish_reason, usage=usage(reply))
    finally:
        stream.close()
