"""Idle conversations' KV states kept in RAM (``serve --keep-chats-memory``), found again by prompt prefix.

With parallel slots, a fifth conversation overwrites one of four; the overwritten one's next
request would evaluate its whole history again, images included. A :class:`MemoryKVStore`
keeps the state a slot (or the single sequence) is about to lose and gives it back when a
later prompt starts with more of it than any slot holds, as llama-server's RAM prompt cache
does. It is :mod:`gguf_mcv.runtime.kv_store`'s tier in RAM: no files, no checks of a format
(the states never leave this process), gone when the process ends. Bounded in bytes, least
recently used first out; a state that extends an older one of the same conversation
replaces it. With a disk store as well, :class:`Tiers` puts this one in front.

``counts`` holds what happened: ``saved``, ``restored``, ``refused`` (llama.cpp would not take
it back: forgotten), ``evicted`` (the cap made room), ``too_big`` (a state larger than the
whole cap, not kept).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Callable, Sequence

from ..errors import ConfigError
from .sequence import KVState, StateStore, Unit, n_positions, usable_prefix

#: what ``counts`` counts
EVENTS = ("saved", "restored", "evicted", "refused", "too_big")
#: a state losing fewer positions than this is not kept (as the disk store's default)
MIN_POSITIONS = 64
#: ``auto`` takes this share of the RAM available once the model is loaded ...
AUTO_SHARE = 0.25
#: ... but never more than this (llama-server's prompt cache defaults to 8 GiB; small boards come first here)
AUTO_CAP = 2 * 2**30
#: below this an ``auto`` store is not worth having (one image conversation of a small model fills it)
AUTO_MIN = 16 * 2**20


def auto_size(available: int) -> int:
    """The cap ``auto`` gives when ``available`` bytes of RAM are free: a quarter, at most
    :data:`AUTO_CAP`; 0 (no store) where that is under :data:`AUTO_MIN`."""
    size = min(AUTO_CAP, int(max(0, available) * AUTO_SHARE))
    return size if size >= AUTO_MIN else 0


def resolve_cap(cap: int | str | None, available: Callable[[], int]) -> int:
    """The byte cap ``cap`` asks for: a positive number of bytes; ``"auto"`` (:func:`auto_size`
    of ``available()``); 0, None or ``"off"``: no store (0). :class:`ConfigError` for anything else."""
    if cap is None or cap == "off" or (isinstance(cap, int) and not isinstance(cap, bool) and cap == 0):
        return 0
    if cap == "auto":
        return auto_size(available())
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ConfigError(f"The kept-chats memory cap must be a number of bytes, 'auto' or 'off', not {cap!r}.")
    return cap


def state_bytes(state: KVState) -> int:
    """RAM ``state`` takes: llama.cpp's state and its checkpoints."""
    return len(state.data) + sum(len(data) for _, _, data in state.checkpoints)


class MemoryKVStore:
    """Kept KV states of one model in this process's RAM, at most ``max_bytes`` of them.

    Safe for the caller's threads (:meth:`find`) and the slots' loop (:meth:`keep`) at once.
    """

    def __init__(self, max_bytes: int, *, min_positions: int = MIN_POSITIONS) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ConfigError(f"The kept-chats memory cap must be a positive number of bytes, not {max_bytes!r} "
                              "(0 or 'off' turns the store off).")
        if isinstance(min_positions, bool) or not isinstance(min_positions, int) or min_positions < 1:
            raise ConfigError(f"min_positions must be a positive integer, not {min_positions!r}.")
        self.max_bytes, self.min_positions = max_bytes, min_positions
        self.counts: Counter[str] = Counter()
        self._states: OrderedDict[tuple[Unit, ...], KVState] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    def find(self, units: Sequence[Unit], *, better_than: int, partial: bool) -> KVState | None:
        """The kept state that holds most of ``units``' leading units, if that is more than
        ``better_than`` (``partial``: see :func:`gguf_mcv.runtime.sequence.usable_prefix`); or None."""
        if n_positions(units) < self.min_positions:
            return None
        with self._lock:
            best = max(((usable_prefix(s, units, partial), key) for key, s in reversed(self._states.items())),
                       default=(0, None), key=lambda ranked: ranked[0])  # ties: the most recent
            usable, key = best
            if key is None or usable <= better_than:
                return None
            self._states.move_to_end(key)
            return self._states[key]

    def keep(self, state: KVState) -> None:
        """Keep ``state``, making room by forgetting the least recently used ones."""
        if n_positions(state.units) < self.min_positions:
            return
        size = state_bytes(state)
        key = tuple(state.units)
        with self._lock:
            if size > self.max_bytes:
                self.counts["too_big"] += 1
                return
            self._drop(key)
            # an older state of the same conversation that this one extends is of no more use
            for older in [k for k in self._states if len(k) < len(key) and key[:len(k)] == k]:
                self._drop(older)
            self._states[key] = state
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._states)))
                self.counts["evicted"] += 1
            self.counts["saved"] += 1

    def refused(self, state: KVState, why: str) -> None:
        """llama.cpp refused ``state`` from :meth:`find`: it is forgotten (counted)."""
        with self._lock:
            if self._states.get(tuple(state.units)) is state:
                self._drop(tuple(state.units))
            self.counts["refused"] += 1

    def restored(self, state: KVState) -> None:
        """``state`` (from :meth:`find`) now fills a sequence (counted)."""
        with self._lock:
            self.counts["restored"] += 1

    def holds(self, state: KVState) -> bool:
        """Whether ``state`` is one of this store's (the very object :meth:`find` gave)."""
        with self._lock:
            return self._states.get(tuple(state.units)) is state

    def usage(self) -> int:
        """Bytes the kept states take now."""
        with self._lock:
            return self._bytes

    def entries(self) -> int:
        """How many states are kept now."""
        with self._lock:
            return len(self._states)

    def _drop(self, key: tuple[Unit, ...]) -> None:
        state = self._states.pop(key, None)
        if state is not None:
            self._bytes -= state_bytes(state)


class Tiers:
    """A RAM store in front of another (the disk's): states go to both, and are looked for in
    RAM first, then where the other holds more of the prompt."""

    def __init__(self, memory: MemoryKVStore, other: StateStore) -> None:
        self.memory, self.other = memory, other
        self.min_positions = min(memory.min_positions, other.min_positions)

    def find(self, units: Sequence[Unit], *, better_than: int, partial: bool) -> KVState | None:
        """The state of either tier that holds most of ``units`` (RAM's where they tie)."""
        near = self.memory.find(units, better_than=better_than, partial=partial)
        held = usable_prefix(near, units, partial) if near is not None else better_than
        return self.other.find(units, better_than=max(better_than, held), partial=partial) or near

    def keep(self, state: KVState) -> None:
        """Keep ``state`` in both."""
        self.memory.keep(state)
        self.other.keep(state)

    def refused(self, state: KVState, why: str) -> None:
        """The tier ``state`` came from forgets it."""
        (self.memory if self.memory.holds(state) else self.other).refused(state, why)

    def restored(self, state: KVState) -> None:
        """The tier ``state`` came from counts it."""
        (self.memory if self.memory.holds(state) else self.other).restored(state)
