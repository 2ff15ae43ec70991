"""MiniCPM-V 4.5: Qwen3-8B (hybrid thinking, off unless asked), the resampler (version 6)."""

from .generation import BENCH_TEXT, BENCH_VISION, THINK_MARKERS, Generation

GENERATION = Generation(
    key="4.5", name="MiniCPM-V 4.5", text_arch="qwen3", projector_type="resampler", minicpmv_version=6,
    chat_template="qwen3", tokenizer="qwen2", tokens_per_slice=64, think_markers=THINK_MARKERS,
    catalog_names=("minicpm-v-4.5",),
    synthetic_tiny=dict(n_ctx_train=40960),
    synthetic_bench=dict(n_ctx_train=40960, **BENCH_TEXT, **BENCH_VISION, n_vocab=151748),
)
