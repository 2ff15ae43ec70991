"""What one MiniCPM-V generation is: the facts every layer needs about it, as one value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Qwen3's reasoning markers (MiniCPM-V 4.5 and 4.6 Thinking write them; their templates
#: open the answer with the first)
THINK_MARKERS: tuple[str, str] = ("<think>", "</think>")

#: bench-sized shapes shared by every generation: the real SigLIP-400M tower and a
#: Qwen2-0.5B-sized text model (widths a speed benchmark can run on two cores)
BENCH_VISION: dict[str, Any] = dict(v_embd=1152, v_layer=27, v_head=16, v_ff=4304, n_merges=1000)
BENCH_TEXT: dict[str, Any] = dict(n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864)


@dataclass(frozen=True)
class Generation:
    """One MiniCPM-V generation, as its official GGUF files and llama.cpp see it."""

    key: str  #: short name: "2.6", "o-2.6", "4.6-thinking"
    name: str  #: the release's own name
    #: the text model's ``general.architecture`` (None: no file of it was read here, not checked)
    text_arch: str | None
    projector_type: str  #: the mmproj's ``clip.projector_type``
    minicpmv_version: int | None  #: the mmproj's ``clip.minicpmv_version`` (None: it has none)
    chat_template: str  #: the prompt family (gguf_mcv.prompt.templates.FAMILIES)
    #: how the vocabulary is written: "qwen2", "qwen35", "llama3" (byte-level BPE) or "spm"
    tokenizer: str
    tokens_per_slice: int  #: image tokens each slice becomes (the resampler's queries)
    think_markers: tuple[str, str] | None = None  #: (open, close) when it reasons before answering
    thinking_default: bool = False  #: its template reasons unless told not to
    onnx_encoder: bool = True  #: gguf_mcv.vision.onnx_graph builds its vision encoder
    catalog_names: tuple[str, ...] = ()  #: its entries in the bundled models.toml
    #: SyntheticSpec fields of its tiny test model beyond the ones above (None: no synthetic model)
    synthetic_tiny: dict[str, Any] | None = field(default=None, compare=False)
    synthetic_bench: dict[str, Any] | None = field(default=None, compare=False)  #: the same, bench-sized

    def synthetic_fields(self, size: str = "tiny") -> dict[str, Any]:
        """Every SyntheticSpec field this generation sets, for ``size`` "tiny" or "bench"."""
        extra = self.synthetic_tiny if size == "tiny" else self.synthetic_bench
        if extra is None:
            raise ValueError(f"{self.name} has no synthetic {size} model")
        own: dict[str, Any] = dict(
            name=self.name, text_arch=self.text_arch, tokenizer=self.tokenizer, chat_template=self.chat_template,
            projector=self.projector_type, query_num=self.tokens_per_slice)
        if self.minicpmv_version is not None:
            own["minicpmv_version"] = self.minicpmv_version
        return {**own, **extra}
