"""The OpenAI API: ``/v1/models`` and ``/v1/chat/completions`` (SSE when streaming)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from ..openai_compat import completion, completion_chunks, tool_call_chunks
from ..options import check_sampling, stop_list
from .answering import answer, answer_stream, place_in_queue
from .bodies import Body, json_body
from .gate import Place
from .http_errors import HTTPError, error_responses, json_request_body, streamed_responses
from .media_urls import check_media_urls
from .remote_media import fetch_remote_media
from .state import State, check_output, dropped_turns_header, file_mtime, model_stream, state_of


class StreamOptions(Body):
    include_usage: bool = False


class ChatMessage(Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(Body):
    """``POST /v1/chat/completions``; usage is reported whatever ``stream_options`` says."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # sampling values are checked by gguf_mcv.options, as everywhere else
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise HTTPError(400, "Only n=1 is supported.", param="n")
        if self.logprobs:
            raise HTTPError(400, "logprobs are not supported.", param="logprobs")
        self.output_format()

    def output_format(self) -> dict[str, Any]:
        """``schema=``/``format=`` for :meth:`Model.chat_completion` from ``response_format``."""
        spec = self.response_format or {}
        kind = spec.get("type", "text")
        if kind == "text":
            return {}
        if kind == "json_object":
            return {"format": "json"}
        if kind == "json_schema":
            schema = (spec.get("json_schema") or {}).get("schema") if isinstance(spec.get("json_schema"), dict) \
                else None
            if not isinstance(schema, dict):
                raise HTTPError(400, "response_format of type json_schema needs json_schema.schema, a JSON "
                                     "schema object.", param="response_format")
            return {"schema": schema}
        raise HTTPError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', not "
                             f"{kind!r}.", param="response_format")

    def options(self, n_ctx: int) -> dict[str, Any]:
        """Keyword arguments for :meth:`Model.chat_completion`."""
        thinking = (self.chat_template_kwargs or {}).get("enable_thinking")
        sampling = check_sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  repeat_penalty=self.repeat_penalty, seed=self.seed)
        return dict(max_tokens=self.max_completion_tokens or self.max_tokens or n_ctx,
                    stop=stop_list(self.stop), thinking=None if thinking is None else bool(thinking),
                    tools=self.tools, tool_choice=self.tool_choice, **sampling, **self.output_format())

    def message_dicts(self) -> list[dict[str, Any]]:
        # "developer" is what newer OpenAI clients call the system role
        return [{**m.model_dump(), "role": "system" if m.role == "developer" else m.role}
                for m in self.messages]


router = APIRouter(responses=error_responses(ollama=False))


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state_of(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    state = state_of(request)
    state.check_model(model_id)
    return _model_card(state)


def _model_card(state: State) -> dict[str, Any]:
    return {"id": state.name, "object": "model", "owned_by": "gguf_mcv",
            "created": int(file_mtime(state.model.info.model_path))}


@router.post("/v1/chat/completions", responses=streamed_responses("text/event-stream"),
             openapi_extra=json_request_body(ChatCompletionRequest))
async def chat_completions(
    request: Request,
    place: Annotated[Place, Depends(place_in_queue)],  # before the body: a full queue refuses it unread
    body: Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))],
) -> Any:
    state = state_of(request)
    state.check_model(body.model)
    name = state.name  # OpenAI answers name the model that answered
    body.check_supported()
    messages = body.message_dicts()
    check_media_urls(messages, allow_remote=state.allow_remote, allow_files=state.policy.allow_files)
    if state.allow_remote:
        messages = await asyncio.to_thread(fetch_remote_media, messages, state.max_body_bytes)
    options = body.options(state.model.info.n_ctx)
    await asyncio.to_thread(check_output, state.model, options)
    start = partial(model_stream, state, messages, options)
    if body.stream:
        shape = tool_call_chunks if body.tools and body.tool_choice != "none" else completion_chunks
        return await answer_stream(request, place, start, partial(shape, model=name), ndjson=False)
    reply = await answer(request, place, start)
    return JSONResponse(completion(reply, model=name), headers=dropped_turns_header(reply))
