"""Predict how fast a MiniCPM-V model answers: decode tokens/s, prefill, vision encode, first answer.

Pure: every function works from the two towers' shapes, the text file's size and
quant, and a :class:`Rates` -- what the machine does per second, measured once by
:mod:`gguf_mcv.speed_probe` (or its documented defaults). The model is a roofline:

* **decode** (one token): the weights read per token (every layer matrix and the
  output matrix; only one row of ``token_embd``) plus the KV cache at the current
  length, over the memory bandwidth -- or, when that is quicker than the arithmetic,
  those weight bytes over llama.cpp's measured matrix-vector rate (small models whose
  layers sit in the CPU caches, or few slow cores). The probe's per-token time includes
  llama.cpp's and gguf_mcv's per-token overheads, so they are in that rate.
* **prefill** and the **vision encoder**: floating-point operations over llama.cpp's
  measured rate for that work (quantized GEMM for the text model, libmtmd's F16
  matrices for the tower).
* **GPU offload**: the share of layers the planner put on the GPU runs at the GPU's
  rates (:data:`GPU_RATES`, published figures, not measured here).

The first answer to a photo is its slices' encoder passes, the prompt's prefill and
one decode step; slices come from :mod:`gguf_mcv.slicing` for a 12-megapixel 4:3 photo
at the chosen ``detail``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from . import memory
from .errors import ConfigError
from .shapes import TextShape, VisionShape
from .slicing import AUTO_MAX_SLICES_CPU, AUTO_MAX_SLICES_GPU, DETAILS, MAX_SLICES, count_slices, fit_slices

#: The photo a first-answer prediction assumes: 12 megapixels, 4:3 (a phone camera).
PHOTO_SIZE = (4000, 3000)
#: Frames of the video a first-answer prediction assumes (one slice each).
VIDEO_FRAMES = 16
#: Text tokens of a question around its images: system turn, template, question.
QUESTION_TOKENS = 48
#: Tokens per video frame besides its slice: the timestamp line and the markers.
FRAME_TEXT_TOKENS = 10
#: Markers around one image's slices (<image>, </image>, <slice>, </slice>, newlines) per slice.
MARKER_TOKENS_PER_SLICE = 2


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return _number(value) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class Rates:
    """What one machine does per second, for the speed model. Every field is positive.

    ``bandwidth``: bytes per second a streaming read reaches with all threads (decode
    reads every weight once per token). ``matvec``: weight bytes per second llama.cpp's
    decode kernels get through when memory is not the limit. ``prefill_flops``: FLOP/s
    of llama.cpp's quantized matrix multiplication on a prompt. ``vision_flops``: FLOP/s
    of libmtmd's vision encoder (F16 weights). ``threads``: the thread count they were
    measured with.
    """

    bandwidth: float
    matvec: float
    prefill_flops: float
    vision_flops: float
    threads: int = 1
    source: str = "defaults"

    def __post_init__(self) -> None:
        for name in ("bandwidth", "matvec", "prefill_flops", "vision_flops"):
            value = getattr(self, name)
            if not _positive(value):
                raise ConfigError(f"Rates.{name} must be a positive finite number, not {value!r}.")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1:
            raise ConfigError(f"Rates.threads must be a positive integer, not {self.threads!r}.")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: Used when probing is switched off (``probe=False`` / ``GGUF_MCV_NO_PROBE=1``): this
#: project's 2-core AVX-512 development machine. Its 1-thread probe (tools/bench_speed.py,
#: README "Speed: predicted vs measured": 31 GB/s, 13.5 GB/s, 120 and 64 GFLOP/s), the
#: arithmetic rates x 1.6 for the second core (a SigLIP slice took ~14 s on one thread
#: there and ~9 s on two), rounded.
DEFAULT_RATES = Rates(bandwidth=30e9, matvec=22e9, prefill_flops=190e9, vision_flops=100e9,
                      threads=2, source="defaults")


@dataclass(frozen=True)
class GpuRates:
    """A GPU's memory bandwidth (bytes/s) and the FLOP/s llama.cpp gets from it."""

    bandwidth: float
    flops: float
    source: str


#: GPU figures are published peaks times llama.cpp's usual share of them (about 60 %
#: of bandwidth, 30 % of dense FP16 throughput); no GPU was available to measure.
#: Jetson Orin Nano 8 GB: 68 GB/s LPDDR5, ~10 TFLOPS dense FP16 tensor (NVIDIA data sheet).
GPU_RATES = {
    "jetson": GpuRates(0.6 * 68e9, 0.3 * 10e12, "Jetson Orin Nano data sheet x llama.cpp share"),
    "cuda": GpuRates(0.6 * 256e9, 0.3 * 30e12, "a laptop RTX 4060 (256 GB/s) x llama.cpp share"),
    "metal": GpuRates(0.6 * 100e9, 0.3 * 7e12, "Apple M2 (100 GB/s) x llama.cpp share"),
}


@dataclass(frozen=True)
class SpeedPrediction:
    """Predicted speed of one quant on one machine (seconds, tokens per second)."""

    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    encode_s_per_slice: float
    first_answer_s: float  #: a typical photo at ``detail``: encode + prefill + first token
    video_first_answer_s: float  #: a 16-frame video: 16 slices + prefill + first token
    photo_slices: int  #: encoder passes for the photo (overview included)
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# --- operation counts -----------------------------------------------------------------


def text_flops_per_token(text: TextShape) -> float:
    """Multiply-adds x 2 of the repeating layers for one token (attention projections and FFN)."""
    t = text
    q_out = t.n_head * t.head_dim
    kv_out = t.n_head_kv * t.head_dim
    per_layer = t.n_embd * (2 * q_out + 2 * kv_out) + 3 * t.n_embd * t.ff
    return 2.0 * per_layer * t.n_layers


def attention_flops(text: TextShape, n_past: int) -> float:
    """Scores and weighted sum of one token against ``n_past`` cached positions."""
    t = text
    return 4.0 * n_past * t.n_head * t.head_dim * t.kv_layers


def vision_flops_per_slice(vision: VisionShape | None, text_width: int) -> float:
    """One 448-pixel slice through the ViT and the projector (multiply-adds x 2).

    Per block: Q, K, V and output projections (4 P W^2), the FFN (2 P W F) and the
    attention itself (2 P^2 W), P patches of width W; then the patch embedding and the
    resampler's key/value projection into the text width and its attention. MiniCPM-V
    4.6 (``full_blocks``) has no resampler: after its first ``full_blocks`` blocks a
    window-attention merger (about one block) joins 2x2 patches, the remaining blocks
    see P/4 tokens, and a last 2x2 merge projects P/16 tokens to the text width
    (libmtmd ``clip_graph_minicpmv4_6``).
    """
    v = vision or VisionShape()
    p, w, f = v.patches, v.width, v.ff

    def block(n: int) -> int:
        return 4 * n * w * w + 2 * n * w * f + 2 * n * n * w

    patch_embd = p * 3 * v.patch_size**2 * w
    d, q = text_width, v.query_tokens
    if v.full_blocks is not None:
        full = min(v.full_blocks, v.blocks)
        merged = full * block(p) + block(p) + (v.blocks - full) * block(p // 4)
        return 2.0 * (merged + patch_embd + (p // 16) * 4 * w * d)
    resampler = p * w * d + 2 * p * d * d + 3 * q * d * d + 2 * q * p * d
    return 2.0 * (v.blocks * block(p) + patch_embd + resampler)


def decode_bytes(model_size: int, text: TextShape, quant: str | None) -> int:
    """Weight bytes read for one token: the file less ``token_embd`` (one row of it is read),
    which with tied embeddings is also the output matrix and so is read whole."""
    token_embd, _ = memory.embedding_bytes(text, quant)
    if text.tied_embeddings:
        return model_size
    return max(0, model_size - token_embd)


# --- predictions ----------------------------------------------------------------------


def decode_seconds(model_size: int, text: TextShape, quant: str | None, rates: Rates, *,
                   n_past: int = 512, kv_cache_type: str = "f16", gpu_share: float = 0.0,
                   gpu: GpuRates | None = None) -> float:
    """Seconds for one decoded token at ``n_past`` cached positions.

    ``gpu_share`` (0..1) of the layer weights and KV cache run on ``gpu``.
    """
    weights = decode_bytes(model_size, text, quant)
    kv = text.kv_bytes_per_token(memory.KV_BYTES_PER_ELEMENT[kv_cache_type]) * max(0, n_past)
    share = _share(gpu_share, gpu)
    cpu_weights, cpu_kv = weights * (1 - share), kv * (1 - share)
    cpu = max((cpu_weights + cpu_kv) / rates.bandwidth, cpu_weights / rates.matvec)
    on_gpu = 0.0
    if share and gpu is not None:
        on_gpu = (weights + kv) * share / gpu.bandwidth
    return cpu + on_gpu


def prefill_seconds(n_tokens: int, text: TextShape, rates: Rates, *, n_past: int = 0,
                    gpu_share: float = 0.0, gpu: GpuRates | None = None) -> float:
    """Seconds to evaluate ``n_tokens`` prompt tokens after ``n_past`` (logits for the last only)."""
    n = max(0, n_tokens)
    flops = n * text_flops_per_token(text) + attention_flops(text, n_past + n // 2) * n
    flops += 2.0 * text.n_vocab * text.n_embd  # the output matrix, for the last token
    share = _share(gpu_share, gpu)
    seconds = flops * (1 - share) / rates.prefill_flops
    if share and gpu is not None:
        seconds += flops * share / gpu.flops
    return seconds


def encode_seconds(vision: VisionShape | None, text_width: int, rates: Rates, *,
                   gpu: GpuRates | None = None) -> float:
    """Seconds for one slice through the vision encoder (on ``gpu`` when given)."""
    flops = vision_flops_per_slice(vision, text_width)
    return flops / (gpu.flops if gpu is not None else rates.vision_flops)


def photo_slices(detail: str = "auto", *, vision_on_gpu: bool = False,
                 size: tuple[int, int] = PHOTO_SIZE, slice_size: int = 448) -> int:
    """Encoder passes for a photo of ``size`` at ``detail``: the slices plus the overview."""
    if detail not in DETAILS:
        raise ConfigError(f"detail must be one of {', '.join(DETAILS)}, not {detail!r}.")
    budget = {"low": 0, "high": MAX_SLICES,
              "auto": AUTO_MAX_SLICES_GPU if vision_on_gpu else AUTO_MAX_SLICES_CPU}[detail]
    width, height = fit_slices(*size, budget, slice_size)
    return 1 + count_slices(width, height, slice_size)


def predict(*, model_size: int, text: TextShape, quant: str | None, vision: VisionShape | None,
            rates: Rates, detail: str = "auto", kv_cache_type: str = "f16", gpu_share: float = 0.0,
            vision_on_gpu: bool = False, gpu: GpuRates | None = None) -> SpeedPrediction:
    """Decode, prefill and encode rates and first-answer times for one quant on one machine."""
    v = vision or VisionShape()
    slice_size = v.image_size or 448
    slices = photo_slices(detail, vision_on_gpu=vision_on_gpu, slice_size=slice_size)
    encode = encode_seconds(v, text.n_embd, rates, gpu=gpu if vision_on_gpu else None)
    gpu_args: dict[str, Any] = dict(gpu_share=gpu_share, gpu=gpu)
    per_slice = v.query_tokens + MARKER_TOKENS_PER_SLICE

    def first_answer(n_slices: int, extra_tokens: int) -> float:
        prompt = n_slices * per_slice + extra_tokens + QUESTION_TOKENS
        return (n_slices * encode + prefill_seconds(prompt, text, rates, **gpu_args)
                + decode_seconds(model_size, text, quant, rates, n_past=prompt,
                                 kv_cache_type=kv_cache_type, **gpu_args))

    photo_prompt = slices * per_slice + QUESTION_TOKENS
    token = decode_seconds(model_size, text, quant, rates, n_past=photo_prompt,
                           kv_cache_type=kv_cache_type, **gpu_args)
    prefill_512 = prefill_seconds(512, text, rates, **gpu_args)
    return SpeedPrediction(
        decode_tokens_per_s=1.0 / token,
        prefill_tokens_per_s=512 / prefill_512,
        encode_s_per_slice=encode,
        first_answer_s=first_answer(slices, 0),
        video_first_answer_s=first_answer(VIDEO_FRAMES, VIDEO_FRAMES * FRAME_TEXT_TOKENS),
        photo_slices=slices,
        detail=detail,
    )


def gpu_rates_for(backend: str | None, board_kind: str | None = None) -> GpuRates | None:
    """The assumed GPU rates for a llama.cpp backend (None: no GPU)."""
    if backend is None:
        return None
    if board_kind == "jetson":
        return GPU_RATES["jetson"]
    return GPU_RATES.get(backend, GPU_RATES["cuda"])


def check_limit(name: str, value: Any) -> float | None:
    """A speed limit as a positive finite float, or None; ConfigError for anything else."""
    if value is None:
        return None
    if not _number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number, not {value!r}.")
    return float(value)


def scaled(rates: Rates, **factors: float) -> Rates:
    """``rates`` with some fields multiplied (e.g. ``bandwidth=0.5``): for what-if boards."""
    return replace(rates, **{k: getattr(rates, k) * f for k, f in factors.items()})


def _share(gpu_share: float, gpu: GpuRates | None) -> float:
    if gpu is None:
        return 0.0
    return min(1.0, max(0.0, float(gpu_share)))
