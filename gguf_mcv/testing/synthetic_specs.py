"""The shapes of synthetic MiniCPM-V pairs: one tiny and one bench spec per generation.

:data:`TINY` is MiniCPM-V 2.6 (Qwen2 + ``resampler``); :data:`GENERATIONS` holds the
text architecture, tokenizer kind, chat template and projector of each generation's
official GGUFs (2.5, 2.6, o-2.6, 4.0, 4.5, 4.6, 4.6-thinking) with small widths.
:mod:`~gguf_mcv.testing.synthetic` writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import generations
from ..errors import ConfigError

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
    chat_template: str = "chatml"  #: a prompt family of gguf_mcv.generations (2.6's own: chatml)
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
        families = generations.chat_templates()
        if self.chat_template not in families:
            problems.append(f"chat_template {self.chat_template!r} is not one of {', '.join(families)}")
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
        if self.tokenizer in TOKENIZERS and self.n_vocab < min_vocab(self):
            problems.append(f"n_vocab {self.n_vocab} < {min_vocab(self)} (bytes + {self.n_merges} merges + specials)")
        if min(self.n_layer, self.v_layer, self.n_ff, self.query_num, self.n_merges) < 1:
            problems.append("layer counts, n_ff, query_num and n_merges must be positive")
        if self.text_arch == "qwen35" and min(self.full_attention_interval, self.ssm_heads, self.ssm_head_dim) < 1:
            problems.append("qwen35 needs full_attention_interval, ssm_heads and ssm_head_dim >= 1")
        return problems


def min_vocab(spec: SyntheticSpec) -> int:
    """The smallest ``n_vocab`` that holds the spec's bytes, merges and control tokens."""
    kind = TOKENIZERS[spec.tokenizer]
    leading = len(SPM_LEADING) + 64 if kind.model == "llama" else 0  # + single-character pieces
    return leading + 256 + len(kind.specials) + spec.n_merges


#: generation -> (tiny, bench) spec: the text architecture, tokenizer kind, chat template and
#: projector of the official GGUFs (gguf_mcv.generations), with small widths; the bench sizes
#: keep the real SigLIP-400M tower and vocabulary sizes
GENERATIONS: dict[str, tuple[SyntheticSpec, SyntheticSpec]] = {
    key: (SyntheticSpec(**g.synthetic_fields("tiny")), SyntheticSpec(**g.synthetic_fields("bench")))
    for key, g in generations.GENERATIONS.items() if g.synthetic_tiny is not None and g.synthetic_bench is not None}
TINY, BENCH = GENERATIONS["2.6"]  #: MiniCPM-V 2.6: the defaults, and its bench size

#: Named specs for tools (``--preset``): "tiny"/"bench" (2.6), and "<generation>" / "<generation>-bench".
PRESETS: dict[str, SyntheticSpec] = {
    "tiny": TINY, "bench": BENCH,
    **{g: tiny for g, (tiny, _) in GENERATIONS.items()},
    **{f"{g}-bench": bench for g, (_, bench) in GENERATIONS.items()},
}  # fmt: skip
