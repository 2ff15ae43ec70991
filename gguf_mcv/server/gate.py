"""The queue in front of the model: ``capacity`` answers at a time (the model's parallel
slots, else one), a bounded number admitted, then 503.

A request takes its :class:`Place` before its body is read, so a full queue refuses it
unread, and at most ``max_waiting + 1`` request bodies are held at once.
"""

from __future__ import annotations

import asyncio

from .http_errors import HTTPError


class Gate:
    """``capacity`` answers at a time, at most ``max_waiting`` more admitted; beyond that: busy."""

    def __init__(self, max_waiting: int, capacity: int = 1) -> None:
        self.max_waiting = max_waiting
        self.capacity = capacity
        self.admitted = 0
        self.active = 0  #: answers running
        self._slots = asyncio.Semaphore(capacity)

    @property
    def busy(self) -> bool:
        """Whether an answer is running."""
        return self.active > 0

    @property
    def waiting(self) -> int:
        """Admitted requests not being answered: reading their body or waiting for the model."""
        return self.admitted - self.active

    def admit(self, retry_after: int) -> Place:
        """A place in the queue; 503 with ``Retry-After`` when the queue is full."""
        if self.admitted >= self.max_waiting + self.capacity:
            raise HTTPError(503, f"The server is busy ({self.waiting} requests waiting); try again "
                                 f"in {retry_after} s.", code="server_busy",
                            headers={"Retry-After": str(retry_after)})
        self.admitted += 1
        return Place(self)


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
