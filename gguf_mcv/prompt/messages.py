"""OpenAI-style chat messages → the role and parts of each turn.

A message's ``content`` is a string or a list of parts: ``{"type": "text",
"text": ...}``, ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``
(``image_url`` may also be a plain string) and ``{"type": "video_url",
"video_url": {"url": ...}}``. Image URLs may be ``data:`` URIs, local paths,
``file://`` URLs and — only when allowed — ``http(s)`` URLs. Parts keep their
order; :class:`~gguf_mcv.prompt.turns.TurnBuilder` turns them into a turn.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..errors import ConfigError, MediaError
from ..vision.media import Image
from .turns import ROLES, Part, Video

#: URL schemes an image or video may be named by (besides a plain local path)
_LOCAL_SCHEMES = ("", "file")
_REMOTE_SCHEMES = ("http", "https")


@dataclass(frozen=True)
class MediaPolicy:
    """Which image locations a caller may name. A server refuses local files unless told otherwise."""

    allow_files: bool = True
    allow_remote: bool = False

    def check(self, url: str) -> None:
        """Raise :class:`MediaError` if ``url`` points somewhere this policy forbids."""
        if url.startswith("data:"):
            return
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if len(scheme) == 1:  # a Windows drive letter, not a scheme
            scheme = ""
        if scheme in _REMOTE_SCHEMES:
            if not self.allow_remote:
                raise MediaError(f"Remote URLs are not allowed here: {url[:80]}. {self.allowed()}")
        elif scheme not in _LOCAL_SCHEMES:
            raise MediaError(f"Unsupported URL scheme {scheme!r} in {url[:80]}. {self.allowed()}")
        elif not self.allow_files:
            raise MediaError(f"Local file paths are not allowed here: {url[:80]}. {self.allowed()}")

    def allowed(self) -> str:
        """A sentence saying which kinds of location this policy accepts."""
        kinds = ["data: URIs"]
        kinds += ["http(s) URLs"] if self.allow_remote else []
        kinds += ["local paths and file:// URLs"] if self.allow_files else []
        return f"Allowed here: {', '.join(kinds)}."


def convert(
    messages: Iterable[Mapping[str, Any]],
    *,
    prepare_image: Callable[[str, str], Image],
    policy: MediaPolicy = MediaPolicy(),
) -> list[tuple[str, list[Part]]]:
    """Turn OpenAI-style ``messages`` into ``(role, parts)`` pairs, parts in order.

    ``prepare_image(url, detail)`` decodes and sizes one image; a video part becomes a
    :class:`~gguf_mcv.prompt.turns.Video` (sampled later, when the turn is built).
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise ConfigError(f"messages must be a list of message dicts, not {type(messages).__name__}.")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ConfigError(f"Message {i} must be a dict with 'role' and 'content', not "
                              f"{type(message).__name__}.")
        role = message.get("role")
        if role not in ROLES:
            raise ConfigError(f"Message {i} has role {role!r}; supported roles: {', '.join(ROLES)}.")
        parts: list[Part] = []
        for part in _parts(message.get("content"), i):
            kind = part.get("type")
            if kind == "text":
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise ConfigError(f"Message {i}: a text part's text must be a string.")
                parts.append(text)
            elif kind == "image_url":
                url, detail = _url(part, "image_url", i)
                policy.check(url)
                parts.append(prepare_image(url, detail))
            elif kind == "video_url":
                url, _ = _url(part, "video_url", i)
                policy.check(url)
                parts.append(Video(url))
            else:
                raise ConfigError(f"Message {i} has a content part of unsupported type {kind!r}.")
        if role != "user" and any(not isinstance(p, str) for p in parts):
            raise ConfigError(f"Message {i}: only user messages may carry images or videos.")
        turns.append((str(role), parts))
    if not turns:
        raise ConfigError("No messages were given.")
    return turns


def _parts(content: Any, index: int) -> list[Mapping[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(p, Mapping) for p in content):
        return content
    raise ConfigError(f"Message {index}: content must be a string or a list of parts.")


def _url(part: Mapping[str, Any], key: str, index: int) -> tuple[str, str]:
    value = part.get(key)
    if isinstance(value, str):
        return value, "auto"
    if isinstance(value, Mapping) and isinstance(value.get("url"), str):
        return value["url"], str(value.get("detail") or "auto")
    if isinstance(value, (os.PathLike,)):
        return os.fspath(value), "auto"
    raise ConfigError(f"Message {index}: a {key} part needs a url.")
