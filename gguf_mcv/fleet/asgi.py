"""One HTTP request, as the front forwarded it, answered by an ASGI app in this process.

The response comes back as it is sent: first ``{"status", "headers"}``, then the body's chunks.
Closing the iterator early (the client hung up) tells the app the client disconnected, so the
server code stops the generation as it does for a direct client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from starlette.types import ASGIApp, Message


async def answer(app: ASGIApp, request: dict[str, Any], extra_headers: Sequence[tuple[str, str]] = (),
                 before_end: Callable[[], Awaitable[Any]] | None = None) -> AsyncIterator[Any]:
    """Run ``request`` (method, path, query, headers, body, client) through ``app``; its response.

    ``before_end`` is awaited before the body's last chunk is passed on.
    """
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
             "method": request["method"], "path": request["path"], "raw_path": request["path"].encode(),
             "query_string": request.get("query", "").encode(), "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
             "client": tuple(request.get("client") or ("127.0.0.1", 0)), "server": ("127.0.0.1", 80)}
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.get("body", b""), "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield {"status": message["status"], "headers": headers + list(extra_headers)}
            elif message["type"] == "http.response.body":
                last = not message.get("more_body", False)
                if last and before_end is not None:
                    await before_end()
                if message.get("body"):
                    yield bytes(message["body"])
                if last:
                    break
        await task
    finally:
        disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 10)  # the answer thread sees the hang-up and stops
