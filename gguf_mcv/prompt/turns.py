"""Turns of a conversation as typed values, and the one place a user turn is built.

``Model.ask``, ``ask_video``, ``Chat.send``, ``chat_completion`` (and so the
server) and the llama-cpp-python chat handler all build their turns with a
:class:`TurnBuilder`: images are decoded and sized, videos sampled, frames fitted
to the context and text marked as plain the same way whichever door a question
came in by.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence, Union, cast

import numpy as np
import PIL.Image

from ..errors import ConfigError, ContextOverflowError, MediaError
from ..options import check_int, check_number, check_text
from ..vision.media import Image, ImageInput, load_image
from ..vision.slicing import apply_detail, detail_size
from ..vision.video import Frame, Frames, VideoInput, format_timestamp, sample_frames
from . import plaintext
from .measure import PromptMeasure
from .templates import ChatTemplate

if TYPE_CHECKING:
    from ..runtime.engine import Engine
    from ..runtime.generation import AnswerLock

ROLES = ("system", "user", "assistant")
Images = Union[ImageInput, Sequence[ImageInput]]


@dataclass(frozen=True)
class VideoOptions:
    """How videos in a question are sampled (see :meth:`gguf_mcv.Model.ask_video`)."""

    max_frames: int | None = None
    fps: float | None = 1.0
    dedupe: bool = True
    timestamps: bool = True

    def __post_init__(self) -> None:
        if self.max_frames is not None:
            check_int("max_frames", self.max_frames, low=1)
        if self.fps is not None and check_number("fps", self.fps) <= 0:
            raise ConfigError(f"fps must be greater than 0, not {self.fps}.")


@dataclass(frozen=True)
class Video:
    """A video part of a turn (a bare string in a turn's parts is text)."""

    source: VideoInput


Part = Union[str, Image, Video]


@dataclass(frozen=True)
class Turn:
    """One message, ready to render: ``text`` holds one media marker per image in
    ``images`` (video frames included), in order; ``videos`` are the sampled videos
    those frames came from."""

    role: str
    text: str
    images: tuple[Image, ...] = ()
    videos: tuple[Frames, ...] = ()

    @property
    def content(self) -> str:
        """The text as a person wrote it (without the plain-text marks)."""
        return plaintext.unmark(self.text)


@dataclass
class FrameCounts:
    """Video frames of one turn: sampled, dropped as duplicates, thinned to fit, and their cache keys."""

    sampled: int = 0
    dropped: int = 0
    thinned: int = 0
    keys: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Rendered:
    """A conversation rendered for the engine."""

    text: str
    images: list[Image]
    reasoning: bool  #: the answer starts with reasoning (thinking on)


class TurnBuilder:
    """Builds and renders turns for one engine, template and context size."""

    def __init__(self, engine: "Engine", template: ChatTemplate, *, n_ctx: int, can_think: bool = False,
                 thinking_default: bool = False, vision_gpu: bool = False,
                 allow_remote_media: bool = False, name: str = "this model",
                 lock: "AnswerLock | None" = None) -> None:
        self.engine = engine
        self.lock = lock  #: held while frames are measured with the engine (it may be busy)
        self.template = template
        self.n_ctx = n_ctx
        self.can_think = can_think
        self.thinking_default = thinking_default
        self.vision_gpu = vision_gpu
        self.allow_remote_media = allow_remote_media
        self.name = name
        #: positions of rendered prompts, each piece (a text, a stretch of markup, an image) measured once
        self.measure = PromptMeasure(engine, lock)
        # One image decoded at a time: a camera photo's decode briefly takes several copies of
        # its full-size pixels (memory.IMAGE_COPIES), and the plan counts that peak once. Threads
        # sharing a model with parallel slots (a server's answers) decoded side by side: 4
        # clients' 12 MP photos peaked at 951 MiB where one takes 339 (tools/soak_server.py).
        self._decoding = threading.Lock()

    @property
    def slice_size(self) -> int:
        return self.engine.slice_size

    # -- parts --------------------------------------------------------------------

    def image(self, image: ImageInput, *, detail: str = "auto", max_slices: int | None = None) -> Image:
        """Decode ``image`` and size it for the vision encoder (:func:`~gguf_mcv.vision.slicing.detail_size`);
        one image at a time per model, whatever the number of threads asking."""
        def fit(width: int, height: int) -> tuple[int, int]:
            return detail_size(width, height, detail=detail, max_slices=max_slices, slice_size=self.slice_size,
                               vision_gpu=self.vision_gpu)

        fit(1, 1)  # a bad detail or max_slices is refused before anything is decoded
        with self._decoding:
            # decoded no larger than the slices need (a JPEG at 1/2, 1/4 or 1/8 scale)
            return load_image(image, allow_remote=self.allow_remote_media, fit=fit)

    def user_parts(self, prompt: str, images: Images = (), videos: VideoInput | Sequence[VideoInput] = (), *,
                   detail: str = "auto", max_slices: int | None = None) -> list[Part]:
        """The parts of an everyday question: the videos, then the images, then the prompt."""
        check_text("prompt", prompt)
        prepared = [self.image(i, detail=detail, max_slices=max_slices) for i in as_image_list(images)]
        return [*(Video(v) for v in as_video_list(videos)), *prepared, prompt]

    # -- turns --------------------------------------------------------------------

    def system(self, text: str | None) -> list[Turn]:
        """The conversation's head: a system turn for ``text``, or nothing."""
        return [] if text is None else [self.turn("system", [check_text("system", text)])]

    def turn(self, role: str, parts: Sequence[Part]) -> Turn:
        """A turn without videos (system, assistant, or a user turn with images only)."""
        if role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, not {role!r}.")
        if any(isinstance(p, Video) for p in parts):
            raise ConfigError("Videos belong in a user turn built with user_turn().")
        return self._assemble(role, parts, {})[0]

    def user_turn(self, parts: Sequence[Part], *, history: Sequence[Turn] = (),
                  options: VideoOptions = VideoOptions(), max_tokens: int = 512,
                  thinking: bool | None = None) -> tuple[Turn, FrameCounts]:
        """The user turn for ``parts``, its videos sampled and thinned to fit the context.

        Frames, their lines, the rest of the prompt (``history`` and this turn's text and
        images) and room for an answer of ``max_tokens`` (at most a quarter of ``n_ctx``)
        must fit. Too many frames are thinned uniformly across the videos — unless
        ``options.max_frames`` was given: then :class:`ContextOverflowError` says how
        many fit, before anything is encoded.
        """
        sampled = {id(v): sample_frames(v.source, max_frames=options.max_frames, fps=options.fps,
                                        dedupe=options.dedupe, max_side=self.slice_size,
                                        allow_remote=self.allow_remote_media)
                   for v in parts if isinstance(v, Video)}
        counts = FrameCounts(sampled=sum(f.sampled for f in sampled.values()),
                             dropped=sum(f.dropped for f in sampled.values()))
        before = sum(len(f) for f in sampled.values())
        if sampled:
            sampled = self._fit_frames(parts, sampled, history, options, max_tokens, thinking)
        turn, frames = self._assemble("user", parts, sampled, options.timestamps)
        counts.thinned = before - len(frames)
        counts.keys = [self.engine.image_key(f.digest) for f in frames]
        return turn, counts

    def conversation(self, messages: Sequence[tuple[str, Sequence[Part]]], *,
                     options: VideoOptions = VideoOptions(), max_tokens: int = 512,
                     thinking: bool | None = None) -> tuple[list[Turn], FrameCounts]:
        """Turns for ``(role, parts)`` messages; a user turn with videos is built by
        :meth:`user_turn` against the turns before it. The counts are the last video turn's."""
        turns: list[Turn] = []
        counts = FrameCounts()
        for role, parts in messages:
            if role == "user" and any(isinstance(p, Video) for p in parts):
                turn, counts = self.user_turn(parts, history=turns, options=options,
                                              max_tokens=max_tokens, thinking=thinking)
            else:
                turn = self.turn(role, parts)
            turns.append(turn)
        return turns, counts

    def _assemble(self, role: str, parts: Sequence[Part], sampled: dict[int, Frames],
                  timestamps: bool = True) -> tuple[Turn, list[Image]]:
        """Text (one marker per image, text parts marked plain), images, videos of a turn."""
        lines: list[str] = []
        images: list[Image] = []
        frames: list[Image] = []
        videos: list[Frames] = []
        marker = self.engine.marker
        for part in parts:
            if isinstance(part, str):
                lines.append(plaintext.plain(check_text("text", part)))
            elif isinstance(part, Image):
                lines.append(marker)
                images.append(part)
            elif isinstance(part, Video):
                video = sampled[id(part)]
                videos.append(video)
                lines.append("\n".join(frame_line(f, marker, timestamps) for f in video))
                shown = [self.frame_image(f) for f in video]
                frames += shown
                images += shown
            else:
                raise ConfigError(f"A turn part must be text, an Image or a Video, not {type(part).__name__}.")
        if images and role != "user":
            raise ConfigError(f"Only user turns may carry images or videos (this one is {role!r}).")
        return Turn(role, "\n".join(lines), tuple(images), tuple(videos)), frames

    def frame_image(self, frame: Frame) -> Image:
        """A video frame as the encoder takes it: one slice."""
        return apply_detail(frame.image, detail="low", slice_size=self.slice_size)

    def _fit_frames(self, parts: Sequence[Part], sampled: dict[int, Frames], history: Sequence[Turn],
                    options: VideoOptions, max_tokens: int, thinking: bool | None) -> dict[int, Frames]:
        without_videos = self._assemble("user", [p for p in parts if not isinstance(p, Video)], {})[0]
        room = self._room(list(history) + [without_videos], thinking, max_tokens)
        non_empty = [f for f in sampled.values() if f]
        if not non_empty:
            return sampled
        cost = max(self._frame_cost(f, options.timestamps) for f in non_empty)
        total = sum(len(f) for f in sampled.values())
        if total * cost <= room:
            return sampled
        if options.max_frames is not None or room < cost * len(non_empty):
            raise ContextOverflowError(
                f"{total} video frames need about {total * cost} positions but only {max(room, 0)} "
                f"of n_ctx={self.n_ctx} are left after the text and an answer of up to "
                f"{max_tokens} tokens. Use max_frames={max(room // cost, 1)} or less, or load "
                "the model with a larger n_ctx."
            )
        allowed = room // cost
        return {k: thin(f, max(1, allowed * len(f) // total)) for k, f in sampled.items()}

    def answer_room(self, max_tokens: int) -> int:
        """Positions kept free for an answer: ``max_tokens``, at most a quarter of the context."""
        return min(max_tokens, self.n_ctx // 4)

    def positions_of(self, turn: Turn) -> int:
        """Positions one turn's text and images fill (without the template's markup)."""
        return self._positions(turn.text, turn.images)

    def fit(self, turns: Sequence[Turn], *, max_tokens: int, thinking: bool | None = None,
            keep_first: int = 0) -> tuple[list[Turn], int]:
        """``turns`` with their oldest user turns (each with its answers) dropped, whole turns at a
        time, until the prompt and :meth:`answer_room` fit in the context; also how many user
        turns were dropped. System turns, the first ``keep_first`` user turns and the newest turn
        are never dropped: :class:`ContextOverflowError` when those alone do not fit. Each
        candidate is measured by :attr:`measure`: a turn measured before (in this call or an
        earlier one) is not tokenized again.
        """
        kept, dropped = list(turns), 0
        while (room := self._room(kept, thinking, max_tokens)) < 0:
            users = [i for i, t in enumerate(kept[:-1]) if t.role == "user"]
            if len(users) <= keep_first:
                pinned = f" with the {keep_first} pinned turn(s)" if keep_first else ""
                raise ContextOverflowError(
                    f"The newest question{pinned} needs {self.n_ctx - room} positions with room for an "
                    f"answer, but n_ctx is {self.n_ctx}: nothing older is left to drop. Ask a shorter "
                    "question, use fewer or lower-detail images, pin fewer turns, or load the model "
                    "with a larger n_ctx."
                )
            first = users[keep_first]
            end = next((i for i in range(first + 1, len(kept)) if kept[i].role == "user"), len(kept) - 1)
            del kept[first:end]
            dropped += 1
        return kept, dropped

    def _room(self, turns: list[Turn], thinking: bool | None, max_tokens: int) -> int:
        rendered = self.render(turns, thinking)
        return self.n_ctx - self._positions(rendered.text, rendered.images) - self.answer_room(max_tokens)

    def _positions(self, text: str, images: Sequence[Image]) -> int:
        """Positions ``text`` and ``images`` fill, as the engine tokenizes them (see :attr:`measure`)."""
        return self.measure.positions(text, images)

    def _frame_cost(self, frames: Frames, timestamps: bool) -> int:
        """Positions one frame takes in the prompt (its line, markers and image tokens)."""
        last = frames[-1]
        line = frame_line(last, self.engine.marker, timestamps)
        return self._positions(line + "\n", [self.frame_image(last)]) + 1

    # -- rendering ----------------------------------------------------------------

    def thinking(self, thinking: bool | None) -> bool:
        """Whether this answer reasons first (``None``: the model's default)."""
        if thinking and not self.can_think:
            raise ConfigError(f"{self.name} cannot think; drop thinking=True.")
        return self.thinking_default if thinking is None else bool(thinking)

    def render(self, turns: Sequence[Turn], thinking: bool | None = None) -> Rendered:
        """The prompt text for ``turns`` (with the assistant's turn opened), and its images."""
        if not turns or turns[-1].role == "assistant":
            raise ConfigError("The last message must not be the assistant's: nothing to answer.")
        think = self.thinking(thinking)
        text = self.template.render([{"role": t.role, "content": t.text} for t in turns],
                                    thinking=think if self.can_think else None)
        return Rendered(text, [image for t in turns for image in t.images], think)


def frame_line(frame: Frame, marker: str, timestamps: bool) -> str:
    """A frame's line in the prompt: its time (when known and wanted) and its marker."""
    if timestamps and frame.timestamp is not None:
        return f"at {format_timestamp(frame.timestamp)}: {marker}"
    return marker


def thin(frames: Frames, n: int) -> Frames:
    """``n`` of ``frames`` by centred uniform sampling (MiniCPM-V's formula)."""
    if n >= len(frames):
        return frames
    gap = len(frames) / n
    return Frames([frames[int(i * gap + gap / 2)] for i in range(n)], sampled=frames.sampled,
                  dropped=frames.dropped, missed=frames.missed, duration=frames.duration,
                  native_fps=frames.native_fps, total_frames=frames.total_frames, source=frames.source)


_SINGLE_IMAGE = (str, bytes, bytearray, memoryview, os.PathLike, PIL.Image.Image, np.ndarray, Image)


def as_image_list(images: Images | None) -> list[ImageInput]:
    """One image or a sequence of them, as a list."""
    if images is None:
        return []
    if isinstance(images, _SINGLE_IMAGE):
        return [cast(ImageInput, images)]
    if isinstance(images, (list, tuple)):
        return list(images)
    raise MediaError(f"images must be an image or a list of images, not {type(images).__name__}.")


def as_video_list(videos: VideoInput | Sequence[VideoInput] | None) -> list[VideoInput]:
    """One video or a list of them, as a list. A string or path is one video, never a
    sequence of paths; a list of frames (images) is a list of videos only when its items
    are themselves videos, so pass ``[frames]`` for one video made of frames."""
    if videos is None:
        return []
    if isinstance(videos, (str, bytes, os.PathLike, np.ndarray)):
        return [videos]
    if isinstance(videos, (list, tuple)):
        return list(videos)
    raise MediaError(f"videos must be a video or a list of videos, not {type(videos).__name__}.")
