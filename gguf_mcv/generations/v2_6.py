"""MiniCPM-V 2.6: Qwen2-7B, the resampler with 64 queries (version 3), ChatML."""

from .generation import BENCH_TEXT, BENCH_VISION, Generation

GENERATION = Generation(
    key="2.6", name="MiniCPM-V 2.6", text_arch="qwen2", projector_type="resampler", minicpmv_version=3,
    chat_template="chatml", tokenizer="qwen2", tokens_per_slice=64, catalog_names=("minicpm-v-2.6",),
    synthetic_tiny={}, synthetic_bench=dict(**BENCH_TEXT, **BENCH_VISION, n_vocab=151936),
)
