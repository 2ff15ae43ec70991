"""Tokenizing a prompt of text and images into a :class:`Prompt` of units.

Text people wrote (marked plain, :mod:`gguf_mcv.prompt.plaintext`) goes through llama.cpp's
tokenizer without special tokens; the template's markup and its image markers go through
libmtmd's ``mtmd_tokenize``, which also cuts each image into its chunks (an overview and
slices). A :class:`Prompt` holds one unit per text token and one per image chunk, and keeps
libmtmd's native chunks until it is closed. The :class:`Tokenizer` also knows which tokens
spell which text (:meth:`Tokenizer.same_text`), to reuse a cache that holds other tokens for
the same words.
"""

from __future__ import annotations

import codecs
import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import llama_log
from ..errors import ConfigError, ContextOverflowError, EngineError, MediaError
from ..prompt import plaintext
from ..vision.media import Image
from .sequence import ImageUnit, Unit, n_positions


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
        """Positions the prompt fills in the KV cache."""
        return n_positions(self.units)

    def image_chunk(self, index: int) -> tuple[ImageUnit, object]:
        """Unit ``index`` and libmtmd's native chunk for it; :class:`EngineError` unless it is an image chunk."""
        unit = self.units[index]
        if not isinstance(unit, ImageUnit) or index not in self._image_chunks:
            raise EngineError(f"Unit {index} of the prompt is not an image chunk (a prompt built elsewhere?).")
        return unit, self._image_chunks[index]

    def image_chunks(self) -> list[tuple[int, object]]:
        """Every image chunk as (unit index, native chunk), in prompt order."""
        return sorted(self._image_chunks.items(), key=lambda item: item[0])

    def image_source(self, index: int) -> tuple[Image, int] | None:
        """The image and slice number (0 = the overview) image chunk ``index`` was cut from, if known."""
        return self._image_sources.get(index)

    def replace_units(self, start: int, end: int, replacement: Sequence[Unit]) -> None:
        """Put ``replacement`` (text tokens) in place of ``units[start:end]``."""
        shift = len(replacement) - (end - start)
        self.units[start:end] = list(replacement)
        self._image_chunks = {(k + shift if k >= end else k): chunk
                              for k, chunk in self._image_chunks.items()}
        self._image_sources = {(k + shift if k >= end else k): source
                               for k, source in self._image_sources.items()}

    def close(self) -> None:
        """Free the native chunks (the units stay)."""
        if self._chunks:
            from llama_cpp import mtmd_cpp  # already loaded by the tokenizer that made the chunks

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


class Tokenizer:
    """Text and images into :class:`Prompt` units, with a ``Llama`` and a libmtmd context.

    ``image_key(digest, index)`` names slice ``index`` of an image in the embedding cache.
    """

    def __init__(self, llama: Any, mtmd_ctx: Any, image_key: Callable[[str, int], str]) -> None:
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.llama = llama
        self._mt = mtmd_cpp
        self._ctx = mtmd_ctx
        self._image_key = image_key
        self.marker = mtmd_cpp.mtmd_default_marker().decode()  #: the text standing for one image
        self._pieces: dict[int, bytes] = {}  # token -> its text, for realigning re-tokenized text
        vocab = llama_cpp.llama_model_get_vocab(llama.model)
        # SentencePiece puts "▁" before the text that starts a tokenization (add_space_prefix)
        self._spm = llama_cpp.llama_vocab_type(vocab) == llama_cpp.LLAMA_VOCAB_TYPE_SPM

    def close(self) -> None:
        """Forget the libmtmd context (its owner frees it) and the remembered token texts."""
        self._ctx = None
        self._pieces.clear()

    def tokenize(self, text: str, images: Sequence[Image] = ()) -> Prompt:
        """Split ``text`` (with one marker per image) and ``images`` into units.

        Text marked plain is tokenized without special tokens, and a marker inside it is
        text, not an image; the rest (the template's markup) may hold special tokens and the
        images' markers.
        """
        if self._ctx is None:
            raise EngineError("The tokenizer's vision context has been freed.")
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

    def piece(self, token: int) -> bytes:
        """The text of ``token``, control tokens included (remembered)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.llama.detokenize([token], special=True)
        return piece

    def same_text(self, kv: Sequence[Unit], new: Sequence[Unit], start: int,
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
                bytes_a += self.piece(unit)
                a += 1
            else:
                unit = new[b] if b < len(new) else None
                if not isinstance(unit, int):
                    return None
                bytes_b += self.piece(unit)
                b += 1
        return None

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
            llama_log.clear_recent()
            rc = mt.mtmd_tokenize(self._ctx, chunks, ctypes.byref(inp), array, len(bitmaps))
            if rc != 0:
                details = llama_log.recent_errors() or f"error code {rc}"
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

    def _bitmap(self, image: Image, bitmap_id: str) -> Any:
        rgb = np.ascontiguousarray(image.rgb, dtype=np.uint8)
        data = rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        bitmap = self._mt.mtmd_bitmap_init(image.width, image.height, data)
        if not bitmap:
            raise MediaError(f"libmtmd refused image {image.source} ({image.width}×{image.height}).")
        self._mt.mtmd_bitmap_set_id(bitmap, bitmap_id.encode())
        return bitmap

    def _read_chunks(self, chunks: Any, prompt: Prompt, images: dict[bytes, Image]) -> None:
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
            prompt.units.append(ImageUnit(self._image_key(digest, index), n_pos))
            prompt.image_tokens += n_pos

    def _starts_with_bos(self, text: str) -> bool:
        bos = self.llama.token_bos()
        if bos < 0:
            return False
        piece = self.llama.detokenize([bos], special=True).decode("utf-8", errors="ignore")
        return bool(piece) and text.startswith(piece)


def _decoded(data: bytes) -> tuple[str, bool]:
    """``data`` as text (invalid bytes as U+FFFD, as answers are), and whether no character
    is left incomplete at its end."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(data, final=False)
    return text, not decoder.getstate()[0]
