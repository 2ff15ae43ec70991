"""The everyday API: a loaded :class:`Model` answers questions; :class:`Chat` keeps a conversation.

A ``Model`` owns one llama.cpp context. Calls from several Python threads are
serialised on a lock: one question is evaluated at a time, the others wait (a
stream holds the lock from its first piece until it ends or is closed).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence, Union

import numpy as np
import PIL.Image

from . import native
from .engine import Engine, Sampling
from .errors import ConfigError, ContextOverflowError
from .generation import Stream, respond
from .media import Image, ImageInput, load_image
from .reply import Reply
from .slicing import apply_detail
from .templates import ChatTemplate

DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded: names, files, and the model family's traits."""

    name: str
    model_path: str
    mmproj_path: str
    quant: str | None
    repo: str | None
    template_origin: str
    can_think: bool
    thinking_default: bool
    n_ctx: int
    slice_size: int
    vision_gpu: bool = False


Images = Union[ImageInput, Sequence[ImageInput]]


class Model:
    """A loaded MiniCPM-V model. Use :func:`gguf_mcv.load` to make one."""

    def __init__(
        self,
        engine: Engine,
        *,
        info: ModelInfo,
        template: ChatTemplate,
        sampling: Sampling,
        allow_remote_media: bool = False,
        verbose: bool = False,
    ) -> None:
        self._engine: Engine | None = engine
        self.info = info
        self.template = template
        self.sampling = sampling
        self.allow_remote_media = allow_remote_media
        self._verbose = verbose
        self._lock = threading.RLock()

    # -- questions ------------------------------------------------------------

    def ask(
        self,
        prompt: str,
        images: Images = (),
        *,
        stream: bool = False,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        repeat_penalty: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        system: str | None = None,
        thinking: bool | None = None,
        detail: str = "auto",
        max_slices: int | None = None,
    ) -> Reply | Stream:
        """Answer ``prompt`` about ``images``; a :class:`Reply` (a ``str``), or a :class:`Stream`.

        ``images`` is one image or a sequence of them: paths, bytes, data URIs, PIL
        images or H×W×3 uint8 arrays. Sampling settings default to the model's
        recommended ones. ``detail`` and ``max_slices`` bound how many 448-pixel
        slices each image is cut into (see :meth:`prepare_image`).
        """
        messages = [] if system is None else [{"role": "system", "text": system, "images": []}]
        prepared = [self.prepare_image(i, detail=detail, max_slices=max_slices) for i in as_list(images)]
        messages.append({"role": "user", "text": self._user_text(prompt, len(prepared)), "images": prepared})
        pieces = self._respond(
            messages, thinking, max_tokens, stop,
            self._sampling(temperature, top_p, top_k, repeat_penalty, seed),
        )
        return _deliver(pieces, stream)

    def chat(self, system: str | None = None, thinking: bool | None = None, *,
             overflow: str = "error") -> "Chat":
        """Start a conversation. ``overflow="drop_oldest"`` drops old turns when the context fills."""
        return Chat(self, system=system, thinking=thinking, overflow=overflow)

    def prepare_image(self, image: ImageInput, *, detail: str = "auto",
                      max_slices: int | None = None) -> Image:
        """Decode ``image`` and size it for the vision encoder (see :func:`slicing.apply_detail`).

        ``detail="high"`` keeps it as it is: libmtmd cuts a large image into up to 9
        448-pixel slices plus an overview (64 tokens each on 2.6-style models).
        ``"low"`` shrinks it to one slice. ``"auto"`` (default) allows 4 slices when
        the vision encoder runs on the CPU, 9 on a GPU. ``max_slices=N`` sets the
        budget directly (the image is scaled down, aspect kept, until it needs at most N).
        """
        return apply_detail(load_image(image, allow_remote=self.allow_remote_media), detail=detail,
                            max_slices=max_slices, slice_size=self.info.slice_size,
                            vision_gpu=self.info.vision_gpu)

    # -- lifecycle ------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise ConfigError("This model has been closed; load it again.")
        return self._engine

    def close(self) -> None:
        """Free the model's native memory. The model cannot be used afterwards."""
        with self._lock:
            if self._engine is None:
                return
            engine, self._engine = self._engine, None
            llama = engine.llama
            engine.close()
            llama.close()
            if self._verbose:
                native.verbose_release()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._engine is None else f"n_ctx={self.info.n_ctx}"
        return f"<gguf_mcv.Model {self.info.name} {self.info.quant or ''} {state}>"

    # -- internals ------------------------------------------------------------

    def _sampling(self, temperature: float | None, top_p: float | None, top_k: int | None,
                  repeat_penalty: float | None, seed: int | None) -> Sampling:
        given = dict(temperature=temperature, top_p=top_p, top_k=top_k,
                     repeat_penalty=repeat_penalty, seed=seed)
        return replace(self.sampling, **{k: v for k, v in given.items() if v is not None})

    def _user_text(self, prompt: str, n_images: int) -> str:
        return "\n".join([self.engine.marker] * n_images + [prompt])

    def _render(self, messages: Sequence[dict[str, Any]], thinking: bool | None) -> tuple[str, list[Image], bool]:
        """Prompt text, the images in order, and whether reasoning comes first."""
        think = self._thinking(thinking)
        rendered = self.template.render(
            [{"role": m["role"], "content": m["text"]} for m in messages],
            thinking=think if self.info.can_think else None,
        )
        images = [image for m in messages for image in m["images"]]
        return rendered, images, bool(think)

    def _thinking(self, thinking: bool | None) -> bool:
        if thinking and not self.info.can_think:
            raise ConfigError(f"{self.info.name} cannot think; drop thinking=True.")
        return self.info.thinking_default if thinking is None else thinking

    def _respond(self, messages, thinking, max_tokens, stop, sampling):
        if max_tokens < 1:
            raise ConfigError("max_tokens must be at least 1.")
        text, images, reasoning = self._render(messages, thinking)
        return respond(
            self.engine, text, images, sampling=sampling, max_tokens=max_tokens,
            stop=list(stop or ()), reasoning=reasoning, lock=self._lock,
        )


class Chat:
    """A conversation with a :class:`Model`; each turn reuses what the previous ones evaluated."""

    def __init__(self, model: Model, *, system: str | None = None, thinking: bool | None = None,
                 overflow: str = "error") -> None:
        if overflow not in ("error", "drop_oldest"):
            raise ConfigError("overflow must be 'error' or 'drop_oldest'.")
        self.model = model
        self.system = system
        self.thinking = thinking
        self.overflow = overflow
        self._messages: list[dict[str, Any]] = []

    @property
    def history(self) -> list[dict[str, Any]]:
        """The turns so far: ``{"role", "content", "images"}`` with images as :class:`Image`."""
        return [{"role": m["role"], "content": m["text"], "images": list(m["images"])}
                for m in self._messages]

    def send(self, prompt: str, images: Images = (), *, stream: bool = False,
             max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float | None = None,
             top_p: float | None = None, top_k: int | None = None,
             repeat_penalty: float | None = None, seed: int | None = None,
             stop: Sequence[str] | None = None, detail: str = "auto",
             max_slices: int | None = None) -> Reply | Stream:
        """Add a user turn and answer it (a :class:`Reply`, or a :class:`Stream` of pieces)."""
        model = self.model
        prepared = [model.prepare_image(i, detail=detail, max_slices=max_slices) for i in as_list(images)]
        user = {"role": "user", "text": model._user_text(prompt, len(prepared)), "images": prepared}
        sampling = model._sampling(temperature, top_p, top_k, repeat_penalty, seed)
        return _deliver(self._turn(user, max_tokens, stop, sampling), stream)

    def undo(self) -> None:
        """Drop the last user turn and its answer (the next turn reuses the cache up to there)."""
        while self._messages:
            if self._messages.pop()["role"] == "user":
                break

    def reset(self) -> None:
        """Forget the conversation."""
        self._messages.clear()

    def _all(self, extra: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        head = [] if self.system is None else [{"role": "system", "text": self.system, "images": []}]
        return head + self._messages + list(extra)

    def _turn(self, user, max_tokens, stop, sampling):
        def attempt():
            return self.model._respond(self._all([user]), self.thinking, max_tokens, stop, sampling)

        pieces = attempt()
        produced: list[str] = []
        try:
            while True:
                try:
                    piece = next(pieces)
                except StopIteration as done:
                    self._messages += [user, _assistant(done.value)]
                    return done.value
                except ContextOverflowError:
                    if produced or self.overflow != "drop_oldest" or not self._messages:
                        raise
                    self.undo_oldest()
                    pieces = attempt()
                    continue
                produced.append(piece)
                yield piece
        except GeneratorExit:
            # a cancelled stream: the partial answer is what the model said
            pieces.close()
            self._messages += [user, _assistant("".join(produced))]
            raise

    def undo_oldest(self) -> None:
        """Drop the oldest user turn and its answer."""
        if not self._messages:
            return
        del self._messages[0]
        while self._messages and self._messages[0]["role"] != "user":
            del self._messages[0]


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "text": str(text), "images": []}


def _deliver(pieces, stream: bool) -> Reply | Stream:
    s = Stream(pieces)
    return s if stream else s.text()


def as_list(images: Images) -> list[ImageInput]:
    """One image or a sequence of them, as a list."""
    if isinstance(images, (str, bytes, bytearray, os.PathLike, PIL.Image.Image, np.ndarray, Image)):
        return [images]
    return list(images)
