"""The everyday API: a loaded :class:`Model` answers questions; :class:`Chat` keeps a conversation.

A ``Model`` owns one llama.cpp context. Calls from several Python threads are
serialised on a lock: one question is evaluated at a time, the others wait (a
stream holds the lock from its first piece until it ends or is closed).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

import numpy as np
import PIL.Image

from . import native
from .engine import Engine, Sampling
from .errors import ConfigError, ContextOverflowError
from .generation import Stream, respond
from .media import Image, ImageInput, load_image
from .messages import MediaPolicy, convert
from .reply import Reply, VideoStats
from .slicing import apply_detail
from .video import Frame, Frames, VideoInput, format_timestamp, sample_frames
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


@dataclass(frozen=True)
class VideoOptions:
    """How videos in a question are sampled (see :meth:`Model.ask_video`)."""

    max_frames: int | None = None
    fps: float | None = 1.0
    dedupe: bool = True
    timestamps: bool = True


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

    def ask_video(
        self,
        video: VideoInput,
        prompt: str,
        *,
        max_frames: int | None = None,
        fps: float | None = 1.0,
        dedupe: bool = True,
        timestamps: bool = True,
        stream: bool = False,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop: Sequence[str] | None = None,
        system: str | None = None,
        thinking: bool | None = None,
        progress: Callable[[int, int], None] | None = None,
        **sampling: Any,
    ) -> Reply | Stream:
        """Answer ``prompt`` about a video (a file, GIF, folder or list of images, or frames array).

        Frames are sampled about ``fps`` per second (at most ``max_frames``, default from
        :func:`~gguf_mcv.video.default_max_frames`), near-duplicates dropped
        (``dedupe``), each fed as one 448-pixel slice, with its time in the prompt when
        ``timestamps``. If the frames do not fit in the context they are thinned
        uniformly — unless ``max_frames`` was given, then :class:`ContextOverflowError`
        is raised before anything is encoded. ``progress(done, total)`` follows the
        encoding. Sampling keywords (``temperature``, ``top_p``, ``top_k``,
        ``repeat_penalty``, ``seed``) as in :meth:`ask`; ``reply.video`` counts the frames.
        """
        head = [] if system is None else [_message("system", system)]
        options = VideoOptions(max_frames, fps, dedupe, timestamps)
        user, counts = self._user_turn(prompt, [], [video], head, options, max_tokens, thinking)
        pieces = self._respond(head + [user], thinking, max_tokens, stop, self._sampling(**sampling),
                               progress=progress, video=counts)
        return _deliver(pieces, stream)

    def chat_completion(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        stream: bool = False,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop: Sequence[str] | None = None,
        thinking: bool | None = None,
        policy: MediaPolicy = MediaPolicy(),
        video_options: VideoOptions = VideoOptions(),
        progress: Callable[[int, int], None] | None = None,
        **sampling: Any,
    ) -> Reply | Stream:
        """Answer OpenAI-style ``messages`` (``text``, ``image_url`` and ``video_url`` parts).

        ``policy`` says whether local paths and remote URLs may be named (a server
        refuses both by default). Videos are sampled with ``video_options``; frames
        that do not fit raise :class:`ContextOverflowError` before anything is encoded.
        """
        def video_part(url: str) -> tuple[str, list[Image]]:
            frames = sample_frames(url, max_frames=video_options.max_frames, fps=video_options.fps,
                                   dedupe=video_options.dedupe, max_side=self.info.slice_size)
            lines = [_frame_line(f, self.engine.marker, video_options.timestamps) for f in frames]
            images = [apply_detail(f.image, detail="low", slice_size=self.info.slice_size) for f in frames]
            return "\n".join(lines), images

        turns = convert(messages, marker=self.engine.marker, policy=policy, prepare_video=video_part,
                        prepare_image=lambda url, detail: self.prepare_image(url, detail=detail))
        if turns[-1]["role"] == "assistant":
            raise ConfigError("The last message must not be the assistant's: nothing to answer.")
        pieces = self._respond(turns, thinking, max_tokens, stop, self._sampling(**sampling),
                               progress=progress)
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

    def _sampling(self, temperature: float | None = None, top_p: float | None = None,
                  top_k: int | None = None, repeat_penalty: float | None = None,
                  seed: int | None = None) -> Sampling:
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

    def _respond(self, messages, thinking, max_tokens, stop, sampling, *, progress=None,
                 video: "_FrameCounts | None" = None):
        if max_tokens < 1:
            raise ConfigError("max_tokens must be at least 1.")
        text, images, reasoning = self._render(messages, thinking)
        encoded: list[str] = []
        pieces = respond(
            self.engine, text, images, sampling=sampling, max_tokens=max_tokens,
            stop=list(stop or ()), reasoning=reasoning, lock=self._lock, progress=progress,
            on_prefill=lambda stats: encoded.extend(stats.encoded_keys),
        )
        return pieces if video is None or not video.keys else _count_frames(pieces, video, encoded)

    def _user_turn(self, prompt: str, images: list[Image], videos: Sequence[VideoInput],
                   history: list[dict[str, Any]], options: "VideoOptions", max_tokens: int,
                   thinking: bool | None) -> tuple[dict[str, Any], "_FrameCounts"]:
        """The user message for ``prompt`` with images and videos; frames fitted to the context."""
        marker = self.engine.marker
        sampled = [sample_frames(v, max_frames=options.max_frames, fps=options.fps,
                                 dedupe=options.dedupe, max_side=self.info.slice_size)
                   for v in videos]
        plain = _message("user", self._user_text(prompt, len(images)), images)
        counts = _FrameCounts(sampled=sum(f.sampled for f in sampled),
                              dropped=sum(f.dropped for f in sampled))
        if not sampled:
            return plain, counts
        room = self._room_for_frames(history + [plain], thinking, max_tokens)
        cost = max(self._frame_cost(f, options.timestamps) for f in sampled if f)
        total = sum(len(f) for f in sampled)
        if total * cost > room:
            if options.max_frames is not None or room < cost * len(sampled):
                raise ContextOverflowError(
                    f"{total} video frames need about {total * cost} positions but only {room} of "
                    f"n_ctx={self.info.n_ctx} are left after the text and an answer of up to "
                    f"{max_tokens} tokens. Use max_frames={max(room // cost, 1)} or less, or load "
                    "the model with a larger n_ctx."
                )
            allowed = room // cost
            sampled = [_thin(f, max(1, allowed * len(f) // total)) for f in sampled]
        blocks, frames = [], []
        for f in sampled:
            blocks.append("\n".join(_frame_line(fr, marker, options.timestamps) for fr in f))
            frames += [apply_detail(fr.image, detail="low", slice_size=self.info.slice_size) for fr in f]
        counts.thinned = total - len(frames)
        counts.keys = [self.engine.image_key(image.digest) for image in frames]
        text = "\n".join(blocks + [plain["text"]])
        return _message("user", text, frames + images), counts

    def _room_for_frames(self, messages: list[dict[str, Any]], thinking: bool | None,
                         max_tokens: int) -> int:
        text, images, _ = self._render(messages, thinking)
        with self.engine.tokenize(text, images) as prompt:
            used = prompt.n_pos
        return self.info.n_ctx - used - min(max_tokens, self.info.n_ctx // 4)

    def _frame_cost(self, frames: Frames, timestamps: bool) -> int:
        """Positions one frame takes in the prompt (its line, markers and image tokens)."""
        last = frames[-1]
        image = apply_detail(last.image, detail="low", slice_size=self.info.slice_size)
        line = _frame_line(last, self.engine.marker, timestamps)
        with self.engine.tokenize(line + "\n", [image]) as prompt:
            return prompt.n_pos + 1


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
             max_slices: int | None = None, videos: Sequence[VideoInput] = (),
             video_options: VideoOptions = VideoOptions(),
             progress: Callable[[int, int], None] | None = None) -> Reply | Stream:
        """Add a user turn and answer it (a :class:`Reply`, or a :class:`Stream` of pieces).

        ``videos`` are sampled into frames as in :meth:`Model.ask_video`, with
        ``video_options``; images and videos of earlier turns stay in the conversation.
        """
        model = self.model
        prepared = [model.prepare_image(i, detail=detail, max_slices=max_slices) for i in as_list(images)]
        user, counts = model._user_turn(prompt, prepared, list(videos), self._all([]), video_options,
                                        max_tokens, self.thinking)
        sampling = model._sampling(temperature, top_p, top_k, repeat_penalty, seed)
        return _deliver(self._turn(user, max_tokens, stop, sampling, progress, counts), stream)

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

    def _turn(self, user, max_tokens, stop, sampling, progress=None, counts=None):
        def attempt():
            return self.model._respond(self._all([user]), self.thinking, max_tokens, stop, sampling,
                                       progress=progress, video=counts)

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
    return _message("assistant", str(text))


def _message(role: str, text: str, images: Sequence[Image] = ()) -> dict[str, Any]:
    return {"role": role, "text": text, "images": list(images)}


@dataclass
class _FrameCounts:
    sampled: int = 0
    dropped: int = 0
    thinned: int = 0
    keys: list[str] = field(default_factory=list)


def _frame_line(frame: Frame, marker: str, timestamps: bool) -> str:
    if timestamps and frame.timestamp is not None:
        return f"at {format_timestamp(frame.timestamp)}: {marker}"
    return marker


def _thin(frames: Frames, n: int) -> Frames:
    """``n`` of ``frames`` by centred uniform sampling (MiniCPM-V's formula)."""
    if n >= len(frames):
        return frames
    gap = len(frames) / n
    kept = Frames([frames[int(i * gap + gap / 2)] for i in range(n)], sampled=frames.sampled,
                  dropped=frames.dropped, missed=frames.missed, duration=frames.duration,
                  native_fps=frames.native_fps, total_frames=frames.total_frames,
                  source=frames.source)
    return kept


def _count_frames(pieces, counts: _FrameCounts, encoded: list[str]):
    """Pass ``pieces`` through; attach :class:`VideoStats` to the reply at the end."""
    reply = yield from pieces
    done = set(encoded)
    reply.video = VideoStats(sampled=counts.sampled, dropped=counts.dropped, thinned=counts.thinned,
                             used=len(counts.keys), encoded=sum(k in done for k in counts.keys))
    return reply


def _deliver(pieces, stream: bool) -> Reply | Stream:
    s = Stream(pieces)
    return s if stream else s.text()


def as_list(images: Images) -> list[ImageInput]:
    """One image or a sequence of them, as a list."""
    if isinstance(images, (str, bytes, bytearray, os.PathLike, PIL.Image.Image, np.ndarray, Image)):
        return [images]
    return list(images)
