"""What the planner weighs for each quant: the request's facts (:class:`Context`), where things run
(:class:`Setup`), and the memory model's estimate for that setup (:func:`estimate_setup`, :func:`fits`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..hardware import Hardware, cpu_family
from ..models.shapes import TextShape, VisionShape
from ..vision.vision_backends import VisionSetup
from . import memory, speed
from .plan import LoadChoices, QuantCandidate

#: Share of free VRAM left unused (fragmentation, the display, other processes).
GPU_HEADROOM = 0.05


@dataclass(frozen=True)
class Setup:
    """Where things run, for one quant."""

    n_gpu_layers: int = 0  # llama.cpp's count; -1 = everything
    vision_on_gpu: bool = False
    backend: str | None = None
    unified: bool = False
    vision_backend: str = "llama.cpp"  #: who runs the vision encoder (resolved, never "auto")
    vision: VisionSetup | None = None  #: the whole decision (:func:`choose_setup`)


Evaluated = tuple  # (QuantCandidate, memory.MemoryEstimate, Setup)


@dataclass
class Context:
    """Everything about the request that is the same for every quant."""

    arch: TextShape
    vision: VisionShape
    mmproj_size: int
    hardware: Hardware
    n_ctx: int
    kv_cache_type: str
    image_tokens: int
    budget: int
    gpu_free: int | None = None
    backend: str | None = None
    unified: bool = False
    cpu_only: bool = False  #: unified memory too small for a full offload: CPU alone
    rates: speed.Rates | None = None
    detail: str = "auto"
    min_tokens_per_s: float | None = None
    max_first_answer_s: float | None = None
    speeds: dict[str, speed.SpeedPrediction] | None = None  #: per quant, when rates are known
    vision_request: str = "auto"  #: the ``vision_backend`` asked for
    onnxruntime: str | None = None  #: onnxruntime's version where it imports, else None
    vision_moves: Callable[[str], str] | None = None  #: the native check's replacement for a backend
    int8_cosine: float | None = None  #: int8 vs fp32, from a cached conversion
    #: ONNX weights read from their mapped file, not packed (the last shrink: see ``memory.estimate``)
    vision_mapped: bool = False
    model: str = ""  #: the catalog name planned for ("" if unknown): not suggested as a smaller model
    given: LoadChoices = LoadChoices()  #: what the load fixed itself

    @property
    def limited(self) -> bool:
        return self.min_tokens_per_s is not None or self.max_first_answer_s is not None


def make_context(arch, vision, mmproj_size, hardware, n_ctx, kv_cache_type, image_tokens, budget) -> Context:
    ctx = Context(arch=arch, vision=vision or VisionShape(),
                   mmproj_size=mmproj_size, hardware=hardware, n_ctx=n_ctx,
                   kv_cache_type=kv_cache_type,
                   image_tokens=image_tokens if image_tokens is not None else default_image_tokens(vision),
                   budget=budget)
    gpu = hardware.gpu
    if hardware.gpu_offload and gpu is not None:
        ctx.backend, ctx.unified = gpu.backend, gpu.unified
        if not gpu.unified and gpu.free_memory > 0:
            ctx.gpu_free = gpu.free_memory
    return ctx


def estimate_setup(c: QuantCandidate, ctx: Context, setup: Setup, n_ctx: int | None = None,
              kv_cache_type: str | None = None) -> memory.MemoryEstimate:
    return memory.estimate(
        model_size=c.size, text=ctx.arch, mmproj_size=ctx.mmproj_size, vision=ctx.vision,
        quant=c.quant, n_ctx=n_ctx or ctx.n_ctx, kv_cache_type=kv_cache_type or ctx.kv_cache_type,
        image_tokens=ctx.image_tokens, n_gpu_layers=setup.n_gpu_layers,
        vision_on_gpu=setup.vision_on_gpu, gpu_backend=setup.backend,
        unified_memory=setup.unified, cpu=ctx.hardware.repack_family or cpu_family(ctx.hardware.machine),
        vision_backend=setup.vision_backend,
        # the photo decoded as ``detail`` cuts it on this encoder (auto: 4 slices on a CPU)
        image_slices=speed.slice_budget(ctx.detail, vision_on_gpu=setup.vision_on_gpu),
        vision_mapped=ctx.vision_mapped and setup.vision_backend.startswith("onnx-"),
    )


def on_gpu_whole(s: Setup) -> bool:
    return s.n_gpu_layers < 0 and s.vision_on_gpu


def setup_fits(e: memory.MemoryEstimate, s: Setup, ctx: Context) -> bool:
    if e.needed > ctx.budget:
        return False
    if e.gpu is not None and not s.unified and ctx.gpu_free is not None and not ctx.given.by_hand:
        return e.gpu.total <= ctx.gpu_free * (1 - GPU_HEADROOM)
    return True


def default_image_tokens(vision: VisionShape | None = None) -> int:
    """Tokens of one full-detail image: overview + 9 slices of ``query_tokens`` (640 for 2.6)."""
    return 10 * (vision or VisionShape()).query_tokens

