"""The queue in front of the model: one answer at a time, a bounded number admitted, then 503.

A request takes its :class:`Place` before its body is read, so a full queue refuses it
unread, and at most ``max_waiting + 1`` request bodies are held at once.
"""

from __future__ import annotations

import asyncio

from .http_errors import HTTPError


class Gate:
    """One answer at a time, at most ``max_waiting`` more admitted; beyond that: busy."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.admitted = 0
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        """Whether an answer is running."""
        return self._lock.locked()

    @property
    def waiting(self) -> int:
        """Admitted requests not being answered: reading their body or waiting for the model."""
        return self.admitted - int(self.busy)

    def admit(self, retry_after: int) -> Place:
        """A place in the queue; 503 with ``Retry-After`` when the queue is full."""
        if self.admitted > self.max_waiting:
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
        """Wait until this request may use the model."""
        await self._gate._lock.acquire()
        self._answering = True

    def leave(self) -> None:
        """Give the place (and the model, if it had its turn) to the next request; idempotent."""
        if self._left:
            return
        self._left = True
        self._gate.admitted -= 1
        if self._answering:
            self._gate._lock.release()
