"""The inference engine: a llama.cpp text context plus a libmtmd vision context.

An :class:`Engine` evaluates prompts made of text and images and generates
tokens. It remembers what its KV cache holds as a list of *units* — one per text
token, one per image chunk (an overview or a slice) — and each prefill evaluates
only what follows the longest common prefix with that list. Image chunks are
encoded by the vision tower once; their embeddings go to an
:class:`~gguf_mcv.vision.embed_cache.EmbeddingCache` and are fed from there whenever the
same pixels come back, in this conversation or another one. Prompts are made by its
:class:`~gguf_mcv.runtime.tokenizer.Tokenizer` and tokens sampled by the token loop
(:mod:`gguf_mcv.runtime.token_loop`).

The engine is not thread-safe; :class:`~gguf_mcv.model.Model` serialises access.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Protocol, Sequence, cast

import numpy as np

from .. import llama_log
from ..errors import ConfigError, ContextOverflowError, EngineError, ModelClosedError
from ..models.headers import read_projector_header
from ..models.identity import file_identity
from ..options import GenerationOptions
from ..vision.embed_cache import DEFAULT_BACKEND, EmbeddingCache, cache_key
from ..vision.media import Image
from .file_watch import MappedFiles
from .sampling import TokenSampler
from .sequence import (
    ImageUnit,
    KVState,
    SequenceCache,
    StateStore,
    Unit,
    checkpoint_point,
    common_prefix,
    n_positions,
    shift_match,
    width,
)
from .token_loop import SequenceView, generate_tokens
from .tokenizer import Prompt, Tokenizer, check_room

#: input_ids value marking positions filled from image embeddings
IMAGE_SENTINEL = -1


class VisionEncoder(Protocol):
    """A vision encoder other than libmtmd's (``gguf_mcv.vision.onnx_vision``)."""

    name: str  #: the backend, for messages
    key_tag: str  #: embedding-cache key prefix: the mmproj's identity and the backend

    def encode(self, image: Image, index: int) -> np.ndarray:
        """Embeddings (tokens × width) of slice ``index`` (0 = the overview) of ``image``."""

    @property
    def mapped_files(self) -> tuple[Path, ...]:
        """The files it reads weights from while it encodes (checked before each answer)."""


@dataclass
class PrefillStats:
    """What one prefill did: positions in the prompt, reused from the cache, evaluated."""

    prompt_tokens: int = 0
    image_tokens: int = 0
    reused_tokens: int = 0
    evaluated_tokens: int = 0
    slices_encoded: int = 0
    slices_from_cache: int = 0
    encode_ms: float = 0.0
    prefill_ms: float = 0.0
    encoded_keys: list[str] = field(default_factory=list)


class Engine:
    """Evaluate text+image prompts with KV-cache reuse and generate tokens."""

    def __init__(
        self,
        llama,
        mmproj_path: str | os.PathLike,
        *,
        vision_on_gpu: bool = False,
        vision_flash_attn: bool | None = None,
        n_threads: int | None = None,
        embed_cache: EmbeddingCache | None = None,
        warmup: bool = False,
        slice_size: int | None = None,
        encoder: VisionEncoder | None = None,
    ) -> None:
        import llama_cpp  # lazy: loads llama.cpp's native library (~0.3 s)
        from llama_cpp import mtmd_cpp

        llama_log.install()
        self.llama = llama
        self._lc = llama_cpp
        self._mt = mtmd_cpp
        self.mmproj_path = os.fspath(mmproj_path)
        #: encodes slices instead of libmtmd (which then holds a stand-in mmproj); its key
        #: tag keeps its embeddings apart from libmtmd's in a shared cache
        self.encoder = encoder
        self.mmproj_id = encoder.key_tag if encoder is not None else file_identity(self.mmproj_path)
        #: what encodes images: part of every cache key and of a saved chat's identity
        self.vision_backend = encoder.name if encoder is not None else DEFAULT_BACKEND
        if slice_size is None:
            slice_size = read_projector_header(self.mmproj_path).shape.image_size
        self.slice_size = slice_size or 448  #: side of one vision-encoder slice, in pixels
        self.embed_cache = embed_cache if embed_cache is not None else EmbeddingCache()
        self.sampler = TokenSampler(llama)  #: picks each generated token
        self.encoder_calls = 0
        self.finish_reason = "length"  #: why the last generate() on sequence 0 ended
        #: keeps the cache's state when a prompt would overwrite it, and gives back kept ones
        self.kv_store: StateStore | None = None
        # hybrid and recurrent text models (MiniCPM-V 4.6's qwen35) cannot rewind their cache
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(llama.model)
                              or llama_cpp.llama_model_is_hybrid(llama.model))
        #: what sequence 0 holds (the parallel scheduler has one such cache per slot)
        self.sequence = _LlamaSequence(llama, recurrent=self.recurrent)
        self.n_embd = int(llama_cpp.llama_model_n_embd_inp(llama.model))

        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = vision_on_gpu
        params.print_timings = False
        params.n_threads = n_threads or llama.n_threads_batch
        params.warmup = warmup
        params.flash_attn_type = {
            None: llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
            True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[vision_flash_attn]
        llama_log.clear_recent()
        self._ctx = mtmd_cpp.mtmd_init_from_file(self.mmproj_path.encode(), llama.model, params)
        if not self._ctx:
            raise EngineError(
                f"llama.cpp could not load the vision projector {self.mmproj_path} "
                f"with this text model ({llama_log.recent_errors() or 'no details logged'})."
            )
        if not mtmd_cpp.mtmd_support_vision(self._ctx):
            self.close()
            raise EngineError(f"{self.mmproj_path} has no vision encoder.")
        #: turns text and images into prompts; knows which tokens spell which text
        self.tokenizer = Tokenizer(llama, self._ctx, self.image_key)
        self.marker = self.tokenizer.marker  #: the text standing for one image in a prompt
        #: every file whose weights are mapped: a change is refused before the next answer
        self.files = MappedFiles([llama.model_path, self.mmproj_path, *(encoder.mapped_files if encoder else ())])

    # -- state -----------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return int(self.llama.n_ctx())

    @property
    def n_past(self) -> int:
        """Positions currently held in the KV cache (kept equal to the ``Llama``'s count)."""
        return int(self.llama.n_tokens)

    @property
    def units(self) -> tuple[Unit, ...]:
        """What the KV cache holds, in order."""
        return tuple(self.sequence.units)

    @property
    def shifted_positions(self) -> int:
        """Positions removed by shifting the cache (see :meth:`prefill`)."""
        return self.sequence.shifted_positions

    @property
    def restored_checkpoints(self) -> int:
        """Rewinds of a recurrent cache served by a checkpoint."""
        return self.sequence.restored_checkpoints

    def reset(self) -> None:
        """Forget everything in the KV cache."""
        self._check_open()
        self.sequence.sync()
        self.sequence.truncate(0)

    def save_state(self) -> KVState:
        """What the KV cache holds: its units, llama.cpp's state of the sequence and the
        recurrent-state checkpoints (to save it)."""
        self._check_open()
        self.sequence.sync()
        return self.sequence.save_state()

    def restore_state(self, state: KVState) -> None:
        """Make the KV cache hold ``state.units`` from ``state`` (from :meth:`save_state` with this model).

        :class:`EngineError` when llama.cpp refuses the state, it does not hold exactly the
        units' positions (the cache is then empty), or a checkpoint does not fall on a unit;
        :class:`ContextOverflowError` when the units do not fit in this context.
        """
        self._check_open()
        self.sequence.sync()
        self.sequence.restore(state, self.n_ctx)

    @property
    def closed(self) -> bool:
        return not getattr(self, "_ctx", None)

    def _check_open(self) -> None:
        if self.closed:
            raise ModelClosedError("This model has been closed; load it again.")

    def close(self) -> None:
        """Free the vision context (the ``Llama`` belongs to the caller)."""
        if getattr(self, "tokenizer", None) is not None:
            self.tokenizer.close()
        if getattr(self, "_ctx", None):
            self._mt.mtmd_free(self._ctx)
            self._ctx = None

    # -- tokenize --------------------------------------------------------------

    def tokenize(self, text: str, images: Sequence[Image] = ()) -> Prompt:
        """Split ``text`` (with one marker per image) and ``images`` into units
        (:meth:`Tokenizer.tokenize <gguf_mcv.runtime.tokenizer.Tokenizer.tokenize>`).

        Every answer starts here, so here a weights file changed since the load is refused
        (:class:`~gguf_mcv.errors.ModelFileChangedError`), before anything reads it.
        """
        self._check_open()
        self.files.check()
        return self.tokenizer.tokenize(text, images)

    def count_image_tokens(self, image: Image) -> int:
        """How many positions ``image`` fills once tokenized (markers excluded)."""
        with self.tokenize(self.marker, [image]) as prompt:
            return prompt.image_tokens

    def image_key(self, digest: str, index: int = 0) -> str:
        """The cache key of slice ``index`` of an image with this content digest."""
        return cache_key(self.vision_backend, self.mmproj_id, digest, index)

    # -- prefill ---------------------------------------------------------------

    def prefill(self, prompt: Prompt, *, reserve: int = 0, shift: bool = False,
                progress: Callable[[int, int, int], None] | None = None) -> PrefillStats:
        """Make the KV cache hold ``prompt``, evaluating only what is not there yet.

        ``reserve`` positions must stay free after the prompt (for the answer);
        :class:`ContextOverflowError` is raised before anything is evaluated otherwise.
        ``progress(done, total, cached)`` is called before the first image chunk is encoded and
        after each one (``cached`` of the ``done`` chunks came from the embedding cache); every
        image chunk is encoded before the first is evaluated. With
        ``shift``, a stretch the prompt no longer has (dropped turns) is removed from the
        cache and what follows it shifted back, where the model's cache can shift.
        """
        self._check_open()
        units = prompt.units
        stats = PrefillStats(prompt_tokens=prompt.n_pos, image_tokens=prompt.image_tokens)
        if not units or not isinstance(units[-1], int):
            raise ConfigError("A prompt must end with text (the assistant's turn marker).")
        check_room(prompt, reserve, self.n_ctx)
        start = time.perf_counter()
        seq = self.sequence
        seq.sync()
        common = self._realign(prompt, common_prefix(seq.units, units))
        if self.kv_store is not None:
            common = self._swap_state(prompt, common, shift)
        if shift:
            common = self._shift_out(prompt, common)
        check_room(prompt, reserve, self.n_ctx)  # realigning can change the count a little
        if common == len(units):
            common -= 1  # re-evaluate the last token: sampling needs fresh logits
        seq.truncate(common)
        common = len(seq.units)  # a recurrent cache may only go back to a checkpoint, or to 0
        stats.reused_tokens = seq.n_past
        # every image is encoded before any is evaluated: the encoder's weights and the text model's
        # are then read in turn, never together (what memory.estimate's vision_mapped counts on)
        images = [k for k in range(common, len(units)) if isinstance(units[k], ImageUnit)]
        if progress is not None and images:
            progress(0, len(images), 0)
        ready: dict[int, np.ndarray] = {}
        for done, k in enumerate(images, start=1):
            ready[k] = self.embeddings(prompt, k, stats)
            if progress is not None:
                progress(done, len(images), stats.slices_from_cache)
        i = common
        checkpoint_at = checkpoint_point(units) if self.recurrent else -1
        while i < len(units):
            if isinstance(units[i], int):
                j = i
                while j < len(units) and isinstance(units[j], int):
                    j += 1
                if i <= checkpoint_at < j:  # the next turn re-renders this prompt's last tokens
                    self._eval_tokens(cast(Sequence[int], units[i:checkpoint_at]))
                    seq.save_checkpoint()
                    i = checkpoint_at
                self._eval_tokens(cast(Sequence[int], units[i:j]))
                i = j
            else:
                self.eval_image(seq, prompt, i, stats, self.n_ctx, embd=ready.pop(i))
                i += 1
        stats.evaluated_tokens = prompt.n_pos - stats.reused_tokens
        stats.prefill_ms = (time.perf_counter() - start) * 1000.0
        return stats

    def _realign(self, prompt: Prompt, common: int) -> int:
        """Reuse cached tokens where the prompt spells the same text with other tokens.

        The model's own answer comes back in the next turn's prompt as text, and
        re-tokenizing it need not give the tokens that were generated. Where the cache and
        the prompt diverge but their text agrees again a little later, the prompt takes the
        cached tokens for that stretch, so the answer is not evaluated a second time.
        Returns the new length of the common prefix.
        """
        kv, new = self.sequence.units, prompt.units
        while common < min(len(kv), len(new)):
            span = self.tokenizer.same_text(kv, new, common)
            if span is None:
                break
            i, j = span
            prompt.replace_units(common, j, kv[common:i])
            common = i + common_prefix(kv[i:], new[i:])
        return common

    def _swap_state(self, prompt: Prompt, common: int, shift: bool) -> int:
        """Keep the cache's state in ``kv_store`` when this prompt would drop at least its
        ``min_positions`` positions (reusing its first ``common`` units, or with ``shift`` all
        up to the end of the stretch :meth:`_shift_out` would keep), and restore a kept state
        that holds more of the prompt. Returns the new common prefix length."""
        store = cast(StateStore, self.kv_store)
        seq = self.sequence
        found = store.find(prompt.units, better_than=common, partial=not self.recurrent)
        match = shift_match(seq.units, prompt.units, common) if shift else None
        # the stretch a shift drops is dropped for good (the conversation goes on without it)
        seq.keep_in(store, n_positions(seq.units[:common if match is None else sum(match)]))
        if found is None:
            return common
        if not seq.restore_from(store, found, self.n_ctx):  # the sequence is as it was, or empty
            return min(common, len(seq.units))
        return self._realign(prompt, common_prefix(seq.units, prompt.units))

    def keep_idle(self) -> None:
        """Give the cache's state to ``kv_store`` if it holds something the store has not (and
        that is worth keeping)."""
        self.sequence.keep_in(self.kv_store)

    def _shift_out(self, prompt: Prompt, common: int) -> int:
        """Remove a stretch of the cache the prompt skips (dropped turns) and shift the rest
        back, where the cache can shift (:meth:`SequenceCache.shift_out`); returns the new
        common prefix length."""
        match = self.sequence.shift_match(prompt.units, common)
        if match is None or not self.sequence.shift_out(common, *match):
            return common
        return common + match[1]

    def _eval_tokens(self, tokens: Sequence[int]) -> None:
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextOverflowError(f"The context window of {self.n_ctx} positions is full.")
        try:
            self.llama.eval(list(tokens))
        except RuntimeError as exc:
            self.sequence.sync()
            raise EngineError(f"llama.cpp failed to evaluate the prompt: {exc}") from exc
        self.sequence.record(tokens)

    def embeddings(self, prompt: Prompt, index: int, stats: PrefillStats) -> np.ndarray:
        """The embeddings of image chunk ``index`` of ``prompt``: from the embedding cache, or from
        the vision encoder (counted in ``stats``)."""
        self._check_open()
        unit, chunk = prompt.image_chunk(index)
        n_values = int(self._mt.mtmd_input_chunk_get_n_tokens(chunk)) * self.n_embd
        embd = self.embed_cache.get(unit.key, n_values=n_values)  # a wrong-sized entry is a miss
        if embd is None:
            start = time.perf_counter()
            embd = self._encode(chunk, unit, prompt.image_source(index))
            stats.encode_ms += (time.perf_counter() - start) * 1000.0
            stats.slices_encoded += 1
            stats.encoded_keys.append(unit.key)
        else:
            stats.slices_from_cache += 1
        return embd

    def eval_image(self, seq: SequenceCache, prompt: Prompt, index: int, stats: PrefillStats, n_ctx: int,
                   embd: np.ndarray | None = None) -> None:
        """Evaluate image chunk ``index`` of ``prompt`` into ``seq`` (a sequence of this
        engine's context) after what it holds: its embeddings are ``embd`` (from
        :meth:`embeddings`), else fetched now the same way. :class:`ContextOverflowError` when
        the chunk does not fit in ``n_ctx``; :class:`EngineError` when llama.cpp fails (the
        sequence then holds what it held)."""
        self._check_open()
        unit, chunk = prompt.image_chunk(index)
        if embd is None:
            embd = self.embeddings(prompt, index, stats)
        if seq.n_past + unit.n_pos > n_ctx:
            raise ContextOverflowError(f"The context window of {n_ctx} positions is full.")
        new_n_past = self._lc.llama_pos(0)
        rc = self._mt.mtmd_helper_decode_image_chunk(
            self._ctx, self.llama.ctx, chunk,
            embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            seq.n_past, seq.seq, self.llama.n_batch, ctypes.byref(new_n_past),
            self._mt.mtmd_helper_post_decode_callback(), None,
        )
        if rc != 0:
            seq.drop_tail()
            raise EngineError(f"llama.cpp failed to decode image embeddings (code {rc}).")
        seq.record([unit], n_past=int(new_n_past.value))

    def _encode(self, chunk, unit: ImageUnit, source: tuple[Image, int] | None = None) -> np.ndarray:
        if self.encoder is not None:
            return self._encode_with(self.encoder, chunk, unit, source)
        llama_log.clear_recent()
        rc = self._mt.mtmd_encode_chunk(self._ctx, chunk)
        if rc != 0:
            raise EngineError(f"The vision encoder failed ({llama_log.recent_errors() or rc}).")
        self.encoder_calls += 1
        n_tokens = int(self._mt.mtmd_input_chunk_get_n_tokens(chunk))
        ptr = self._mt.mtmd_get_output_embd(self._ctx)
        embd = np.ctypeslib.as_array(ptr, shape=(n_tokens * self.n_embd,)).copy()
        self.embed_cache.put(unit.key, embd)
        return embd

    def _encode_with(self, encoder: VisionEncoder, chunk, unit: ImageUnit,
                     source: tuple[Image, int] | None) -> np.ndarray:
        if source is None:
            raise EngineError("An image chunk without its image reached the encoder (a prompt built elsewhere?).")
        n_tokens = int(self._mt.mtmd_input_chunk_get_n_tokens(chunk))
        embd = encoder.encode(source[0], source[1]).reshape(-1)
        if embd.size != n_tokens * self.n_embd:
            raise EngineError(f"The {encoder.name} vision encoder gave {embd.size} values for a slice where libmtmd "
                              f"expects {n_tokens} tokens of {self.n_embd}; use vision_backend='llama.cpp'.")
        self.encoder_calls += 1
        embd = np.ascontiguousarray(embd, dtype=np.float32)
        self.embed_cache.put(unit.key, embd)
        return embd

    # -- generate --------------------------------------------------------------

    def generate(self, options: GenerationOptions, *,
                 seq: "SequenceView | None" = None) -> Generator[int, None, None]:
        """Yield sampled tokens until an end-of-generation token, ``options.max_tokens`` or a full context.

        Each token is evaluated into the KV cache only when the consumer asks for the
        next one, so stopping early (a stop string, a cancelled stream) leaves the
        cache holding exactly what was used. ``self.finish_reason`` says why it ended.
        ``options`` also holds the sampling and the grammar (see :class:`GenerationOptions`).
        ``seq`` generates into another sequence of the context (see :class:`SequenceView`; the
        parallel scheduler's slots); by default, this engine's own sequence 0.
        """
        view = seq if seq is not None else _OwnSequence(self)
        return generate_tokens(self.sampler, view, options, piece=self.tokenizer.piece,
                               markup=lambda text: self.llama.tokenize(text, add_bos=False, special=True))

    def check_grammar(self, grammar: str) -> None:
        """Raise :class:`ConfigError` unless llama.cpp parses ``grammar`` (GBNF, root rule ``root``);
        the vocabulary's UTF-8 table (see :meth:`TokenSampler.sample`) is made here the first time."""
        self._check_open()
        self.sampler.check_grammar(grammar)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a generated token stands for (control tokens give none)."""
        return self.llama.detokenize([token], special=False)

    def token_markup(self, token: int) -> bytes:
        """The text of a token, control tokens included (``<think>`` in some vocabularies)."""
        return self.tokenizer.piece(token)


class _LlamaSequence(SequenceCache):
    """Sequence 0 as the ``Llama`` object counts it too (``n_tokens`` and ``input_ids``, which
    its own ``eval`` and ``generate`` read): every change is mirrored there."""

    def __init__(self, llama: Any, *, recurrent: bool) -> None:
        super().__init__(llama.ctx, 0, recurrent=recurrent)
        self.llama = llama

    def _changed(self, first_unit: int, first_pos: int) -> None:
        ids = [u if isinstance(u, int) else IMAGE_SENTINEL for u in self.units[first_unit:] for _ in range(width(u))]
        self.llama.input_ids[first_pos:first_pos + len(ids)] = ids
        self.llama.n_tokens = self.n_past

    def sync(self) -> None:
        """Agree with the ``Llama`` object when someone else used it in between: keep the units
        it still holds, and adopt text it evaluated beyond them."""
        llama_pos = int(self.llama.n_tokens)
        ids = self.llama.input_ids
        keep, pos = 0, 0
        for unit in self.units:
            end = pos + width(unit)
            if end > llama_pos or not np.all(ids[pos:end] == (unit if isinstance(unit, int) else IMAGE_SENTINEL)):
                break
            keep, pos = keep + 1, end
        del self.units[keep:]
        self.checkpoints = [c for c in self.checkpoints if c.n_units <= keep]
        extra = ids[pos:llama_pos]
        if np.any(extra == IMAGE_SENTINEL):  # positions only libmtmd could have filled: not ours
            self.n_past = pos
            self.drop_tail()
        else:
            self.units.extend(int(t) for t in extra)
            self.n_past = llama_pos


class _OwnSequence:
    """The engine's own sequence 0, evaluated through the ``Llama`` object."""

    def __init__(self, engine: "Engine") -> None:
        self._engine = engine
        self.logits_index = -1

    @property
    def finish_reason(self) -> str:
        return self._engine.finish_reason

    @finish_reason.setter
    def finish_reason(self, value: str) -> None:
        self._engine.finish_reason = value

    @property
    def n_past(self) -> int:
        return self._engine.n_past

    @property
    def n_ctx(self) -> int:
        return self._engine.n_ctx

    def eval_token(self, token: int) -> None:
        self._engine._eval_tokens([token])
