"""Small random-weight MiniCPM-V models, laid out like the real GGUF files.

No real weights are needed to test loading, projector matching, image slicing,
quant selection or the chat path: :func:`build` writes a text model (F16 source
plus a ladder of quants made by llama.cpp's own quantizer) and an mmproj with the
tensor names, types and metadata of the official GGUFs. :data:`TINY` is MiniCPM-V
2.6 (Qwen2 + ``resampler``); :data:`GENERATIONS` holds one tiny and one bench spec
per MiniCPM-V generation (2.5, 2.6, o-2.6, 4.0, 4.5, 4.6, 4.6-thinking), each with
its text architecture, tokenizer kind and projector. The answers are gibberish; the
plumbing is real.

Tensors are streamed to disk one at a time (the ``bench`` preset is ~1.3 GB of
F16), each drawn from its own numpy generator seeded by ``(seed, crc32(name))``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from .. import llama_log
from ..errors import ConfigError, EngineError

#: Bump when the files written for the same spec change, so cached builds are redone.
GENERATOR_VERSION = 1
MANIFEST_NAME = "synthetic-manifest.json"
MMPROJ_NAME = "mmproj-model-f16.gguf"
F16_NAME = "ggml-model-f16.gguf"

#: The quant ladder a planner chooses from, smallest file first.
LADDER: tuple[str, ...] = ("Q2_K", "Q3_K_M", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
#: Every quant name :func:`quantize` accepts (``llama_cpp.LLAMA_FTYPE_MOSTLY_<name>``).
QUANT_NAMES: tuple[str, ...] = (
    "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M",
    "Q5_0", "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0",
)  # fmt: skip

#: Control tokens after the BPE vocabulary, in Qwen2 order (``<|endoftext|>`` first).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "</image>",
    "<slice>", "</slice>", "<unk>", "<think>", "</think>",
)  # fmt: skip
#: Llama-3's control tokens (MiniCPM-Llama3-V 2.5) plus the markers libmtmd looks up.
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<image>", "</image>", "<slice>", "</slice>", "<unk>",
)  # fmt: skip
#: Added tokens of MiniCPM4's SentencePiece vocabulary (MiniCPM-V 4.0) that the chat needs.
SPM_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<image>", "</image>", "<slice>", "</slice>",
)  # fmt: skip
#: A SentencePiece vocabulary opens with these three (ids 0, 1, 2).
SPM_LEADING: tuple[str, ...] = ("<unk>", "<s>", "</s>")

#: MiniCPM-V 2.6's own chat template (ChatML with a default system message).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerKind:
    """How one family's vocabulary is written: tokenizer model, pre-tokenizer, control tokens."""

    model: str  #: tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None  #: tokenizer.ggml.pre (llama.cpp's pre-tokenizer regex set)
    specials: tuple[str, ...]
    bos: str
    eos: str
    pad: str
    add_bos: bool


#: ``SyntheticSpec.tokenizer`` -> how the vocabulary is written. Qwen2/2.5/3 GGUFs say
#: pre "qwen2", Qwen3.5 says "qwen35", Llama-3 says "llama-bpe" (llama-vocab.cpp's names).
TOKENIZERS: dict[str, TokenizerKind] = {
    "qwen2": TokenizerKind("gpt2", "qwen2", SPECIAL_TOKENS, "<|endoftext|>", "<|im_end|>", "<|endoftext|>", False),
    "qwen35": TokenizerKind("gpt2", "qwen35", SPECIAL_TOKENS, "<|endoftext|>", "<|im_end|>", "<|endoftext|>", False),
    "llama3": TokenizerKind("gpt2", "llama-bpe", LLAMA3_SPECIAL_TOKENS, "<|begin_of_text|>", "<|eot_id|>",
                            "<|end_of_text|>", True),
    "spm": TokenizerKind("llama", None, SPM_SPECIAL_TOKENS, "<s>", "<|im_end|>", "<unk>", True),
}  # fmt: skip

#: Text architectures the generator writes (llama.cpp's general.architecture names).
TEXT_ARCHS: tuple[str, ...] = ("qwen2", "llama", "minicpm", "qwen3", "qwen35")
#: Projector types the generator writes (clip.projector_type).
PROJECTORS: tuple[str, ...] = ("resampler", "minicpmv4_6")

#: libmtmd indexes the ViT's learned position table on a fixed 70x70 grid (980 px / 14).
POS_GRID = 70

# Frequent English words (roughly by rank); BPE merges are learnt from them.
_WORDS = """
the of and to in a is that for it as was with be by on not he i this are or his
from at which but have an they you were her she there one all we their been has
when who will more no if out so said what up its about into than them can only
other new some could time these two may then do first any my now such like our
over man me even most made after also did many before must through back years
where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old
year off come since against go came right used take three image picture photo
describe show color red green blue white black small large left top bottom
person people cat dog car tree house text number answer question what where
there is are this that which shows contains looks like scene background front
""".split()

_GGML_F16, _GGML_F32 = 1, 0  # general.file_type values


@dataclass(frozen=True)
class SyntheticSpec:
    """Every shape of a synthetic MiniCPM-V pair; the defaults are the ``tiny`` (2.6) preset."""

    n_embd: int = 256  # text width = projector output width (a multiple of 128 for the resampler)
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 768
    n_vocab: int = 512
    n_merges: int = 240  # fewer if the built-in word list runs out of pairs
    n_ctx_train: int = 32768
    rope_theta: float = 1_000_000.0
    v_embd: int = 64
    v_layer: int = 2
    v_head: int = 4
    v_ff: int = 160  # must differ from v_embd (libmtmd tells fc1 from fc2 by shape)
    image_size: int = 448
    patch_size: int = 14
    query_num: int = 64
    minicpmv_version: int = 3
    seed: int = 0
    #: padding tokens as visible text ("pad123") instead of unused "[PAD123]": random
    #: weights put most probability on padding, which then detokenizes to nothing and
    #: leaves a streaming benchmark nothing to count
    visible_padding: bool = False
    text_arch: str = "qwen2"  #: one of TEXT_ARCHS
    tokenizer: str = "qwen2"  #: a key of TOKENIZERS
    chat_template: str = "chatml"  #: "chatml" (2.6's own), "llama3" or "qwen3" (templates.FAMILIES)
    projector: str = "resampler"  #: one of PROJECTORS
    head_dim: int = 0  #: text attention head size; 0 = n_embd / n_head
    #: qwen35: every n-th layer is full attention, the others gated-delta-net (recurrent)
    full_attention_interval: int = 4
    ssm_heads: int = 4  #: qwen35 linear-attention heads (key heads = value heads here)
    ssm_head_dim: int = 64  #: qwen35 linear-attention head size (ssm.state_size)
    merger_layer: int = 0  #: minicpmv4_6: the ViT block after which the window merger runs
    tied_embeddings: bool = False  #: no output.weight: llama.cpp reuses token_embd (Qwen3.5 ties them)
    name: str = "MiniCPM-V 2.6"

    @property
    def head_size(self) -> int:
        """The text attention head size."""
        return self.head_dim or self.n_embd // self.n_head

    def validate(self) -> None:
        """Raise ConfigError for shapes llama.cpp or libmtmd would refuse."""
        problems = self._kind_problems() + self._shape_problems()
        if problems:
            raise ConfigError("invalid synthetic model spec: " + "; ".join(problems))

    def _kind_problems(self) -> list[str]:
        problems = []
        if self.text_arch not in TEXT_ARCHS:
            problems.append(f"text_arch {self.text_arch!r} is not one of {', '.join(TEXT_ARCHS)}")
        if self.tokenizer not in TOKENIZERS:
            problems.append(f"tokenizer {self.tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
        if self.chat_template not in ("chatml", "llama3", "qwen3"):
            problems.append(f"chat_template {self.chat_template!r} is not chatml, llama3 or qwen3")
        if self.projector not in PROJECTORS:
            problems.append(f"projector {self.projector!r} is not one of {', '.join(PROJECTORS)}")
        return problems

    def _shape_problems(self) -> list[str]:
        problems = []
        if self.projector == "resampler" and self.n_embd % 128:
            problems.append(f"n_embd {self.n_embd} is not a multiple of 128 (resampler head size)")
        if self.n_head_kv < 1 or self.n_head % self.n_head_kv or (not self.head_dim and self.n_embd % self.n_head):
            problems.append("n_head must divide n_embd and n_head_kv must divide n_head")
        elif self.head_size % 2:
            problems.append("text head size must be even (RoPE)")
        if self.v_embd % self.v_head:
            problems.append("v_head must divide v_embd")
        if self.v_ff == self.v_embd:
            problems.append("v_ff must differ from v_embd")
        if self.image_size % self.patch_size:
            problems.append("image_size must be a multiple of patch_size")
        elif self.projector == "minicpmv4_6" and (self.image_size // self.patch_size) % 4:
            problems.append("minicpmv4_6 merges 4x4 patches: image_size / patch_size must be a multiple of 4")
        if self.projector == "minicpmv4_6" and not 0 <= self.merger_layer < self.v_layer:
            problems.append("merger_layer must be a ViT block (0 .. v_layer - 1)")
        if self.tokenizer in TOKENIZERS and self.n_vocab < _min_vocab(self):
            problems.append(f"n_vocab {self.n_vocab} < {_min_vocab(self)} (bytes + {self.n_merges} merges + specials)")
        if min(self.n_layer, self.v_layer, self.n_ff, self.query_num, self.n_merges) < 1:
            problems.append("layer counts, n_ff, query_num and n_merges must be positive")
        if self.text_arch == "qwen35" and min(self.full_attention_interval, self.ssm_heads, self.ssm_head_dim) < 1:
            problems.append("qwen35 needs full_attention_interval, ssm_heads and ssm_head_dim >= 1")
        return problems


def _min_vocab(spec: SyntheticSpec) -> int:
    kind = TOKENIZERS[spec.tokenizer]
    leading = len(SPM_LEADING) + 64 if kind.model == "llama" else 0  # + single-character pieces
    return leading + 256 + len(kind.specials) + spec.n_merges


TINY = SyntheticSpec()
BENCH = SyntheticSpec(
    n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864, n_vocab=151936, n_merges=1000,
    v_embd=1152, v_layer=27, v_head=16, v_ff=4304,
)  # fmt: skip

# One tiny and one bench spec per MiniCPM-V generation: the text architecture, tokenizer
# kind, chat template and projector of the official GGUFs (catalog: models.toml), with
# small widths. The bench sizes keep the real SigLIP-400M tower and vocabulary sizes.
_V25: dict[str, Any] = dict(text_arch="llama", tokenizer="llama3", chat_template="llama3", minicpmv_version=2,
            query_num=96, rope_theta=500_000.0, n_ctx_train=8192, name="MiniCPM-Llama3-V 2.5")
_O26: dict[str, Any] = dict(minicpmv_version=4, name="MiniCPM-o 2.6")
# MiniCPM4's vocabulary is SentencePiece (73448 pieces); scale_emb 12, scale_depth 1.4.
_V40: dict[str, Any] = dict(text_arch="minicpm", tokenizer="spm", minicpmv_version=5, n_vocab=640, name="MiniCPM-V 4.0")
_V45: dict[str, Any] = dict(text_arch="qwen3", chat_template="qwen3", minicpmv_version=6, n_ctx_train=40960,
            name="MiniCPM-V 4.5")
# MiniCPM-V 4.6's config.json: insert_layer_id 6, tie_word_embeddings true, Qwen3.5-0.8B text
_V46: dict[str, Any] = dict(text_arch="qwen35", tokenizer="qwen35", chat_template="qwen3", projector="minicpmv4_6",
            tied_embeddings=True, n_layer=4, n_ctx_train=262144, rope_theta=10_000_000.0, name="MiniCPM-V 4.6")
_V46_BENCH: dict[str, Any] = dict(n_embd=1024, n_layer=24, n_head=8, n_head_kv=2, head_dim=256, n_ff=3584,
                  n_vocab=248320, ssm_heads=16, ssm_head_dim=128, merger_layer=6)
_BENCH_VISION: dict[str, Any] = dict(v_embd=1152, v_layer=27, v_head=16, v_ff=4304, n_merges=1000)
_BENCH_TEXT: dict[str, Any] = dict(n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864)

#: generation -> (tiny, bench) spec
GENERATIONS: dict[str, tuple[SyntheticSpec, SyntheticSpec]] = {
    "2.5": (SyntheticSpec(**_V25),
            SyntheticSpec(**{**_V25, **_BENCH_TEXT, **_BENCH_VISION, "n_embd": 1024, "n_head": 16,
                             "n_head_kv": 4, "n_vocab": 128256})),
    "2.6": (TINY, BENCH),
    "o-2.6": (SyntheticSpec(**_O26), SyntheticSpec(**{**_O26, **_BENCH_TEXT, **_BENCH_VISION, "n_vocab": 151700})),
    "4.0": (SyntheticSpec(**_V40), SyntheticSpec(**{**_V40, **_BENCH_TEXT, **_BENCH_VISION, "n_vocab": 73448})),
    "4.5": (SyntheticSpec(**_V45), SyntheticSpec(**{**_V45, **_BENCH_TEXT, **_BENCH_VISION, "n_vocab": 151748})),
    "4.6": (SyntheticSpec(**_V46), SyntheticSpec(**{**_V46, **_BENCH_VISION, **_V46_BENCH})),
    "4.6-thinking": (SyntheticSpec(**{**_V46, "name": "MiniCPM-V 4.6 Thinking"}),
                     SyntheticSpec(**{**_V46, **_BENCH_VISION, **_V46_BENCH, "name": "MiniCPM-V 4.6 Thinking"})),
}  # fmt: skip

#: Named specs for tools (``--preset``): "tiny"/"bench" (2.6), and "<generation>" / "<generation>-bench".
PRESETS: dict[str, SyntheticSpec] = {
    "tiny": TINY, "bench": BENCH,
    **{g: tiny for g, (tiny, _) in GENERATIONS.items()},
    **{f"{g}-bench": bench for g, (_, bench) in GENERATIONS.items()},
}  # fmt: skip


@dataclass(frozen=True)
class SyntheticModel:
    """The files of one build: mmproj, the F16 text source and one file per quant."""

    out_dir: Path
    spec: SyntheticSpec
    mmproj: Path
    f16: Path
    quants: dict[str, Path]


# --- tokenizer ---------------------------------------------------------------


def byte_tokens() -> list[str]:
    """GPT-2's 256 byte tokens (printable bytes as themselves, the rest shifted to U+0100..)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in printable] + [chars[b] for b in range(256) if b not in printable]


def bpe_merges(n_merges: int) -> list[tuple[str, str]]:
    """Learn up to ``n_merges`` BPE merges from a Zipf-weighted English word list."""
    return list(_learned_merges(n_merges))


@lru_cache(maxsize=8)
def _learned_merges(n_merges: int) -> tuple[tuple[str, str], ...]:
    # about a second for a few hundred merges: every model of a build (and every model
    # the speed probe writes) has the same vocabulary
    counts: dict[tuple[str, ...], int] = {}
    for rank, word in enumerate(dict.fromkeys(_WORDS)):
        weight = 40_000 // (rank + 200)  # gently Zipf: rarer words still get whole-word merges
        for form, w in (("Ġ" + word, weight), (word, weight // 4), ("Ġ" + word.title(), weight // 8)):
            counts[tuple(form)] = counts.get(tuple(form), 0) + w + 1
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: dict[tuple[str, str], int] = {}
        for syms, c in counts.items():
            for pair in zip(syms, syms[1:], strict=False):
                pairs[pair] = pairs.get(pair, 0) + c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        counts = {_merge(syms, best): c for syms, c in counts.items()}
    return tuple(merges)


def _merge(syms: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(syms):
        if i + 1 < len(syms) and (syms[i], syms[i + 1]) == pair:
            out.append(syms[i] + syms[i + 1])
            i += 2
        else:
            out.append(syms[i])
            i += 1
    return tuple(out)


def vocabulary(spec: SyntheticSpec) -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE tokens, token types and merge strings: bytes, merged tokens, specials, padding."""
    import gguf  # lazy: ~0.2 s to import, only to build models

    tokens = byte_tokens()
    merges = bpe_merges(spec.n_merges)
    for a, b in merges:
        if a + b not in tokens[256:]:
            tokens.append(a + b)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    specials = TOKENIZERS[spec.tokenizer].specials
    tokens += specials
    types += [int(gguf.TokenType.CONTROL)] * len(specials)
    _pad(spec, tokens, types, "\u0120")  # "Ġ" is the byte-level BPE space
    return tokens, types, [f"{a} {b}" for a, b in merges]


def spm_vocabulary(spec: SyntheticSpec) -> tuple[list[str], list[int], list[float]]:
    """SentencePiece pieces, types and scores: ``<unk> <s> </s>``, 256 byte pieces, characters,
    the merged words (``▁`` for a leading space), added tokens, padding."""
    import gguf  # lazy: ~0.2 s to import, only to build models

    merges = [(a.replace("Ġ", "▁"), b.replace("Ġ", "▁")) for a, b in bpe_merges(spec.n_merges)]
    chars = sorted({c for a, b in merges for c in a + b})
    pieces = list(dict.fromkeys([*chars, *(a + b for a, b in merges)]))
    tokens = [*SPM_LEADING, *(f"<0x{b:02X}>" for b in range(256)), *pieces, *SPM_SPECIAL_TOKENS]
    T = gguf.TokenType
    types = [int(T.UNKNOWN), int(T.CONTROL), int(T.CONTROL)] + [int(T.BYTE)] * 256
    types += [int(T.NORMAL)] * len(pieces) + [int(T.CONTROL)] * len(SPM_SPECIAL_TOKENS)
    # SentencePiece merges the adjacent pair whose result scores highest: earlier merges first.
    scores = [0.0] * (len(SPM_LEADING) + 256) + [-float(i) for i in range(len(pieces))]
    scores += [0.0] * len(SPM_SPECIAL_TOKENS)
    _pad(spec, tokens, types, "▁")
    return tokens, types, scores + [-1e4] * (len(tokens) - len(scores))


def _pad(spec: SyntheticSpec, tokens: list[str], types: list[int], space: str) -> None:
    """Fill the vocabulary up to ``n_vocab`` with ``[PAD{i}]`` (unused) or visible ``pad{i}``."""
    import gguf  # lazy: ~0.2 s to import, only to build models

    pad = range(len(tokens), spec.n_vocab)
    if spec.visible_padding:
        tokens += [f"{space}pad{i}" for i in pad]
        types += [int(gguf.TokenType.NORMAL)] * len(pad)
    else:
        tokens += [f"[PAD{i}]" for i in pad]
        types += [int(gguf.TokenType.UNUSED)] * len(pad)


# --- tensors -----------------------------------------------------------------

#: One tensor to write: name, numpy shape (ggml's reversed), dtype, and how to fill it.
_Plan = tuple[str, tuple[int, ...], type, str]


def _linear(name: str, n_out: int, n_in: int, bias: bool = True) -> list[_Plan]:
    plans: list[_Plan] = [(f"{name}.weight", (n_out, n_in), np.float16, "normal")]
    return plans + [(f"{name}.bias", (n_out,), np.float32, "normal")] if bias else plans


def _layer_norm(name: str, n: int) -> list[_Plan]:
    return [(f"{name}.weight", (n,), np.float32, "ones"), (f"{name}.bias", (n,), np.float32, "zeros")]


def _rms_norm(name: str, n: int) -> list[_Plan]:
    return [(f"{name}.weight", (n,), np.float32, "ones")]


def text_tensors(spec: SyntheticSpec) -> list[_Plan]:
    """The text model's tensors as convert_hf_to_gguf writes them at F16 (1-D tensors stay F32)."""
    d = spec.n_embd
    plans: list[_Plan] = [("token_embd.weight", (spec.n_vocab, d), np.float16, "normal")]
    for i in range(spec.n_layer):
        plans += _block(spec, f"blk.{i}", recurrent=_is_recurrent(spec, i))
    plans += _rms_norm("output_norm", d)
    return plans if spec.tied_embeddings else plans + [("output.weight", (spec.n_vocab, d), np.float16, "normal")]


def _is_recurrent(spec: SyntheticSpec, layer: int) -> bool:
    # llama.cpp src/models/qwen35.cpp: without attention.recurrent_layers, layer i is
    # recurrent unless (i + 1) % full_attention_interval == 0.
    return spec.text_arch == "qwen35" and (layer + 1) % spec.full_attention_interval != 0


def _block(spec: SyntheticSpec, b: str, *, recurrent: bool) -> list[_Plan]:
    d, f = spec.n_embd, spec.n_ff
    mixer = _gated_delta_net(spec, b) if recurrent else _attention(spec, b)
    # qwen35 names the pre-FFN norm post_attention_norm (llama-arch.cpp LLM_TENSOR_ATTN_POST_NORM)
    ffn_norm = "post_attention_norm" if spec.text_arch == "qwen35" else "ffn_norm"
    return [
        *_rms_norm(f"{b}.attn_norm", d), *mixer, *_rms_norm(f"{b}.{ffn_norm}", d),
        *_linear(f"{b}.ffn_gate", f, d, bias=False), *_linear(f"{b}.ffn_up", f, d, bias=False),
        *_linear(f"{b}.ffn_down", d, f, bias=False),
    ]  # fmt: skip


def _attention(spec: SyntheticSpec, b: str) -> list[_Plan]:
    d, hd = spec.n_embd, spec.head_size
    q, kv = hd * spec.n_head, hd * spec.n_head_kv
    bias = spec.text_arch == "qwen2"  # llama.cpp's qwen2 loads q/k/v biases unconditionally
    # qwen35's attention query carries its output gate: 2 x (heads x head size) rows
    q_rows = 2 * q if spec.text_arch == "qwen35" else q
    plans = _linear(f"{b}.attn_q", q_rows, d, bias) + _linear(f"{b}.attn_k", kv, d, bias)
    plans += _linear(f"{b}.attn_v", kv, d, bias) + _linear(f"{b}.attn_output", d, q, bias=False)
    if spec.text_arch in ("qwen3", "qwen35"):  # per-head RMS norms on q and k
        plans += _rms_norm(f"{b}.attn_q_norm", hd) + _rms_norm(f"{b}.attn_k_norm", hd)
    return plans


def _gated_delta_net(spec: SyntheticSpec, b: str) -> list[_Plan]:
    """A qwen35 linear-attention layer (llama.cpp src/models/qwen35.cpp, load_arch_tensors)."""
    d, heads, hd = spec.n_embd, spec.ssm_heads, spec.ssm_head_dim
    inner = heads * hd  # key_dim = value_dim: as many key heads as value heads here
    return [
        *_linear(f"{b}.attn_qkv", 3 * inner, d, bias=False),
        *_linear(f"{b}.attn_gate", inner, d, bias=False),
        # ggml_ssm_conv wants an F32 kernel; the converter keeps it F32 too
        (f"{b}.ssm_conv1d.weight", (3 * inner, _SSM_CONV_KERNEL), np.float32, "normal"),
        (f"{b}.ssm_dt.bias", (heads,), np.float32, "zeros"),
        (f"{b}.ssm_a", (heads,), np.float32, "minus_ones"),  # A = -exp(A_log): negative decay
        *_linear(f"{b}.ssm_beta", heads, d, bias=False),
        *_linear(f"{b}.ssm_alpha", heads, d, bias=False),
        *_rms_norm(f"{b}.ssm_norm", hd),
        *_linear(f"{b}.ssm_out", d, inner, bias=False),
    ]  # fmt: skip


_SSM_CONV_KERNEL = 4  # Qwen3.5's linear_conv_kernel_dim


def mmproj_tensors(spec: SyntheticSpec) -> list[_Plan]:
    """SigLIP tower + projector tensors as the MiniCPM-V converters write them (2-D weights F16)."""
    head = _resampler(spec) if spec.projector == "resampler" else []
    tail = _merger(spec) if spec.projector == "minicpmv4_6" else []
    return head + _vision_tower(spec) + tail


def _resampler(spec: SyntheticSpec) -> list[_Plan]:
    d, dv, n_pos = spec.n_embd, spec.v_embd, POS_GRID * POS_GRID
    plans: list[_Plan] = [
        ("resampler.pos_embed_k", (n_pos, d), np.float32, "sincos"),
        ("resampler.query", (spec.query_num, d), np.float32, "normal"),
        ("resampler.proj.weight", (d, d), np.float16, "normal"),
        ("resampler.kv.weight", (d, dv), np.float16, "normal"),
    ]
    for part in ("q", "k", "v", "out"):
        plans += _linear(f"resampler.attn.{part}", d, d)
    for part in ("q", "kv", "post"):
        plans += _layer_norm(f"resampler.ln_{part}", d)
    return plans


def _vision_tower(spec: SyntheticSpec) -> list[_Plan]:
    dv, p, n_pos = spec.v_embd, spec.patch_size, POS_GRID * POS_GRID
    # The converter always writes the conv kernel F16 (ggml's conv once had no F32 kernel).
    plans: list[_Plan] = [("v.patch_embd.weight", (dv, 3, p, p), np.float16, "normal")]
    plans += [("v.patch_embd.bias", (dv,), np.float32, "normal")]
    plans += [("v.position_embd.weight", (n_pos, dv), np.float16, "normal")]
    for i in range(spec.v_layer):
        b = f"v.blk.{i}"
        for part in ("attn_k", "attn_v", "attn_q", "attn_out"):
            plans += _linear(f"{b}.{part}", dv, dv)
        plans += _layer_norm(f"{b}.ln1", dv)
        # Real files name fc1 "ffn_down" and fc2 "ffn_up"; libmtmd swaps them back by shape.
        plans += _linear(f"{b}.ffn_down", spec.v_ff, dv) + _linear(f"{b}.ffn_up", dv, spec.v_ff)
        plans += _layer_norm(f"{b}.ln2", dv)
    return plans + _layer_norm("v.post_ln", dv)


def _merger(spec: SyntheticSpec) -> list[_Plan]:
    """MiniCPM-V 4.6's mergers (libmtmd clip.cpp, PROJECTOR_TYPE_MINICPMV4_6): a window
    attention + 2x2 downsample MLP inside the ViT, then a final 2x2 DownsampleMLP."""
    dv, d, hidden = spec.v_embd, spec.n_embd, spec.v_ff
    plans = _layer_norm("v.vit_merger.ln1", dv)
    for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
        plans += _linear(f"v.vit_merger.{part}", dv, dv)
    plans += _layer_norm("v.vit_merger.ds_ln", 4 * dv)  # 4 neighbouring patches concatenated
    plans += _linear("v.vit_merger.ds_ffn_up", hidden, 4 * dv) + _linear("v.vit_merger.ds_ffn_down", dv, hidden)
    plans += _layer_norm("mm.input_norm", 4 * dv)
    return plans + _linear("mm.up", hidden, 4 * dv) + _linear("mm.down", d, hidden)


def _sincos_2d(dim: int, grid: int) -> np.ndarray:
    """MAE-style 2-D sin/cos table, (grid*grid, dim): what the converter stores as pos_embed_k."""
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))
    h, w = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))
    halves = [np.outer(pos.reshape(-1), omega) for pos in (h, w)]
    return np.concatenate([f(x) for x in halves for f in (np.sin, np.cos)], axis=1)


def _fill(plan: _Plan, seed: int) -> np.ndarray:
    """Materialise one tensor: each from its own generator, so shapes elsewhere don't shift it."""
    name, shape, dtype, kind = plan
    if kind == "ones":
        return np.ones(shape, dtype)
    if kind == "minus_ones":
        return -np.ones(shape, dtype)
    if kind == "zeros":
        return np.zeros(shape, dtype)
    if kind == "sincos":
        return _sincos_2d(shape[1], POS_GRID).astype(dtype)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape, np.float32) * np.float32(0.02)).astype(dtype)


# --- writing -----------------------------------------------------------------


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; rename it over ``path`` only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


#: Every byte of a random block is masked to its low 4 bits: as the high byte of an f16
#: (a block's scale) that keeps the scale below 2**-11, as small as a real model's, so
#: activations stay finite. Larger random scales overflow to inf and NaN, which some of
#: ggml's kernels then process up to 2x slower than real weights (measured: Q8_0, Q5_0).
_SAFE_MASK = 0x0F


def _raw_blocks(shape: tuple[int, ...], ggml_type: str, seed: int, name: str) -> np.ndarray:
    """Random bytes laid out as ``ggml_type`` blocks for a (rows, cols) matrix: meaningless
    weights that cost llama.cpp exactly what real ones of that type cost."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    rows, cols = shape
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    raw = np.frombuffer(rng.bytes(rows * (cols // block) * size), np.uint8).reshape(rows, -1)
    return raw & np.uint8(_SAFE_MASK)


def _write_gguf(path: Path, arch: str, add_kv: Callable[[Any], None], plans: list[_Plan], seed: int,
                weight_type: str | None = None) -> Path:
    """Write a GGUF file tensor by tensor (never all weights in memory at once).

    With ``weight_type`` (a ggml type name) every 2-D F16 matrix is written as random
    blocks of that type instead (see :func:`write_text_model`).
    """
    import gguf  # lazy: ~0.2 s to import, only to build models

    def raw(shape: tuple[int, ...], dtype: type) -> bool:
        return weight_type is not None and len(shape) == 2 and dtype is np.float16

    with _atomic(Path(path)) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        add_kv(writer)
        for name, shape, dtype, _ in plans:
            if raw(shape, dtype):
                data = _raw_blocks(shape, str(weight_type), seed, name)
                writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes,
                                       raw_dtype=gguf.GGMLQuantizationType[str(weight_type)])
            else:
                writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for plan in plans:
            name, shape, dtype, _ = plan
            writer.write_tensor_data(_raw_blocks(shape, str(weight_type), seed, name) if raw(shape, dtype)
                                     else _fill(plan, seed))
        writer.close()
    return Path(path)


def write_text_model(path: str | os.PathLike[str], spec: SyntheticSpec = TINY, *,
                     weight_type: str | None = None) -> Path:
    """Write the F16 text model (with tokenizer and chat template) to ``path``.

    ``weight_type`` (a ggml type name such as ``"Q5_1"``) writes every weight matrix as
    random blocks of that type instead, in milliseconds and without llama.cpp's
    quantizer: the model then answers nonsense at exactly the speed of that type, which
    is what the speed probe times. Every matrix's row length must be a multiple of the
    type's block size.
    """
    spec.validate()
    if weight_type is not None:
        _check_weight_type(spec, weight_type)

    def add_kv(w: Any) -> None:
        w.add_name(f"{spec.name} synthetic (random weights)")
        w.add_context_length(spec.n_ctx_train)
        w.add_embedding_length(spec.n_embd)
        w.add_block_count(spec.n_layer)
        w.add_feed_forward_length(spec.n_ff)
        w.add_head_count(spec.n_head)
        w.add_head_count_kv(spec.n_head_kv)
        w.add_rope_freq_base(spec.rope_theta)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_file_type(_GGML_F16)
        _add_arch_kv(w, spec)
        _add_tokenizer(w, spec)
        w.add_chat_template(_chat_template(spec))

    return _write_gguf(Path(path), spec.text_arch, add_kv, text_tensors(spec), spec.seed, weight_type)


def _check_weight_type(spec: SyntheticSpec, weight_type: str) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block = GGML_QUANT_SIZES[GGMLQuantizationType[weight_type]][0]
    except KeyError:
        raise ConfigError(f"unknown ggml type {weight_type!r}") from None
    rows = {shape[1] for _, shape, dtype, _ in text_tensors(spec) if len(shape) == 2 and dtype is np.float16}
    if any(n % block for n in rows):
        raise ConfigError(f"{weight_type} packs {block} weights per block: every matrix row "
                          f"({', '.join(map(str, sorted(rows)))} wide here) must be a multiple of it")


def _add_arch_kv(w: Any, spec: SyntheticSpec) -> None:
    """The metadata only some architectures have."""
    arch = spec.text_arch
    if spec.head_dim or arch in ("qwen3", "qwen35"):  # Qwen3 GGUFs always state the head size
        w.add_key_length(spec.head_size)
        w.add_value_length(spec.head_size)
    if arch == "minicpm":
        # MiniCPM4 (llama.cpp LLM_ARCH_MINICPM): scale_emb 12; residual scale_depth / sqrt(layers);
        # logits divided by hidden / dim_model_base (256)
        w.add_float32(f"{arch}.embedding_scale", 12.0)
        w.add_float32(f"{arch}.residual_scale", 1.4 / spec.n_layer**0.5)
        w.add_float32(f"{arch}.logit_scale", spec.n_embd / 256)
    if arch == "qwen35":
        inner = spec.ssm_heads * spec.ssm_head_dim
        rot = spec.head_size // 4  # Qwen3.5: partial_rotary_factor 0.25
        w.add_rope_dimension_count(rot)
        # interleaved M-RoPE sections (t, h, w, -), as Qwen3.5's 11/11/10 of 32 rotary pairs
        half = rot // 2
        w.add_rope_dimension_sections([half - 2 * (half // 3), half // 3, half // 3, 0])
        w.add_ssm_conv_kernel(_SSM_CONV_KERNEL)
        w.add_ssm_inner_size(inner)
        w.add_ssm_state_size(spec.ssm_head_dim)
        w.add_ssm_time_step_rank(spec.ssm_heads)
        w.add_ssm_group_count(spec.ssm_heads)
        w.add_uint32(f"{arch}.full_attention_interval", spec.full_attention_interval)


def _add_tokenizer(w: Any, spec: SyntheticSpec) -> None:
    kind = TOKENIZERS[spec.tokenizer]
    if kind.model == "llama":
        tokens, types, scores = spm_vocabulary(spec)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
    else:
        tokens, types, merges = vocabulary(spec)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(kind.pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    # As in Qwen2 GGUFs: BPE's built-in default bos (id 11) would be a byte token.
    w.add_bos_token_id(ids[kind.bos])
    w.add_eos_token_id(ids[kind.eos])
    w.add_pad_token_id(ids[kind.pad])
    w.add_unk_token_id(ids["<unk>"])
    w.add_add_bos_token(kind.add_bos)


def _chat_template(spec: SyntheticSpec) -> str:
    if spec.chat_template == "chatml":
        return CHAT_TEMPLATE
    from ..prompt.templates import FAMILIES  # the same Llama-3 / Qwen3 (enable_thinking) templates

    return FAMILIES[spec.chat_template]


def write_mmproj(path: str | os.PathLike[str], spec: SyntheticSpec = TINY) -> Path:
    """Write the F16 vision projector (SigLIP tower + projector, output width ``spec.n_embd``)."""
    spec.validate()

    def add_kv(w: Any) -> None:
        w.add_name(f"{spec.name} synthetic image encoder (random weights)")
        w.add_description("image encoder for MiniCPM-V")
        w.add_file_type(_GGML_F16)
        w.add_bool("clip.has_text_encoder", False)
        w.add_bool("clip.has_vision_encoder", True)
        w.add_string("clip.projector_type", spec.projector)
        if spec.projector == "resampler":
            w.add_bool("clip.has_minicpmv_projector", True)
            w.add_int32("clip.minicpmv_version", spec.minicpmv_version)
            w.add_uint32("clip.minicpmv_query_num", spec.query_num)
        else:
            # clip.cpp borrows wa_layer_indexes[0] as the merger's insertion block; the
            # merge factor (clip.vision.projector.scale_factor) defaults to 4 (16x fewer tokens)
            w.add_array("clip.vision.wa_layer_indexes", [spec.merger_layer])
            w.add_uint32("clip.vision.projector.scale_factor", 4)
        w.add_bool("clip.use_gelu", True)
        w.add_uint32("clip.vision.image_size", spec.image_size)
        w.add_uint32("clip.vision.patch_size", spec.patch_size)
        w.add_uint32("clip.vision.embedding_length", spec.v_embd)
        w.add_uint32("clip.vision.feed_forward_length", spec.v_ff)
        w.add_uint32("clip.vision.projection_dim", 0)
        w.add_uint32("clip.vision.attention.head_count", spec.v_head)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        w.add_uint32("clip.vision.block_count", spec.v_layer)
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    return _write_gguf(Path(path), "clip", add_kv, mmproj_tensors(spec), spec.seed)


# --- quantizing --------------------------------------------------------------

def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], quant: str, *, verbose: bool = False) -> Path:
    """Quantize a GGUF text model with llama.cpp's own quantizer (``llama_model_quantize``)."""
    name = quant.upper()
    if name not in QUANT_NAMES:
        raise ConfigError(f"unknown quant {quant!r}; choose one of {', '.join(QUANT_NAMES)}")
    import llama_cpp  # lazy: ~0.2 s to import, only to build models

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
    with _atomic(Path(dst)) as tmp, llama_log.shown(verbose):
        rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), ctypes.byref(params))
        if rc != 0:
            raise EngineError(f"llama.cpp failed to quantize {src} to {name} (code {rc}); rerun with verbose=True")
    return Path(dst)


# --- building a ladder -------------------------------------------------------


def quant_filename(quant: str) -> str:
    """File name of a quant in a build folder, as in the real repos: ``ggml-model-Q4_K_M.gguf``."""
    return f"ggml-model-{quant.upper()}.gguf"


def _manifest(spec: SyntheticSpec) -> dict[str, Any]:
    return {"generator": GENERATOR_VERSION, "spec": dataclasses.asdict(spec)}


def _reusable(out_dir: Path, spec: SyntheticSpec) -> dict[str, int]:
    """Names and sizes of files a previous build of the same spec left in ``out_dir``."""
    try:
        recorded = json.loads((out_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict) or {k: recorded.get(k) for k in ("generator", "spec")} != _manifest(spec):
        return {}
    files = recorded.get("files", {})
    return {n: s for n, s in files.items() if (out_dir / n).is_file() and (out_dir / n).stat().st_size == s}


def build(
    out_dir: str | os.PathLike[str],
    spec: SyntheticSpec = TINY,
    quants: Sequence[str] = LADDER,
    *,
    verbose: bool = False,
) -> SyntheticModel:
    """Write (or reuse) the mmproj, the F16 text source and the requested quants in ``out_dir``."""
    spec.validate()
    out, names = Path(out_dir), [q.upper() for q in ([quants] if isinstance(quants, str) else quants)]
    for q in names:
        if q not in QUANT_NAMES:
            raise ConfigError(f"unknown quant {q!r}; choose one of {', '.join(QUANT_NAMES)}")
    have = _reusable(out, spec)
    if not have:  # a stale manifest must not vouch for files being rewritten
        (out / MANIFEST_NAME).unlink(missing_ok=True)
    jobs: list[tuple[str, Callable[[Path], object]]] = [
        (MMPROJ_NAME, lambda p: write_mmproj(p, spec)),
        (F16_NAME, lambda p: write_text_model(p, spec)),
    ]
    jobs += [(quant_filename(q), partial(_quantize_from_f16, out / F16_NAME, quant=q, verbose=verbose))
             for q in names]
    for name, make in jobs:
        if name not in have:
            start = time.perf_counter()
            make(out / name)
            have[name] = (out / name).stat().st_size
            if verbose:
                print(f"wrote {out / name} ({have[name]} bytes, {time.perf_counter() - start:.1f}s)", file=sys.stderr)
            _write_manifest(out, spec, have)
    return SyntheticModel(out, spec, out / MMPROJ_NAME, out / F16_NAME, {q: out / quant_filename(q) for q in names})


def _write_manifest(out_dir: Path, spec: SyntheticSpec, files: dict[str, int]) -> None:
    with _atomic(out_dir / MANIFEST_NAME) as tmp:
        tmp.write_text(json.dumps({**_manifest(spec), "files": dict(sorted(files.items()))}, indent=2) + "\n")


def _quantize_from_f16(f16: Path, out: Path, *, quant: str, verbose: bool) -> None:
    quantize(f16, out, quant, verbose=verbose)
