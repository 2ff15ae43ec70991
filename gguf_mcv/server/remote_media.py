"""Fetching http(s) images and videos for a request, only from public addresses (no SSRF;
:mod:`gguf_mcv.vision.remote`, the fetch every caller uses)."""

from __future__ import annotations

import base64
from typing import Any

from ..vision import remote
from .media_urls import part_url

#: Connect and per-read timeout when fetching a remote image or video for a request.
REMOTE_TIMEOUT_S = 10.0


def fetch_remote_media(messages: list[dict[str, Any]], max_bytes: int) -> list[dict[str, Any]]:
    """``messages`` with each http(s) image or video URL replaced by a data: URI of its bytes."""
    def part(p: Any) -> Any:
        url = part_url(p)
        if url is None or not remote.is_remote(url):
            return p
        body = remote.fetch(url, max_bytes=max_bytes, timeout=REMOTE_TIMEOUT_S)
        data = "data:;base64," + base64.b64encode(body).decode()
        kind = p["type"]
        value = p[kind]
        return {**p, kind: {**value, "url": data} if isinstance(value, dict) else data}

    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list)
            else m for m in messages]
