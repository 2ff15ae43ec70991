"""MiniCPM-V 4.6 and 4.6 Thinking: Qwen3.5-0.8B (hybrid attention, tied embeddings) and the
``minicpmv4_6`` projector (a window merger inside the ViT, then a 2x2 downsampling MLP)."""

from dataclasses import replace
from typing import Any

from .generation import BENCH_VISION, THINK_MARKERS, Generation

# config.json: insert_layer_id 6, tie_word_embeddings true, rope_theta 1e7, 262144 positions
_TINY: dict[str, Any] = dict(tied_embeddings=True, n_layer=4, n_ctx_train=262144, rope_theta=10_000_000.0)
_BENCH: dict[str, Any] = {**_TINY, **BENCH_VISION, **dict(
    n_embd=1024, n_layer=24, n_head=8, n_head_kv=2, head_dim=256, n_ff=3584, n_vocab=248320, ssm_heads=16,
    ssm_head_dim=128, merger_layer=6)}

GENERATION = Generation(
    key="4.6", name="MiniCPM-V 4.6", text_arch="qwen35", projector_type="minicpmv4_6", minicpmv_version=None,
    chat_template="qwen3", tokenizer="qwen35", tokens_per_slice=64, think_markers=THINK_MARKERS,
    catalog_names=("minicpm-v-4.6",), synthetic_tiny=_TINY, synthetic_bench=_BENCH,
)
#: the same files' layout, reasoning by default
THINKING = replace(GENERATION, key="4.6-thinking", name="MiniCPM-V 4.6 Thinking", thinking_default=True,
                   catalog_names=("minicpm-v-4.6-thinking",))
