"""HTTP errors: the error type the routes raise, its OpenAI and Ollama shapes, the handlers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import (
    ConfigError,
    ContextOverflowError,
    GgufMcvError,
    MediaError,
    ModelFileChangedError,
    ModelNotFoundError,
)

log = logging.getLogger("gguf_mcv.server")

#: Seconds a request cut off by a stopping server is told to wait (a supervised server's new
#: worker takes about that long to load the tiny model; a real one longer, and clients retry).
STOPPING_RETRY_AFTER_S = 5

#: Called when a weights file changed under the loaded model: a supervised worker sets it to end
#: itself, so that its supervisor loads the model again from the files as they are now.
on_model_file_changed: Callable[[ModelFileChangedError], None] | None = None

#: Status for a request whose client hung up before it was answered (nginx's convention).
CLIENT_CLOSED = 499


_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
_OPENAI_SHAPE = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": _NULLABLE_STRING,
                   "code": _NULLABLE_STRING}}}}
_OLLAMA_SHAPE = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_STATUSES = {400: "Bad request", 401: "Missing or wrong API key", 403: "Origin not allowed", 404: "Not found",
             408: "Body too slow", 413: "Body too large", 415: "Body not JSON", 421: "Host not allowed",
             500: "A fault", 503: "Busy or stopping (Retry-After)"}


def error_responses(ollama: bool) -> dict[int | str, dict[str, Any]]:
    """The error answers a route declares in its OpenAPI schema: Ollama's shape or OpenAI's."""
    schema = _OLLAMA_SHAPE if ollama else _OPENAI_SHAPE
    return {status: {"description": what, "content": {"application/json": {"schema": schema}}}
            for status, what in _STATUSES.items()}


def json_request_body(model: type) -> dict[str, Any]:
    """``openapi_extra`` declaring a JSON request body (routes read theirs with ``bodies.json_body``,
    which FastAPI does not see): an object, checked by ``model`` (a 400 when it does not fit)."""
    return {"requestBody": {"required": True, "description": f"A {model.__name__} (a 400 otherwise).",
                            "content": {"application/json": {"schema": {"type": "object"}}}}}


def streamed_responses(media_type: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is JSON, or ``media_type`` (SSE, NDJSON) when the request asked to stream."""
    return {200: {"description": "The answer; streamed when asked",
                  "content": {"application/json": {"schema": {"type": "object"}},
                              media_type: {"schema": {"type": "string"}}}}}


class HTTPError(Exception):
    """An error answer, rendered in the shape of the API the request was for."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error", 421: "permission_error",
                503: "server_busy"}


def error_response(request: Request, error: HTTPError) -> JSONResponse:
    """``error`` as a response in the shape of the API ``request`` was for."""
    ollama = request.url.path.startswith("/api/")
    content = {"error": error.message} if ollama else openai_error(error)
    return JSONResponse(content, status_code=error.status, headers=error.headers)


def openai_error(error: HTTPError) -> dict[str, Any]:
    """``error`` as an OpenAI error body."""
    return {"error": {"message": error.message, "type": _ERROR_TYPES.get(error.status, "server_error"),
                      "param": error.param, "code": error.code}}


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPError)
    return error_response(request, exc)


async def _on_library_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GgufMcvError)
    return error_response(request, as_http_error(exc))


async def _on_starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(request, HTTPError(exc.status_code, str(exc.detail),
                                              headers=dict(exc.headers or {})))


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED)


async def _on_crash(request: Request, exc: Exception) -> Response:
    # Starlette logs the exception itself after this answer is sent
    return error_response(request, HTTPError(500, f"Internal error: {type(exc).__name__}: {exc}",
                                              code="internal_error"))


def as_http_error(exc: BaseException) -> HTTPError:
    """The HTTP answer for an exception raised while answering; real faults are logged."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, (MediaError, ContextOverflowError, ConfigError)):
        code = "invalid_image" if isinstance(exc, MediaError) else None
        return HTTPError(400, str(exc), code=code)
    if isinstance(exc, ModelNotFoundError):
        return HTTPError(404, str(exc), code="not_found")
    if isinstance(exc, ModelFileChangedError):
        if on_model_file_changed is None:
            return HTTPError(503, str(exc), code="model_file_changed")
        on_model_file_changed(exc)
        return HTTPError(503, f"{exc} The server is loading it again: retry shortly.", code="model_file_changed")
    log.error("Answering failed", exc_info=exc)
    return HTTPError(500, f"Internal error: {type(exc).__name__}: {exc}", code="internal_error")


def add_error_handlers(app: FastAPI) -> None:
    """Answer every exception in the shape of the API the request was for."""
    app.add_exception_handler(HTTPError, _on_http_error)
    app.add_exception_handler(GgufMcvError, _on_library_error)
    app.add_exception_handler(StarletteHTTPException, _on_starlette_error)
    app.add_exception_handler(ClientGone, _on_client_gone)
    app.add_exception_handler(Exception, _on_crash)


class AnswerWhenStopping:
    """ASGI middleware: a request the server cancels as it stops (uvicorn cancels those left at
    the end of its graceful-shutdown time, queued ones included) gets a 503 with ``Retry-After``
    in its API's error shape, not uvicorn's plain-text 500 and a ``CancelledError`` traceback.
    A response already started (a stream) just ends there, with one line in the log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python 3.11+
            if uncancel is not None:  # the cancel is answered here; the task ends normally
                uncancel()
            if started:
                log.warning("The server is stopping: a response to %s was cut off.", scope.get("path"))
                return
            refusal = HTTPError(503, f"The server is stopping: this request was not answered; try again in "
                                     f"{STOPPING_RETRY_AFTER_S} s.", code="server_stopping",
                                headers={"Retry-After": str(STOPPING_RETRY_AFTER_S)})
            await error_response(Request(scope), refusal)(scope, receive, send)
