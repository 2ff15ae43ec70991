"""OpenAI-style chat messages → the turns a :class:`~gguf_mcv.model.Model` renders.

A message's ``content`` is a string or a list of parts: ``{"type": "text",
"text": ...}``, ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``
(``image_url`` may also be a plain string) and ``{"type": "video_url",
"video_url": {"url": ...}}``. Image URLs may be ``data:`` URIs, local paths,
``file://`` URLs and — only when allowed — ``http(s)`` URLs. Parts keep their
order; each image becomes one media marker in the turn's text.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from .errors import ConfigError, MediaError
from .media import Image

ROLES = ("system", "user", "assistant")


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
        if scheme in ("http", "https"):
            if not self.allow_remote:
                raise MediaError(f"Remote image URLs are not allowed here: {url[:80]}")
        elif not self.allow_files:
            raise MediaError(
                f"Local file paths are not allowed here: {url[:80]}. Send the image as a data: URI."
            )


def convert(
    messages: Iterable[Mapping[str, Any]],
    *,
    marker: str,
    prepare_image: Callable[[str, str], Image],
    prepare_video: Callable[[str], tuple[str, list[Image]]] | None = None,
    policy: MediaPolicy = MediaPolicy(),
) -> list[dict[str, Any]]:
    """Turn OpenAI-style ``messages`` into ``{"role", "text", "images"}`` turns.

    ``prepare_image(url, detail)`` decodes and sizes one image; ``prepare_video(url)``
    returns the text (with one marker per frame) and the frames of a video part.
    """
    turns = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise ConfigError(f"Message {i} has role {role!r}; supported roles: {', '.join(ROLES)}.")
        texts: list[str] = []
        images: list[Image] = []
        for part in _parts(message.get("content"), i):
            kind = part.get("type")
            if kind == "text":
                texts.append(str(part.get("text", "")))
            elif kind == "image_url":
                url, detail = _url(part, "image_url", i)
                policy.check(url)
                images.append(prepare_image(url, detail))
                texts.append(marker)
            elif kind == "video_url" and prepare_video is not None:
                url, _ = _url(part, "video_url", i)
                policy.check(url)
                text, frames = prepare_video(url)
                images.extend(frames)
                texts.append(text)
            else:
                raise ConfigError(f"Message {i} has a content part of unsupported type {kind!r}.")
        if images and role != "user":
            raise ConfigError(f"Message {i}: only user messages may carry images or videos.")
        turns.append({"role": role, "text": "\n".join(texts), "images": images})
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
