"""How many text layers (and whether the vision tower) fit a GPU's free memory, from the memory
model's device-memory terms (:func:`gguf_mcv.planning.memory.estimate`)."""

from __future__ import annotations

from ..models.shapes import TextShape, VisionShape
from .memory import estimate


def fit_gpu_layers(free_vram: int, *, model_size: int, text: TextShape, quant: str | None,
                   n_ctx: int, kv_cache_type: str = "f16", mmproj_size: int = 0,
                   vision: VisionShape | None = None, vision_on_gpu: bool = False,
                   gpu_backend: str = "cuda", headroom: float = 0.05) -> int:
    """The largest ``n_gpu_layers`` (llama.cpp's count, output first) whose device memory
    fits ``free_vram`` less ``headroom``; ``t.n_layers + 1`` means everything."""
    t = text
    usable = int(free_vram * (1 - headroom))
    best = 0
    for n in range(1, t.n_layers + 2):
        est = estimate(model_size=model_size, text=t, mmproj_size=mmproj_size, vision=vision,
                       quant=quant, n_ctx=n_ctx, kv_cache_type=kv_cache_type, n_gpu_layers=n,
                       vision_on_gpu=vision_on_gpu, gpu_backend=gpu_backend, cpu="none")
        if est.gpu is None or est.gpu.total > usable:
            break
        best = n
    return best
