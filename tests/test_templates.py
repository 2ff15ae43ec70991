"""Chat templates render each family the way its models expect."""

from __future__ import annotations

import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.prompt.templates import FAMILIES, ChatTemplate, choose_template

MESSAGES = [{"role": "user", "content": "<__media__>\nWhat is it?"},
            {"role": "assistant", "content": "A cat."},
            {"role": "user", "content": "Colour?"}]


def test_chatml_adds_the_default_system_prompt() -> None:
    out = choose_template(None, "chatml").render(MESSAGES)
    assert out == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<__media__>\nWhat is it?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\nColour?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}] + MESSAGES[:1]
    assert choose_template(None, "chatml").render(with_system).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_llama3_format_for_minicpm_llama3_v25() -> None:
    out = choose_template(None, "llama3", bos_token="<|begin_of_text|>").render(MESSAGES[:1])
    assert out == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
        "<__media__>\nWhat is it?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_qwen3_thinking_off_adds_an_empty_think_block() -> None:
    template = choose_template(None, "qwen3")
    assert template.supports_thinking
    off = template.render(MESSAGES[:1], thinking=False)
    on = template.render(MESSAGES[:1], thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


def test_qwen3_drops_reasoning_from_earlier_answers() -> None:
    history = [MESSAGES[0], {"role": "assistant", "content": "<think>hmm</think>\n\nA cat."},
               MESSAGES[2]]
    out = choose_template(None, "qwen3").render(history, thinking=False)
    assert "hmm" not in out and "<|im_start|>assistant\nA cat.<|im_end|>" in out


def test_embedded_template_wins_and_a_broken_one_falls_back() -> None:
    embedded = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert choose_template(embedded, "llama3").origin == "gguf"
    assert choose_template("{% for x in %}", "llama3").origin == "family:llama3"
    assert choose_template(None, None).origin == "family:chatml"
    with pytest.raises(ConfigError, match="Unknown chat template family"):
        choose_template(None, "mistral")


def test_templates_render_in_a_sandbox() -> None:
    evil = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "custom")
    with pytest.raises(ConfigError):
        evil.render(MESSAGES)
    raising = ChatTemplate("{{ raise_exception('no system role') }}", "custom")
    with pytest.raises(ConfigError, match="no system role"):
        raising.render(MESSAGES)


def test_every_family_renders() -> None:
    for name in FAMILIES:
        assert "What is it?" in choose_template(None, name).render(MESSAGES)
