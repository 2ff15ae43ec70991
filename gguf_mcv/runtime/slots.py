"""Parallel slots: N sequences of one llama.cpp context, answered together (continuous batching).

A :class:`Scheduler` owns the sequences of a context loaded with ``parallel=N`` and one
thread that runs the step loop. Each step evaluates, in one ``llama_batch``, the last
sampled token of every slot that is answering, plus at most one chunk of one new prompt
(:data:`PREFILL_CHUNK` tokens) — or, where that prompt has an image next, one image
slice instead (encoded by the vision tower, or taken from the embedding cache). So
running answers stall for at most one chunk or one slice while a new one starts, and a
cancelled answer stops within one too. Between two slices the running answers decode for
as long as the last slice took (:data:`VISION_SHARE`).

Each slot remembers what its sequence holds, as the engine does for sequence 0: a
follow-up goes to the free slot holding the longest prefix of its prompt; when a busy
slot holds a longer one (a shared system prompt, an image another conversation asked
about), that prefix is copied into the chosen slot (``llama_memory_seq_cp``: each slot has a
KV stream of its own, so it is a copy of the buffer, not an evaluation).

A prompt that dropped its oldest turns (``Job.shift``) has the dropped stretch removed from
its slot's sequence and the rest shifted back, as the engine does for sequence 0. With a
``store`` (:mod:`gguf_mcv.runtime.kv_store`), a slot's state is kept before another conversation
overwrites it, and a prompt that starts with more of a kept state than any slot holds gets
that state put back into its slot.

Only the scheduler's thread touches the context. Callers tokenize on their own thread,
:meth:`Scheduler.submit` a :class:`Job` and read its events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator, Sequence, cast

from ..errors import AnswerCancelled, ConfigError, EngineError, ModelClosedError
from ..options import GenerationOptions
from .engine import Engine, PrefillStats
from .sequence import (
    ImageUnit,
    KVState,
    SequenceCache,
    StateStore,
    Unit,
    checkpoint_point,
    common_prefix,
    n_positions,
    usable_prefix,
)
from .tokenizer import Prompt, check_room

log = logging.getLogger(__name__)

#: Most prompt tokens evaluated in one step beside the running answers' tokens: a new
#: prompt delays running answers by at most one such chunk (or one image slice).
PREFILL_CHUNK = 256
#: While answers are running, an image slice (seconds of the encoder on a CPU, during which
#: no answer advances) waits until they have decoded for this many times as long as the last
#: slice took: decoding keeps at least half the time instead of one token per slice.
VISION_SHARE = 1.0
#: How long the step loop sleeps waiting for work before it checks whether it should stop.
IDLE_POLL_S = 0.5


@dataclass
class Job:
    """One answer for the scheduler: a tokenized prompt and how to generate.

    The scheduler reports through :attr:`events`, in order: ``("progress", (done, total,
    cached))`` per image slice, ``("prefilled", PrefillStats)``, ``("token", int)`` per
    generated token, then ``("end", finish_reason)`` or ``("error", exception)``.
    """

    prompt: Prompt
    options: GenerationOptions  #: how Engine.generate answers it
    events: "queue.Queue[tuple[str, Any]]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    #: a stretch of a slot's cache this prompt skips (dropped turns) may be shifted out
    shift: bool = False
    stored: KVState | None = None  #: a kept state that holds more of the prompt (see Scheduler.store)

    def cancel(self) -> None:
        """Stop this job at the scheduler's next step (within one chunk or image slice)."""
        self.cancelled.set()


class _Slot:
    """One sequence of the context: what it holds, and the job it is answering."""

    def __init__(self, cache: SequenceCache, n_ctx: int) -> None:
        self.cache = cache  #: what the slot's sequence holds
        self._n_ctx = n_ctx
        self.job: Job | None = None
        self.cursor = 0  # next prompt unit to evaluate
        self.stats = PrefillStats()
        self.started = 0.0
        self.served = 0  # the scheduler's turn count when this slot's prompt was last served
        self.todo_images = 0
        self.done_images = 0
        self.checkpoint_at = -1  # where the prompt being evaluated gets its checkpoint
        self.tokens: Generator[int, None, None] | None = None
        self.pending: int | None = None  # the last sampled token
        self.evaluated = False  # whether ``pending`` is in the sequence (not yet counted)
        self.logits_index = -1
        self.finish_reason = "length"
        self.last_used = 0.0

    # -- the SequenceView that Engine.generate sees ---------------------------------

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_past(self) -> int:
        return self.cache.n_past

    @property
    def units(self) -> list[Unit]:
        return self.cache.units

    def eval_token(self, token: int) -> None:
        # the scheduler evaluated it in the step's batch before resuming the generator; it is
        # counted only now, so the generator's "is the context full" check before this call
        # sees the count it would see alone
        assert self.evaluated and token == self.pending, "a token was resumed before it was evaluated"
        self.record_pending()

    def record_pending(self) -> None:
        """Count the pending token as held, once the batch holding it was evaluated."""
        if self.evaluated:
            self.cache.record([cast(int, self.pending)])
            self.evaluated = False

    # -- state ---------------------------------------------------------------------

    @property
    def free(self) -> bool:
        return self.job is None

    @property
    def prefilling(self) -> bool:
        return self.job is not None and self.tokens is None


@dataclass
class _KeepIdle:
    """A request to the step loop: give every idle slot's state to the store."""

    done: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    """Run up to ``n_slots`` answers at once on ``engine``'s context (loaded with that many
    sequences); see the module docstring. ``n_ctx`` is each slot's context window."""

    def __init__(self, engine: Engine, n_slots: int, n_ctx: int, *,
                 prefill_chunk: int = PREFILL_CHUNK) -> None:
        if n_slots < 1:
            raise ConfigError(f"parallel must be at least 1, not {n_slots}.")
        import llama_cpp  # lazy: loads llama.cpp's native library

        self.engine = engine
        self._lc = llama_cpp
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.n_batch = int(engine.llama.n_batch)
        self.prefill_chunk = max(1, min(prefill_chunk, self.n_batch - n_slots))
        self._slots = [_Slot(SequenceCache(engine.llama.ctx, i, recurrent=engine.recurrent), n_ctx)
                       for i in range(n_slots)]
        self._inbox: "queue.Queue[Job | _KeepIdle | None]" = queue.Queue()
        self._waiting: deque[Job] = deque()
        self._batch = self._lc.llama_batch_init(self.n_batch, 0, 1)
        self._can_rewind = not engine.recurrent  # recurrent state cannot go back partly
        self._closed = False
        self._died = ""
        self.steps = 0  #: batches evaluated (for tests and benchmarks)
        self.steps_taken = 0  # prompt turns handed out
        # seconds the last image slice took, and seconds of other steps since: while answers
        # run, a slice waits until they have had as long (VISION_SHARE), so decoding goes on
        # at half speed or more instead of one token per slice (seconds per slice on a CPU)
        self._slice_s = 0.0
        self._since_slice_s = 0.0
        self.copied_positions = 0  #: prompt positions shared from another slot instead of evaluated
        self.restored_states = 0  #: prompts started from a state the store kept
        #: keeps a slot's state before another conversation overwrites it, and gives kept ones back
        self.store: StateStore | None = None
        self._thread = threading.Thread(target=self._loop, name="gguf_mcv-slots", daemon=True)
        self._thread.start()

    # -- callers ---------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        """Queue ``job``; it starts when a slot is free. Checks what can be checked now."""
        units = job.prompt.units
        if not units or not isinstance(units[-1], int):
            raise ConfigError("A prompt must end with text (the assistant's turn marker).")
        check_room(job.prompt, 1, self.n_ctx, n_slots=self.n_slots)
        if self._closed:
            raise ModelClosedError("This model has been closed; load it again.")
        self._check_alive()
        store = self.store
        if store is not None and job.stored is None:  # read on the caller's thread, not the loop's
            held = max(common_prefix(list(s.units), units) for s in self._slots)
            job.stored = store.find(units, better_than=held, partial=self._can_rewind)
        self._inbox.put(job)
        return job

    def keep_idle(self, timeout: float = 60.0) -> bool:
        """Give every idle slot's state to the store (as the server stops); whether that was done
        within ``timeout`` seconds."""
        if self.store is None or self._closed or not self._thread.is_alive():
            return False
        request = _KeepIdle()
        self._inbox.put(request)
        return request.done.wait(timeout)

    def events(self, job: Job, on_progress: Callable[[int, int, int], None] | None = None
               ) -> Iterator[tuple[str, Any]]:
        """``job``'s events as they come, up to its end (progress handed to ``on_progress``);
        raises its error, or :class:`EngineError` if the step loop died without answering it."""
        while True:
            try:
                kind, value = job.events.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                self._check_alive()
                continue
            if kind == "progress":
                if on_progress is not None:
                    on_progress(*value)
                continue
            if kind == "error":
                raise value
            yield kind, value
            if kind == "end":
                return

    def _check_alive(self) -> None:
        if not self._thread.is_alive() and not self._closed:
            raise EngineError(f"The parallel-slot scheduler stopped ({self._died or 'no reason known'}); "
                              "load the model again.")

    @property
    def restored_checkpoints(self) -> int:
        """Rewinds of a recurrent slot served by a checkpoint."""
        return sum(s.cache.restored_checkpoints for s in self._slots)

    @property
    def shifted_positions(self) -> int:
        """Positions removed by shifting a slot's cache (dropped turns)."""
        return sum(s.cache.shifted_positions for s in self._slots)

    @property
    def active(self) -> int:
        """Slots answering now (prefilling or generating)."""
        return sum(not s.free for s in self._slots)

    @property
    def queued(self) -> int:
        """Jobs waiting for a slot."""
        return len(self._waiting) + self._inbox.qsize()

    def slot_units(self) -> list[tuple[Unit, ...]]:
        """What each slot's sequence holds (a snapshot; for tests and diagnostics)."""
        return [tuple(s.units) for s in self._slots]

    def close(self) -> None:
        """Stop the loop (jobs still queued or running get :class:`ModelClosedError`) and
        free the batch. The context itself belongs to the engine's ``Llama``."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._lc.llama_batch_free(self._batch)

    # -- the step loop ---------------------------------------------------------------

    def _loop(self) -> None:
        gone: Exception = ModelClosedError("The model was closed while this answer was running.")
        try:
            while not self._closed:
                self._take_inbox(block=not any(not s.free for s in self._slots) and not self._waiting)
                self._drop_cancelled()
                self._assign()
                if any(not s.free for s in self._slots):
                    self._step()
        except Exception as exc:  # a fault of this loop: every answer learns of it, none waits forever
            self._died = f"{type(exc).__name__}: {exc}"
            log.error("The parallel-slot scheduler failed", exc_info=exc)
            gone = EngineError(f"The parallel-slot scheduler failed: {self._died}.")
        finally:
            for slot in self._slots:
                if slot.job is not None:
                    self._finish(slot, "error", gone)
            while self._waiting:
                self._fail(self._waiting.popleft(), gone)
            while True:
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(job, _KeepIdle):
                    job.done.set()
                elif job is not None:
                    self._fail(job, gone)

    def _take_inbox(self, block: bool) -> None:
        try:
            job = self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if job is None:
                self._closed = True
                return
            if isinstance(job, _KeepIdle):
                for slot in self._slots:
                    if slot.free:
                        slot.cache.keep_in(self.store)
                job.done.set()
            else:
                self._waiting.append(job)
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        for slot in self._slots:
            if slot.job is not None and slot.job.cancelled.is_set():
                self._finish(slot, "error", AnswerCancelled("The answer was cancelled."))
        for job in [j for j in self._waiting if j.cancelled.is_set()]:
            self._waiting.remove(job)
            self._fail(job, AnswerCancelled("The answer was cancelled before it started."))

    def _assign(self) -> None:
        """Give waiting jobs (oldest first) the free slot that serves them best (:meth:`_fit`)."""
        while self._waiting:
            free = [s for s in self._slots if s.free]
            if not free:
                return
            job = self._waiting.popleft()
            held = max(common_prefix(s.units, job.prompt.units) for s in self._slots)  # the same for every slot
            slot = max(free, key=lambda s: self._fit(s, job, held))
            self._start(slot, job)

    def _fit(self, slot: _Slot, job: Job, held: int) -> tuple[int, int, float]:
        """How well ``slot`` serves ``job``: the prompt positions it starts with less the positions
        of what it holds beyond them (another conversation, overwritten); then its own prefix; then
        the least recently used. Where sequences rewind, a slot starts with the longest prefix any
        slot holds (``held``, in units; :meth:`_start` copies it), so an empty slot is taken before one
        that shares only the chat template's first tokens with the prompt and holds another conversation."""
        units = job.prompt.units
        keep = self._reusable(slot, job)[0]
        start = max(keep, held) if self._can_rewind else keep
        lost = n_positions(slot.units[keep:])
        return n_positions(units[:start]) - lost, keep, -slot.last_used

    def _reusable(self, slot: _Slot, job: Job) -> tuple[int, tuple[int, int] | None]:
        """How many leading units of ``job``'s prompt ``slot`` can keep — with a dropped stretch
        shifted out, where the job allows it and the cache can shift — and that shift's match."""
        units = job.prompt.units
        keep = common_prefix(slot.units, units)
        match = slot.cache.shift_match(units, keep) if job.shift else None
        return (keep + match[1] if match is not None else keep), match

    def _start(self, slot: _Slot, job: Job) -> None:
        units = job.prompt.units
        cache = slot.cache
        slot.job, slot.cursor, slot.tokens, slot.pending = job, 0, None, None
        slot.started, slot.served = time.perf_counter(), 0
        slot.stats = PrefillStats(prompt_tokens=job.prompt.n_pos, image_tokens=job.prompt.image_tokens)
        keep, match = self._reusable(slot, job)
        source = max((s for s in self._slots if s is not slot), default=None,
                     key=lambda s: common_prefix(s.units, units))
        shared = common_prefix(source.units, units) if source is not None else 0
        limit = len(units) - 1  # the last prompt token is evaluated again: sampling needs its logits
        stored, job.stored = job.stored, None
        from_store = usable_prefix(stored, units, self._can_rewind) if stored is not None else 0
        # kept before it is overwritten (the stretch a shift drops is dropped for good)
        cache.keep_in(self.store, n_positions(cache.units[:keep if match is None else sum(match)]))
        from_the_store = min(from_store, limit) > max(keep, shared if self._can_rewind else 0)
        if from_the_store and cache.restore_from(cast(StateStore, self.store), cast(KVState, stored), slot.n_ctx):
            self.restored_states += 1
            cache.truncate(min(from_store, limit))
        else:
            if from_the_store:  # refused: the sequence may be empty now
                keep, match = self._reusable(slot, job)
            if self._can_rewind and source is not None and min(shared, limit) > keep:
                self.copied_positions += cache.copy_from(source.cache, min(shared, limit))
            else:
                if match is not None:
                    cache.shift_out(keep - match[1], *match)
                cache.truncate(min(keep, limit))
        slot.cursor = len(slot.units)
        slot.checkpoint_at = checkpoint_point(units) if not self._can_rewind else -1
        slot.stats.reused_tokens = slot.n_past
        slot.todo_images = sum(1 for u in units[slot.cursor:] if isinstance(u, ImageUnit))
        slot.done_images = 0
        if slot.todo_images:
            job.events.put(("progress", (0, slot.todo_images, 0)))

    def _step(self) -> None:
        """One batch: every answering slot's pending token, plus one chunk of one prompt
        (an image slice only once the running answers have had their share of time)."""
        began = time.perf_counter()
        # prompts take turns (the least recently served first): a short question is not kept
        # waiting behind every slice of another one's big image
        answering = any(s.tokens is not None for s in self._slots)
        slice_due = not answering or self._since_slice_s >= self._slice_s * VISION_SHARE
        prefill = min((s for s in self._slots if s.prefilling and (slice_due or not self._at_image(s))),
                      default=None, key=lambda s: (s.served, s.started))
        if prefill is not None:
            prefill.served = self.steps_taken = self.steps_taken + 1
        if prefill is not None and self._at_image(prefill):
            ok = self._image_step(prefill)
            self._slice_s, self._since_slice_s = time.perf_counter() - began, 0.0
            if not ok:
                return
            prefill = None  # one slice per step: the running answers go on meanwhile
            began = time.perf_counter()
        decoding = [s for s in self._slots if s.tokens is not None]
        full = [s for s in decoding if s.n_past >= s.n_ctx]  # its generator ends without evaluating
        decoding = [s for s in decoding if s.n_past < s.n_ctx]
        batch, n = self._batch, 0
        for slot in decoding:
            self._put(n, cast(int, slot.pending), slot.n_past, slot.cache.seq, True)
            slot.logits_index, n = n, n + 1
        chunk: Sequence[int] = ()
        if prefill is not None:
            units = cast(Job, prefill.job).prompt.units
            end = prefill.cursor
            if prefill.cursor == prefill.checkpoint_at:  # the next turn re-renders what follows
                prefill.cache.save_checkpoint()
            stop_at = prefill.checkpoint_at if prefill.checkpoint_at > prefill.cursor else len(units)
            while (end < min(len(units), stop_at) and isinstance(units[end], int)
                   and end - prefill.cursor < self.prefill_chunk):
                end += 1
            chunk = cast(Sequence[int], units[prefill.cursor:end])
            last = end == len(units)
            for k, token in enumerate(chunk):
                self._put(n + k, token, prefill.n_past + k, prefill.cache.seq, last and k == len(chunk) - 1)
            if last:
                prefill.logits_index = n + len(chunk) - 1
            n += len(chunk)
        if n:
            batch.n_tokens = n
            rc = self._lc.llama_decode(self.engine.llama.ctx, batch)
            if rc != 0:
                self._decode_failed(rc, decoding + ([prefill] if prefill is not None else []))
                return
            self.steps += 1
        for slot in decoding:
            slot.evaluated = True
        if prefill is not None:
            prefill.cache.record(chunk)
            prefill.cursor += len(chunk)
            if prefill.cursor == len(cast(Job, prefill.job).prompt.units):
                self._prefilled(prefill)
        for slot in decoding + full:
            self._advance(slot)
        self._since_slice_s += time.perf_counter() - began

    @staticmethod
    def _at_image(slot: _Slot) -> bool:
        """Whether ``slot``'s prompt goes on with an image slice."""
        return isinstance(cast(Job, slot.job).prompt.units[slot.cursor], ImageUnit)

    def _put(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self._batch
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
        b.seq_id[i][0] = seq

    def _image_step(self, slot: _Slot) -> bool:
        """Evaluate the image slice at ``slot``'s cursor; False if that failed (job ended)."""
        job = cast(Job, slot.job)
        try:
            self.engine.eval_image(slot.cache, job.prompt, slot.cursor, slot.stats, slot.n_ctx)
        except Exception as exc:
            self._finish(slot, "error", exc)
            return False
        slot.cursor += 1
        slot.done_images += 1
        job.events.put(("progress", (slot.done_images, slot.todo_images, slot.stats.slices_from_cache)))
        return True

    def _prefilled(self, slot: _Slot) -> None:
        """The prompt is in: report it, and sample the first token."""
        job = cast(Job, slot.job)
        slot.stats.evaluated_tokens = job.prompt.n_pos - slot.stats.reused_tokens
        slot.stats.prefill_ms = (time.perf_counter() - slot.started) * 1000.0
        job.events.put(("prefilled", slot.stats))
        slot.finish_reason = "length"
        slot.tokens = self.engine.generate(job.options, seq=slot)
        self._advance(slot)

    def _advance(self, slot: _Slot) -> None:
        """Resume ``slot``'s generator: its next token, or its end."""
        job = cast(Job, slot.job)
        try:
            token = next(cast(Generator[int, None, None], slot.tokens))
        except StopIteration:
            self._finish(slot, "end", slot.finish_reason)
            return
        except Exception as exc:
            self._finish(slot, "error", exc)
            return
        slot.pending = token
        job.events.put(("token", token))

    def _decode_failed(self, rc: int, slots: list[_Slot]) -> None:
        """llama.cpp refused a batch: the jobs in it fail, their sequences are cleared."""
        error = EngineError(f"llama.cpp failed to evaluate a batch (code {rc}).")
        for slot in slots:
            slot.cache.clear()
            self._finish(slot, "error", error)

    def _finish(self, slot: _Slot, kind: str, value: Any) -> None:
        job = cast(Job, slot.job)
        if slot.tokens is not None:
            slot.tokens.close()  # frees its samplers, on this thread
        slot.record_pending()  # evaluated but never resumed: the sequence holds it all the same
        slot.job, slot.tokens, slot.pending = None, None, None
        slot.last_used = time.perf_counter()
        job.prompt.close()
        job.events.put((kind, value))

    def _fail(self, job: Job, error: Exception) -> None:
        job.prompt.close()
        job.events.put(("error", error))
