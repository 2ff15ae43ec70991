"""The queue in front of the model: one answer at a time, a bounded wait, then 503."""

from __future__ import annotations

import asyncio

from .http_errors import HTTPError


class Gate:
    """One answer at a time, at most ``max_waiting`` waiting; beyond that: busy."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.waiting = 0
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def acquire(self, retry_after: int) -> None:
        if self._lock.locked() and self.waiting >= self.max_waiting:
            raise HTTPError(503, f"The server is busy ({self.waiting} requests waiting); try again "
                                 f"in {retry_after} s.", code="server_busy",
                            headers={"Retry-After": str(retry_after)})
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1

    def release(self) -> None:
        self._lock.release()
