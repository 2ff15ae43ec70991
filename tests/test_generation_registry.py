"""The generations registry is the one list of MiniCPM-V generations: every generation module
is in it, and the bundled catalog, the prompt families and the vision backends agree with it."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from gguf_mcv import generations
from gguf_mcv.generations import GENERATIONS, Generation
from gguf_mcv.models.catalog import load_catalog
from gguf_mcv.models.headers import MINICPMV_VERSIONS
from gguf_mcv.prompt.templates import FAMILIES


def test_every_generation_module_is_registered_once() -> None:
    declared = []
    for info in pkgutil.iter_modules(generations.__path__):
        module = importlib.import_module(f"gguf_mcv.generations.{info.name}")
        declared += [v for v in vars(module).values() if isinstance(v, Generation)]
    assert sorted(g.key for g in declared) == sorted(GENERATIONS)
    assert all(GENERATIONS[g.key] is g for g in declared)


@pytest.mark.parametrize("entry", list(load_catalog()), ids=lambda e: e.name)
def test_each_catalog_entry_is_a_generation_and_agrees_with_it(entry) -> None:
    owners = [g for g in GENERATIONS.values() if entry.name in g.catalog_names]
    assert len(owners) == 1, f"{entry.name} belongs to {[g.key for g in owners]}: name it in one generation"
    g = owners[0]
    assert (entry.projector_type, entry.minicpmv_version, entry.chat_template, entry.arch.architecture) == (
        g.projector_type, g.minicpmv_version, g.chat_template, g.text_arch)
    assert (entry.thinking, entry.thinking_default) == (g.think_markers is not None, g.thinking_default)
    assert entry.vision.query_tokens == g.tokens_per_slice


def test_every_name_a_generation_claims_is_in_the_catalog() -> None:
    names = set(load_catalog().names())
    for g in GENERATIONS.values():
        assert set(g.catalog_names) <= names, g.key


def test_every_prompt_family_a_generation_uses_is_rendered() -> None:
    assert set(generations.chat_templates()) <= set(FAMILIES)


def test_the_headers_name_each_projector_version_by_its_generation() -> None:
    assert MINICPMV_VERSIONS[3] == "MiniCPM-V 2.6" and MINICPMV_VERSIONS[100045] == "MiniCPM-o 4.5"
    assert generations.text_arch_of(None, "minicpmv4_6") == "qwen35"  # 4.6 carries no version
    assert generations.text_arch_of(100045, "resampler") is None  # known, its text model not checked
    assert generations.text_arch_of(None, "resampler") is None


def test_a_generation_without_a_synthetic_model_says_so() -> None:
    with pytest.raises(ValueError, match="no synthetic"):
        GENERATIONS["o-4.5"].synthetic_fields("tiny")
    assert GENERATIONS["2.5"].synthetic_fields("tiny")["query_num"] == 96
