"""PromptMeasure: a rendered prompt's positions from its pieces (texts, images), each tokenized once per model."""

from __future__ import annotations

import numpy as np
import pytest

from gguf_mcv import ConfigError
from gguf_mcv.prompt.measure import PromptMeasure


class Spy:
    """Wraps ``engine.tokenize`` (the real one) and keeps how many positions each call filled."""

    def __init__(self, engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[int] = []
        real = engine.tokenize

        def tokenize(text, images=()):
            prompt = real(text, images)
            self.calls.append(prompt.n_pos)
            return prompt

        monkeypatch.setattr(engine, "tokenize", tokenize)


def test_each_segment_is_tokenized_once_and_the_sum_is_exact(tiny_model, monkeypatch) -> None:
    turns = tiny_model.turns
    image = turns.image(np.full((200, 300, 3), 90, dtype=np.uint8), detail="low")
    conversation = turns.system("Be brief.") + [turns.turn("user", [image, "What is it?"]),
                                                 turns.turn("assistant", ["A square."]),
                                                 turns.turn("user", ["And now?"])]
    rendered = turns.render(conversation)
    with tiny_model.engine.tokenize(rendered.text, rendered.images) as whole:
        expected = whole.n_pos
    measure = PromptMeasure(tiny_model.engine)
    spy = Spy(tiny_model.engine, monkeypatch)
    assert measure.positions(rendered.text, rendered.images) == expected
    first = len(spy.calls)
    assert first >= 4  # the pieces (and the anchors)
    assert measure.positions(rendered.text, rendered.images) == expected
    assert len(spy.calls) == first  # nothing measured again
    # one more question: only its own segments are new
    longer = turns.render(conversation + [turns.turn("assistant", ["Still."]), turns.turn("user", ["Why?"])])
    with tiny_model.engine.tokenize(longer.text, longer.images) as whole:
        expected = whole.n_pos
    spy.calls.clear()
    assert measure.positions(longer.text, longer.images) == expected
    assert 1 <= len(spy.calls) <= 3 and sum(spy.calls) < expected // 2


def test_markers_and_images_must_match(tiny_model) -> None:
    measure = PromptMeasure(tiny_model.engine)
    with pytest.raises(ConfigError, match="1 image markers but 0 images"):
        measure.positions(tiny_model.engine.marker)


def test_the_least_recently_used_segments_are_forgotten(tiny_model, monkeypatch) -> None:
    measure = PromptMeasure(tiny_model.engine, capacity=2)
    spy = Spy(tiny_model.engine, monkeypatch)
    for text in ("one", "two", "three", "three", "one"):
        measure.positions(text)
    assert len(spy.calls) == 4  # "one" was forgotten when "three" came
