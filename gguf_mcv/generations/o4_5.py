"""MiniCPM-o 4.5: known to libmtmd (``clip.minicpmv_version`` 100045) and named in messages;
not in the catalog, and no synthetic model of it is written."""

from .generation import Generation

GENERATION = Generation(
    key="o-4.5", name="MiniCPM-o 4.5", text_arch=None, projector_type="resampler", minicpmv_version=100045,
    chat_template="qwen3", tokenizer="qwen2", tokens_per_slice=64,
)
