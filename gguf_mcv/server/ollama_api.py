"""The Ollama API: ``/api/generate`` and ``/api/chat`` (NDJSON), model listings, version, ``/``."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ..errors import MediaError
from ..options import check_sampling, stop_list
from ..reply import Reply
from ..runtime.generation import Stream
from .answering import answer, answer_stream, place_in_queue
from .bodies import Body, json_body
from .gate import Place
from .http_errors import HTTPError, error_responses, json_request_body, streamed_responses
from .state import State, check_output, dropped_turns_header, file_mtime, model_stream, state_of

#: The Ollama API version reported by /api/version (tools gate features on it).
OLLAMA_API_VERSION = "0.12.0"


class OllamaOptions(Body):
    # sampling values are checked by gguf_mcv.options, as everywhere else
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    num_predict: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None


class _OllamaRequest(Body):
    model: str | None = None
    stream: bool | None = True  # Ollama streams unless told not to
    options: OllamaOptions | None = None
    think: bool | str | None = None
    format: str | dict[str, Any] | None = None

    def check_supported(self, **refused: Any) -> None:
        if isinstance(self.format, str) and self.format not in ("", "json"):
            raise HTTPError(400, f"format must be 'json' or a JSON schema, not {self.format!r}.")
        for name, value in refused.items():
            if value:
                raise HTTPError(400, f"{name} is not supported by this server.")

    def options_for(self, n_ctx: int) -> dict[str, Any]:
        """Keyword arguments for :meth:`Model.chat_completion`."""
        o = self.options or OllamaOptions()
        think = self.think if not isinstance(self.think, str) else self.think.lower() not in ("", "false")
        sampling = check_sampling(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                                  repeat_penalty=o.repeat_penalty,
                                  seed=o.seed if o.seed is None or o.seed >= 0 else None)  # Ollama: -1 = random
        return dict(max_tokens=o.num_predict if o.num_predict and o.num_predict > 0 else n_ctx,
                    stop=stop_list(o.stop), thinking=think, format=self.format or None,
                    tools=getattr(self, "tools", None) or None, **sampling)


class GenerateRequest(_OllamaRequest):
    prompt: str | None = ""
    images: list[str] | None = None
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    raw: bool | None = None
    context: list[int] | None = None


class OllamaMessage(Body):
    role: str
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class OllamaChatRequest(_OllamaRequest):
    messages: list[OllamaMessage] | None = None
    tools: list[Any] | None = None


class ShowRequest(Body):
    model: str | None = None
    name: str | None = None  # what older clients send


router = APIRouter(responses=error_responses(ollama=True))


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    return {"models": [_ollama_model(state_of(request))]}


@router.get("/api/ps")
async def running(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {"models": [{**_ollama_model(state), "size_vram": 0, "context_length": state.model.info.n_ctx}]}


@router.post("/api/show", openapi_extra=json_request_body(ShowRequest))
async def show(request: Request, body: Annotated[ShowRequest, Depends(json_body(ShowRequest))]) -> Any:
    state = state_of(request)
    state.check_model(body.model or body.name or state.name)
    info = state.model.info
    capabilities = ["completion", "vision", "tools"] + (["thinking"] if info.can_think else [])
    return {"modelfile": "", "parameters": "", "template": "", "details": _details(state),
            # file names only: where the files live is no business of the clients
            "model_info": {"general.architecture": "minicpmv", "general.name": info.name,
                           "general.file": Path(info.model_path).name,
                           "general.mmproj": Path(info.mmproj_path).name,
                           "minicpmv.context_length": info.n_ctx},
            "capabilities": capabilities, "modified_at": _iso(file_mtime(info.model_path))}


def _ollama_model(state: State) -> dict[str, Any]:
    info = state.model.info
    files = [info.model_path, info.mmproj_path]
    size = sum(os.path.getsize(f) for f in files if os.path.exists(f))
    # a digest of the file identity, not of its contents (hashing gigabytes per listing is too slow)
    digest = hashlib.sha256(f"{info.model_path}:{size}:{file_mtime(info.model_path)}".encode()).hexdigest()
    name = state.name if ":" in state.name else f"{state.name}:latest"
    return {"name": name, "model": name, "modified_at": _iso(file_mtime(info.model_path)), "size": size,
            "digest": digest, "details": _details(state)}


def _details(state: State) -> dict[str, Any]:
    from ..models.quants import quant_from_name

    info = state.model.info
    quant = info.quant or quant_from_name(Path(info.model_path).name) or ""
    return {"parent_model": "", "format": "gguf", "family": "minicpmv", "families": ["minicpmv", "clip"],
            "parameter_size": "", "quantization_level": quant}


@router.post("/api/generate", responses=streamed_responses("application/x-ndjson"),
              openapi_extra=json_request_body(GenerateRequest))
async def generate(request: Request,
                   place: Annotated[Place, Depends(place_in_queue)],  # before the body (see openai_api)
                   body: Annotated[GenerateRequest, Depends(json_body(GenerateRequest))]) -> Any:
    state = state_of(request)
    name = state.check_model(body.model)
    body.check_supported(suffix=body.suffix, template=body.template, raw=body.raw, context=body.context)
    prompt, images = body.prompt or "", body.images or []
    if not prompt and not images:  # Ollama's way of asking to load the model
        return _ollama_part(name, "", chat=False) | {"done": True, "done_reason": "load"}

    def messages() -> list[dict[str, Any]]:
        system = [] if not body.system else [{"role": "system", "content": body.system}]
        return system + [_ollama_user("user", prompt, images)]

    return await _ollama_answer(request, place, body, name, messages, chat=False)


@router.post("/api/chat", responses=streamed_responses("application/x-ndjson"),
              openapi_extra=json_request_body(OllamaChatRequest))
async def chat(request: Request,
               place: Annotated[Place, Depends(place_in_queue)],  # before the body (see openai_api)
               body: Annotated[OllamaChatRequest, Depends(json_body(OllamaChatRequest))]) -> Any:
    state = state_of(request)
    name = state.check_model(body.model)
    body.check_supported()
    given = body.messages or []
    if not given:
        return _ollama_part(name, "", chat=True) | {"done": True, "done_reason": "load"}

    def messages() -> list[dict[str, Any]]:
        return [_ollama_user(m.role, m.content or "", m.images or [], m.tool_calls) for m in given]

    return await _ollama_answer(request, place, body, name, messages, chat=True, tools=bool(body.tools))


async def _ollama_answer(request: Request, place: Place, body: _OllamaRequest, name: str,
                         messages: Callable[[], list[dict[str, Any]]], *, chat: bool, tools: bool = False) -> Any:
    """Answer ``messages()`` (made on the answer's thread: base64 decoding is not free)."""
    state = state_of(request)
    began = time.perf_counter()
    options = body.options_for(state.model.info.n_ctx)
    await asyncio.to_thread(check_output, state.model, options)

    def start() -> Stream:
        return model_stream(state, messages(), options)

    if body.stream is not False:
        shape = partial(_ollama_chunks, model=name, chat=chat, began=began, hold=tools)
        return await answer_stream(request, place, start, shape, ndjson=True)
    reply = await answer(request, place, start)
    return JSONResponse(_ollama_final(name, reply, chat=chat, began=began, text=str(reply)),
                        headers=dropped_turns_header(reply))


def _ollama_user(role: str, text: str, images: list[str],
                 tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An OpenAI-style message: the images (base64, as Ollama sends them) first, then the text."""
    if tool_calls:
        return {"role": role, "content": text, "tool_calls": tool_calls}
    if not images:
        return {"role": role, "content": text}
    parts = [{"type": "image_url", "image_url": {"url": _base64_data_uri(b64, i)}}
             for i, b64 in enumerate(images)]
    return {"role": role, "content": parts + [{"type": "text", "text": text}]}


def _base64_data_uri(text: str, index: int) -> str:
    if text.startswith("data:"):
        return text
    clean = "".join(text.split())  # line-wrapped base64 is common
    try:
        base64.b64decode(clean, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"images[{index}] is not valid base64 image data.") from None
    return "data:;base64," + clean


def _ollama_chunks(stream: Stream, *, model: str, chat: bool, began: float,
                   hold: bool = False) -> Iterator[dict[str, Any]]:
    """Ollama's streaming lines: one per piece, then the final one with the counters. With
    ``hold`` (tools given) the text comes in the final line: a call must not arrive as text."""
    if hold:
        reply = stream.result()
        yield _ollama_final(model, reply, chat=chat, began=began, text=str(reply))
        return
    for piece in stream:
        yield _ollama_part(model, piece, chat=chat)
    assert stream.reply is not None
    yield _ollama_final(model, stream.reply, chat=chat, began=began, text="")


def _ollama_part(model: str, text: str, *, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "created_at": _iso(time.time())}
    if chat:
        body["message"] = {"role": "assistant", "content": text}
    else:
        body["response"] = text
    body["done"] = False
    return body


def _ollama_final(model: str, reply: Reply, *, chat: bool, began: float, text: str) -> dict[str, Any]:
    """The last line (or the whole non-streaming answer): done, with durations in nanoseconds."""
    final = _ollama_part(model, text, chat=chat)
    if reply.reasoning:
        (final["message"] if chat else final)["thinking"] = reply.reasoning
    if chat and reply.tool_calls:
        final["message"]["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}}
                                          for c in reply.tool_calls]
    def ns(ms: float) -> int:
        return int(ms * 1e6)

    final.update(
        done=True, done_reason="stop" if reply.finish_reason == "tool_calls" else reply.finish_reason,
        total_duration=int((time.perf_counter() - began) * 1e9), load_duration=0,
        prompt_eval_count=reply.usage.prompt_tokens, prompt_eval_duration=ns(reply.timings.prefill_ms),
        eval_count=reply.usage.completion_tokens, eval_duration=ns(reply.timings.decode_ms),
    )
    if reply.dropped_turns:  # not an Ollama field: what `serve --truncate` dropped
        final["dropped_turns"] = reply.dropped_turns
    return final


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")
