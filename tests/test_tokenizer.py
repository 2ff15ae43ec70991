"""Prompts of text and images as units: plain text, markup with image markers, the image chunks."""

from __future__ import annotations

import numpy as np
import pytest

from gguf_mcv.errors import ConfigError, ContextOverflowError, EngineError
from gguf_mcv.prompt import plaintext
from gguf_mcv.runtime.sequence import ImageUnit
from gguf_mcv.runtime.tokenizer import Prompt, check_room
from gguf_mcv.vision.media import load_image


def picture(seed: int, size: tuple[int, int] = (320, 240)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def test_each_image_chunk_is_a_unit_with_its_native_chunk_and_source(tiny_model) -> None:
    engine = tiny_model.engine
    image = load_image(picture(1, (896, 448)))
    with engine.tokenize(f"a{engine.marker}b", [image]) as prompt:
        chunks = prompt.image_chunks()
        assert [i for i, _ in chunks] == [i for i, u in enumerate(prompt.units) if isinstance(u, ImageUnit)]
        assert len(chunks) > 1  # an overview and its slices
        for slice_index, (i, chunk) in enumerate(chunks):
            unit, native = prompt.image_chunk(i)
            assert native is chunk and unit.key == engine.image_key(image.digest, slice_index)
            assert prompt.image_source(i) == (image, slice_index)
        assert prompt.image_tokens == sum(u.n_pos for u in prompt.units if isinstance(u, ImageUnit))
        with pytest.raises(EngineError, match="not an image chunk"):
            prompt.image_chunk(0)
    assert prompt.image_chunks() == []  # closed: the native chunks are freed


def test_replacing_text_units_moves_the_image_chunks_with_them(tiny_model) -> None:
    engine = tiny_model.engine
    image = load_image(picture(2))
    with engine.tokenize(f"one two three{engine.marker}", [image]) as prompt:
        first = prompt.image_chunks()[0][0]
        prompt.replace_units(0, first, [7])
        assert prompt.image_chunks()[0][0] == 1
        assert isinstance(prompt.image_chunk(1)[0], ImageUnit) and prompt.image_source(1) == (image, 0)


def test_a_marker_count_unlike_the_images_is_refused(tiny_model) -> None:
    engine = tiny_model.engine
    with pytest.raises(ConfigError, match="1 image markers but 0 images"):
        engine.tokenize(f"look: {engine.marker}")


def test_a_marker_in_plain_text_is_text(tiny_model) -> None:
    engine = tiny_model.engine
    with engine.tokenize("said: " + plaintext.plain(f"here {engine.marker}")) as prompt:
        assert prompt.image_tokens == 0 and all(isinstance(u, int) for u in prompt.units)


def test_check_room_names_the_positions_and_the_slots() -> None:
    prompt = Prompt(units=[1, 2, ImageUnit("k", 10)], image_tokens=10)
    check_room(prompt, 4, 16)
    with pytest.raises(ContextOverflowError, match=r"12 positions \(10 of them image tokens\) plus 5 .* 2 parallel slots"):
        check_room(prompt, 5, 16, n_slots=2)


def test_same_text_finds_where_other_tokens_spell_the_same_words(tiny_model) -> None:
    tokenizer = tiny_model.engine.tokenizer
    llama = tiny_model.engine.llama
    words = llama.tokenize(b"hello world", add_bos=False, special=False)
    by_byte = [t for ch in b"hello world" for t in llama.tokenize(bytes([ch]), add_bos=False, special=False)]
    assert b"".join(tokenizer.piece(t) for t in by_byte) == b"hello world"
    start = next(k for k, (a, b) in enumerate(zip(words, by_byte)) if a != b)  # the tokens part here
    i, j = tokenizer.same_text(words, by_byte, start)
    assert i > start and j > start
    assert b"".join(map(tokenizer.piece, words[start:i])) == b"".join(map(tokenizer.piece, by_byte[start:j]))
    assert tokenizer.same_text([1, 2], [ImageUnit("k", 4)], 0) is None
