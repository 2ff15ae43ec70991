"""OpenAI chat-completion response shapes built from a :class:`~gguf_mcv.reply.Reply` or a stream."""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Iterator

from .reply import Reply
from .runtime.generation import Stream


def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def usage(reply: Reply) -> dict[str, Any]:
    """OpenAI ``usage``, with image and cached prompt tokens in the details, and
    ``dropped_turns`` when turns were dropped to make the conversation fit."""
    u = reply.usage
    counts = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "image_tokens": u.image_tokens},
    }
    return {**counts, "dropped_turns": reply.dropped_turns} if reply.dropped_turns else counts


def completion(reply: Reply, *, model: str) -> dict[str, Any]:
    """A ``chat.completion`` object, with the reply's ``tool_calls`` (content None if empty)."""
    message: dict[str, Any] = {"role": "assistant", "content": str(reply)}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["content"] = str(reply) or None
        message["tool_calls"] = [call.openai() for call in reply.tool_calls]
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


def tool_call_chunks(stream: Stream, *, model: str) -> Iterator[dict[str, Any]]:
    """Chunks of an answer that may call a tool: the text is sent once the answer is known (a call
    must not reach the client as text), then the calls, then the finish (with usage)."""
    chunk = chunk_maker(model)
    try:
        yield chunk({"role": "assistant", "content": ""})
        reply = stream.result()
        if str(reply):
            yield chunk({"content": str(reply)})
        if reply.tool_calls:
            yield chunk({"tool_calls": [{"index": i, **call.openai()} for i, call in enumerate(reply.tool_calls)]})
        yield chunk({}, reply.finish_reason, usage=usage(reply))
    finally:
        stream.close()
