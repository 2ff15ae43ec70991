"""Where watched frames come from: a camera, a video file, a network stream, or an iterable of frames.

OpenCV sources (:class:`CaptureSource`) are read by a thread that keeps only the newest
frame, so OpenCV's own buffer never fills with stale frames and a slow reader never falls
behind the stream: :meth:`CaptureSource.newest` hands out the latest frame, and the frame
indexes say how many were never looked at. A stream or camera that stops delivering is
reopened with exponential backoff; after ``give_up_s`` without a frame the reader gives up
with :class:`~gguf_mcv.errors.SourceLostError`. A video file is played at its own frame
rate, as a camera would deliver it, and ends the watch when it ends.

An iterable of frames (:class:`IterableSource`: numpy arrays, PIL images, anything
:func:`~gguf_mcv.vision.media.load_image` takes) gives one frame per request, for
synthetic streams and for callers that grab frames themselves.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Union

import numpy as np

from ..errors import ConfigError, GgufMcvError, MediaError, SourceError, SourceLostError
from ..options import check_number, check_url
from ..vision.media import MAX_PIXELS, load_image, local_path, regular_file
from ..vision.video_decode import check_frame_size
from .mjpeg import open_mjpeg

SourceInput = Union[int, str, os.PathLike, Iterable[Any]]

#: URL schemes handed to OpenCV's FFmpeg backend as network streams.
STREAM_SCHEMES = ("rtsp", "rtsps", "rtmp", "http", "https", "udp", "tcp", "srt")
#: Seconds a stream or camera may go without a frame (reconnecting meanwhile) before the watch gives up.
DEFAULT_GIVE_UP_S = 30.0
#: Longest ``give_up_s`` accepted (a day): past it a dead camera would look like a hang.
MAX_GIVE_UP_S = 86_400.0
#: Shortest ``give_up_s`` accepted: no camera or stream reopens faster.
MIN_GIVE_UP_S = 0.01
#: OpenCV's FFmpeg backend waits at most this long to open or read a network stream.
NETWORK_TIMEOUT_S = 5.0
#: First wait before reopening a dropped source, doubled after each failed try up to the maximum.
BACKOFF_START_S = 0.25
BACKOFF_MAX_S = 5.0
#: Longest wait, in seconds, between two looks at Ctrl-C or a stop request while waiting for a frame.
STOP_POLL_S = 0.1
#: Unusable frames in a row (empty, of an unknown pixel format) before a source counts as corrupt.
MAX_BAD_IN_A_ROW = 25
ACCEPTED_SOURCES = ("a camera index (0), a device path (/dev/video0), a video file, an rtsp:// or "
                    "http(s):// stream URL, or an iterable of frames (numpy arrays, PIL images)")


@dataclass(frozen=True)
class Grab:
    """One frame: ``rgb`` (H×W×3 uint8), its ``index`` in the source (0, 1, …) and when it was read."""

    rgb: np.ndarray
    index: int
    time: float  #: ``time.time()`` when the frame was read


class FrameSource(Protocol):
    """What the watch loop reads frames from."""

    name: str
    reconnects: int  #: times the source dropped and was reopened
    bad_frames: int  #: unusable frames skipped

    def newest(self, after: int, timeout: float, stop: threading.Event | None = None) -> Grab | None:
        """The newest frame with an index above ``after`` (waiting up to ``timeout`` s for one);
        None when the source has ended or ``stop`` is set. Raises :class:`SourceError` when it
        cannot go on."""
        ...

    def close(self) -> None:
        """Stop reading and release the device, file or connection."""
        ...


def open_source(source: SourceInput, *, give_up_s: float = DEFAULT_GIVE_UP_S,
                network_timeout_s: float = NETWORK_TIMEOUT_S) -> FrameSource:
    """A :class:`FrameSource` for ``source`` (see :data:`ACCEPTED_SOURCES`), reading already.

    A missing video file is a :class:`SourceError` here; a camera or stream that cannot be
    opened is retried for ``give_up_s`` seconds, then raised by :meth:`FrameSource.newest`.
    """
    return start_source(check_source(source), give_up_s=give_up_s, network_timeout_s=network_timeout_s)


@dataclass(frozen=True)
class SourceSpec:
    """A checked source, not opened yet: ``kind`` ("camera", "file", "stream" or "frames"),
    what OpenCV opens (or the iterable), and the ``name`` messages use (no password)."""

    kind: str
    target: Any
    name: str


def check_source(source: Any) -> SourceSpec:
    """``source`` checked without opening it: ConfigError for a value of the wrong kind,
    SourceError for a video file that does not exist or is not a file."""
    if isinstance(source, bool):
        raise ConfigError(f"source must be {ACCEPTED_SOURCES}, not a bool.")
    if isinstance(source, int):
        if source < 0:
            raise ConfigError(f"A camera index is 0 or more, not {source}.")
        return SourceSpec("camera", source, f"camera {source}")
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if isinstance(text, bytes):
            raise ConfigError(f"source must be {ACCEPTED_SOURCES}, not a bytes path.")
        kind, target = classify(text)
        name = redact(text) if kind == "stream" else (f"camera {target}" if isinstance(target, int) else text)
        return SourceSpec(kind, target, name)
    if isinstance(source, (bytes, bytearray, memoryview, dict)) or not isinstance(source, Iterable):
        raise ConfigError(f"source must be {ACCEPTED_SOURCES}, not {type(source).__name__}.")
    return SourceSpec("frames", source, "the frames given")


def start_source(spec: SourceSpec, *, give_up_s: float = DEFAULT_GIVE_UP_S,
                 network_timeout_s: float = NETWORK_TIMEOUT_S) -> FrameSource:
    """The :class:`FrameSource` for a checked source, opened (an OpenCV source in its reader thread)."""
    give_up_s = check_give_up(give_up_s)
    network_timeout_s = check_seconds("network_timeout_s", network_timeout_s, MIN_GIVE_UP_S, MAX_GIVE_UP_S)
    if spec.kind == "frames":
        return IterableSource(spec.target, spec.name)
    return CaptureSource(spec.target, spec.kind, spec.name, give_up_s=give_up_s,
                         network_timeout_s=network_timeout_s)


def check_give_up(value: Any) -> float:
    """``give_up_s`` checked: a number of seconds, from 0.01 to a day."""
    return check_seconds("give_up_s", value, MIN_GIVE_UP_S, MAX_GIVE_UP_S)


def check_seconds(name: str, value: Any, low: float, high: float) -> float:
    """``value`` checked as a number of seconds in [``low``, ``high``] (an int too large for a
    float included: a ConfigError, never an OverflowError)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -high <= value <= high:
        raise ConfigError(f"{name} must be at least {low:g} and at most {high:g} seconds, not a number "
                          f"of {len(str(abs(value)))} digits.")
    seconds = check_number(name, value)
    if not low <= seconds <= high:
        raise ConfigError(f"{name} must be at least {low:g} and at most {high:g} seconds, not {seconds:g}.")
    return seconds


def classify(text: str) -> tuple[str, int | str]:
    """(kind, what OpenCV opens) for a source given as text: "camera", "stream" or "file"."""
    if not text.strip():
        raise ConfigError(f"source must be {ACCEPTED_SOURCES}, not an empty string.")
    if text.strip().isdigit():
        return "camera", int(text.strip())
    parts = check_url("source", text, host_for=STREAM_SCHEMES)  # a bad port or bracket: ConfigError now
    scheme = parts.scheme.lower()
    if scheme in STREAM_SCHEMES:
        return "stream", text
    if len(scheme) > 1 and scheme != "file":
        raise ConfigError(f"Unsupported stream URL scheme {scheme!r} in {redact(text)}: use "
                          f"{', '.join(s + '://' for s in STREAM_SCHEMES)}.")
    if scheme == "file":
        text = urllib.parse.unquote(parts.path)
    if re.fullmatch(r"/dev/video\d+", text):
        return "camera", text
    try:
        regular_file(local_path(text, "Video"), "Video")
    except MediaError as exc:
        raise SourceError(f"{exc} (watch sources are {ACCEPTED_SOURCES}.)") from None
    return "file", str(Path(text).expanduser())


def redact(url: str) -> str:
    """``url`` as messages show it: its user info and the value of every query parameter masked
    (``***``), scheme, host (brackets of an IPv6 address kept), port and path as they were.

    Camera URLs carry secrets in the password, in a token given as the user name
    (``rtsp://TOKEN@host``) and in query parameters (``?user=admin&pwd=…``, ``?token=…``); a
    user name shown next to a password is kept (``admin:***``), one alone is masked. A URL that
    cannot be split is shown as its scheme alone.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc_end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    netloc, tail = rest[:netloc_end], rest[netloc_end:]
    userinfo, at, hostport = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        netloc = (f"{user}:***" if colon and user else "***") + "@" + hostport
    path, _, fragment = tail.partition("#")
    path, question, query = path.partition("?")
    if question:
        masked = [(name + "=***" if equals else "***") if (name or equals) else ""
                  for name, equals, _ in (part.partition("=") for part in query.split("&"))]
        path += "?" + "&".join(masked)
    if fragment:
        path += "#***"
    return f"{scheme}://{netloc}{path}"


class CaptureSource:
    """A camera, video file or network stream read through OpenCV by a thread keeping the newest frame."""

    def __init__(self, target: int | str, kind: str, name: str, *, give_up_s: float = DEFAULT_GIVE_UP_S,
                 network_timeout_s: float = NETWORK_TIMEOUT_S) -> None:
        self.name = name
        self.kind = kind
        self.reconnects = 0
        self.bad_frames = 0
        self._target = target
        self._give_up_s = give_up_s
        self._network_timeout_s = network_timeout_s
        self._cond = threading.Condition()
        self._latest: Grab | None = None
        self._error: GgufMcvError | None = None
        self._ended = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"gguf-mcv watch: {name}", daemon=True)
        self._thread.start()

    def newest(self, after: int, timeout: float, stop: threading.Event | None = None) -> Grab | None:
        """See :meth:`FrameSource.newest`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if stop is not None and stop.is_set():
                    return None
                if self._latest is not None and self._latest.index > after:
                    return self._latest
                if self._error is not None:
                    raise self._error
                if self._ended:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SourceLostError(f"{self.name} gave no new frame for {timeout:g} s: is it still "
                                          "delivering? (check the camera or stream).")
                self._cond.wait(min(left, STOP_POLL_S))  # short waits: Ctrl-C and stop() are seen promptly

    def close(self) -> None:
        """See :meth:`FrameSource.close`; waits for the reader thread (at most a network timeout)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(self._network_timeout_s + 1.0)

    # -- the reader thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            self._read_all()
        except GgufMcvError as exc:  # already says what happened (a part over the limits)
            self._finish(error=exc)
        except Exception as exc:  # noqa: BLE001 - cv2.error and friends: the consumer gets one clear error
            why = str(exc).replace(str(self._target), self.name)  # OpenCV may quote the URL, secrets and all
            self._finish(error=SourceError(f"Reading {self.name} failed ({type(exc).__name__}: {why})."))

    def _finish(self, *, error: GgufMcvError | None = None) -> None:
        with self._cond:
            if error is not None and self._error is None:
                self._error = error
            self._ended = True
            self._cond.notify_all()

    def _open(self) -> Any:
        import cv2  # lazy: `import gguf_mcv` does not load OpenCV

        if self.kind == "stream" and urllib.parse.urlsplit(str(self._target)).scheme.lower() in ("http", "https"):
            try:
                mjpeg = open_mjpeg(str(self._target), self.name, self._network_timeout_s)
            except OSError:
                return None  # unreachable: tried again with backoff
            if mjpeg is not None:
                return mjpeg  # anything else over HTTP (HLS, a video file) goes on to FFmpeg
        if self.kind == "stream":
            ms = int(self._network_timeout_s * 1000)
            cap = cv2.VideoCapture(self._target, cv2.CAP_FFMPEG,
                                   [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, ms, cv2.CAP_PROP_READ_TIMEOUT_MSEC, ms])
        else:
            cap = cv2.VideoCapture(self._target)
        if not cap.isOpened():
            cap.release()
            return None
        if self.kind == "camera":
            cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)  # where the driver allows it; the thread drains anyway
        return cap

    def _reopen(self, *, first: bool) -> Any:
        """The source opened again (backoff between tries), or None once ``give_up_s`` has passed."""
        deadline = time.monotonic() + self._give_up_s
        delay = BACKOFF_START_S
        while not self._stop.is_set():
            cap = self._open()
            if cap is not None:
                if not first:
                    self.reconnects += 1
                return cap
            if time.monotonic() + delay > deadline:
                break
            self._stop.wait(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
        if not self._stop.is_set():
            self._finish(error=self._lost(first))
        return None

    def _lost(self, first: bool) -> GgufMcvError:
        tried = f"{self._give_up_s:g} s"
        if self.kind == "file":
            return SourceError(f"OpenCV cannot read video file {self.name}: is it a complete video "
                               "(MP4, AVI, MKV, WebM…) its FFmpeg knows?")
        hint = ("is it plugged in, and not in use by another program?" if self.kind == "camera" else
                "check the URL, that the camera or server is up and reachable, and that OpenCV's FFmpeg "
                "reads this format.")
        if first:
            return SourceError(f"Could not open {self.name} (tried for {tried}): {hint}")
        why = "was it unplugged?" if self.kind == "camera" else "is the stream down?"
        return SourceLostError(f"{self.name} stopped delivering frames and did not come back within {tried}: "
                               f"{why} Raise give_up_s to wait longer.")

    def _read_all(self) -> None:
        import cv2  # lazy: see _open

        cap = self._open()
        if cap is None:
            if self.kind == "file":
                self._finish(error=self._lost(True))
                return
            cap = self._reopen(first=True)
        if cap is not None:
            try:
                check_frame_size(cap, self.name)  # the size the container or stream declares, before decoding
            except MediaError as exc:
                cap.release()
                self._finish(error=SourceError(str(exc)))
                return
        fps = cap.get(cv2.CAP_PROP_FPS) if cap is not None and self.kind == "file" else 0.0
        start = time.monotonic()
        index, bad = 0, 0
        try:
            while cap is not None and not self._stop.is_set():
                ok, frame = cap.read()
                if not ok:
                    cap.release()
                    cap = None
                    if self.kind == "file":
                        break
                    cap = self._reopen(first=False)
                    continue
                if isinstance(frame, np.ndarray) and frame.ndim >= 2 and frame.shape[0] * frame.shape[1] > MAX_PIXELS:
                    self._finish(error=SourceError(
                        f"Frame {index} of {self.name} is {frame.shape[1]}×{frame.shape[0]} pixels, over the "
                        f"{MAX_PIXELS:,}-pixel limit: lower the camera's or stream's resolution."))
                    return
                rgb = to_rgb(frame)
                if rgb is None:
                    self.bad_frames += 1
                    bad += 1
                    if bad >= MAX_BAD_IN_A_ROW:
                        self._finish(error=SourceError(
                            f"{self.name} gave {bad} unusable frames in a row (empty, or a pixel format "
                            "OpenCV did not convert): is the stream corrupt?"))
                        return
                    continue
                bad = 0
                with self._cond:
                    self._latest = Grab(rgb, index, time.time())
                    self._cond.notify_all()
                index += 1
                if fps > 0:  # a file plays at its own pace, as a camera would deliver it
                    self._stop.wait(max(0.0, start + index / fps - time.monotonic()))
        finally:
            if cap is not None:
                cap.release()
        self._finish()


def to_rgb(frame: Any) -> np.ndarray | None:
    """An OpenCV frame (BGR, BGRA or grey; 8- or 16-bit) as H×W×3 uint8 RGB; None if unusable
    (over :data:`~gguf_mcv.vision.media.MAX_PIXELS` included)."""
    import cv2  # lazy: see CaptureSource._open

    if not isinstance(frame, np.ndarray) or frame.size == 0 or frame.ndim not in (2, 3):
        return None
    if frame.shape[0] * frame.shape[1] > MAX_PIXELS:  # refused before it is converted (copied)
        return None
    if frame.dtype == np.uint16:
        frame = (frame >> 8).astype(np.uint8)
    elif frame.dtype != np.uint8:
        return None
    if frame.ndim == 2:
        return cv2.cvtColor(frame, cv2.COLOR_GRAY2RGB)
    codes = {1: cv2.COLOR_GRAY2RGB, 3: cv2.COLOR_BGR2RGB, 4: cv2.COLOR_BGRA2RGB}
    code = codes.get(frame.shape[2])
    return None if code is None else cv2.cvtColor(frame, code)


class IterableSource:
    """Frames from an iterable, one per :meth:`newest` call (a synthetic stream, frames grabbed elsewhere)."""

    def __init__(self, frames: Iterable[Any], name: str = "the frames given") -> None:
        self.name = name
        self.reconnects = 0
        self.bad_frames = 0
        self._frames: Iterator[Any] = iter(frames)
        self._index = -1

    def newest(self, after: int, timeout: float, stop: threading.Event | None = None) -> Grab | None:
        """The iterable's next frame (``after`` and ``timeout`` do not apply); None once it is
        exhausted or ``stop`` is set."""
        if stop is not None and stop.is_set():
            return None
        try:
            item = next(self._frames)
        except StopIteration:
            return None
        except GgufMcvError:
            raise
        except Exception as exc:  # noqa: BLE001 - the caller's iterator: whatever it raises ends the watch
            raise SourceLostError(f"The frame iterable raised {type(exc).__name__}: {exc}") from exc
        self._index += 1
        try:
            image = load_image(item)
        except MediaError as exc:
            raise SourceError(f"Frame {self._index} of {self.name} cannot be used: {exc}") from None
        # a copy: a caller refilling one buffer must not change the frame being compared
        return Grab(np.array(image.rgb, copy=True), self._index, time.time())

    def close(self) -> None:
        """Close the iterable when it is a generator."""
        close = getattr(self._frames, "close", None)
        if callable(close):
            close()
