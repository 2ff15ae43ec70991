"""MiniCPM-o 2.6: Qwen2.5-7B, the resampler (version 4); its audio and speech parts are not run."""

from .generation import BENCH_TEXT, BENCH_VISION, Generation

GENERATION = Generation(
    key="o-2.6", name="MiniCPM-o 2.6", text_arch="qwen2", projector_type="resampler", minicpmv_version=4,
    chat_template="chatml", tokenizer="qwen2", tokens_per_slice=64, catalog_names=("minicpm-o-2.6",),
    synthetic_tiny={}, synthetic_bench=dict(**BENCH_TEXT, **BENCH_VISION, n_vocab=151700),
)
