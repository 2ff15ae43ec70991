"""Where a request should go: the routing policy, without Ray (pure, so it is tested as a unit).

A request continuing a conversation goes to the replica that answered its longest known message
prefix; else one about an image a replica has encoded goes there. Either holds while that replica
has room (fewer requests than ``capacity``) and carries at most ``imbalance`` more requests than
the least loaded one; otherwise, and for anything else, the less loaded of two random candidates.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from ..errors import ConfigError
from .keys import RouteKey

DEFAULT_IMBALANCE = 4
DEFAULT_MAX_ENTRIES = 100_000


class Policy:
    """What each replica has answered (bounded, least recently used out), and the choice of replica."""

    def __init__(self, imbalance: int = DEFAULT_IMBALANCE, max_entries: int = DEFAULT_MAX_ENTRIES,
                 seed: int | None = None) -> None:
        if not isinstance(imbalance, int) or isinstance(imbalance, bool) or imbalance < 0:
            raise ConfigError(f"imbalance must be a whole number of requests >= 0, not {imbalance!r}.")
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigError(f"max_entries must be a whole number >= 1, not {max_entries!r}.")
        self.imbalance = imbalance
        self.max_entries = max_entries
        self._holders: OrderedDict[str, str] = OrderedDict()  # "p:"/"i:" + digest -> replica
        self._random = random.Random(seed)

    def record(self, key: RouteKey, replica: str) -> None:
        """``replica`` answered the request with ``key``: it now holds its prefixes and images."""
        for entry in [*("p:" + p for p in key.prefixes), *("i:" + i for i in key.images)]:
            self._holders[entry] = replica
            self._holders.move_to_end(entry)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, replicas: Iterable[str]) -> None:
        """Those replicas are gone (died, stopped): what they held is held nowhere."""
        gone = set(replicas)
        for entry in [e for e, r in self._holders.items() if r in gone]:
            del self._holders[entry]

    def holder(self, key: RouteKey, live: Iterable[str]) -> str | None:
        """The live replica holding the longest prefix of ``key``, else the most of its images."""
        alive = set(live)
        for prefix in reversed(key.prefixes):
            replica = self._holders.get("p:" + prefix)
            if replica in alive:
                return replica
        counts: dict[str, int] = {}
        for image in key.images:
            replica = self._holders.get("i:" + image)
            if replica in alive:
                counts[replica] = counts.get(replica, 0) + 1
        return max(counts, key=lambda r: counts[r]) if counts else None

    def choose(self, key: RouteKey, loads: Mapping[str, int], capacity: Mapping[str, int] | None = None
               ) -> list[list[str]]:
        """Ranks of replicas to try, best first, from ``loads`` (each live replica's requests).

        The holder alone when it has room and is within the imbalance; then (or only) the less
        loaded of two random others first. ``capacity``: each replica's most requests (none: no cap).
        """
        if not loads:
            return []
        lightest = min(loads.values())
        holder = self.holder(key, loads)
        ranks: list[list[str]] = []
        if holder is not None and loads[holder] - lightest <= self.imbalance and (
                capacity is None or loads[holder] < capacity.get(holder, loads[holder] + 1)):
            ranks.append([holder])
        others = [r for r in loads if not ranks or r != holder]
        if others:
            two = self._random.sample(others, min(2, len(others)))
            ranks.append(sorted(two, key=lambda r: loads[r]))
        return ranks
