"""The queue in front of the model: ``capacity`` answers at a time (the model's parallel
slots, else one), a bounded number admitted, then 503.

A request is admitted once its body has arrived, so a client that sends its body slowly
holds no place in the queue. A full queue still refuses a request before its body is
read (:meth:`Gate.check`), and the bodies being read share a byte budget
(:meth:`Gate.hold`), so the memory they take stays bounded however many arrive at once.
"""

from __future__ import annotations

import asyncio

from .http_errors import HTTPError


class Gate:
    """``capacity`` answers at a time, at most ``max_waiting`` more admitted; beyond that: busy.

    ``body_budget`` bytes of request bodies may be in flight (being read) at once.
    """

    def __init__(self, max_waiting: int, capacity: int = 1, body_budget: int | None = None) -> None:
        self.max_waiting = max_waiting
        self.capacity = capacity
        self.admitted = 0
        self.active = 0  #: answers running
        self.body_budget = body_budget
        self.reading = 0  #: bytes of request bodies being read
        self._slots = asyncio.Semaphore(capacity)

    @property
    def busy(self) -> bool:
        """Whether an answer is running."""
        return self.active > 0

    @property
    def waiting(self) -> int:
        """Admitted requests not being answered (waiting for the model)."""
        return self.admitted - self.active

    def check(self, retry_after: int) -> None:
        """503 with ``Retry-After`` when the queue is full (nothing is taken)."""
        if self.admitted >= self.max_waiting + self.capacity:
            raise self._busy(f"The server is busy ({self.waiting} requests waiting)", retry_after)

    def admit(self, retry_after: int) -> Place:
        """A place in the queue; 503 with ``Retry-After`` when the queue is full."""
        self.check(retry_after)
        self.admitted += 1
        return Place(self)

    def hold(self, size: int, retry_after: int) -> None:
        """Count ``size`` more bytes of a body being read; 503 when that passes the budget."""
        if self.body_budget is not None and self.reading + size > self.body_budget:
            raise self._busy("The server is busy receiving other requests", retry_after)
        self.reading += size

    def release(self, size: int) -> None:
        """Uncount ``size`` bytes counted by :meth:`hold` (the body was read, or given up)."""
        self.reading -= size

    @staticmethod
    def _busy(what: str, retry_after: int) -> HTTPError:
        return HTTPError(503, f"{what}; try again in {retry_after} s.", code="server_busy",
                         headers={"Retry-After": str(retry_after)})


class Place:
    """One request's place in the :class:`Gate`, from admission until :meth:`leave`.

    Its ``owner`` calls :meth:`leave` when done with it: ``"request"`` (the request's
    handling), then possibly ``"response"`` (a response started before the answer),
    then ``"answer"`` (the answer's thread, when it ends).
    """

    def __init__(self, gate: Gate) -> None:
        self._gate = gate
        self._answering = False
        self._left = False
        self.owner = "request"

    async def turn(self) -> None:
        """Wait until this request may use the model (one of its slots)."""
        await self._gate._slots.acquire()
        self._answering = True
        self._gate.active += 1

    def leave(self) -> None:
        """Give the place (and the model, if it had its turn) to the next request; idempotent."""
        if self._left:
            return
        self._left = True
        self._gate.admitted -= 1
        if self._answering:
            self._gate.active -= 1
            self._gate._slots.release()
