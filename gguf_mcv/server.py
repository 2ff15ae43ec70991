"""A local HTTP server for one :class:`~gguf_mcv.model.Model`: OpenAI and Ollama clients work as they are.

    from gguf_mcv.server import serve
    serve(model, port=8080)            # http://127.0.0.1:8080/v1 and http://127.0.0.1:8080/api

Routes (``/health`` needs no key, every other route does when a key is set):

* OpenAI: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``
  (SSE when ``stream``; usage always in the last chunk). Errors are
  ``{"error": {"message", "type", "param", "code"}}``.
* Ollama: ``POST /api/generate``, ``POST /api/chat`` (NDJSON unless ``"stream": false``),
  ``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``GET /api/version``, ``GET /``.
  Errors are ``{"error": "message"}``.
* ``GET /health`` (model name, queue length) and ``GET /metrics`` (JSON counters).

The model answers one request at a time; up to ``max_queue`` more wait, later ones get
``503`` with ``Retry-After`` (Ollama's own answer to a full queue; OpenAI clients retry
it). Each answer runs on its own thread; a client that hangs up stops its generation.

Security: binds 127.0.0.1 by default. The API key (``api_key=``, else the environment
variable ``GGUF_MCV_API_KEY``) is accepted as ``Authorization: Bearer <key>``. Request
bodies over ``max_body_bytes`` get 413. Images and videos come inside the request
(data: URIs, Ollama's base64); local paths and ``file://`` URLs only with
``allow_local_files``; ``http(s)`` URLs only with ``allow_remote_media``, and then the
server fetches them itself (size cap, timeout, at most 3 redirects) and only from
public addresses: every address the host resolves to is checked and the connection
goes to the checked one, so a URL cannot reach loopback, private or link-local hosts.

A request's ``model`` may be omitted; if given it must name the served model: its
served name, catalog name or alias, Hub repo, display name or file stem, any case,
with or without an Ollama tag (``:latest`` or the quant, e.g. ``minicpm-v-2.6:q4_k_m``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import math
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Annotated, Any, TypeVar

try:
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field, ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "gguf_mcv.server needs FastAPI and uvicorn: pip install 'gguf-mcv[server]'"
    ) from exc

from . import __version__
from .errors import ConfigError, ContextOverflowError, GgufMcvError, MediaError, ModelNotFoundError
from .generation import Stream
from .messages import MediaPolicy
from .model import Model
from .openai_compat import completion, completion_chunks
from .reply import Reply

__all__ = ["API_KEY_ENV", "build_app", "serve"]

log = logging.getLogger("gguf_mcv.server")

API_KEY_ENV = "GGUF_MCV_API_KEY"
DEFAULT_MAX_BODY_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_QUEUE = 8
#: Connect and per-read timeout when fetching a remote image or video.
REMOTE_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
#: The Ollama API version reported by /api/version (tools gate features on it).
OLLAMA_API_VERSION = "0.12.0"
#: Status for a request whose client hung up before it was answered (nginx's convention).
CLIENT_CLOSED = 499

T = TypeVar("T")


# -- public API -------------------------------------------------------------------------


def build_app(
    model: Model,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int = DEFAULT_MAX_QUEUE,
    allow_local_files: bool = False,
    allow_remote_media: bool = False,
) -> FastAPI:
    """A FastAPI app serving ``model`` over the OpenAI and Ollama APIs (see the module doc).

    ``model_name`` is the name clients see (default: the catalog name, else the model's
    name). ``api_key=None`` reads ``$GGUF_MCV_API_KEY``; ``api_key=""`` means no key.
    ``max_queue`` requests may wait while one is answered.
    """
    if max_queue < 0 or max_body_bytes < 1:
        raise ConfigError("max_queue must be >= 0 and max_body_bytes >= 1.")
    key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
    served, names = _model_names(model, model_name)
    state = _State(
        model=model, name=served, names=names, api_key=key or None, max_body_bytes=max_body_bytes,
        policy=MediaPolicy(allow_files=allow_local_files, allow_remote=False),
        allow_remote=allow_remote_media, gate=_Gate(max_queue), metrics=_Metrics(),
    )
    app = FastAPI(title="gguf_mcv", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.gguf = state
    app.include_router(_health)
    app.include_router(_openai, dependencies=[Depends(_authorize)])
    app.include_router(_ollama, dependencies=[Depends(_authorize)])
    app.add_exception_handler(_HTTPError, _on_http_error)
    app.add_exception_handler(GgufMcvError, _on_library_error)
    app.add_exception_handler(StarletteHTTPException, _on_starlette_error)
    app.add_exception_handler(_ClientGone, _on_client_gone)
    app.add_exception_handler(Exception, _on_crash)
    app.add_middleware(_CountRequests, metrics=state.metrics)
    return app


def serve(
    model: Model,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int = DEFAULT_MAX_QUEUE,
    allow_local_files: bool = False,
    allow_remote_media: bool = False,
    log_level: str = "info",
) -> None:
    """Serve ``model`` with uvicorn until interrupted (options as in :func:`build_app`)."""
    import uvicorn

    app = build_app(model, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                    max_queue=max_queue, allow_local_files=allow_local_files,
                    allow_remote_media=allow_remote_media)
    if app.state.gguf.api_key is None and not _is_loopback(host):
        log.warning("Serving on %s without an API key: anyone who can reach it can use the model. "
                    "Set %s or pass api_key.", host, API_KEY_ENV)
    # a graceful-shutdown limit: an endless stream must not keep Ctrl-C waiting
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# -- state --------------------------------------------------------------------------------


@dataclass
class _State:
    """What the routes share: the model, settings, the queue and the counters."""

    model: Model
    name: str
    names: frozenset[str]
    api_key: str | None
    max_body_bytes: int
    policy: MediaPolicy
    allow_remote: bool
    gate: _Gate
    metrics: _Metrics

    def check_model(self, requested: str | None) -> str:
        """The name to echo for ``requested``; 404 if it names another model."""
        if not requested:
            return self.name
        if _normal_name(requested) not in self.names:
            raise _HTTPError(404, f"Model {requested!r} not found: this server runs {self.name!r}.",
                             code="model_not_found", param="model")
        return requested


def _state(request: Request) -> _State:
    return request.app.state.gguf


def _model_names(model: Model, model_name: str | None) -> tuple[str, frozenset[str]]:
    """The served name, and every name (normalised) a request may use for it."""
    info = model.info
    entry = _catalog_entry(info.name, info.repo)
    served = model_name or (entry.name if entry is not None else info.name)
    names = {served, info.name, Path(info.model_path).stem, Path(info.model_path).name}
    if info.repo:
        names.add(info.repo)
    if entry is not None:
        names.update({entry.name, entry.display_name, entry.repo, *entry.aliases})
    # an Ollama-style alias ("minicpm-v:8b") also answers to its bare name, as in Ollama
    names.update(n.partition(":")[0] for n in list(names) if ":" in n and "/" not in n)
    return served, frozenset(_normal_name(n) for n in names)


def _catalog_entry(name: str, repo: str | None):
    from .catalog import load_catalog

    try:
        catalog = load_catalog()
    except (GgufMcvError, OSError):
        return None
    return (catalog.by_repo(repo) if repo else None) or catalog.find(name)


def _normal_name(name: str) -> str:
    """Case-folded, without an Ollama tag (``:latest``, ``:q4_k_m``…)."""
    name = name.strip().casefold()
    base, sep, tag = name.rpartition(":")
    if sep and "/" not in tag:
        from .quants import is_known_quant

        if tag == "latest" or is_known_quant(tag):
            return base
    return name


# -- errors ---------------------------------------------------------------------------------


class _HTTPError(Exception):
    """An error answer, rendered in the shape of the API the request was for."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers


class _ClientGone(Exception):
    """The client hung up before its answer was ready."""


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 503: "server_busy"}


def _error_response(request: Request, error: _HTTPError) -> JSONResponse:
    ollama = request.url.path.startswith("/api/")
    content = {"error": error.message} if ollama else _openai_error(error)
    return JSONResponse(content, status_code=error.status, headers=error.headers)


def _openai_error(error: _HTTPError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": _ERROR_TYPES.get(error.status, "server_error"),
                      "param": error.param, "code": error.code}}


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, _HTTPError)
    return _error_response(request, exc)


async def _on_library_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GgufMcvError)
    return _error_response(request, _as_http_error(exc))


async def _on_starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return _error_response(request, _HTTPError(exc.status_code, str(exc.detail),
                                               headers=dict(exc.headers or {})))


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED)


async def _on_crash(request: Request, exc: Exception) -> Response:
    # Starlette logs the exception itself after this answer is sent
    return _error_response(request, _HTTPError(500, f"Internal error: {type(exc).__name__}: {exc}",
                                               code="internal_error"))


def _as_http_error(exc: BaseException) -> _HTTPError:
    """The HTTP answer for an exception raised while answering; real faults are logged."""
    if isinstance(exc, _HTTPError):
        return exc
    if isinstance(exc, (MediaError, ContextOverflowError, ConfigError)):
        code = "invalid_image" if isinstance(exc, MediaError) else None
        return _HTTPError(400, str(exc), code=code)
    if isinstance(exc, ModelNotFoundError):
        return _HTTPError(404, str(exc), code="not_found")
    log.error("Answering failed", exc_info=exc)
    return _HTTPError(500, f"Internal error: {type(exc).__name__}: {exc}", code="internal_error")


def _invalid(exc: ValidationError) -> _HTTPError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "json_invalid":
        return _HTTPError(400, f"The request body is not valid JSON: {first['msg']}.")
    where = f"{param}: " if param else ""
    return _HTTPError(400, f"Invalid request: {where}{first['msg']}.", param=param)


# -- request plumbing: key, body, queue, answers ---------------------------------------------


async def _authorize(request: Request) -> None:
    key = _state(request).api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise _HTTPError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


B = TypeVar("B", bound=BaseModel)


def _json_body(schema: type[B]) -> Callable[[Request], Awaitable[B]]:
    """A dependency that reads the body (size-limited, any content type) into ``schema``."""
    async def read(request: Request) -> B:
        raw = await _read_limited(request, _state(request).max_body_bytes)
        try:  # off the event loop: a body may hold megabytes of base64
            return await asyncio.to_thread(schema.model_validate_json, raw)
        except ValidationError as exc:
            raise _invalid(exc) from None
    return read


async def _read_limited(request: Request, limit: int) -> bytes:
    """The request body; 413 as soon as it is known to exceed ``limit`` (chunked bodies too)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise _ClientGone() from None
    return b"".join(chunks)


def _too_large(limit: int) -> _HTTPError:
    return _HTTPError(413, f"The request body is larger than {limit} bytes. Send smaller images "
                           "or start the server with a larger body limit.", code="request_too_large")


class _Gate:
    """One answer at a time, at most ``max_waiting`` waiting; beyond that: busy."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.waiting = 0
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def acquire(self, retry_after: int) -> None:
        if self._lock.locked() and self.waiting >= self.max_waiting:
            raise _HTTPError(503, f"The server is busy ({self.waiting} requests waiting); try again "
                                  f"in {retry_after} s.", code="server_busy",
                             headers={"Retry-After": str(retry_after)})
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1

    def release(self) -> None:
        self._lock.release()


class _Job:
    """One answer generated on its own thread; what it yields reaches the event loop in a queue.

    The thread evaluates the prompt first (so bad images fail before a response starts),
    then iterates ``shape(stream)``, checking between items whether it was cancelled.
    ``done(outcome, reply, seconds)`` is called on the event loop when the thread ends;
    ``outcome`` is ``"answered"`` (with the reply), ``"cancelled"`` or ``"failed"``.
    """

    def __init__(self, start: Callable[[], Stream], shape: Callable[[Stream], Iterable[Any]],
                 done: Callable[[str, Reply | None, float], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._stop = threading.Event()
        self._start, self._shape, self._done = start, shape, done
        self.reply: Reply | None = None
        threading.Thread(target=self._run, name="gguf_mcv-answer", daemon=True).start()

    def cancel(self) -> None:
        self._stop.set()

    async def ready(self) -> None:
        """Wait until the prompt has been evaluated; raise what went wrong before that."""
        kind, value = await self._events.get()
        if kind == "error":
            raise value

    async def items(self) -> AsyncIterator[Any]:
        """What ``shape`` yields, until the end; raises what went wrong."""
        while True:
            kind, value = await self._events.get()
            if kind == "error":
                raise value
            if kind == "end":
                self.reply = value
                return
            yield value

    async def result(self) -> Reply:
        async for _ in self.items():
            pass
        assert self.reply is not None
        return self.reply

    def _run(self) -> None:
        began, outcome, reply = time.perf_counter(), "failed", None
        try:
            stream = _primed(self._start())
            self._emit("ready", None)
            with stream:  # closing it stops generation and frees the model, on this thread
                for item in self._shape(stream):
                    if self._stop.is_set():
                        outcome = "cancelled"
                        return
                    self._emit("item", item)
            outcome, reply = "answered", stream.reply
            self._emit("end", reply)
        except Exception as exc:
            self._emit("error", exc)
        finally:
            self._call(self._done, outcome, reply, time.perf_counter() - began)

    def _emit(self, kind: str, value: Any) -> None:
        self._call(self._events.put_nowait, (kind, value))

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is gone (server shut down)
            pass


def _primed(stream: Stream) -> Stream:
    """Evaluate the prompt now (its errors surface here); a Stream of the same pieces.

    Closing the returned stream closes ``stream``.
    """
    try:
        first = [next(stream)]
    except StopIteration:  # an empty answer: stream.reply is set
        first = []

    def pieces() -> Generator[str, None, Reply]:
        with stream:
            if first:  # an exhausted Stream must not be iterated again: it would lose its reply
                yield first[0]
                yield from stream
        assert stream.reply is not None
        return stream.reply

    return Stream(pieces())


async def _or_hang_up(request: Request, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, unless the client hangs up first: then :class:`_ClientGone`."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_hung_up(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise _ClientGone()
    return task.result()


async def _hung_up(request: Request) -> None:
    # the body has been read, so the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _begin(request: Request, start: Callable[[], Stream],
                 shape: Callable[[Stream], Iterable[Any]]) -> _Job:
    """Wait for the model (503 when the queue is full), start the answer, wait until it runs."""
    state = _state(request)
    await _or_hang_up(request, state.gate.acquire(state.metrics.retry_after()))
    try:
        job = _Job(start, shape, partial(_finished, state))
    except BaseException:
        state.gate.release()
        raise
    with _cancelled_on_error(job):
        await _or_hang_up(request, job.ready())
    return job


@contextmanager
def _cancelled_on_error(job: _Job) -> Iterator[None]:
    """Stop ``job`` if anything goes wrong (a hang-up too); answer its errors over HTTP."""
    try:
        yield
    except (_ClientGone, _HTTPError):
        job.cancel()
        raise
    except Exception as exc:
        job.cancel()
        raise _as_http_error(exc) from None
    except BaseException:
        job.cancel()
        raise


def _finished(state: _State, outcome: str, reply: Reply | None, seconds: float) -> None:
    state.gate.release()
    state.metrics.record(outcome, reply, seconds)


async def _answer(request: Request, start: Callable[[], Stream]) -> Reply:
    """The whole answer (the generation stops if the client hangs up)."""
    job = await _begin(request, start, iter)
    with _cancelled_on_error(job):
        return await _or_hang_up(request, job.result())


async def _answer_stream(request: Request, start: Callable[[], Stream],
                         shape: Callable[[Stream], Iterable[Any]], ndjson: bool) -> Response:
    """A streaming response of what ``shape`` makes of the answer: NDJSON lines or SSE events."""
    job = await _begin(request, start, shape)
    fmt = _ndjson_lines if ndjson else _sse_events
    return _AnswerResponse(job, fmt(job),
                           media_type="application/x-ndjson" if ndjson else "text/event-stream")


class _AnswerResponse(StreamingResponse):
    """A streaming answer whose generation stops however the response ends (a hang-up too)."""

    def __init__(self, job: _Job, content: AsyncIterator[str], media_type: str) -> None:
        super().__init__(content, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


async def _sse_events(job: _Job) -> AsyncIterator[str]:
    try:
        async for chunk in job.items():
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except Exception as exc:  # the response has started: the error goes in the stream
        yield f"data: {json.dumps(_openai_error(_as_http_error(exc)), ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


async def _ndjson_lines(job: _Job) -> AsyncIterator[str]:
    try:
        async for line in job.items():
            yield json.dumps(line, ensure_ascii=False) + "\n"
    except Exception as exc:
        yield json.dumps({"error": _as_http_error(exc).message}, ensure_ascii=False) + "\n"


# -- metrics ----------------------------------------------------------------------------------


@dataclass
class _Metrics:
    """Counters since the server started; changed only on the event loop."""

    started: float = field(default_factory=time.time)
    requests: Counter = field(default_factory=Counter)
    answers: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    image_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    encode_ms: float = 0.0
    answer_seconds: float = 0.0

    def record(self, outcome: str, reply: Reply | None, seconds: float) -> None:
        if reply is None:
            self.cancelled += outcome == "cancelled"
            self.failed += outcome == "failed"
            return
        self.answers += 1
        self.answer_seconds += seconds
        u = reply.usage
        self.prompt_tokens += u.prompt_tokens
        self.image_tokens += u.image_tokens
        self.cached_tokens += u.cached_tokens
        self.completion_tokens += u.completion_tokens
        self.encode_ms += reply.timings.encode_ms

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: about one answer's time."""
        mean = self.answer_seconds / self.answers if self.answers else 1.0
        return min(60, max(1, math.ceil(mean)))

    def snapshot(self, gate: _Gate) -> dict[str, Any]:
        by_route: dict[str, dict[str, int]] = {}
        for (route, status), n in sorted(self.requests.items()):
            by_route.setdefault(route, {})[str(status)] = n
        return {
            "uptime_s": round(time.time() - self.started, 3), "requests": by_route,
            "answers": self.answers, "cancelled": self.cancelled, "failed": self.failed,
            "prompt_tokens": self.prompt_tokens, "image_tokens": self.image_tokens,
            "cached_tokens": self.cached_tokens, "completion_tokens": self.completion_tokens,
            "encode_ms_total": round(self.encode_ms, 3),
            "answer_seconds_total": round(self.answer_seconds, 3),
            "queue_length": gate.waiting, "in_flight": int(gate.busy), "max_queue": gate.max_waiting,
        }


class _CountRequests:
    """ASGI middleware counting requests by route and status (unmatched paths together)."""

    def __init__(self, app: ASGIApp, metrics: _Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            path = getattr(scope.get("route"), "path", "(unmatched)")
            self.metrics.requests[(f"{scope['method']} {path}", status)] += 1


# -- health and metrics routes ------------------------------------------------------------------

_health = APIRouter()


@_health.get("/health")
async def health(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {"status": "ok", "model": state.name, "queue_length": state.gate.waiting,
            "in_flight": int(state.gate.busy)}


@_health.get("/metrics", dependencies=[Depends(_authorize)])
async def metrics(request: Request) -> dict[str, Any]:
    state = _state(request)
    return state.metrics.snapshot(state.gate)


# -- OpenAI ---------------------------------------------------------------------------------------


class _Body(BaseModel):
    """Request bodies accept unknown fields: clients send many this server does not use."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Body):
    """``POST /v1/chat/completions``; usage is reported whatever ``stream_options`` says."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    repeat_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise _HTTPError(400, "Only n=1 is supported.", param="n")
        if self.logprobs:
            raise _HTTPError(400, "logprobs are not supported.", param="logprobs")
        if self.tools:
            raise _HTTPError(400, "Tools are not supported by this server.", param="tools")
        if (self.response_format or {}).get("type", "text") != "text":
            raise _HTTPError(400, "Only response_format type 'text' is supported.",
                             param="response_format")

    def options(self, n_ctx: int) -> dict[str, Any]:
        """Keyword arguments for :meth:`Model.chat_completion`."""
        thinking = (self.chat_template_kwargs or {}).get("enable_thinking")
        return dict(max_tokens=self.max_completion_tokens or self.max_tokens or n_ctx,
                    stop=_stops(self.stop), thinking=None if thinking is None else bool(thinking),
                    temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    repeat_penalty=self.repeat_penalty, seed=self.seed)

    def message_dicts(self) -> list[dict[str, Any]]:
        # "developer" is what newer OpenAI clients call the system role
        return [{**m.model_dump(), "role": "system" if m.role == "developer" else m.role}
                for m in self.messages]


def _stream(state: _State, messages: list[dict[str, Any]], options: dict[str, Any]) -> Stream:
    """Start answering ``messages`` (on the answer's thread) under the server's media policy."""
    stream = state.model.chat_completion(messages, stream=True, policy=state.policy, **options)
    assert isinstance(stream, Stream)
    return stream


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


_openai = APIRouter()


@_openai.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_state(request))]}


@_openai.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    state = _state(request)
    state.check_model(model_id)
    return _model_card(state)


def _model_card(state: _State) -> dict[str, Any]:
    return {"id": state.name, "object": "model", "owned_by": "gguf_mcv",
            "created": int(_mtime(state.model.info.model_path))}


@_openai.post("/v1/chat/completions")
async def chat_completions(
    request: Request, body: Annotated[ChatCompletionRequest, Depends(_json_body(ChatCompletionRequest))],
) -> Any:
    state = _state(request)
    state.check_model(body.model)
    name = state.name  # OpenAI answers name the model that answered
    body.check_supported()
    messages = body.message_dicts()
    if state.allow_remote:
        messages = await asyncio.to_thread(_fetch_remote_media, messages, state.max_body_bytes)
    start = partial(_stream, state, messages, body.options(state.model.info.n_ctx))
    if body.stream:
        return await _answer_stream(request, start, partial(completion_chunks, model=name), ndjson=False)
    return completion(await _answer(request, start), model=name)


# -- remote media -------------------------------------------------------------------------------


def _fetch_remote_media(messages: list[dict[str, Any]], max_bytes: int) -> list[dict[str, Any]]:
    """``messages`` with each http(s) image or video URL replaced by a data: URI of its bytes."""
    def part(p: Any) -> Any:
        kind = p.get("type") if isinstance(p, dict) else None
        value = p.get(kind) if kind in ("image_url", "video_url") else None
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
            return p
        data = "data:;base64," + base64.b64encode(_fetch_public(url, max_bytes=max_bytes)).decode()
        return {**p, kind: {**value, "url": data} if isinstance(value, dict) else data}

    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list)
            else m for m in messages]


def _fetch_public(url: str, *, max_bytes: int, timeout: float = REMOTE_TIMEOUT_S) -> bytes:
    """GET ``url``, but only from public addresses; :class:`MediaError` for anything else.

    Every address the host resolves to must be public, and the connection goes to the
    checked address (no second DNS answer). Redirects are followed (at most
    :data:`MAX_REDIRECTS`), each checked the same way.
    """
    for _ in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError:
            raise MediaError(f"Bad port in media URL {url[:200]}.") from None
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise MediaError(f"Only http(s) media URLs can be fetched, not {url[:200]}.")
        conn = _connect(parts, _public_address(parts.hostname, port, url), port, timeout)
        try:
            conn.request("GET", urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")),
                         headers={"User-Agent": f"gguf_mcv/{__version__}", "Accept": "image/*, video/*"})
            resp = conn.getresponse()
            location = resp.getheader("location")
            if resp.status in (301, 302, 303, 307, 308) and location:
                url = urllib.parse.urljoin(url, location)
                continue
            if resp.status != 200:
                raise MediaError(f"Fetching {url[:200]} failed: HTTP {resp.status}.")
            return _read_capped(resp, max_bytes, url)
        except (OSError, http.client.HTTPException) as exc:  # timeouts, resets, TLS, bad HTTP
            raise MediaError(f"Fetching {url[:200]} failed: {exc}.") from exc
        finally:
            conn.close()
    raise MediaError(f"Fetching {url[:200]}: more than {MAX_REDIRECTS} redirects.")


def _public_address(host: str, port: int, url: str) -> str:
    """An address of ``host`` after checking that all of them are public."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise MediaError(f"Cannot resolve the host of {url[:200]}: {exc}.") from exc
    for info in infos:
        if not _is_public(ipaddress.ip_address(info[4][0])):
            raise MediaError(f"Refusing to fetch {url[:200]}: {host} is not a public address "
                             f"({info[4][0]}).")
    return str(infos[0][4][0])


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _connect(parts: urllib.parse.SplitResult, address: str, port: int,
             timeout: float) -> http.client.HTTPConnection:
    """A connection to ``address`` speaking HTTP(S) for ``parts.hostname`` (TLS checks that name)."""
    host = parts.hostname or ""
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
        if parts.scheme.lower() == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
    except OSError as exc:
        raise MediaError(f"Cannot connect to {host}: {exc}.") from exc
    cls = http.client.HTTPSConnection if parts.scheme.lower() == "https" else http.client.HTTPConnection
    conn = cls(host, port, timeout=timeout)
    conn.sock = sock  # already connected: http.client will not resolve the name again
    return conn


def _read_capped(resp: http.client.HTTPResponse, max_bytes: int, url: str) -> bytes:
    declared = resp.getheader("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise MediaError(f"{url[:200]} is larger than {max_bytes} bytes.")
    data = resp.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise MediaError(f"{url[:200]} is larger than {max_bytes} bytes.")
    return data


# -- Ollama ---------------------------------------------------------------------------------------


class OllamaOptions(_Body):
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    num_predict: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = Field(default=None, gt=0)


class _OllamaRequest(_Body):
    model: str | None = None
    stream: bool | None = True  # Ollama streams unless told not to
    options: OllamaOptions | None = None
    think: bool | str | None = None
    format: str | dict[str, Any] | None = None

    def check_supported(self, **refused: Any) -> None:
        if self.format:
            raise _HTTPError(400, "format (JSON output) is not supported by this server.")
        for name, value in refused.items():
            if value:
                raise _HTTPError(400, f"{name} is not supported by this server.")

    def options_for(self, n_ctx: int) -> dict[str, Any]:
        """Keyword arguments for :meth:`Model.chat_completion`."""
        o = self.options or OllamaOptions()
        think = self.think if not isinstance(self.think, str) else self.think.lower() not in ("", "false")
        return dict(max_tokens=o.num_predict if o.num_predict and o.num_predict > 0 else n_ctx,
                    stop=_stops(o.stop), thinking=think, temperature=o.temperature, top_p=o.top_p,
                    top_k=o.top_k, repeat_penalty=o.repeat_penalty,
                    seed=o.seed if o.seed is None or o.seed >= 0 else None)


class GenerateRequest(_OllamaRequest):
    prompt: str | None = ""
    images: list[str] | None = None
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    raw: bool | None = None
    context: list[int] | None = None


class OllamaMessage(_Body):
    role: str
    content: str | None = ""
    images: list[str] | None = None


class OllamaChatRequest(_OllamaRequest):
    messages: list[OllamaMessage] | None = None
    tools: list[Any] | None = None


class ShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # what older clients send


_ollama = APIRouter()


@_ollama.get("/", response_class=PlainTextResponse)
async def root() -> str:
    return "gguf_mcv is running"


@_ollama.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION}


@_ollama.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    return {"models": [_ollama_model(_state(request))]}


@_ollama.get("/api/ps")
async def running(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {"models": [{**_ollama_model(state), "size_vram": 0, "context_length": state.model.info.n_ctx}]}


@_ollama.post("/api/show")
async def show(request: Request, body: Annotated[ShowRequest, Depends(_json_body(ShowRequest))]) -> Any:
    state = _state(request)
    state.check_model(body.model or body.name or state.name)
    info = state.model.info
    capabilities = ["completion", "vision"] + (["thinking"] if info.can_think else [])
    return {"modelfile": "", "parameters": "", "template": "", "details": _details(state),
            "model_info": {"general.architecture": "minicpmv", "general.name": info.name,
                           "general.file": info.model_path, "general.mmproj": info.mmproj_path,
                           "minicpmv.context_length": info.n_ctx},
            "capabilities": capabilities, "modified_at": _iso(_mtime(info.model_path))}


def _ollama_model(state: _State) -> dict[str, Any]:
    info = state.model.info
    files = [info.model_path, info.mmproj_path]
    size = sum(os.path.getsize(f) for f in files if os.path.exists(f))
    # a digest of the file identity, not of its contents (hashing gigabytes per listing is too slow)
    digest = hashlib.sha256(f"{info.model_path}:{size}:{_mtime(info.model_path)}".encode()).hexdigest()
    name = state.name if ":" in state.name else f"{state.name}:latest"
    return {"name": name, "model": name, "modified_at": _iso(_mtime(info.model_path)), "size": size,
            "digest": digest, "details": _details(state)}


def _details(state: _State) -> dict[str, Any]:
    from .quants import quant_from_name

    info = state.model.info
    quant = info.quant or quant_from_name(Path(info.model_path).name) or ""
    return {"parent_model": "", "format": "gguf", "family": "minicpmv", "families": ["minicpmv", "clip"],
            "parameter_size": "", "quantization_level": quant}


@_ollama.post("/api/generate")
async def generate(request: Request,
                   body: Annotated[GenerateRequest, Depends(_json_body(GenerateRequest))]) -> Any:
    state = _state(request)
    name = state.check_model(body.model)
    body.check_supported(suffix=body.suffix, template=body.template, raw=body.raw, context=body.context)
    prompt, images = body.prompt or "", body.images or []
    if not prompt and not images:  # Ollama's way of asking to load the model
        return _ollama_part(name, "", chat=False) | {"done": True, "done_reason": "load"}

    def messages() -> list[dict[str, Any]]:
        system = [] if not body.system else [{"role": "system", "content": body.system}]
        return system + [_ollama_user("user", prompt, images)]

    return await _ollama_answer(request, body, name, messages, chat=False)


@_ollama.post("/api/chat")
async def chat(request: Request,
               body: Annotated[OllamaChatRequest, Depends(_json_body(OllamaChatRequest))]) -> Any:
    state = _state(request)
    name = state.check_model(body.model)
    body.check_supported(tools=body.tools)
    given = body.messages or []
    if not given:
        return _ollama_part(name, "", chat=True) | {"done": True, "done_reason": "load"}

    def messages() -> list[dict[str, Any]]:
        return [_ollama_user(m.role, m.content or "", m.images or []) for m in given]

    return await _ollama_answer(request, body, name, messages, chat=True)


async def _ollama_answer(request: Request, body: _OllamaRequest, name: str,
                         messages: Callable[[], list[dict[str, Any]]], *, chat: bool) -> Any:
    """Answer ``messages()`` (made on the answer's thread: base64 decoding is not free)."""
    state = _state(request)
    began = time.perf_counter()
    options = body.options_for(state.model.info.n_ctx)

    def start() -> Stream:
        return _stream(state, messages(), options)

    if body.stream is not False:
        shape = partial(_ollama_chunks, model=name, chat=chat, began=began)
        return await _answer_stream(request, start, shape, ndjson=True)
    reply = await _answer(request, start)
    return _ollama_final(name, reply, chat=chat, began=began, text=str(reply))


def _ollama_user(role: str, text: str, images: list[str]) -> dict[str, Any]:
    """An OpenAI-style message: the images (base64, as Ollama sends them) first, then the text."""
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


def _ollama_chunks(stream: Stream, *, model: str, chat: bool, began: float) -> Iterator[dict[str, Any]]:
    """Ollama's streaming lines: one per piece, then the final one with the counters."""
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
    def ns(ms: float) -> int:
        return int(ms * 1e6)

    final.update(
        done=True, done_reason=reply.finish_reason,
        total_duration=int((time.perf_counter() - began) * 1e9), load_duration=0,
        prompt_eval_count=reply.usage.prompt_tokens, prompt_eval_duration=ns(reply.timings.prefill_ms),
        eval_count=reply.usage.completion_tokens, eval_duration=ns(reply.timings.decode_ms),
    )
    return final


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")
