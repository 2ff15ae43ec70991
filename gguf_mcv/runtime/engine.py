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
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Protocol, Sequence, Union, cast

import numpy as np

from ..errors import ConfigError, ContextOverflowError, EngineError, MediaError, ModelClosedError
from ..models.headers import read_projector_header
from ..models.identity import file_identity
from ..options import GenerationOptions, Sampling
from ..output import utf8mask
from ..prompt import plaintext
from ..vision.embed_cache import DEFAULT_BACKEND, EmbeddingCache, cache_key
from ..vision.media import Image
from . import native

#: input_ids value marking positions filled from image embeddings
IMAGE_SENTINEL = -1
#: how many recent tokens the repeat penalty looks at
PENALTY_LAST_N = 64
#: recurrent caches: a checkpoint is kept this many units before the end of each prompt, where
#: the next turn's prompt still agrees (its re-rendered generation prompt and answer follow)
CHECKPOINT_TAIL = 32
#: and at most this many checkpoints are kept (each a copy of the recurrent state)
MAX_CHECKPOINTS = 2
#: a stretch dropped from the middle of the cache is shifted out (not re-evaluated) only when
#: at least this many units after it are reused (or all that remain)
MIN_SHIFT_MATCH = 8


class StateStore(Protocol):
    """Where KV states of conversations wait while the cache holds others (``gguf_mcv.runtime.kv_store``)."""

    min_positions: int  #: states shorter than this are not worth keeping

    def find(self, units: Sequence["Unit"], *, better_than: int, partial: bool) -> "KVState | None":
        """A kept state sharing more than ``better_than`` leading units with ``units``
        (with ``partial=False``: only one it can go back to, see :func:`usable_prefix`)."""

    def keep(self, state: "KVState") -> None:
        """Keep ``state`` (written in the background)."""

    def refused(self, state: "KVState", why: str) -> None:
        """``state`` (from :meth:`find`) could not be restored: forget it."""

    def restored(self, state: "KVState") -> None:
        """``state`` (from :meth:`find`) now fills a sequence."""


class VisionEncoder(Protocol):
    """A vision encoder other than libmtmd's (``gguf_mcv.vision.onnx_vision``)."""

    name: str  #: the backend, for messages
    key_tag: str  #: embedding-cache key prefix: the mmproj's identity and the backend

    def encode(self, image: Image, index: int) -> np.ndarray:
        """Embeddings (tokens × width) of slice ``index`` (0 = the overview) of ``image``."""


@dataclass(frozen=True)
class ImageUnit:
    """One image chunk in the KV cache: its content key and how many positions it fills."""

    key: str
    n_pos: int


Unit = Union[int, ImageUnit]


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
        return _n_pos(self.units)

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


@dataclass
class KVState:
    """A copy of what the KV cache holds (:meth:`Engine.save_state`): its units, llama.cpp's
    sequence state, and checkpoints of the recurrent state as ``(n_units, n_pos, data)``."""

    units: list[Unit]
    data: bytes
    checkpoints: list[tuple[int, int, bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class _Checkpoint:
    """The recurrent part of the sequence state after ``n_units`` units (``n_pos`` positions)."""

    n_units: int
    n_pos: int
    data: Any  #: the ctypes byte array llama.cpp wrote the state into


def usable_prefix(state: KVState, units: Sequence[Unit], partial: bool) -> int:
    """How many leading units of ``units`` a cache restored from ``state`` keeps: their common
    prefix, or — where the cache cannot go back partly (``partial=False``) — all of the state
    if it is a prefix of ``units``, else its latest checkpoint inside the common prefix, or 0."""
    common = _common_prefix(state.units, units)
    if partial or common == len(state.units):
        return common
    return max((n for n, _, _ in state.checkpoints if n <= common), default=0)


def checkpoints_of(state: KVState) -> list[_Checkpoint]:
    """``state``'s checkpoints as llama.cpp buffers; :class:`EngineError` if one does not fall on its units."""
    checkpoints = [_Checkpoint(n, p, (ctypes.c_uint8 * len(d)).from_buffer_copy(d)) for n, p, d in state.checkpoints]
    if any(not 0 < c.n_units <= len(state.units) or c.n_pos != _n_pos(state.units[:c.n_units]) for c in checkpoints):
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


def _n_pos(units: Sequence[Unit]) -> int:
    return sum(1 if isinstance(u, int) else u.n_pos for u in units)


def _width(unit: Unit) -> int:
    return 1 if isinstance(unit, int) else unit.n_pos


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
        self._units: list[Unit] = []
        self._pieces: dict[int, bytes] = {}  # token -> its text, for realigning re-tokenized text
        self._utf8: np.ndarray | None = None  # utf8mask.token_table of this vocabulary, made once
        self._utf8_refused: np.ndarray | None = None  # [state, token]: the token would break UTF-8
        self._utf8_lock = threading.Lock()
        self.encoder_calls = 0
        self.shifted_positions = 0  #: positions removed by shifting the cache (see prefill)
        self.restored_checkpoints = 0  #: rewinds of a recurrent cache served by a checkpoint
        self.finish_reason = "length"  #: why the last generate() on sequence 0 ended
        self._checkpoints: list[_Checkpoint] = []
        #: keeps the cache's state when a prompt would overwrite it, and gives back kept ones
        self.kv_store: StateStore | None = None
        self._dirty = False  # the cache holds evaluated units no store has yet
        # hybrid and recurrent text models (MiniCPM-V 4.6's qwen35) cannot rewind their cache
        self._recurrent = bool(llama_cpp.llama_model_is_recurrent(llama.model)
                               or llama_cpp.llama_model_is_hybrid(llama.model))
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
        return tuple(self._units)

    def reset(self) -> None:
        """Forget everything in the KV cache."""
        self._check_open()
        self._truncate(0)

    def save_state(self) -> KVState:
        """What the KV cache holds: its units, llama.cpp's state of the sequence and the
        recurrent-state checkpoints (to save it)."""
        self._check_open()
        self._sync_with_llama()
        buf = copy_seq_state(self._lc, self.llama.ctx, 0)
        if buf is None:
            raise EngineError("llama.cpp could not copy the KV cache's state.")
        return KVState(list(self._units), bytes(buf),
                       [(c.n_units, c.n_pos, bytes(c.data)) for c in self._checkpoints])

    def restore_state(self, state: KVState) -> None:
        """Make the KV cache hold ``state.units`` from ``state`` (from :meth:`save_state` with this model).

        :class:`EngineError` (and an empty cache) when llama.cpp refuses the state, it does
        not hold exactly the units' positions, or a checkpoint does not fall on a unit;
        :class:`ContextOverflowError` when the units do not fit in this context.
        """
        self._check_open()
        units, data = list(state.units), state.data
        n_pos = _n_pos(units)
        if n_pos > self.n_ctx:
            raise ContextOverflowError(f"The saved state holds {n_pos} positions but n_ctx is {self.n_ctx}: "
                                       "load the model with a larger n_ctx.")
        checkpoints = checkpoints_of(state)
        lc, ctx = self._lc, self.llama.ctx
        mem = lc.llama_get_memory(ctx)
        self._truncate(0)
        self._checkpoints = []
        native.clear_recent()
        restored = set_seq_state(lc, ctx, 0, data)
        if not restored or int(lc.llama_memory_seq_pos_max(mem, 0)) != n_pos - 1:
            lc.llama_memory_clear(mem, True)
            raise EngineError("llama.cpp did not accept the saved KV state "
                              f"({native.recent_errors() or 'it holds other positions than the conversation'}).")
        ids = [u if isinstance(u, int) else IMAGE_SENTINEL for u in units for _ in range(_width(u))]
        self.llama.input_ids[:n_pos] = ids
        self.llama.n_tokens = n_pos
        self._units = units
        self._checkpoints = checkpoints
        self._dirty = False

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
        (the template's markup) may hold special tokens and the images' markers.
        """
        self._check_open()
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
        ``progress(done, total, cached)`` is called before the first image chunk and after
        each one (``cached`` of the ``done`` chunks came from the embedding cache). With
        ``shift``, a stretch the prompt no longer has (dropped turns) is removed from the
        cache and what follows it shifted back, where the model's cache can shift.
        """
        self._check_open()
        units = prompt.units
        stats = PrefillStats(prompt_tokens=prompt.n_pos, image_tokens=prompt.image_tokens)
        if not units or not isinstance(units[-1], int):
            raise ConfigError("A prompt must end with text (the assistant's turn marker).")
        if prompt.n_pos + reserve > self.n_ctx:
            raise ContextOverflowError(
                f"The prompt needs {prompt.n_pos} positions ({prompt.image_tokens} of them image "
                f"tokens){f' plus {reserve} for the answer' if reserve else ''}, but n_ctx is "
                f"{self.n_ctx}. Load the model with a larger n_ctx, use fewer or lower-detail "
                "images, or start a new conversation."
            )
        start = time.perf_counter()
        self._sync_with_llama()
        common = self._realign(prompt, _common_prefix(self._units, units))
        if self.kv_store is not None:
            common = self._swap_state(prompt, common, shift)
        if shift:
            common = self._shift_out(prompt, common)
        if prompt.n_pos + reserve > self.n_ctx:  # realigning can change the count a little
            raise ContextOverflowError(
                f"The prompt needs {prompt.n_pos} positions but n_ctx is {self.n_ctx}."
            )
        if common == len(units):
            common -= 1  # re-evaluate the last token: sampling needs fresh logits
        self._truncate(common)
        common = len(self._units)  # a recurrent cache may only go back to a checkpoint, or to 0
        stats.reused_tokens = self.n_past
        todo = sum(1 for u in units[common:] if isinstance(u, ImageUnit))
        done = 0
        if progress is not None and todo:
            progress(0, todo, 0)
        i = common
        checkpoint_at = self._checkpoint_point(units) if self._recurrent else -1
        while i < len(units):
            if isinstance(units[i], int):
                j = i
                while j < len(units) and isinstance(units[j], int):
                    j += 1
                if i <= checkpoint_at < j:  # the next turn re-renders this prompt's last tokens
                    self._eval_tokens(cast(Sequence[int], units[i:checkpoint_at]))
                    self._save_checkpoint()
                    i = checkpoint_at
                self._eval_tokens(cast(Sequence[int], units[i:j]))
                i = j
            else:
                self._eval_image(prompt, i, stats)
                i += 1
                done += 1
                if progress is not None:
                    progress(done, todo, stats.slices_from_cache)
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
        kv, new = self._units, prompt.units
        while common < min(len(kv), len(new)):
            span = self._same_text(kv, new, common)
            if span is None:
                break
            i, j = span
            prompt.replace_units(common, j, kv[common:i])
            common = i + _common_prefix(kv[i:], new[i:])
        return common

    def _swap_state(self, prompt: Prompt, common: int, shift: bool) -> int:
        """Keep the cache's state in ``kv_store`` when this prompt would drop at least its
        ``min_positions`` positions (reusing its first ``common`` units, or with ``shift`` all
        up to the end of the stretch :meth:`_shift_out` would keep), and restore a kept state that holds more of the
        prompt. Returns the new common prefix length."""
        store = cast(StateStore, self.kv_store)
        found = store.find(prompt.units, better_than=common, partial=not self._recurrent)
        match = shift_match(self._units, prompt.units, common) if shift else None
        # the stretch a shift drops is dropped for good (the conversation goes on without it)
        reused = _n_pos(self._units[:common if match is None else sum(match)])
        if self._dirty and self.n_past - reused >= store.min_positions:
            store.keep(self.save_state())
            self._dirty = False
        if found is None:
            return common
        try:
            self.restore_state(found)
        except (EngineError, ContextOverflowError) as exc:  # the cache is empty now
            store.refused(found, str(exc))
            return 0
        store.restored(found)
        return self._realign(prompt, _common_prefix(self._units, prompt.units))

    def keep_idle(self) -> None:
        """Give the cache's state to ``kv_store`` if it holds something the store has not (and
        that is worth keeping)."""
        store = self.kv_store
        if store is not None and self._dirty and self.n_past >= store.min_positions:
            store.keep(self.save_state())
            self._dirty = False

    def _shift_out(self, prompt: Prompt, common: int) -> int:
        """Remove a stretch of the cache the prompt skips (dropped turns) and shift the rest back.

        llama.cpp's sequence remove + add (a RoPE shift of the cached keys) instead of
        evaluating everything after the stretch again. Only for caches that can shift
        (attention-only text models); returns the new common prefix length.
        """
        kv = self._units
        mem = self._lc.llama_get_memory(self.llama.ctx)
        match = shift_match(kv, prompt.units, common)
        if match is None or not self._lc.llama_memory_can_shift(mem):
            return common
        best_k, best_n = match
        self._truncate(best_k + best_n)  # what follows the reused stretch goes first
        start, stop, end = _n_pos(kv[:common]), _n_pos(kv[:best_k]), self.n_past
        delta = stop - start
        if not self._lc.llama_memory_seq_rm(mem, 0, start, stop):
            return common
        self._lc.llama_memory_seq_add(mem, 0, stop, -1, -delta)
        ids = self.llama.input_ids
        ids[start:end - delta] = ids[stop:end].copy()
        self.llama.n_tokens = end - delta
        del self._units[common:best_k]
        self.shifted_positions += delta
        return common + best_n

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
            self._sync_with_llama()
            raise EngineError(f"llama.cpp failed to evaluate the prompt: {exc}") from exc
        self._units.extend(tokens)
        self._dirty = True

    def _eval_image(self, prompt: Prompt, index: int, stats: PrefillStats) -> None:
        unit = prompt.units[index]
        assert isinstance(unit, ImageUnit)
        chunk = prompt._image_chunks[index]
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
        n_past = self.n_past
        new_n_past = self._lc.llama_pos(0)
        rc = self._mt.mtmd_helper_decode_image_chunk(
            self._ctx, self.llama.ctx, chunk,
            embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            n_past, 0, self.llama.n_batch, ctypes.byref(new_n_past),
            self._mt.mtmd_helper_post_decode_callback(), None,
        )
        if rc != 0:
            self._truncate(len(self._units))
            raise EngineError(f"llama.cpp failed to decode image embeddings (code {rc}).")
        self.llama.n_tokens = new_n_past.value
        self.llama.input_ids[n_past:new_n_past.value] = IMAGE_SENTINEL
        self._units.append(unit)
        self._dirty = True

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

    def _truncate(self, n_units: int) -> None:
        """Keep the first ``n_units`` units in the cache — or, where the cache is recurrent and
        cannot go back (llama.cpp refuses a partial rewind of recurrent state), the units up to
        the latest checkpoint before them, or nothing."""
        self._checkpoints = [c for c in self._checkpoints if c.n_units <= n_units]
        pos = _n_pos(self._units[:n_units])
        mem = self._lc.llama_get_memory(self.llama.ctx)
        if n_units < len(self._units) and not self._lc.llama_memory_seq_rm(mem, 0, pos, -1):
            n_units, pos = self._restore_checkpoint(mem)
        del self._units[n_units:]
        self.llama.n_tokens = pos

    @staticmethod
    def _checkpoint_point(units: Sequence[Unit]) -> int:
        """Where a prompt's checkpoint goes: CHECKPOINT_TAIL units before its end, never
        before its last image (an image is never evaluated again because of a rewind)."""
        last_image = max((k for k, u in enumerate(units) if not isinstance(u, int)), default=-1)
        return max(len(units) - CHECKPOINT_TAIL, last_image + 1)

    def _save_checkpoint(self) -> None:
        """Keep the recurrent part of the sequence state here (llama.cpp's PARTIAL_ONLY state,
        as llama-server's context checkpoints do); at most MAX_CHECKPOINTS are kept.

        The oldest goes before the new one is allocated, and the copy llama.cpp writes is the
        one kept, so checkpoints never hold more than MAX_CHECKPOINTS states (the memory
        model counts exactly that).
        """
        del self._checkpoints[:-(MAX_CHECKPOINTS - 1) or None]
        data = copy_seq_state(self._lc, self.llama.ctx, 0, partial=True)
        if data is None:
            return  # no checkpoint: a rewind re-evaluates from the start, as before
        self._checkpoints.append(_Checkpoint(len(self._units), self.n_past, data))

    def _restore_checkpoint(self, mem) -> tuple[int, int]:
        """Go back to the latest checkpoint still valid; (units kept, positions kept)."""
        lc = self._lc
        while self._checkpoints:
            c = self._checkpoints.pop()
            restored = set_seq_state(lc, self.llama.ctx, 0, c.data, partial=True)
            # the recurrent state now ends at the checkpoint: attention cells after it can go
            if restored and lc.llama_memory_seq_rm(mem, 0, c.n_pos, -1):
                self._checkpoints.append(c)
                self.restored_checkpoints += 1
                return c.n_units, c.n_pos
        lc.llama_memory_clear(mem, True)
        return 0, 0

    def _sync_with_llama(self) -> None:
        """Agree with the ``Llama`` object when someone else used it in between."""
        llama_pos = int(self.llama.n_tokens)
        ids = self.llama.input_ids
        keep, pos = 0, 0
        for unit in self._units:
            end = pos + (1 if isinstance(unit, int) else unit.n_pos)
            if end > llama_pos:
                break
            expected = unit if isinstance(unit, int) else IMAGE_SENTINEL
            if not np.all(ids[pos:end] == expected):
                break
            keep, pos = keep + 1, end
        del self._units[keep:]
        # text the Llama evaluated beyond what we knew of is adopted as ours
        extra = ids[pos:llama_pos]
        if np.any(extra == IMAGE_SENTINEL):
            self._truncate(keep)
        else:
            self._units.extend(int(t) for t in extra)

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
        sampler = self._sampler(sampling)
        constrain = None
        utf8 = self._utf8_table() if grammar is not None else None
        state = utf8mask.ACCEPT  # where the constrained text stands in UTF-8 (see utf8mask)
        if grammar is not None and opener is not None:
            either = f'{grammar}\n{_GRAMMAR_OR_OPENER} ::= "{may_open}" | root'
            constrain = self._grammar_sampler(either, root=_GRAMMAR_OR_OPENER)
        elif grammar is not None and waiting is None:
            constrain = self._grammar_sampler(grammar)
        recent = b""  # the end of the text so far, to spot `may_open` and `grammar_after`
        view.finish_reason = "length"
        try:
            for _ in range(max_tokens):
                token = self._sample(sampler, constrain, view.logits_index, state)
                if lc.llama_vocab_is_eog(self._vocab, token):
                    if waiting is None or not must_answer or view.n_past + len(waiting) >= view.n_ctx:
                        view.finish_reason = "stop"
                        return
                    # the reasoning ended without its closing tag: close it, then the answer
                    for closing in self.llama.tokenize(waiting, add_bos=False, special=True):
                        yield closing
                        view.eval_token(closing)
                    waiting, recent, state = None, b"", utf8mask.ACCEPT
                    constrain = self._grammar_sampler(cast(str, grammar))
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
                    constrain = self._grammar_sampler(cast(str, grammar))
        finally:
            lc.llama_sampler_free(sampler)
            if constrain is not None:
                lc.llama_sampler_free(constrain)

    def check_grammar(self, grammar: str) -> None:
        """Raise :class:`ConfigError` unless llama.cpp parses ``grammar`` (GBNF, root rule ``root``);
        the vocabulary's UTF-8 table (see :meth:`_sample`) is made here the first time."""
        self._check_open()
        self._lc.llama_sampler_free(self._grammar_sampler(grammar))
        self._utf8_table()

    def _grammar_sampler(self, grammar: str, root: str = "root"):
        native.clear_recent()
        sampler = self._lc.llama_sampler_init_grammar(self._vocab, grammar.encode("utf-8"), root.encode())
        if not sampler:  # llama.cpp logs why and returns NULL
            raise ConfigError(f"llama.cpp could not use the grammar: {native.recent_errors() or 'no details logged'}."
                              " Check the schema (or GBNF) for rules that refer to themselves first.")
        return sampler

    def _sample(self, chain, constrain, index: int = -1, utf8_state: int = utf8mask.ACCEPT) -> int:
        """The next token from ``chain``, within the grammar ``constrain`` when there is one.

        As llama.cpp's own common sampler does: sample as usual, check only that token
        against the grammar, and only if the grammar refuses it run the grammar over the
        whole vocabulary and sample again. Checking every token of a 150k vocabulary
        against the grammar costs more than the model's forward pass; most sampled tokens
        are allowed (a grammar only rules out what the model rarely wants). Under a grammar,
        tokens that would break UTF-8 from ``utf8_state`` are refused the same way (see
        :mod:`gguf_mcv.output.utf8mask`).
        """
        lc = self._lc
        if constrain is None:
            return int(lc.llama_sampler_sample(chain, self.llama.ctx, index))
        refused = cast(np.ndarray, self._utf8_refused)[utf8_state]
        candidates = self._candidates(index)
        lc.llama_sampler_apply(chain, ctypes.byref(candidates.array))
        token = int(candidates.array.data[candidates.array.selected].id)
        if refused[token]:  # sample again without the tokens that break UTF-8 (no grammar pass yet)
            candidates = self._masked_candidates(index, refused)
            lc.llama_sampler_apply(chain, ctypes.byref(candidates.array))
            token = int(candidates.array.data[candidates.array.selected].id)
        one = (lc.llama_token_data * 1)(lc.llama_token_data(token, 0.0, 0.0))
        single = lc.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
        lc.llama_sampler_apply(constrain, ctypes.byref(single))
        if one[0].logit == -np.inf:  # refused: constrain the whole vocabulary, then sample
            candidates = self._masked_candidates(index, refused)
            lc.llama_sampler_apply(constrain, ctypes.byref(candidates.array))
            if not np.isfinite(candidates.data["logit"]).any():
                # sampling on would pick a token the grammar refuses, and llama.cpp aborts
                raise EngineError("The grammar allows no token of this model's vocabulary here: "
                                  "simplify the schema (or GBNF).")
            lc.llama_sampler_apply(chain, ctypes.byref(candidates.array))
            token = int(candidates.array.data[candidates.array.selected].id)
        lc.llama_sampler_accept(constrain, token)
        lc.llama_sampler_accept(chain, token)
        return token

    def _masked_candidates(self, index: int, refused: np.ndarray) -> "_Candidates":
        """:meth:`_candidates` without the ``refused`` tokens (EngineError if none is left)."""
        candidates = self._candidates(index)
        candidates.data["logit"][refused] = -np.inf
        if not np.isfinite(candidates.data["logit"]).any():
            raise EngineError("Every token of this model's vocabulary would break UTF-8 here.")
        return candidates

    def _utf8_table(self) -> np.ndarray:
        """This vocabulary's :func:`utf8mask.token_table`, made on first use (about a second
        for 150k tokens)."""
        with self._utf8_lock:
            if self._utf8 is None:
                lc, n_vocab = self._lc, self.llama.n_vocab()
                answer = [self._token_piece(t, special=False) for t in range(n_vocab)]
                grammar = [self._token_piece(t, special=True) for t in range(n_vocab)]
                eog = np.array([lc.llama_vocab_is_eog(self._vocab, t) for t in range(n_vocab)], dtype=bool)
                table = utf8mask.token_table(answer, grammar, eog)
                self._utf8_refused = np.ascontiguousarray((table == utf8mask.REJECT).T)
                self._utf8 = table
            return self._utf8

    def _token_piece(self, token: int, special: bool) -> bytes:
        """A token's bytes as llama.cpp writes them (the grammar reads them with ``special``)."""
        buf = ctypes.create_string_buffer(256)
        n = self._lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:max(n, 0)]

    def _candidates(self, index: int = -1) -> "_Candidates":
        """Every token with its logit from row ``index`` of the last evaluation's outputs, as a
        llama.cpp candidate array."""
        n_vocab = self.llama.n_vocab()
        logits = np.ctypeslib.as_array(self._lc.llama_get_logits_ith(self.llama.ctx, index), shape=(n_vocab,))
        data = np.empty(n_vocab, dtype=_TOKEN_DATA)
        data["id"] = np.arange(n_vocab, dtype=np.int32)
        data["logit"] = logits
        data["p"] = 0.0
        pointer = data.ctypes.data_as(ctypes.POINTER(self._lc.llama_token_data))
        array = self._lc.llama_token_data_array(data=pointer, size=n_vocab, selected=-1, sorted=False)
        return _Candidates(data, array)

    def _sampler(self, s: Sampling):
        # A grammar is not part of this chain: see _sample. (Inside it, it would have to come
        # first, on the whole vocabulary: after the top-k shortcut below, every candidate
        # left could be one the grammar forbids.)
        lc = self._lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        add = lambda smpl: lc.llama_sampler_chain_add(chain, smpl)  # noqa: E731
        keep = 1 if s.temperature <= 0 else s.top_k
        if s.repeat_penalty != 1.0:
            if s.repeat_penalty > 1.0 and keep > 0:
                # the penalty only lowers the last PENALTY_LAST_N tokens, so the final top
                # `keep` lies within the first `keep + PENALTY_LAST_N`: same result, without
                # a pass over the whole vocabulary (150k entries) for every token
                add(lc.llama_sampler_init_top_k(keep + PENALTY_LAST_N))
            add(lc.llama_sampler_init_penalties(self.llama.n_vocab(), PENALTY_LAST_N,
                                                s.repeat_penalty, 0.0, 0.0))
        if s.temperature <= 0:
            add(lc.llama_sampler_init_greedy())
            return chain
        add(lc.llama_sampler_init_top_k(s.top_k))
        add(lc.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0:
            add(lc.llama_sampler_init_min_p(s.min_p, 1))
        add(lc.llama_sampler_init_temp(s.temperature))
        seed = s.seed if s.seed is not None else lc.LLAMA_DEFAULT_SEED
        add(lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def token_bytes(self, token: int) -> bytes:
        """The bytes a generated token stands for (control tokens give none)."""
        return self.llama.detokenize([token], special=False)

    def token_markup(self, token: int) -> bytes:
        """The text of a token, control tokens included (``<think>`` in some vocabularies)."""
        return self._piece(token)


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
#: llama.cpp's ``llama_token_data``: id, logit, p
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


@dataclass
class _Candidates:
    """A candidate array for llama.cpp and the numpy buffer it points into (kept alive with it)."""

    data: np.ndarray
    array: Any


def _decoded(data: bytes) -> tuple[str, bool]:
    """``data`` as text (invalid bytes as U+FFFD, as answers are), and whether no character
    is left incomplete at its end."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(data, final=False)
    return text, not decoder.getstate()[0]


def _common_prefix(a: Sequence[Unit], b: Sequence[Unit]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
