"""MiniCPMVChatHandler as a drop-in chat_handler for llama_cpp.Llama."""

from __future__ import annotations

import base64
import io
import json

import llama_cpp  # noqa: F401 - the handler is used with llama_cpp.Llama; it must import
import numpy as np
import PIL.Image
import pytest

import gguf_mcv
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
    llama = gguf_mcv.checked_llama(str(tiny.quants["Q4_K_M"]), n_ctx=4096, chat_handler=handler,
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


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["city"]}}}


def test_tools_round_trip_like_llama_cpp_python_handlers(llm) -> None:
    llama, handler = llm
    messages = [user("Weather in Paris?")]
    out = llama.create_chat_completion(messages=messages, tools=[WEATHER], tool_choice="required",
                                       max_tokens=100, seed=1)
    message = out["choices"][0]["message"]
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)

    messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}]
    answer = llama.create_chat_completion(messages=messages, tools=[WEATHER], max_tokens=4, seed=2)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= out["usage"]["prompt_tokens"]

    chunks = list(llama.create_chat_completion(messages=[user("Again?")], tools=[WEATHER], stream=True,
                                               tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                               max_tokens=100, seed=3))
    calls = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("kwargs, message", [
    ({"functions": [{"name": "f"}]}, "use tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "not both"),
    ({"tools": "get_weather"}, "must be a list"),
])
def test_unsupported_or_bad_tool_arguments_are_refused(llm, kwargs, message) -> None:
    llama, _ = llm
    with pytest.raises(ConfigError, match=message):
        llama.create_chat_completion(messages=[user("?")], max_tokens=2, **kwargs)


def test_missing_mmproj_is_model_not_found(tmp_path) -> None:
    from gguf_mcv.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        MiniCPMVChatHandler(tmp_path / "nope.gguf")


def test_the_onnx_vision_backend_encodes_instead_of_libmtmd(tiny) -> None:
    pytest.importorskip("onnxruntime")
    handler = MiniCPMVChatHandler(str(tiny.mmproj), vision_backend="onnx-int8")
    llama = gguf_mcv.checked_llama(str(tiny.quants["Q4_K_M"]), n_ctx=4096, chat_handler=handler, verbose=False)
    try:
        out = llama.create_chat_completion(messages=[user("What is it?", data_uri(9, (900, 700)))], max_tokens=2)
        engine = handler.engine_for(llama)
        assert engine.vision_backend == "onnx-int8" and engine.encoder.encoder.calls == 5  # overview + 2x2
        assert engine.mmproj_path != str(tiny.mmproj)  # libmtmd holds the stand-in, not the tower
        assert out["usage"]["prompt_tokens_details"]["image_tokens"] == 5 * 64
        assert "int8 vs fp32 cosine" in handler.vision_backend_reason
    finally:
        llama.close()


@pytest.mark.parametrize("kwargs", [{"vision_backend": "onnx"}, {"mmproj_precision": "fp8"},
                                    {"vision_backend": "onnx-fp32", "mmproj_precision": "bf16"}])
def test_bad_vision_settings_are_refused_at_once(tiny, kwargs) -> None:
    with pytest.raises(ConfigError):
        MiniCPMVChatHandler(str(tiny.mmproj), **kwargs)
