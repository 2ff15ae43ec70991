"""Counters for ``GET /metrics`` (shown as JSON here, in Prometheus' format by ``prometheus``),
and the middleware counting requests by route and status."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..reply import Reply
from .gate import Gate


@dataclass
class Metrics:
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
    slices_encoded: int = 0
    slices_from_cache: int = 0

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
        self.slices_encoded += reply.timings.slices_encoded
        self.slices_from_cache += reply.timings.slices_from_cache

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: about one answer's time."""
        mean = self.answer_seconds / self.answers if self.answers else 1.0
        return min(60, max(1, math.ceil(mean)))

    def snapshot(self, gate: Gate) -> dict[str, Any]:
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
            "queue_length": gate.waiting, "in_flight": gate.active, "max_queue": gate.max_waiting,
        }


#: Methods counted under their own name; any other method string counts as ``other``.
COUNTED_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: The path counted for requests no route matched, whatever their path.
UNMATCHED = "(unmatched)"


def request_label(scope: Scope) -> str:
    """``"METHOD /route/template"``, from a bounded set: clients choose methods and paths freely."""
    method = scope["method"] if scope["method"] in COUNTED_METHODS else "other"
    return f"{method} {getattr(scope.get('route'), 'path', UNMATCHED)}"


class CountRequests:
    """ASGI middleware counting requests by method, route and status (unknown ones folded)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
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
            self.metrics.requests[(request_label(scope), status)] += 1
