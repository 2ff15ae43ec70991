"""The webhook sink: each event POSTed as JSON to a URL, from a thread of its own.

:meth:`WebhookSink.send` only puts the event in a bounded queue and returns: a tick never waits
for the receiver (:mod:`.sink_queue`: the oldest event goes when it is full, counted). A POST
that fails (no connection, a timeout, a 5xx or 429 answer) is tried again
after a backoff that doubles up to :data:`MAX_BACKOFF_S`, ``retries`` times, then given up and
counted (``failed``); another 4xx is given up at once. No redirect is followed (a 3xx is a
failure: an event is never sent to a host the user did not name). User info in the URL is sent
as HTTP basic authentication and, like query values, masked wherever the URL is shown.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..options import check_int
from .sink_queue import DEFAULT_QUEUE, QueuedSink, SinkCounts, split_url
from .sources import redact

__all__ = ["SinkCounts", "WebhookSink"]

log = logging.getLogger("gguf_mcv.watch")

#: Seconds a POST may take.
DEFAULT_TIMEOUT_S = 10.0
#: Tries after the first before an event is given up.
DEFAULT_RETRIES = 5
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
#: Bytes of a receiver's answer read (the rest is not needed).
MAX_ANSWER_BYTES = 64 * 1024


class WebhookSink(QueuedSink):
    """POST each event to ``url`` (``http`` or ``https``); see the module's doc."""

    name = "webhook"

    def __init__(self, url: str, *, queue_size: int = DEFAULT_QUEUE, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retries: int = DEFAULT_RETRIES, first_backoff_s: float = FIRST_BACKOFF_S) -> None:
        self.target = _checked_url(url)
        self.shown = redact(url)
        self.retries = check_int("webhook retries", retries, low=0, high=100)
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and 0 < timeout_s <= 600):
            raise ConfigError(f"webhook timeout_s must be a number of seconds in (0, 600], not {timeout_s!r}.")
        self.timeout_s = float(timeout_s)
        self.first_backoff_s = float(first_backoff_s)
        super().__init__(queue_size=queue_size)
        self._start()

    def _stop_grace_s(self) -> float:
        return self.timeout_s

    def _deliver(self, event: dict[str, Any]) -> None:
        body = json.dumps(event, ensure_ascii=False, default=str).encode()
        backoff = self.first_backoff_s
        for attempt in range(self.retries + 1):
            error, again = self._post(body)
            if error is None:
                self.counts.sent += 1
                return
            self.counts.last_error = error
            if not again or attempt == self.retries:
                break
            if self._wait_closing(backoff):
                break
            backoff = min(MAX_BACKOFF_S, backoff * 2)
        self.counts.failed += 1
        log.warning("webhook %s: an event was given up (%s)", self.shown, self.counts.last_error)

    def _post(self, body: bytes) -> tuple[str | None, bool]:
        """(None, _) when the receiver took it, else (what went wrong, whether to try again)."""
        t = self.target
        connection_class = http.client.HTTPSConnection if t.scheme == "https" else http.client.HTTPConnection
        conn = connection_class(t.host, t.port, timeout=self.timeout_s)
        headers = {"Content-Type": "application/json", "User-Agent": "gguf_mcv-watch", **t.auth}
        try:
            conn.request("POST", t.path, body=body, headers=headers)
            answer = conn.getresponse()
            answer.read(MAX_ANSWER_BYTES)
        except (OSError, http.client.HTTPException, socket.timeout) as exc:
            return f"{type(exc).__name__}: {exc}", True
        finally:
            conn.close()
        if 200 <= answer.status < 300:
            return None, False
        if 300 <= answer.status < 400:
            return f"HTTP {answer.status}: a redirect, not followed", False
        return f"HTTP {answer.status}", answer.status >= 500 or answer.status == 429


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int | None
    path: str
    auth: dict[str, str]


def _checked_url(url: Any) -> _Target:
    parts = split_url(url, sink="webhook", schemes=("http", "https"), form="an http:// or https:// URL")
    auth = {}
    if parts.username is not None:
        pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        auth["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    assert parts.hostname is not None
    return _Target(parts.scheme, parts.hostname, parts.port, path, auth)
