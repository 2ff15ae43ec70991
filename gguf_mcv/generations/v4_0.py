"""MiniCPM-V 4.0: MiniCPM4-3B (llama.cpp's "minicpm"; a SentencePiece vocabulary), the resampler (version 5)."""

from .generation import BENCH_TEXT, BENCH_VISION, Generation

GENERATION = Generation(
    key="4.0", name="MiniCPM-V 4.0", text_arch="minicpm", projector_type="resampler", minicpmv_version=5,
    chat_template="chatml", tokenizer="spm", tokens_per_slice=64, catalog_names=("minicpm-v-4.0",),
    # MiniCPM4's vocabulary has 73448 pieces; scale_emb 12, scale_depth 1.4
    synthetic_tiny=dict(n_vocab=640), synthetic_bench=dict(**BENCH_TEXT, **BENCH_VISION, n_vocab=73448),
)
