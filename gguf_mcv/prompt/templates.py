"""Render a conversation into the prompt text a model expects.

The chat template embedded in the GGUF (``tokenizer.chat_template``) is used when
the file has one; otherwise the catalog family's template below. Templates are
Jinja, rendered in a sandbox, the way ``transformers`` renders them. Images are
already replaced by libmtmd's media marker in the message contents.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ConfigError
from ..generations import THINK_MARKERS

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3 = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# Qwen3 style: earlier assistant turns keep only their answer; with thinking off
# the generation prompt carries an empty think block, as Qwen3's own template does.
QWEN3 = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}"
    "{% endif %}"
)

FAMILIES: dict[str, str] = {"chatml": CHATML, "llama3": LLAMA3, "qwen3": QWEN3}

THINK_OPEN = THINK_MARKERS[0]


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and where it came from (``"gguf"`` or ``"family:<name>"``)."""

    source: str
    origin: str
    bos_token: str = ""
    eos_token: str = ""

    @property
    def supports_thinking(self) -> bool:
        """Whether the template switches reasoning on and off (``enable_thinking``)."""
        return "enable_thinking" in self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        thinking: bool | None = None,
    ) -> str:
        """Render ``messages`` (``role`` and string ``content``) into prompt text."""
        extra: dict[str, Any] = {}
        if thinking is not None:
            extra["enable_thinking"] = thinking
        try:
            return _compile(self.source).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise ConfigError(f"The {self.origin} chat template failed to render: {exc}") from exc


def choose_template(
    embedded: str | None, family: str | None, *, bos_token: str = "", eos_token: str = ""
) -> ChatTemplate:
    """The GGUF's own template when it has one, else the family's (ChatML by default)."""
    if embedded and embedded.strip():
        try:
            _compile(embedded)
            return ChatTemplate(embedded, "gguf", bos_token, eos_token)
        except jinja2.TemplateError:
            pass  # a template that does not even compile is treated as absent
    name = family or "chatml"
    if name not in FAMILIES:
        raise ConfigError(f"Unknown chat template family {name!r}; known: {', '.join(FAMILIES)}.")
    return ChatTemplate(FAMILIES[name], f"family:{name}", bos_token, eos_token)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
)
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
_ENV.filters["tojson"] = _tojson
_COMPILED: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    template = _COMPILED.get(source)
    if template is None:
        template = _COMPILED[source] = _ENV.from_string(source)
    return template
