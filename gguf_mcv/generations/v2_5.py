"""MiniCPM-Llama3-V 2.5: Llama-3-8B-Instruct, the resampler with 96 queries (version 2)."""

from .generation import BENCH_TEXT, BENCH_VISION, Generation

GENERATION = Generation(
    key="2.5", name="MiniCPM-Llama3-V 2.5", text_arch="llama", projector_type="resampler", minicpmv_version=2,
    chat_template="llama3", tokenizer="llama3", tokens_per_slice=96, catalog_names=("minicpm-llama3-v-2.5",),
    synthetic_tiny=dict(rope_theta=500_000.0, n_ctx_train=8192),
    synthetic_bench=dict(rope_theta=500_000.0, n_ctx_train=8192, **BENCH_TEXT, **BENCH_VISION)
    | dict(n_embd=1024, n_head=16, n_head_kv=4, n_vocab=128256),
)
