"""gguf_mcv.models.quants: quant names, quality order, bits per weight, and GGUF file-name classification."""

from __future__ import annotations

import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.models.quants import (
    BITS_PER_WEIGHT,
    QUANT_ORDER,
    bits_per_weight,
    classify_gguf,
    estimate_size,
    is_known_quant,
    normalize_quant,
    quality_rank,
    sort_by_quality,
)

# (path in repo, is_mmproj, quant, shard, shard_count): real names from MiniCPM-V repos
# (openbmb, ggml-org, bartowski, second-state, AI-Engine, mzwing) and made-up edge cases.
NAMES = [
    ("ggml-model-Q4_K_M.gguf", False, "Q4_K_M", None, None),
    ("ggml-model-f16.gguf", False, "F16", None, None),
    ("ggml-model-F16.gguf", False, "F16", None, None),
    ("ggml-model-Q4_K.gguf", False, "Q4_K_M", None, None),  # llama-quantize alias
    ("ggml-model-Q3_K.gguf", False, "Q3_K_M", None, None),
    ("ggml-model-IQ3_M.gguf", False, "IQ3_M", None, None),
    ("ggml-model-IQ3_XXS.gguf", False, "IQ3_XXS", None, None),
    ("Model-7.6B-Q4_K_M.gguf", False, "Q4_K_M", None, None),
    ("Model-3.6B-Q4_0.gguf", False, "Q4_0", None, None),
    ("MiniCPM-V-4_5-Q4_K_M.gguf", False, "Q4_K_M", None, None),  # 4_5 is a version
    ("MiniCPM-V-4_5-Q4_0.gguf", False, "Q4_0", None, None),
    ("MiniCPM-V-4_6-Q8_0.gguf", False, "Q8_0", None, None),
    ("MiniCPM-V-4_6-Thinking-F16.gguf", False, "F16", None, None),
    ("MiniCPM-V-4.6-Q4_K_M.gguf", False, "Q4_K_M", None, None),
    ("mmproj-model-f16.gguf", True, "F16", None, None),
    ("mmproj-MiniCPM-V-4.6-F16.gguf", True, "F16", None, None),
    ("mmproj-MiniCPM-V-4.6-Q8_0.gguf", True, "Q8_0", None, None),
    ("mmproj-MiniCPM-V-2_6-f16.gguf", True, "F16", None, None),
    ("MiniCPM-V-2-mmproj.F16.gguf", True, "F16", None, None),
    ("MiniCPM-o-2_6/ggml-model-Q8_0.gguf", False, "Q8_0", None, None),
    ("minicpm-v-2_6-q4_k_m.gguf", False, "Q4_K_M", None, None),
    ("MiniCPM-V-2_6.q5_k_m.gguf", False, "Q5_K_M", None, None),
    ("MiniCPM-V-2.F16.gguf", False, "F16", None, None),
    ("minicpm3-4b-fp16.gguf", False, "F16", None, None),
    ("MiniCPM-V-2_6-IQ4_XS.gguf", False, "IQ4_XS", None, None),
    ("MiniCPM-V-2_6-IQ4_NL.gguf", False, "IQ4_NL", None, None),
    ("MiniCPM-V-2_6-Q4_0.gguf", False, "Q4_0", None, None),
    ("Qwen3.5-4B-BF16.gguf", False, "BF16", None, None),
    ("MiniCPM-V-2_6.f32.gguf", False, "F32", None, None),
    ("MiniCPM-V-2_6-Q4_K_L.gguf", False, None, None, None),  # third-party mix: not guessed
    ("MiniCPM-V-2_6-Q6_K_L.gguf", False, None, None, None),
    ("MiniCPM-V-2_6-Q3_K_XL.gguf", False, None, None, None),
    ("model.gguf", False, None, None, None),
    ("MiniCPM-V-4_5.gguf", False, None, None, None),
    ("big/Model-Q8_0-00001-of-00003.gguf", False, "Q8_0", 1, 3),
    ("Model-Q4_K_M-00003-of-00003.gguf", False, "Q4_K_M", 3, 3),
    ("C:\\models\\ggml-model-Q5_0.gguf", False, "Q5_0", None, None),
    ("GGML-MODEL-Q6_K.GGUF", False, "Q6_K", None, None),
]


@pytest.mark.parametrize(("path", "is_mmproj", "quant", "shard", "count"), NAMES)
def test_classify_real_names(path, is_mmproj, quant, shard, count):
    info = classify_gguf(path)
    assert info is not None
    assert (info.is_mmproj, info.quant, info.shard, info.shard_count) == (is_mmproj, quant, shard, count)
    assert info.kind == ("mmproj" if is_mmproj else "model")
    assert info.is_sharded == (shard is not None)
    assert info.path == path


def test_classify_keeps_the_filename_only():
    assert classify_gguf("MiniCPM-o-2_6/ggml-model-Q8_0.gguf").filename == "ggml-model-Q8_0.gguf"


@pytest.mark.parametrize("path", ["README.md", ".gitattributes", "model.safetensors", "x.gguf.part1of2"])
def test_classify_ignores_non_gguf(path):
    assert classify_gguf(path) is None


def test_order_is_the_quality_ladder():
    ladder = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "IQ4_XS", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M",
              "Q5_0", "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "F16", "BF16", "F32"]
    assert [q for q in QUANT_ORDER if q in ladder] == ladder
    assert [quality_rank(q) for q in ladder] == sorted(quality_rank(q) for q in ladder)
    assert len(set(QUANT_ORDER)) == len(QUANT_ORDER)


def test_quality_rank_accepts_any_spelling():
    assert quality_rank("q4_k_m") == quality_rank("Q4_K") == QUANT_ORDER.index("Q4_K_M")
    assert quality_rank("Q8_0") > quality_rank("Q4_K_M") > quality_rank("Q2_K")


def test_sort_by_quality():
    assert sort_by_quality(["f16", "Q2_K", "q8_0", "Q4_K_M"]) == ["Q2_K", "Q4_K_M", "Q8_0", "F16"]


def test_bits_per_weight_from_llama_quantize_table():
    assert set(BITS_PER_WEIGHT) == set(QUANT_ORDER)
    assert bits_per_weight("Q4_K_M") == pytest.approx(4.9, abs=0.01)  # 4.58 GiB @ Llama-3-8B
    assert bits_per_weight("Q8_0") == pytest.approx(8.5, abs=0.05)  # 34 bytes per 32 weights
    assert bits_per_weight("IQ4_XS") == 4.25
    assert bits_per_weight("F16") == 16.0
    k_ladder = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16"]
    assert [bits_per_weight(q) for q in k_ladder] == sorted(bits_per_weight(q) for q in k_ladder)


def test_estimate_size_matches_a_real_file():
    # MiniCPM-V 2.6 (Qwen2-7B, 7.6e9 weights): the official Q4_K_M is 4,681,089,344 bytes.
    assert estimate_size(7.615e9, "Q4_K_M") == pytest.approx(4_681_089_344, rel=0.02)


@pytest.mark.parametrize(("given", "canonical"), [
    ("q4_k_m", "Q4_K_M"), ("Q4_K_M", "Q4_K_M"), (" q8_0 ", "Q8_0"), ("iq4_xs", "IQ4_XS"),
    ("f16", "F16"), ("fp16", "F16"), ("bf16", "BF16"), ("Q4_K", "Q4_K_M"), ("q5_k", "Q5_K_M"),
    ("q4-k-m", "Q4_K_M"),
])
def test_normalize(given, canonical):
    assert normalize_quant(given) == canonical
    assert is_known_quant(given)


@pytest.mark.parametrize("bad", ["Q4_K_L", "Q9_0", "", "4bit", "Q4_K_XL"])
def test_normalize_unknown_lists_known(bad):
    with pytest.raises(ConfigError) as err:
        normalize_quant(bad)
    assert "Q4_K_M" in str(err.value) and "IQ4_XS" in str(err.value)
    assert not is_known_quant(bad)
