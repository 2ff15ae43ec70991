"""Reading a request: the API key, the JSON content type, the body (size limit, deadline, the
gate's byte budget) into a pydantic model."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect

from .http_errors import ClientGone, HTTPError
from .state import state_of


async def authorize(request: Request) -> None:
    """A dependency: 401 unless the request carries the API key (when one is set)."""
    key = state_of(request).api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise HTTPError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


B = TypeVar("B", bound=BaseModel)


def json_body(schema: type[B]) -> Callable[[Request], Awaitable[B]]:
    """A dependency that reads the JSON body (see :func:`read_body`) into ``schema``."""
    async def read(request: Request) -> B:
        raw = await read_body(request)
        request.state.gguf_mcv_body = None  # parsed next: its bytes need not live as long as the request
        try:  # off the event loop: a body may hold megabytes of base64
            return await asyncio.to_thread(schema.model_validate_json, raw)
        except ValidationError as exc:
            raise _invalid(exc) from None
    return read


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON.

    A web page can send other types (``text/plain``, forms) to any server without asking
    it first; a JSON body makes the browser ask (a CORS preflight), which this server
    refuses unless the page's origin is allowed.
    """
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json" and not (media_type.startswith("application/")
                                                  and media_type.endswith("+json")):
        got = f"'{media_type}'" if media_type else "none"
        raise HTTPError(415, f"The request body must be JSON sent with 'Content-Type: application/json' "
                             f"(got {got}); with curl use --json or -H 'Content-Type: application/json'.",
                        code="unsupported_media_type")


async def read_body(request: Request) -> bytearray:
    """The request's JSON body, read once (later calls return it again, until
    :func:`json_body` has parsed it).

    415 unless it is declared JSON (:func:`require_json`); 413 as soon as it is known to
    exceed the server's body limit; 408 unless it has all arrived within the server's body
    timeout; 503 when the bodies being read at once would pass the gate's byte budget.
    """
    cached = getattr(request.state, "gguf_mcv_body", None)
    if cached is not None:
        return cached
    require_json(request)
    state = state_of(request)
    try:
        body = await asyncio.wait_for(_read_limited(request), state.body_timeout_s)
    except asyncio.TimeoutError:
        raise HTTPError(408, f"The request body did not arrive within {state.body_timeout_s:g} s: send it "
                             "without pauses, or start the server with a longer body timeout.",
                        code="request_timeout", headers={"Connection": "close"}) from None
    request.state.gguf_mcv_body = body
    return body


async def _read_limited(request: Request) -> bytearray:
    """The request body; 413 as soon as it is known to exceed the limit (chunked bodies too)."""
    state = state_of(request)
    limit, gate, retry_after = state.max_body_bytes, state.gate, state.metrics.retry_after()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    # what has arrived counts in the gate's budget, not what is declared: a client that
    # declares a large body and sends nothing holds nothing
    body = bytearray()  # one growing buffer: no list of chunks joined into a second copy
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                raise _too_large(limit)
            gate.hold(len(chunk), retry_after)
            body += chunk
    except ClientDisconnect:
        raise ClientGone() from None
    finally:
        gate.release(len(body))
    return body


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"The request body is larger than {limit} bytes. Send smaller images "
                          "or start the server with a larger body limit.", code="request_too_large")


def _invalid(exc: ValidationError) -> HTTPError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "json_invalid":
        return HTTPError(400, f"The request body is not valid JSON: {first['msg']}.")
    where = f"{param}: " if param else ""
    return HTTPError(400, f"Invalid request: {where}{first['msg']}.", param=param)


class Body(BaseModel):
    """Request bodies accept unknown fields: clients send many this server does not use."""

    model_config = ConfigDict(extra="allow")
