"""``watch``: answers about a live source, one :class:`Observation` per tick, re-encoding only what changed.

At each tick the newest frame is taken from the source (:mod:`.sources`), sized for the
vision encoder, and compared, box by box, with what each box (the overview and every
slice) was last encoded from (:mod:`.changes`). A slice that did not change keeps its
embedding: it is put into the model's embedding cache before the question is asked, so the
engine takes it from there and only the stale slices (and the overview, whenever any slice
changed) go through the vision encoder. Such a frame is asked about under a digest of the mix
(which frame each box's embedding came from), never under its own pixels' digest: a cache
entry of a frame's pixels is always that frame's encoding, for this process and for any other
sharing a disk tier. A frame in which
nothing changed costs no encoder call; it is answered again (``answer_unchanged=True``:
the previous prompt, so the KV cache serves all of it) or reported with the last answer
and no model call at all.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError
from ..options import DETAILS, check_int, check_max_tokens, check_text
from ..reply import Reply, parsed_as_json
from ..vision.media import Image
from ..vision.slicing import MAX_SLICES, slice_grid
from .changes import DEFAULT_THRESHOLD, ChangeTracker, check_threshold, colour_cells
from .events import Event, EventDetector, EventRule, check_events
from .regions import Region, check_region, check_zones
from .snapshots import SnapshotFolder
from .sources import (
    DEFAULT_GIVE_UP_S,
    NETWORK_TIMEOUT_S,
    FrameSource,
    SourceInput,
    check_give_up,
    check_seconds,
    check_source,
    start_source,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..model import Model

#: Longest ``every_s`` accepted (a day): a longer wait looks like a hang.
MAX_EVERY_S = 86_400.0
#: Shortest ``every_s`` accepted (a millisecond): no answer is that fast, and a shorter tick only
#: inflates ``ticks_skipped`` (1e-300 made it a 301-digit number).
MIN_EVERY_S = 0.001
#: An answer's default token budget: a watch asks the same short question again and again.
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class Observation:
    """What a watch saw at one tick.

    ``answer`` is the model's :class:`~gguf_mcv.reply.Reply` (with usage and timings); when
    nothing changed and ``answer_unchanged`` is off, it is the previous answer and ``asked`` is
    False. ``changed`` is the fraction of the picture that differs from what was last encoded;
    ``slices_encoded`` went through the vision encoder, ``slices_reused`` did not (the overview
    counts as a slice). ``frames_skipped``: frames the source delivered since the previous
    observation's frame that no observation looked at; ``ticks_skipped``: ticks missed because
    the previous answer took longer than ``every_s``; ``reconnects``: times the source dropped
    and was reopened so far. ``event``: the :class:`~gguf_mcv.watch.events.Event` this tick
    completed, under ``event_on=`` (None otherwise); ``event_warning``: why this tick's value
    could not be read (a field missing from the parsed answer). ``zone``: the name of the zone
    asked about, under ``zones=`` (None otherwise).
    """

    time: float  #: when the frame was read (``time.time()``)
    frame_index: int
    changed: float
    slices_encoded: int
    slices_reused: int
    answer: Reply
    parsed: Any
    asked: bool
    latency_s: float  #: from the frame's reading to the answer
    frames_skipped: int
    ticks_skipped: int
    reconnects: int
    event: Event | None = None
    event_warning: str | None = None
    zone: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The observation as JSON data (one line of ``gguf-mcv watch``): with ``event`` (its kind,
        values, snapshot and warning) when the tick completed one."""
        out = {"time": round(self.time, 3), "frame": self.frame_index, "changed": round(self.changed, 4),
               "slices_encoded": self.slices_encoded, "slices_reused": self.slices_reused,
               "asked": self.asked, "answer": str(self.answer), "parsed": parsed_as_json(self.parsed),
               "latency_s": round(self.latency_s, 3), "frames_skipped": self.frames_skipped,
               "ticks_skipped": self.ticks_skipped, "reconnects": self.reconnects}
        if self.zone is not None:
            out = {"zone": self.zone, **out}
        if self.event is not None:
            e = self.event.to_dict()
            out["event"] = {k: e[k] for k in ("event", "on", "before", "after", "snapshot", "warning")}
        if self.event_warning is not None:
            out["event_warning"] = self.event_warning
        return out


def watch(model: "Model", source: SourceInput, prompt: str, *, every_s: float = 2.0,
          threshold: float = DEFAULT_THRESHOLD, only_changes: bool = False, answer_unchanged: bool = False,
          schema: Any = None, detail: str = "auto", max_slices: int | None = None,
          max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float = 0.0, seed: int | None = None,
          system: str | None = None, give_up_s: float = DEFAULT_GIVE_UP_S, event_on: str | None = None,
          hold: int = 1, cooldown_s: float = 0.0,
          snapshots: str | os.PathLike | SnapshotFolder | None = None,
          region: tuple[float, float, float, float] | Region | None = None,
          zones: "Mapping[str, Any] | None" = None) -> "Watch":
    """Ask ``prompt`` about ``source`` every ``every_s`` seconds; a :class:`Watch`, an iterator of
    :class:`Observation` that any thread may stop.

    ``source``: a camera index or device path, a video file (played at its own frame rate), an
    ``rtsp://`` or ``http(s)://`` stream, or an iterable of frames (one per tick). Each tick
    takes the newest frame; ticks that pass while an answer runs are skipped and counted.
    Slices that changed by no more than ``threshold`` (a fraction of their area, see
    :mod:`gguf_mcv.watch.changes`) reuse their previous embedding; a frame where nothing did
    costs no encoder call, and, unless ``answer_unchanged``, no model call either.
    ``only_changes`` yields an observation only when the answer (with ``schema``, the parsed
    value) differs from the last one yielded. Answers are greedy by default (``temperature=0``),
    so an unchanged picture gives an unchanged answer. A stream or camera that drops is
    reopened with backoff; after ``give_up_s`` seconds without a frame,
    :class:`~gguf_mcv.errors.SourceLostError`. The watch ends when a file or iterable does;
    closing the iterator releases the source (as does leaving a ``for`` loop over ``watch(...)`` itself);
    :meth:`Watch.stop` and :meth:`Watch.close` work from any thread.

    ``event_on`` turns answers into events (:mod:`gguf_mcv.watch.events`): ``"answer"`` follows
    the answer's text, a field name (``"present"``, ``"door.open"``) that field of the answer
    parsed under ``schema``. A new value that holds ``hold`` ticks, at least ``cooldown_s``
    seconds after the previous event, is an :class:`~gguf_mcv.watch.events.Event` on that tick's
    observation (``observation.event``), which is yielded even under ``only_changes``. With
    ``snapshots`` (a folder, or a :class:`~gguf_mcv.watch.snapshots.SnapshotFolder` for other
    bounds) each event's frame is written there as a JPEG, its path in the event.

    ``region`` (``x, y, w, h``: ints in pixels, or floats in [0, 1] as fractions of the frame;
    :mod:`gguf_mcv.watch.regions`) asks about that rectangle of each frame only: only it is
    compared, encoded and written as a snapshot, so a change outside it costs nothing.
    ``zones`` names several regions of one source, each asked its own question: a mapping of
    name to a region, or to ``(region, prompt)`` (``prompt`` is asked where a zone has none).
    Every tick then yields one observation per zone, in the mapping's order, with its name in
    ``observation.zone``; each zone keeps its own slice embeddings, changes and events, so a
    change in one zone encodes only that zone's slices.

    Arguments are checked here, before anything is opened (:class:`ConfigError`,
    :class:`~gguf_mcv.errors.SourceError` for a missing file).
    """
    if not (hasattr(model, "ask") and hasattr(model, "prepare_image") and hasattr(model, "engine")):
        raise ConfigError(f"model must be a gguf_mcv Model (from gguf_mcv.load), not {type(model).__name__}.")
    check_text("prompt", prompt)
    if system is not None:
        check_text("system", system)
    every_s = check_every(every_s)
    if detail not in DETAILS:
        raise ConfigError(f"detail must be one of {', '.join(DETAILS)}, not {detail!r}.")
    if max_slices is not None:
        check_int("max_slices", max_slices, low=0, high=MAX_SLICES)
    for name, flag in (("only_changes", only_changes), ("answer_unchanged", answer_unchanged)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False, not {flag!r}.")
    options: dict[str, Any] = dict(max_tokens=check_max_tokens(max_tokens), temperature=temperature, seed=seed,
                                   system=system, schema=schema)
    model.sampling.with_overrides(temperature=temperature, seed=seed)  # a bad value, before anything runs
    if schema is not None:
        model.constraint(schema)
    rule = check_events(event_on, hold, cooldown_s, structured=schema is not None,
                        shaping={"hold": hold != 1, "cooldown_s": cooldown_s != 0.0,
                                 "snapshots": snapshots is not None})
    folder = snapshots if isinstance(snapshots, SnapshotFolder) or snapshots is None else SnapshotFolder(snapshots)
    named = check_zones(zones)
    if named is not None and region is not None:
        raise ConfigError("give region= or zones=, not both: a zone is a named region with its own question.")
    for z in named or []:
        if z.prompt is not None:
            check_text(f"zone {z.name}'s prompt", z.prompt)
    areas: list[tuple[str | None, Region | None, str]] = (
        [(z.name, z.region, z.prompt or prompt) for z in named] if named is not None
        else [(None, check_region(region), prompt)])
    threshold = check_threshold(threshold)
    spec = check_source(source)
    runs = [_Watch(model, asked, options, ChangeTracker(threshold), detail=detail, max_slices=max_slices,
                   answer_unchanged=answer_unchanged, events=rule, snapshots=folder, region=area, zone=name)
            for name, area, asked in areas]
    stop = threading.Event()
    return Watch(_observations(runs, spec, every_s=every_s, only_changes=only_changes,
                               give_up_s=check_give_up(give_up_s), stop=stop), stop)


def check_every(value: Any) -> float:
    """``every_s`` checked: seconds between ticks, from a millisecond to a day."""
    return check_seconds("every_s", value, MIN_EVERY_S, MAX_EVERY_S)


class Watch(Iterator[Observation]):
    """A running watch: iterate it for observations; stop it from any thread.

    :meth:`stop` asks the loop to end: it is seen between ticks and while the loop waits for a
    frame or for the next tick (an answer under way is finished first), and the iteration then
    ends as a finished source would, the source released. :meth:`close` stops and releases the
    source too, waiting (from another thread) for the tick under way to end. Also a context
    manager that closes on exit.
    """

    def __init__(self, observations: Generator[Observation, None, None], stop: threading.Event) -> None:
        self._observations = observations
        self._stop = stop
        self._turn = threading.Lock()  # one thread at a time inside the generator

    def __iter__(self) -> "Watch":
        return self

    def __next__(self) -> Observation:
        with self._turn:
            return next(self._observations)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` or :meth:`close` was called."""
        return self._stop.is_set()

    def stop(self) -> None:
        """Ask the watch to end (thread-safe, returns at once): the iteration ends after the tick under way."""
        self._stop.set()

    def close(self) -> None:
        """Stop the watch and release its source (thread-safe; from another thread, this waits
        for the tick under way)."""
        self._stop.set()
        with self._turn:
            self._observations.close()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _observations(runs: "list[_Watch]", spec: Any, *, every_s: float, only_changes: bool, give_up_s: float,
                  stop: threading.Event) -> Generator[Observation, None, None]:
    """The watch's loop: one frame a tick from the source, asked about in each zone in turn."""
    if stop.is_set():
        return
    frames: FrameSource = start_source(spec, give_up_s=give_up_s)
    try:
        start = time.monotonic()
        served = 0  # the tick number last served
        after, skipped_ticks = -1, 0
        shown: list[Any] = [_NOTHING] * len(runs)
        while not stop.is_set():
            grab = frames.newest(after, timeout=give_up_s + NETWORK_TIMEOUT_S, stop=stop)
            if grab is None:
                return
            skipped_frames = grab.index - after - 1
            after = grab.index
            for i, run in enumerate(runs):
                if stop.is_set():
                    return
                seen = run.observe(grab, frames_skipped=skipped_frames, ticks_skipped=skipped_ticks,
                                   reconnects=frames.reconnects)
                key = _answer_key(seen.answer, run.options["schema"] is not None)
                if not only_changes or key != shown[i] or seen.event is not None:
                    shown[i] = key
                    yield seen
            # the next tick: the first one still ahead; those passed meanwhile are skipped
            now = time.monotonic()
            upcoming = max(served + 1, math.floor((now - start) / every_s) + 1)
            skipped_ticks = upcoming - served - 1
            served = upcoming
            stop.wait(max(0.0, start + upcoming * every_s - time.monotonic()))
    finally:
        frames.close()


class _Watch:
    """One zone's state (the whole frame's, without zones): what each box was last encoded from,
    its embeddings, and its events."""

    def __init__(self, model: "Model", prompt: str, options: dict[str, Any], tracker: ChangeTracker, *,
                 detail: str, max_slices: int | None, answer_unchanged: bool, events: EventRule | None = None,
                 snapshots: SnapshotFolder | None = None, region: Region | None = None,
                 zone: str | None = None) -> None:
        self.model = model
        self.region = region
        self.zone = zone
        self.rule = events
        self.detector = None if events is None else EventDetector(events)
        self.snapshots = snapshots
        self.prompt = prompt
        self.options = options
        self.tracker = tracker
        self.detail = detail
        self.max_slices = max_slices
        self.answer_unchanged = answer_unchanged
        self.held: dict[int, np.ndarray] = {}  # box -> the embedding it was last encoded to
        self.origin: dict[int, str] = {}  # box -> the digest of the frame that embedding was encoded from
        self.reference: Image | None = None  # the image last asked about
        self.last: Reply | None = None

    def observe(self, grab: Any, *, frames_skipped: int, ticks_skipped: int, reconnects: int) -> Observation:
        """Answer about this zone of one frame (the whole frame without a region)."""
        rgb = grab.rgb if self.region is None else self.region.crop(grab.rgb)
        changed, encoded, reused, asked = self._answer(rgb)
        assert self.last is not None
        seen = Observation(time=grab.time, frame_index=grab.index, changed=changed, slices_encoded=encoded,
                           slices_reused=reused, answer=self.last, parsed=self.last.parsed, asked=asked,
                           latency_s=max(0.0, time.time() - grab.time), frames_skipped=frames_skipped,
                           ticks_skipped=ticks_skipped, reconnects=reconnects, zone=self.zone)
        return seen if self.detector is None else self._event(seen, rgb)

    def _event(self, seen: Observation, rgb: np.ndarray) -> Observation:
        """``seen`` with the event it completes (and its snapshot), or the reason its value could not be read."""
        assert self.detector is not None and self.rule is not None
        change = self.detector.update(seen)
        if change is None:
            return replace(seen, event_warning=self.detector.warning) if self.detector.warning else seen
        kind, before, after = change
        path, warning = (None, None) if self.snapshots is None else self.snapshots.save(
            rgb, time_s=seen.time, frame=seen.frame_index, zone=self.zone)
        return replace(seen, event=Event(kind, before, after, seen, on=self.rule.on, zone=self.zone, snapshot=path,
                                         warning=warning))

    def _answer(self, rgb: np.ndarray) -> tuple[float, int, int, bool]:
        """Answer about one frame: (fraction changed, slices encoded, slices reused, model asked)."""
        model = self.model
        engine = model.engine
        image = model.prepare_image(rgb, detail=self.detail, max_slices=self.max_slices)
        grid = slice_grid(image.width, image.height, engine.slice_size)
        cells = colour_cells(image.rgb)
        changes = self.tracker.compare(cells, (image.width, image.height), grid)
        n_boxes = len(changes.fractions)
        stale = set(changes.stale) | {i for i in range(n_boxes) if i not in self.held}
        if not stale and self.reference is not None:
            if not self.answer_unchanged:
                return changes.fraction, 0, n_boxes, False
            self.last = self._ask(self.reference)  # the same prompt: the KV cache holds all of it
            return changes.fraction, self.last.timings.slices_encoded, n_boxes - self.last.timings.slices_encoded, True
        stale.add(0)  # the overview sees every slice
        origin = {i: image.digest if i in stale else self.origin[i] for i in range(n_boxes)}
        if len(stale) < n_boxes:
            image = _Mixed(image.rgb, image.source, _mix_digest(origin))
        cache = engine.embed_cache
        for i in range(n_boxes):
            if i not in stale:
                cache.put(engine.image_key(image.digest, i), self.held[i])
        self.last = self._ask(image)
        kept = []
        for i in sorted(stale):
            embedding = cache.get(engine.image_key(image.digest, i))
            if embedding is None:  # the cache is too small to hold a frame: encode it next time too
                self.held.pop(i, None)
                self.origin.pop(i, None)
                self.tracker.forget(i)
            else:
                self.held[i] = embedding
                self.origin[i] = origin[i]
                kept.append(i)
        self.tracker.encoded(cells, kept)
        if self.reference is not None and self.reference.digest != image.digest:
            self._drop(self.reference)
        self.reference = image
        timings = self.last.timings
        return changes.fraction, timings.slices_encoded, timings.slices_from_cache, True

    def _ask(self, image: Image) -> Reply:
        options = self.options
        return self.model.ask(self.prompt, image, detail="high", max_tokens=options["max_tokens"],
                              temperature=options["temperature"], seed=options["seed"], system=options["system"],
                              schema=options["schema"])

    def _drop(self, image: Image | None) -> None:
        """Take a frame no longer asked about out of the embedding cache (its embeddings are held
        here while needed): a watch leaves one frame in the cache (the last), however long it runs."""
        if image is None or self.model.closed:
            return
        engine = self.model.engine
        for i in range(1 + MAX_SLICES):
            engine.embed_cache.discard(engine.image_key(image.digest, i))


@dataclass(frozen=True, eq=False)
class _Mixed(Image):
    """A frame asked about with some boxes' embeddings kept from earlier frames: its ``digest``
    names that mix, so the embedding cache never holds them under the frame's own pixels."""

    mix: str = ""

    @property
    def digest(self) -> str:
        return self.mix


def _mix_digest(origin: dict[int, str]) -> str:
    """A digest of which frame (by pixel digest) each box's embedding was encoded from."""
    text = "watch-mix:" + ",".join(f"{i}={digest}" for i, digest in sorted(origin.items()))
    return hashlib.sha256(text.encode()).hexdigest()


_NOTHING = object()


def _answer_key(reply: Reply, structured: bool) -> Any:
    """What ``only_changes`` compares: the parsed value with a schema (when it parsed), else the text."""
    if structured and reply.parsed is not None:
        return ("parsed", parsed_as_json(reply.parsed))
    return ("text", " ".join(str(reply).split()))
