"""The engine's KV-cache reuse and embedding cache, counted in tokens and encoder calls."""

from __future__ import annotations

import numpy as np
import pytest

import gguf_mcv
from gguf_mcv.errors import ContextOverflowError, EngineError
from gguf_mcv.options import Sampling
from gguf_mcv.runtime.sequence import ImageUnit
from gguf_mcv.vision.embed_cache import EmbeddingCache
from gguf_mcv.vision.media import load_image


def picture(seed: int, size: tuple[int, int] = (320, 240)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


@pytest.fixture
def model(tiny):
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096,
                       embed_cache=EmbeddingCache()) as m:
        yield m


def test_second_turn_evaluates_only_new_tokens(model) -> None:
    chat = model.chat()
    first = chat.send("Describe the picture.", picture(1, (1344, 1344)), max_tokens=6, seed=1,
                      detail="high")
    assert first.timings.slices_encoded == 10
    assert first.usage.cached_tokens <= 40  # at most the shared system prompt of an earlier call
    calls = model.engine.encoder_calls
    second = chat.send("And the colours?", max_tokens=6, seed=1)
    assert model.engine.encoder_calls == calls
    assert second.timings.slices_encoded == second.timings.slices_from_cache == 0
    # everything up to the end of the first answer is reused; only the new turn is evaluated
    new_turn = second.usage.prompt_tokens - first.usage.prompt_tokens - first.usage.completion_tokens
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    assert second.usage.evaluated_tokens <= new_turn + 2  # +2: the answer's end marker retokenized


def test_every_image_chunk_is_encoded_before_any_is_evaluated(model, monkeypatch) -> None:
    # what memory.estimate's vision_mapped counts on: the encoder's and the text model's weights
    # are read in turn, never together
    engine = model.engine
    seen: list[int] = []
    real = engine._encode

    def spy(*args, **kw):
        seen.append(engine.sequence.n_past)
        return real(*args, **kw)

    monkeypatch.setattr(engine, "_encode", spy)
    reply = model.ask("Look.", picture(11, (1344, 1344)), max_tokens=1, detail="high")
    assert len(seen) == reply.timings.slices_encoded == 10
    assert len(set(seen)) == 1  # nothing was evaluated between two encodes


def test_an_encoder_failure_on_a_later_slice_evaluates_nothing_of_the_prompt(model, monkeypatch) -> None:
    engine = model.engine
    model.ask("Warm up.", max_tokens=1)
    before = engine.sequence.n_past
    real, calls = engine._encode, []

    def third_fails(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise EngineError("the vision encoder failed (test)")
        return real(*args, **kw)

    monkeypatch.setattr(engine, "_encode", third_fails)
    with pytest.raises(EngineError, match="test"):
        model.ask("Look.", picture(12, (1344, 1344)), max_tokens=1, detail="high")
    assert engine.sequence.n_past <= before  # no slice of the failed prompt reached the KV cache
    monkeypatch.setattr(engine, "_encode", real)
    assert model.ask("Look.", picture(12, (1344, 1344)), max_tokens=1, detail="high").usage.completion_tokens == 1


def test_cached_image_in_new_conversation_skips_the_encoder(model) -> None:
    image = picture(2, (900, 600))
    model.chat().send("First look.", image, max_tokens=2)
    calls = model.engine.encoder_calls
    model.engine.reset()  # nothing left in the KV cache
    reply = model.chat(system="A different system prompt.").send("Again?", image, max_tokens=2)
    assert model.engine.encoder_calls == calls
    assert reply.timings.slices_encoded == 0
    assert reply.timings.slices_from_cache == reply.usage.image_tokens // 64 > 1


def test_editing_the_last_turn_reuses_the_prefix(model) -> None:
    chat = model.chat()
    image = picture(3)
    chat.send("What is it?", image, max_tokens=3)
    chat.send("Is it big?", max_tokens=3)
    chat.undo()
    assert [m["role"] for m in chat.history] == ["user", "assistant"]
    calls = model.engine.encoder_calls
    reply = chat.send("Is it small?", max_tokens=3)
    assert model.engine.encoder_calls == calls
    assert reply.usage.cached_tokens > reply.usage.image_tokens


def test_cancelled_stream_leaves_the_model_usable(model) -> None:
    chat = model.chat()
    stream = chat.send("Tell a long story.", picture(4), stream=True, max_tokens=200, seed=3)
    next(stream)
    stream.close()
    assert chat.history[-1]["role"] == "assistant"
    reply = chat.send("Shorter please.", max_tokens=3)
    assert reply.usage.completion_tokens >= 1
    assert reply.timings.slices_encoded == 0


def test_units_track_the_kv_cache(model) -> None:
    model.ask("Look.", picture(5), max_tokens=2)
    units = model.engine.units
    images = [u for u in units if isinstance(u, ImageUnit)]
    assert len(images) == 1 and images[0].n_pos == 64
    assert model.engine.n_past == model.engine.llama.n_tokens


def test_context_overflow_names_the_sizes(tiny) -> None:
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=512) as m:
        with pytest.raises(ContextOverflowError) as info:
            m.ask("What?", picture(6, (1344, 1344)), detail="high")
        assert "640 of them image tokens" in str(info.value) and "n_ctx is 512" in str(info.value)
        assert m.engine.encoder_calls == 0  # refused before encoding anything


def test_chat_drops_oldest_turns_when_asked(tiny) -> None:
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=512) as m:
        chat = m.chat(overflow="drop_oldest")
        for i in range(8):  # each turn takes ~90 positions: 8 of them cannot all fit in 512
            chat.send(f"Look at picture {i}.", picture(10 + i), max_tokens=4)
        images = sum(len(t["images"]) for t in chat.history)
        assert 1 <= images < 8  # the oldest ones were dropped to make room


def test_engine_count_image_tokens(model) -> None:
    engine = model.engine
    assert engine.count_image_tokens(load_image(picture(7, (448, 448)))) == 64
    assert engine.count_image_tokens(load_image(picture(7, (1344, 1344)))) == 640


def test_greedy_sampling_is_deterministic(model) -> None:
    image = picture(8)
    a = model.ask("Name it.", image, max_tokens=6, temperature=0)
    b = model.ask("Name it.", image, max_tokens=6, temperature=0)
    assert str(a) == str(b)
    assert Sampling().temperature == 0.7


def test_reused_answer_is_not_evaluated_again_even_when_retokenized_differently(tiny) -> None:
    # the tiny vocabulary's padding tokens (" padN") are never produced by the tokenizer, so
    # an answer made of them comes back in the next prompt as other tokens
    from dataclasses import replace

    from gguf_mcv.testing import synthetic

    spec = replace(synthetic.TINY, visible_padding=True, n_vocab=4096)
    built = synthetic.build(tiny.out_dir.parent / "tiny_visible", spec, quants=["Q4_0"])
    with gguf_mcv.load(model_path=built.quants["Q4_0"], mmproj_path=built.mmproj, n_ctx=4096) as m:
        chat = m.chat()
        first = chat.send("Say something long.", picture(20), max_tokens=24, seed=3)
        assert " pad" in str(first)  # the answer really is padding text
        second = chat.send("Go on.", max_tokens=2)
        # without realigning, reuse would stop at the answer's first token; a random model may
        # also cut a character in half (shown as U+FFFD), after which the text cannot agree
        assert second.usage.cached_tokens > first.usage.prompt_tokens + first.usage.completion_tokens // 2
