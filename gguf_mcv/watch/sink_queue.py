"""What every event sink shares: a bounded queue emptied by a thread of the sink's own.

:meth:`QueuedSink.send` only puts the event in the queue and returns, so a tick never waits for
a receiver. When the queue is full the oldest event waiting goes, and is counted (``dropped``);
so are the events still queued when :meth:`QueuedSink.close` runs out of time. A sink says how
one event is delivered (:meth:`QueuedSink._deliver`).
"""

from __future__ import annotations

import collections
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..options import check_int
from .sources import redact

#: Events kept waiting by default (the oldest go first when more come).
DEFAULT_QUEUE = 256


@dataclass
class SinkCounts:
    """What a sink did with the events it was given."""

    sent: int = 0
    dropped: int = 0  #: pushed out of a full queue, or still queued at the end
    failed: int = 0  #: given up after their tries
    last_error: str | None = None


class QueuedSink:
    """A bounded queue of events and the thread that delivers them, one at a time, in order."""

    name = "sink"

    def __init__(self, *, queue_size: int = DEFAULT_QUEUE) -> None:
        self.queue_size = check_int(f"{self.name} queue_size", queue_size, low=1, high=10**6)
        self.counts = SinkCounts()
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._lock = threading.Condition()
        self._closing = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name=f"gguf_mcv-{self.name}", daemon=True)

    def _start(self) -> None:
        """Start delivering (the subclass calls this once it is set up)."""
        self._thread.start()

    def send(self, event: dict[str, Any]) -> None:
        """Queue ``event`` (JSON data, as :meth:`~gguf_mcv.watch.events.Event.to_dict` gives) to be
        delivered; returns at once."""
        with self._lock:
            if self._closing:
                return
            if len(self._queue) >= self.queue_size:
                self._queue.popleft()
                self.counts.dropped += 1
            self._queue.append(event)
            self._lock.notify_all()

    def pending(self) -> int:
        """Events queued or being delivered."""
        with self._lock:
            return len(self._queue) + (1 if self._busy else 0)

    def close(self, timeout_s: float = 10.0) -> SinkCounts:
        """Deliver what is queued for up to ``timeout_s`` seconds, then stop; what was left is
        dropped and counted. The counts."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (self._queue or self._busy) and time.monotonic() < deadline:
                self._lock.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            self._closing = True
            self.counts.dropped += len(self._queue)
            self._queue.clear()
            self._lock.notify_all()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + self._stop_grace_s())
        self._stopped()
        return self.counts

    def _deliver(self, event: dict[str, Any]) -> None:
        """Deliver one event, counting it sent or failed; may wait (:meth:`_wait_closing`)."""
        raise NotImplementedError

    def _stop_grace_s(self) -> float:
        """Seconds a delivery under way may still take once close() gave up waiting."""
        return 1.0

    def _stopped(self) -> None:
        """Release what the sink holds (after its thread ended)."""

    def _wait_closing(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds, ended early by close(); whether the sink is closing."""
        with self._lock:
            return self._lock.wait_for(lambda: self._closing, timeout=timeout_s)

    @property
    def closing(self) -> bool:
        with self._lock:
            return self._closing

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait()
                if self._closing:
                    return
                event = self._queue.popleft()
                self._busy = True
            try:
                self._deliver(event)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()


def split_url(url: Any, *, sink: str, schemes: tuple[str, ...], form: str) -> urllib.parse.SplitResult:
    """A sink's ``url`` split (its port read), with one of ``schemes`` and a host; ConfigError
    otherwise, saying ``form`` and showing the URL masked."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"{sink} must be {form}, not {url!r}.")
    try:
        parts = urllib.parse.urlsplit(url.strip())
        parts.port  # noqa: B018  (reading it checks it)
    except ValueError as exc:
        raise ConfigError(f"{sink} URL {redact(url)} cannot be read ({exc}).") from None
    if parts.scheme not in schemes or not parts.hostname:
        raise ConfigError(f"{sink} must be {form} with a host, not {redact(url)}.")
    return parts
