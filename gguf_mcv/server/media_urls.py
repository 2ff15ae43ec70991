"""Which image and video URLs a request may name on this server, checked before it is queued."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from typing import Any

from ..errors import MediaError

MEDIA_PARTS = ("image_url", "video_url")


def part_url(part: Any) -> str | None:
    """The URL of an OpenAI ``image_url``/``video_url`` content part (the value may be a string)."""
    kind = part.get("type") if isinstance(part, dict) else None
    value = part.get(kind) if kind in MEDIA_PARTS else None
    url = value.get("url") if isinstance(value, dict) else value
    return url if isinstance(url, str) else None


def media_urls(messages: list[dict[str, Any]]) -> Iterator[str]:
    """Every image and video URL in OpenAI-style ``messages``."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                url = part_url(part)
                if url is not None:
                    yield url


def check_media_urls(messages: list[dict[str, Any]], *, allow_remote: bool, allow_files: bool) -> None:
    """:class:`MediaError`, saying what this server accepts, for a URL it would not open."""
    for url in media_urls(messages):
        refusal = _refusal(_kind(url), allow_remote=allow_remote, allow_files=allow_files)
        if refusal:
            raise MediaError(f"{refusal} ({url[:80]}). {_accepted(allow_remote, allow_files)}")


def _kind(url: str) -> str:
    """``data``, ``remote``, ``local``, ``malformed`` or the unsupported scheme itself."""
    try:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return "malformed"
    if scheme == "data":
        return "data"
    if scheme in ("http", "https"):
        return "remote"
    if scheme in ("", "file") or len(scheme) == 1:  # one letter is a Windows drive
        return "local"
    return scheme


def _refusal(kind: str, *, allow_remote: bool, allow_files: bool) -> str | None:
    if kind == "data" or (kind == "remote" and allow_remote) or (kind == "local" and allow_files):
        return None
    if kind == "remote":
        return "Remote media URLs are not allowed on this server"
    if kind == "local":
        return "Local files are not allowed on this server"
    if kind == "malformed":
        return "A media URL is malformed"
    return f"Media URLs with the scheme {kind!r} are not supported"


def _accepted(allow_remote: bool, allow_files: bool) -> str:
    """What a client may send here, and what the server must be started with for the rest."""
    remote = "http(s) URLs" if allow_remote else "http(s) URLs only when started with --allow-remote-media"
    local = "local paths" if allow_files else "local paths only when started with --allow-local-files"
    return f"This server accepts data: URIs, {remote}, {local}."
