"""The inference engine: a llama.cpp text context plus a libmtmd vision context.

An :class:`Engine` evaluates prompts made of text and images and generates
tokens. It remembers what its KV cache holds as a list of *units* — one per text
token, one per image chunk (an overview or a slice) — and each prefill evaluates
only what follows the longest common prefix with that list. Image chunks are
encoded by the vision tower once; their embeddings go to an
:class:`~gguf_mcv.vision.embed_cache.EmbeddingCache` and are fed from there whenever the
same pixels come back, in this conversation or another one.

The engine is not thread-safe; :class:`~gguf_mcv.model.Model` serialises access.
"""

from __future__ import annotations

import codecs
import ctypes
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Protocol, Sequence, cast

import numpy as np

from ..errors import ConfigError, ContextOverflowError, EngineError, MediaError, ModelClosedError
from ..models.headers import read_projector_header
from ..models.identity import file_identity
from ..options import GenerationOptions
from ..output import utf8mask
from ..prompt import plaintext
from ..vision.embed_cache import DEFAULT_BACKEND, EmbeddingCache, cache_key
from ..vision.media import Image
from . import native
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


@dataclass
class Prompt:
    """A tokenized prompt. Holds native chunks until :meth:`close`."""

    units: list[Unit]
    image_tokens: int
    _chunks: list[object] = field(default_factory=list)  # native chunk lists, freed by close()
    _image_chunks: dict[int, object] = field(default_factory=dict)
    _image_sources: dict[int, tuple[Image, int]] = field(default_factory=dict)  # unit -> (image, slice)

    @property
    def n_pos(self) -> int:
        return n_positions(self.units)

    def replace_units(self, start: int, end: int, replacement: Sequence[Unit]) -> None:
        """Put ``replacement`` (text tokens) in place of ``units[start:end]``."""
        shift = len(replacement) - (end - start)
        self.units[start:end] = list(replacement)
        self._image_chunks = {(k + shift if k >= end else k): chunk
                              for k, chunk in self._image_chunks.items()}
        self._image_sources = {(k + shift if k >= end else k): source
                               for k, source in self._image_sources.items()}

    def close(self) -> None:
        if self._chunks:
            from llama_cpp import mtmd_cpp  # already loaded by the engine that made the chunks

            for chunks in self._chunks:
                mtmd_cpp.mtmd_input_chunks_free(chunks)
            self._chunks.clear()
            self._image_chunks.clear()
            self._image_sources.clear()

    def __enter__(self) -> "Prompt":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_room(prompt: Prompt, reserve: int, n_ctx: int, *, n_slots: int = 1) -> None:
    """:class:`ContextOverflowError` unless ``prompt`` and ``reserve`` more positions (for the
    answer) fit in a context of ``n_ctx`` (each of ``n_slots`` parallel slots' context)."""
    if prompt.n_pos + reserve <= n_ctx:
        return
    where = f"each of the {n_slots} parallel slots has n_ctx {n_ctx}" if n_slots > 1 else f"n_ctx is {n_ctx}"
    raise ContextOverflowError(
        f"The prompt needs {prompt.n_pos} positions ({prompt.image_tokens} of them image "
        f"tokens){f' plus {reserve} for the answer' if reserve else ''}, but {where}. Load the "
        "model with a larger n_ctx, use fewer or lower-detail images, or start a new conversation."
    )


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

        native.install_logging()
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
        self._pieces: dict[int, bytes] = {}  # token -> its text, for realigning re-tokenized text
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
        self._vocab = llama_cpp.llama_model_get_vocab(llama.model)
        # SentencePiece puts "▁" before the text that starts a tokenization (add_space_prefix)
        self._spm = llama_cpp.llama_vocab_type(self._vocab) == llama_cpp.LLAMA_VOCAB_TYPE_SPM

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
        native.clear_recent()
        self._ctx = mtmd_cpp.mtmd_init_from_file(self.mmproj_path.encode(), llama.model, params)
        if not self._ctx:
            raise EngineError(
                f"llama.cpp could not load the vision projector {self.mmproj_path} "
                f"with this text model ({native.recent_errors() or 'no details logged'})."
            )
        if not mtmd_cpp.mtmd_support_vision(self._ctx):
            self.close()
            raise EngineError(f"{self.mmproj_path} has no vision encoder.")
        self.marker = mtmd_cpp.mtmd_default_marker().decode()
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
        self._pieces.clear()
        if getattr(self, "_ctx", None):
            self._mt.mtmd_free(self._ctx)
            self._ctx = None

    # -- tokenize --------------------------------------------------------------

    def tokenize(self, text: str, images: Sequence[Image] = ()) -> Prompt:
        """Split ``text`` (with one marker per image) and ``images`` into units.

        Text marked plain (:mod:`gguf_mcv.prompt.plaintext`: what people wrote) is tokenized
        without special tokens, and a marker inside it is text, not an image; the rest
        (the template's markup) may hold special tokens and the images' markers. Every answer
        starts here, so here a weights file changed since the load is refused
        (:class:`~gguf_mcv.errors.ModelFileChangedError`), before anything reads it.
        """
        self._check_open()
        self.files.check()
        segments = plaintext.split(text)
        n_markers = sum(seg.count(self.marker) for seg, is_plain in segments if not is_plain)
        if n_markers != len(images):
            raise ConfigError(f"The prompt has {n_markers} image markers but {len(images)} images were given.")
        prompt = Prompt(units=[], image_tokens=0)
        add_bos = not self._starts_with_bos(plaintext.unmark(text))
        ordinal = 0
        try:
            for segment, is_plain in segments:
                if is_plain:
                    prompt.units.extend(self._plain_tokens(segment, add_bos))
                else:
                    n = segment.count(self.marker)
                    self._tokenize_markup(prompt, segment, images[ordinal:ordinal + n], ordinal, add_bos)
                    ordinal += n
                add_bos = False
        except BaseException:
            prompt.close()
            raise
        return prompt

    def _plain_tokens(self, text: str, add_bos: bool) -> list[int]:
        """Tokens of user-written ``text`` inside a prompt: no special tokens, and no
        SentencePiece "▁" that only the start of a tokenization gets (libmtmd's tokenization
        of the whole prompt has none there)."""
        data = text.encode("utf-8")
        bos = [self.llama.token_bos()] if add_bos and self.llama.token_bos() >= 0 else []
        if not self._spm:
            return bos + self.llama.tokenize(data, add_bos=False, special=False)
        lead = self.llama.tokenize(b"\n", add_bos=False, special=False)  # "▁", "\n"
        tokens = self.llama.tokenize(b"\n" + data, add_bos=False, special=False)
        if tokens[:len(lead)] == lead:
            return bos + tokens[len(lead):]
        return bos + self.llama.tokenize(data, add_bos=False, special=False)

    def _tokenize_markup(self, prompt: Prompt, text: str, images: Sequence[Image], first: int,
                         add_bos: bool) -> None:
        """Tokenize template markup and its images with libmtmd; append to ``prompt``."""
        mt = self._mt
        bitmaps = []
        chunks = None
        try:
            for ordinal, image in enumerate(images, start=first):
                bitmaps.append(self._bitmap(image, f"{ordinal}|{image.digest}"))
            chunks = mt.mtmd_input_chunks_init()
            raw = text.encode("utf-8")
            inp = mt.mtmd_input_text()
            inp.text, inp.text_len = raw, len(raw)
            inp.add_special = add_bos
            inp.parse_special = True
            array = (mt.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            native.clear_recent()
            rc = mt.mtmd_tokenize(self._ctx, chunks, ctypes.byref(inp), array, len(bitmaps))
            if rc != 0:
                details = native.recent_errors() or f"error code {rc}"
                raise MediaError(f"libmtmd could not prepare the images for this model: {details}.")
            prompt._chunks.append(chunks)
            chunks = None  # owned by the prompt now
            by_id = {f"{o}|{image.digest}".encode(): image for o, image in enumerate(images, start=first)}
            self._read_chunks(prompt._chunks[-1], prompt, by_id)
        finally:
            if chunks is not None:
                mt.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mt.mtmd_bitmap_free(bitmap)

    def count_image_tokens(self, image: Image) -> int:
        """How many positions ``image`` fills once tokenized (markers excluded)."""
        with self.tokenize(self.marker, [image]) as prompt:
            return prompt.image_tokens

    def _bitmap(self, image: Image, bitmap_id: str):
        rgb = np.ascontiguousarray(image.rgb, dtype=np.uint8)
        data = rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        bitmap = self._mt.mtmd_bitmap_init(image.width, image.height, data)
        if not bitmap:
            raise MediaError(f"libmtmd refused image {image.source} ({image.width}×{image.height}).")
        self._mt.mtmd_bitmap_set_id(bitmap, bitmap_id.encode())
        return bitmap

    def _read_chunks(self, chunks, prompt: Prompt, images: dict[bytes, Image]) -> None:
        mt = self._mt
        slice_index: dict[bytes, int] = {}
        for i in range(mt.mtmd_input_chunks_size(chunks)):
            chunk = mt.mtmd_input_chunks_get(chunks, i)
            kind = mt.mtmd_input_chunk_get_type(chunk)
            if kind == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                ptr = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                prompt.units.extend(int(ptr[j]) for j in range(n.value))
                continue
            if kind != mt.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                raise MediaError("Only images are supported by this engine.")
            bitmap_id = mt.mtmd_input_chunk_get_id(chunk) or b""
            index = slice_index.get(bitmap_id, 0)
            slice_index[bitmap_id] = index + 1
            digest = bitmap_id.decode().partition("|")[2]
            n_pos = int(mt.mtmd_input_chunk_get_n_pos(chunk))
            prompt._image_chunks[len(prompt.units)] = chunk
            if bitmap_id in images:
                prompt._image_sources[len(prompt.units)] = (images[bitmap_id], index)
            prompt.units.append(ImageUnit(self.image_key(digest, index), n_pos))
            prompt.image_tokens += n_pos

    def image_key(self, digest: str, index: int = 0) -> str:
        """The cache key of slice ``index`` of an image with this content digest."""
        return cache_key(self.vision_backend, self.mmproj_id, digest, index)

    def _starts_with_bos(self, text: str) -> bool:
        bos = self.llama.token_bos()
        if bos < 0:
            return False
        piece = self.llama.detokenize([bos], special=True).decode("utf-8", errors="ignore")
        return bool(piece) and text.startswith(piece)

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
            span = self._same_text(kv, new, common)
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

    def _same_text(self, kv: Sequence[Unit], new: Sequence[Unit], start: int,
                   limit: int = 4096) -> tuple[int, int] | None:
        """The first (i, j) past ``start`` where ``kv[start:i]`` and ``new[start:j]`` spell the same text.

        Text, not bytes: a generated token may end inside a UTF-8 character, and the answer
        then comes back in the next prompt with U+FFFD in its place.
        """
        a = b = start
        bytes_a = bytes_b = b""
        while a - start < limit:
            text_a, whole_a = _decoded(bytes_a)
            text_b, whole_b = _decoded(bytes_b)
            if a > start and b > start and whole_a and whole_b and text_a == text_b:
                return a, b
            if not (text_a.startswith(text_b) or text_b.startswith(text_a)):
                return None
            if not whole_a or (whole_b and len(text_a) <= len(text_b)):  # advance the shorter text
                unit = kv[a] if a < len(kv) else None
                if not isinstance(unit, int):
                    return None
                bytes_a += self._piece(unit)
                a += 1
            else:
                unit = new[b] if b < len(new) else None
                if not isinstance(unit, int):
                    return None
                bytes_b += self._piece(unit)
                b += 1
        return None

    def _piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.llama.detokenize([token], special=True)
        return piece

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
        unit, chunk = self._image_chunk(prompt, index)
        n_values = int(self._mt.mtmd_input_chunk_get_n_tokens(chunk)) * self.n_embd
        embd = self.embed_cache.get(unit.key, n_values=n_values)  # a wrong-sized entry is a miss
        if embd is None:
            start = time.perf_counter()
            embd = self._encode(chunk, unit, prompt._image_sources.get(index))
            stats.encode_ms += (time.perf_counter() - start) * 1000.0
            stats.slices_encoded += 1
            stats.encoded_keys.append(unit.key)
        else:
            stats.slices_from_cache += 1
        return embd

    def _image_chunk(self, prompt: Prompt, index: int) -> tuple[ImageUnit, object]:
        unit = prompt.units[index]
        if not isinstance(unit, ImageUnit) or index not in prompt._image_chunks:
            raise EngineError(f"Unit {index} of the prompt is not an image chunk (a prompt built elsewhere?).")
        return unit, prompt._image_chunks[index]

    def eval_image(self, seq: SequenceCache, prompt: Prompt, index: int, stats: PrefillStats, n_ctx: int,
                   embd: np.ndarray | None = None) -> None:
        """Evaluate image chunk ``index`` of ``prompt`` into ``seq`` (a sequence of this
        engine's context) after what it holds: its embeddings are ``embd`` (from
        :meth:`embeddings`), else fetched now the same way. :class:`ContextOverflowError` when
        the chunk does not fit in ``n_ctx``; :class:`EngineError` when llama.cpp fails (the
        sequence then holds what it held)."""
        self._check_open()
        unit, chunk = self._image_chunk(prompt, index)
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
        native.clear_recent()
        rc = self._mt.mtmd_encode_chunk(self._ctx, chunk)
        if rc != 0:
            raise EngineError(f"The vision encoder failed ({native.recent_errors() or rc}).")
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
        sampling, max_tokens, grammar = options.sampling, options.max_tokens, options.grammar
        grammar_after, may_open, must_answer = options.grammar_after, options.may_open, options.must_answer
        lc = self._lc
        view = seq if seq is not None else _OwnSequence(self)
        opener = may_open.encode() if grammar and grammar_after and may_open else None
        waiting = grammar_after.encode() if grammar and grammar_after and not opener else None
        sampler = self.sampler.chain(sampling)
        constrain = None
        utf8 = self.sampler.utf8_table() if grammar is not None else None
        state = utf8mask.ACCEPT  # where the constrained text stands in UTF-8 (see utf8mask)
        if grammar is not None and opener is not None:
            either = f'{grammar}\n{_GRAMMAR_OR_OPENER} ::= "{may_open}" | root'
            constrain = self.sampler.grammar(either, root=_GRAMMAR_OR_OPENER)
        elif grammar is not None and waiting is None:
            constrain = self.sampler.grammar(grammar)
        recent = b""  # the end of the text so far, to spot `may_open` and `grammar_after`
        view.finish_reason = "length"
        try:
            for _ in range(max_tokens):
                token = self.sampler.sample(sampler, constrain, view.logits_index, state)
                if lc.llama_vocab_is_eog(self._vocab, token):
                    if waiting is None or not must_answer or view.n_past + len(waiting) >= view.n_ctx:
                        view.finish_reason = "stop"
                        return
                    # the reasoning ended without its closing tag: close it, then the answer
                    for closing in self.llama.tokenize(waiting, add_bos=False, special=True):
                        yield closing
                        view.eval_token(closing)
                    waiting, recent, state = None, b"", utf8mask.ACCEPT
                    constrain = self.sampler.grammar(cast(str, grammar))
                    continue
                if constrain is not None:
                    state = int(cast(np.ndarray, utf8)[token, state])
                yield token
                if view.n_past >= view.n_ctx:
                    return
                view.eval_token(token)
                if opener is None and waiting is None:
                    continue
                recent = (recent + self._piece(token))[-2 * len(opener or waiting or b"") - 64:]
                if opener is not None and opener in recent:  # a free block opened: the grammar waits
                    lc.llama_sampler_free(constrain)
                    constrain, opener, waiting, recent = None, None, grammar_after.encode(), b""  # type: ignore[union-attr]
                elif opener is not None and not opener.startswith(recent.lstrip()):
                    opener = None  # the answer itself began
                elif waiting is not None and waiting in recent:  # the free block ended
                    waiting, state = None, utf8mask.ACCEPT
                    constrain = self.sampler.grammar(cast(str, grammar))
        finally:
            lc.llama_sampler_free(sampler)
            if constrain is not None:
                lc.llama_sampler_free(constrain)

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
        return self._piece(token)


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


class SequenceView(Protocol):
    """Where :meth:`Engine.generate` generates: one sequence of the llama.cpp context.

    ``eval_token`` is called once after each token is yielded, before the next is sampled;
    sampling reads the logits in output row ``logits_index`` of the last evaluation.
    """

    finish_reason: str

    @property
    def n_past(self) -> int: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def logits_index(self) -> int: ...

    def eval_token(self, token: int) -> None: ...


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


#: the root rule of "the grammar's answer, or the opening of a free block" (a name no converter makes)
_GRAMMAR_OR_OPENER = "gguf-mcv-answer-or-opener"
def _decoded(data: bytes) -> tuple[str, bool]:
    """``data`` as text (invalid bytes as U+FFFD, as answers are), and whether no character
    is left incomplete at its end."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(data, final=False)
    return text, not decoder.getstate()[0]
