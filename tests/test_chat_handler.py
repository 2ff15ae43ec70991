"""MiniCPMVChatHandler as a drop-in chat_handler for llama_cpp.Llama."""

from __future__ import annotations

import base64
import io

import llama_cpp
import numpy as np
import PIL.Image
import pytest

from gguf_mcv import MiniCPMVChatHandler
from gguf_mcv.errors import ConfigError, MediaError


def data_uri(seed: int, size=(320, 240)) -> str:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def llm(tiny):
    handler = MiniCPMVChatHandler(str(tiny.mmproj))
    llama = llama_cpp.Llama(model_path=str(tiny.quants["Q4_K_M"]), n_ctx=4096, chat_handler=handler,
                            verbose=False)
    yield llama, handler
    llama.close()


def user(text: str, *images: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def test_create_chat_completion_answers_with_usage(llm) -> None:
    llama, handler = llm
    out = llama.create_chat_completion(messages=[user("What is it?", data_uri(1))], max_tokens=6)
    assert out["object"] == "chat.completion"
    usage = out["usage"]
    assert usage["prompt_tokens_details"]["image_tokens"] == 64
    assert 1 <= usage["completion_tokens"] <= 6  # the peer handler reports far more than max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_follow_up_does_not_re_encode(llm) -> None:
    llama, handler = llm
    messages = [user("Describe.", data_uri(2, (900, 700)))]
    first = llama.create_chat_completion(messages=messages, max_tokens=4, seed=1)
    calls = handler.engine_for(llama).encoder_calls
    messages += [first["choices"][0]["message"], user("And the colours?")]
    second = llama.create_chat_completion(messages=messages, max_tokens=4, seed=1)
    assert handler.engine_for(llama).encoder_calls == calls
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]


def test_streaming_chunks(llm) -> None:
    llama, _ = llm
    chunks = list(llama.create_chat_completion(messages=[user("Go.", data_uri(3))], max_tokens=5,
                                               stream=True))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


def test_file_paths_work_and_remote_urls_are_refused(llm, tmp_path) -> None:
    llama, _ = llm
    path = tmp_path / "a.png"
    PIL.Image.new("RGB", (50, 50), (10, 200, 10)).save(path)
    for url in (str(path), path.as_uri()):
        out = llama.create_chat_completion(messages=[user("?", url)], max_tokens=1)
        assert out["usage"]["prompt_tokens_details"]["image_tokens"] == 64
    with pytest.raises(MediaError, match="Remote URLs are not allowed"):
        llama.create_chat_completion(messages=[user("?", "https://example.com/x.png")], max_tokens=1)


def test_unsupported_features_are_refused(llm) -> None:
    llama, _ = llm
    with pytest.raises(ConfigError, match="tools"):
        llama.create_chat_completion(messages=[user("?")], tools=[{"type": "function",
                                     "function": {"name": "f", "parameters": {}}}])


def test_missing_mmproj_is_model_not_found(tmp_path) -> None:
    from gguf_mcv.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        MiniCPMVChatHandler(tmp_path / "nope.gguf")
