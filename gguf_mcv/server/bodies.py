"""Reading a request: the API key, the body size limit, the JSON body into a pydantic model."""

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
    """A dependency that reads the body (size-limited, any content type) into ``schema``."""
    async def read(request: Request) -> B:
        raw = await _read_limited(request, state_of(request).max_body_bytes)
        try:  # off the event loop: a body may hold megabytes of base64
            return await asyncio.to_thread(schema.model_validate_json, raw)
        except ValidationError as exc:
            raise _invalid(exc) from None
    return read


async def _read_limited(request: Request, limit: int) -> bytearray:
    """The request body; 413 as soon as it is known to exceed ``limit`` (chunked bodies too)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()  # one growing buffer: no list of chunks joined into a second copy
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                raise _too_large(limit)
            body += chunk
    except ClientDisconnect:
        raise ClientGone() from None
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
