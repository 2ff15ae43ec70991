"""A request's routing key: digests of its message prefixes and of its images.

Ray's stock prefix router joins message contents as strings; ours reads the OpenAI and Ollama
bodies as the server does (text parts, image parts, Ollama's ``images``), so a conversation's
follow-up, and an image sent again in any of the two APIs, give the same digests.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from typing import Any

ROUTED_PATHS = ("/v1/chat/completions", "/api/chat", "/api/generate")


@dataclass(frozen=True)
class RouteKey:
    """``prefixes[i]``: the digest of messages ``0..i``; ``images``: the content digests of the images."""

    prefixes: tuple[str, ...] = ()
    images: tuple[str, ...] = ()


NO_KEY = RouteKey()


def route_key(path: str, body: bytes) -> RouteKey:
    """The key of a request to ``path`` with ``body``; :data:`NO_KEY` for anything not a chat request.

    Never raises: a body the server will refuse is routed anywhere, and refused there.
    """
    if path not in ROUTED_PATHS:
        return NO_KEY
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return NO_KEY
    if not isinstance(request, dict):
        return NO_KEY
    if path == "/api/generate":
        messages: Any = [{"role": "system", "content": request.get("system") or ""},
                         {"role": "user", "content": request.get("prompt"), "images": request.get("images")}]
    else:
        messages = request.get("messages")
    if not isinstance(messages, list):
        return NO_KEY
    prefixes: list[str] = []
    images: list[str] = []
    chain = hashlib.sha256()
    for message in messages:
        if not isinstance(message, dict):
            return NO_KEY
        pieces = _pieces(message, images)
        chain.update(json.dumps(pieces, separators=(",", ":")).encode())
        prefixes.append(chain.copy().hexdigest()[:32])
    return RouteKey(tuple(prefixes), tuple(dict.fromkeys(images)))


def _pieces(message: dict, images: list[str]) -> list:
    """A message as [role, (kind, text or image digest)...]; its image digests appended to ``images``."""
    role = message.get("role")
    content = message.get("content")
    pieces: list = [role if isinstance(role, str) else ""]
    parts = content if isinstance(content, list) else [content]
    for part in parts:
        if isinstance(part, str):
            pieces.append(("text", part))
        elif isinstance(part, dict):
            kind = part.get("type")
            if kind == "text":
                pieces.append(("text", str(part.get("text"))))
            elif kind in ("image_url", "input_image"):
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                pieces.append(("image", _image_digest(url, images)))
            else:
                pieces.append((str(kind), json.dumps(part, sort_keys=True, default=str)))
    ollama_images = message.get("images")
    for image in ollama_images if isinstance(ollama_images, list) else ():
        pieces.append(("image", _image_digest(image, images, base64_only=True)))
    return pieces


def _image_digest(value: Any, images: list[str], *, base64_only: bool = False) -> str:
    """The digest of an image's bytes (a data: URI or Ollama's base64), else of its URL or path."""
    text = value if isinstance(value, str) else ""
    payload = text
    if not base64_only:
        head, comma, data = text.partition(",")
        payload = data if comma and head.startswith("data:") and head.endswith(";base64") else ""
    try:
        content = base64.b64decode(payload, validate=True) if payload else text.encode()
    except (binascii.Error, ValueError):
        content = text.encode()
    digest = hashlib.sha256(content).hexdigest()[:32]
    images.append(digest)
    return digest
