"""One sequence of a llama.cpp context: what it holds, and the KV bookkeeping done on it.

A :class:`SequenceCache` remembers what one sequence of the KV cache holds as a list of
*units* — one per text token, one per image chunk (an overview or a slice) — with the
positions they fill, the checkpoints of a recurrent state, and whether it holds anything
a state store has not kept yet. It does the jobs a prompt needs before it is evaluated:
truncate, shift out a dropped stretch, checkpoint and go back to a checkpoint, save and
restore the whole state, keep the state in a store, copy a prefix from another sequence.

The engine uses one for its own sequence 0 (:mod:`gguf_mcv.runtime.engine`), the parallel
scheduler one per slot (:mod:`gguf_mcv.runtime.slots`). Only the thread that owns the
context may call it.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, Union

from .. import llama_log
from ..errors import ContextOverflowError, EngineError
from .kv_streams import HEADER, StreamLayout

log = logging.getLogger(__name__)

#: recurrent caches: a checkpoint is kept this many units before the end of each prompt, where
#: the next turn's prompt still agrees (its re-rendered generation prompt and answer follow)
CHECKPOINT_TAIL = 32
#: and at most this many checkpoints are kept (each a copy of the recurrent state)
MAX_CHECKPOINTS = 2
#: a stretch dropped from the middle of the cache is shifted out (not re-evaluated) only when
#: at least this many units after it are reused (or all that remain)
MIN_SHIFT_MATCH = 8


@dataclass(frozen=True)
class ImageUnit:
    """One image chunk in the KV cache: its content key and how many positions it fills."""

    key: str
    n_pos: int


Unit = Union[int, ImageUnit]


@dataclass
class KVState:
    """A copy of what a sequence holds (:meth:`SequenceCache.save_state`): its units, llama.cpp's
    sequence state, and checkpoints of the recurrent state as ``(n_units, n_pos, data)``."""

    units: list[Unit]
    data: bytes
    checkpoints: list[tuple[int, int, bytes]] = field(default_factory=list)


class StateStore(Protocol):
    """Where KV states of conversations wait while the cache holds others (``gguf_mcv.runtime.kv_store``)."""

    min_positions: int  #: states shorter than this are not worth keeping

    def find(self, units: Sequence[Unit], *, better_than: int, partial: bool) -> KVState | None:
        """A kept state sharing more than ``better_than`` leading units with ``units``
        (with ``partial=False``: only one it can go back to, see :func:`usable_prefix`)."""

    def keep(self, state: KVState) -> None:
        """Keep ``state`` (written in the background)."""

    def refused(self, state: KVState, why: str) -> None:
        """``state`` (from :meth:`find`) could not be restored: forget it."""

    def restored(self, state: KVState) -> None:
        """``state`` (from :meth:`find`) now fills a sequence."""


@dataclass(frozen=True)
class Checkpoint:
    """The recurrent part of a sequence's state after ``n_units`` units (``n_pos`` positions)."""

    n_units: int
    n_pos: int
    data: Any  #: the ctypes byte array llama.cpp wrote the state into


def n_positions(units: Sequence[Unit]) -> int:
    """Positions ``units`` fill in the KV cache."""
    return sum(1 if isinstance(u, int) else u.n_pos for u in units)


def width(unit: Unit) -> int:
    """Positions one unit fills."""
    return 1 if isinstance(unit, int) else unit.n_pos


def common_prefix(a: Sequence[Unit], b: Sequence[Unit]) -> int:
    """How many leading units ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def checkpoint_point(units: Sequence[Unit]) -> int:
    """Where a prompt's checkpoint goes: CHECKPOINT_TAIL units before its end, never before
    its last image (an image is never evaluated again because of a rewind)."""
    last_image = max((k for k, u in enumerate(units) if not isinstance(u, int)), default=-1)
    return max(len(units) - CHECKPOINT_TAIL, last_image + 1)


def usable_prefix(state: KVState, units: Sequence[Unit], partial: bool) -> int:
    """How many leading units of ``units`` a cache restored from ``state`` keeps: their common
    prefix, or — where the cache cannot go back partly (``partial=False``) — all of the state
    if it is a prefix of ``units``, else its latest checkpoint inside the common prefix, or 0."""
    common = common_prefix(state.units, units)
    if partial or common == len(state.units):
        return common
    return max((n for n, _, _ in state.checkpoints if n <= common), default=0)


def checkpoints_of(state: KVState) -> list[Checkpoint]:
    """``state``'s checkpoints as llama.cpp buffers; :class:`EngineError` if one does not fall on its units."""
    checkpoints = [Checkpoint(n, p, (ctypes.c_uint8 * len(d)).from_buffer_copy(d)) for n, p, d in state.checkpoints]
    if any(not 0 < c.n_units <= len(state.units) or c.n_pos != n_positions(state.units[:c.n_units])
           for c in checkpoints):
        raise EngineError("A saved recurrent-state checkpoint does not fall on the conversation's units.")
    return checkpoints[-MAX_CHECKPOINTS:]


def copy_seq_state(lc: Any, ctx: Any, seq: int, *, partial: bool = False) -> Any:
    """llama.cpp's state of sequence ``seq`` as a ctypes buffer (``partial``: only its
    recurrent part, ``PARTIAL_ONLY``, as a checkpoint keeps it); None when llama.cpp cannot
    copy it."""
    flags = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
    size = int(lc.llama_state_seq_get_size_ext(ctx, seq, flags))
    data = (ctypes.c_uint8 * size)()
    if int(lc.llama_state_seq_get_data_ext(ctx, data, size, seq, flags)) != size:
        return None
    return data


def set_seq_state(lc: Any, ctx: Any, seq: int, data: Any, *, partial: bool = False) -> bool:
    """Load ``data`` (:func:`copy_seq_state`'s buffer, or bytes) into sequence ``seq``;
    whether llama.cpp took all of it."""
    flags = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
    if isinstance(data, bytes):
        data = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    n = len(data)
    return n > 0 and int(lc.llama_state_seq_set_data_ext(ctx, data, n, seq, flags)) == n


def shift_match(kv: Sequence[Unit], new: Sequence[Unit], common: int) -> tuple[int, int] | None:
    """Where ``new`` goes on after a stretch of ``kv`` it dropped: ``(k, n)`` when ``kv[k:k+n]``
    equals ``new[common:common+n]`` for the longest such ``n`` (k > common), and ``n`` is at least
    MIN_SHIFT_MATCH (or all that ``kv`` has left); None otherwise."""
    if common >= len(kv) or common >= len(new):
        return None
    # the Z-function of rest + [a separator] + kv[common+1:] gives, for each k, how far kv[k:]
    # matches rest's start: all the matches in linear time, not one scan per k
    rest = list(new[common:])
    z = _z_function([*rest, object(), *kv[common + 1:]])[len(rest) + 1:]
    best_n = max(z, default=0)
    if best_n == 0:
        return None
    best_k = common + 1 + z.index(best_n)  # the first of the longest, as the scan found
    if best_n < min(MIN_SHIFT_MATCH, len(kv) - best_k):
        return None
    return best_k, best_n


def _z_function(s: Sequence[object]) -> list[int]:
    """``z[i]``: the length of the longest common prefix of ``s`` and ``s[i:]`` (``z[0]`` = len(s))."""
    n = len(s)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0  # s[left:right] is the rightmost match of a prefix found so far
    for i in range(1, n):
        length = min(right - i, z[i - left]) if i < right else 0
        while i + length < n and s[length] == s[i + length]:
            length += 1
        z[i] = length
        if i + length > right:
            left, right = i, i + length
    return z


class SequenceCache:
    """What sequence ``seq`` of llama.cpp context ``ctx`` holds, and the KV jobs on it.

    ``recurrent``: the text model keeps a recurrent state (MiniCPM-V 4.6's hybrid qwen35),
    which cannot go back partly; it goes back to a :meth:`save_checkpoint` instead, or to 0.
    """

    def __init__(self, ctx: Any, seq: int, *, recurrent: bool) -> None:
        import llama_cpp  # lazy: loads llama.cpp's native library

        self._lc = llama_cpp
        self._ctx = ctx
        self._mem = llama_cpp.llama_get_memory(ctx)
        self.seq = seq
        self.recurrent = recurrent
        model = llama_cpp.llama_get_model(ctx)
        # each sequence has a KV stream of its own (loader._with_sequences): stream = sequence
        self._streams = StreamLayout(int(llama_cpp.llama_n_seq_max(ctx)),
                                     has_attention=not llama_cpp.llama_model_is_recurrent(model))
        self._hybrid = bool(llama_cpp.llama_model_is_hybrid(model))
        #: whether a stretch can be removed from the middle and what follows shifted back
        self.can_shift = not recurrent and bool(llama_cpp.llama_memory_can_shift(self._mem))
        self.units: list[Unit] = []
        self.n_past = 0  #: positions the units fill
        self.checkpoints: list[Checkpoint] = []
        self.dirty = False  #: holds evaluated units that no store has yet
        self.restored_checkpoints = 0  #: rewinds of a recurrent state served by a checkpoint
        self.shifted_positions = 0  #: positions removed by :meth:`shift_out`

    def _changed(self, first_unit: int, first_pos: int) -> None:
        """Called after the units from ``first_unit`` (at position ``first_pos``) changed, or
        the sequence got shorter; for a mirror of the units kept elsewhere."""

    # -- growing -----------------------------------------------------------------------

    def record(self, units: Sequence[Unit], *, n_past: int | None = None) -> None:
        """Count ``units``, just evaluated into this sequence after its end (``n_past``: the
        position count llama.cpp reported after them, where it said)."""
        first_unit, first_pos = len(self.units), self.n_past
        self.units.extend(units)
        self.n_past = n_past if n_past is not None else first_pos + n_positions(units)
        self.dirty = True
        self._changed(first_unit, first_pos)

    def copy_from(self, other: "SequenceCache", n_units: int) -> int:
        """Make this sequence hold ``other``'s first ``n_units`` units (``llama_memory_seq_cp``,
        not evaluated again); the positions copied. The whole sequence is copied, then cut: across
        KV streams llama.cpp copies only whole sequences (a part is an abort)."""
        pos = n_positions(other.units[:n_units])
        self._lc.llama_memory_seq_rm(self._mem, self.seq, 0, -1)
        self._lc.llama_memory_seq_cp(self._mem, other.seq, self.seq, -1, -1)
        self._lc.llama_memory_seq_rm(self._mem, self.seq, pos, -1)
        self.units, self.n_past, self.checkpoints = list(other.units[:n_units]), pos, []
        self._changed(0, 0)
        return pos

    # -- going back --------------------------------------------------------------------

    def clear(self) -> None:
        """Hold nothing."""
        self._lc.llama_memory_seq_rm(self._mem, self.seq, 0, -1)
        self.units, self.n_past, self.checkpoints = [], 0, []
        self._changed(0, 0)

    def truncate(self, n_units: int) -> None:
        """Keep the first ``n_units`` units — or, where the state is recurrent and cannot go
        back partly (llama.cpp refuses), the units up to the latest checkpoint before them, or
        nothing."""
        self.checkpoints = [c for c in self.checkpoints if c.n_units <= n_units]
        if n_units >= len(self.units):
            return
        pos = n_positions(self.units[:n_units])
        if not self._lc.llama_memory_seq_rm(self._mem, self.seq, pos, -1):
            n_units, pos = self._back_to_checkpoint()
        del self.units[n_units:]
        self.n_past = pos
        self._changed(n_units, pos)

    def drop_tail(self) -> None:
        """Remove cells past the units (a failed evaluation may have written some)."""
        self._lc.llama_memory_seq_rm(self._mem, self.seq, self.n_past, -1)
        self._changed(len(self.units), self.n_past)

    def shift_match(self, units: Sequence[Unit], common: int) -> tuple[int, int] | None:
        """Where ``units`` go on after a stretch of this sequence they dropped (see
        :func:`shift_match`), where this cache can shift; None otherwise."""
        return shift_match(self.units, units, common) if self.can_shift else None

    def shift_out(self, common: int, k: int, n: int) -> bool:
        """Remove ``units[common:k]`` and shift ``units[k:k+n]`` back to follow ``common``
        (llama.cpp's sequence remove + add: a RoPE shift of the cached keys, instead of
        evaluating what follows again); what followed ``k+n`` goes. False (and the first
        ``common`` units kept) where llama.cpp refuses."""
        self.truncate(k + n)
        start, stop = n_positions(self.units[:common]), n_positions(self.units[:k])
        if not self.can_shift or not self._lc.llama_memory_seq_rm(self._mem, self.seq, start, stop):
            self.truncate(common)
            return False
        self._lc.llama_memory_seq_add(self._mem, self.seq, stop, -1, start - stop)
        del self.units[common:k]
        self.n_past -= stop - start
        self.shifted_positions += stop - start
        self._changed(common, start)
        return True

    def save_checkpoint(self) -> None:
        """Keep the recurrent part of the state here (llama.cpp's PARTIAL_ONLY state, as
        llama-server's context checkpoints do); at most MAX_CHECKPOINTS are kept.

        The oldest goes before the new one is allocated, and the copy llama.cpp writes is the
        one kept, so checkpoints never hold more than MAX_CHECKPOINTS states (the memory
        model counts exactly that).
        """
        del self.checkpoints[:-(MAX_CHECKPOINTS - 1) or None]
        data = copy_seq_state(self._lc, self._ctx, self.seq, partial=True)
        if data is not None:  # else no checkpoint: a rewind re-evaluates from the start
            self.checkpoints.append(Checkpoint(len(self.units), self.n_past, data))

    def _back_to_checkpoint(self) -> tuple[int, int]:
        """Go back to the latest checkpoint still valid: (units kept, positions kept)."""
        lc = self._lc
        while self.checkpoints:
            c = self.checkpoints.pop()
            # the recurrent state now ends at the checkpoint: attention cells after it can go
            if (set_seq_state(lc, self._ctx, self.seq, c.data, partial=True)
                    and lc.llama_memory_seq_rm(self._mem, self.seq, c.n_pos, -1)):
                self.checkpoints.append(c)
                self.restored_checkpoints += 1
                return c.n_units, c.n_pos
        lc.llama_memory_seq_rm(self._mem, self.seq, 0, -1)
        return 0, 0

    # -- whole states ------------------------------------------------------------------

    def save_state(self) -> KVState:
        """What this sequence holds: its units, llama.cpp's state and the checkpoints."""
        data = copy_seq_state(self._lc, self._ctx, self.seq)
        if data is None:
            raise EngineError("llama.cpp could not copy the KV cache's state.")
        tail = (int(self._lc.llama_state_seq_get_size_ext(self._ctx, self.seq,
                                                          self._lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)) - HEADER
                if self._hybrid and self._streams.n_stream > 1 else 0)  # a hybrid's recurrent part
        return KVState(list(self.units), self._streams.portable(bytes(data), self.seq, tail),
                       [(c.n_units, c.n_pos, bytes(c.data)) for c in self.checkpoints])

    def restore(self, state: KVState, n_ctx: int) -> None:
        """Make this sequence hold ``state`` (from :meth:`save_state`, same model).

        :class:`ContextOverflowError` when its units do not fit in ``n_ctx``, and
        :class:`EngineError` when a checkpoint does not fall on its units (both with the
        sequence as it was), or when llama.cpp refuses the state or it does not hold exactly
        the units' positions (the sequence is then empty).
        """
        units = list(state.units)
        n_pos = n_positions(units)
        if n_pos > n_ctx:
            raise ContextOverflowError(f"The saved state holds {n_pos} positions but n_ctx is {n_ctx}: "
                                       "load the model with a larger n_ctx.")
        checkpoints = checkpoints_of(state)
        data = self._streams.native(state.data)
        self.clear()
        lc = self._lc
        llama_log.clear_recent()
        if (not set_seq_state(lc, self._ctx, self.seq, data)
                or int(lc.llama_memory_seq_pos_max(self._mem, self.seq)) != n_pos - 1):
            lc.llama_memory_seq_rm(self._mem, self.seq, 0, -1)
            raise EngineError("llama.cpp did not accept the saved KV state "
                              f"({llama_log.recent_errors() or 'it holds other positions than the conversation'}).")
        self.units, self.n_past, self.checkpoints, self.dirty = units, n_pos, checkpoints, False
        self._changed(0, 0)

    def keep_in(self, store: StateStore | None, reused: int = 0) -> bool:
        """Give this sequence's state to ``store`` when it holds something the store has not,
        and a prompt that reuses only ``reused`` of its positions would drop at least the
        store's ``min_positions``; whether it did."""
        if store is None or not self.dirty or self.n_past - reused < store.min_positions:
            return False
        try:
            state = self.save_state()
        except EngineError as exc:  # the state is only not kept: the answer goes on
            log.warning("A KV state was not kept for later: %s", exc)
            return False
        store.keep(state)
        self.dirty = False
        return True

    def restore_from(self, store: StateStore, state: KVState, n_ctx: int) -> bool:
        """:meth:`restore` ``state`` (found in ``store``) and tell the store how it went."""
        try:
            self.restore(state, n_ctx)
        except (EngineError, ContextOverflowError) as exc:
            store.refused(state, str(exc))
            return False
        store.restored(state)
        return True
