"""Checked by mypy (``[tool.mypy] files`` in pyproject.toml), never run: every question's return
type follows ``stream``, and its sampling keywords are typed (a misspelt one is a type error)."""

from __future__ import annotations

import sys

from gguf_mcv import Chat, Model, Reply, SamplingKeywords, Stream

if sys.version_info >= (3, 11):
    from typing import assert_type
else:
    from typing_extensions import assert_type


def questions(model: Model, chat: Chat, settings: SamplingKeywords, flag: bool) -> None:
    messages = [{"role": "user", "content": "Hi."}]
    assert_type(model.ask("Hi.", temperature=0.1, seed=1), Reply)
    assert_type(model.ask("Hi.", stream=True, **settings), Stream)
    assert_type(model.ask("Hi.", stream=flag), Reply | Stream)
    assert_type(model.ask_video("Hi.", "clip.mp4", top_k=4), Reply)
    assert_type(model.ask_video("Hi.", "clip.mp4", stream=True, min_p=0.1), Stream)
    assert_type(model.chat_completion(messages, repeat_penalty=1.1), Reply)
    assert_type(model.chat_completion(messages, stream=True, **settings), Stream)
    assert_type(chat.send("Hi.", top_p=0.9), Reply)
    assert_type(chat.send("Hi.", stream=True), Stream)
    assert_type(chat.regenerate(seed=2), Reply)
    assert_type(chat.regenerate(stream=True), Stream)
    # warn_unused_ignores: each of these must stay a type error
    model.ask("Hi.", temprature=0.1)  # type: ignore[call-overload]
    model.chat_completion(messages, top_k="many")  # type: ignore[call-overload]
    chat.send("Hi.", seed=1.5)  # type: ignore[call-overload]
