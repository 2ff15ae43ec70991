"""Predict how fast a MiniCPM-V model answers: decode tokens/s, prefill, vision encode, first answer.

Pure: every function works from the two towers' shapes, the text file's size and
quant, and a :class:`Rates` -- what the machine does per second, measured once by
:mod:`gguf_mcv.runtime.speed_probe` (or its documented defaults). The model is a roofline:

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
one decode step; slices come from :mod:`gguf_mcv.vision.slicing` for a 12-megapixel 4:3 photo
at the chosen ``detail``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError
from ..models.quants import BITS_PER_WEIGHT
from ..models.shapes import TextShape, VisionShape
from ..options import check_number
from ..vision.slicing import AUTO_MAX_SLICES_CPU, AUTO_MAX_SLICES_GPU, DETAILS, MAX_SLICES, count_slices, fit_slices
from . import memory

#: The share of the streaming bandwidth (:attr:`Rates.bandwidth`, numpy's reads) llama.cpp's
#: decode reaches when memory is the limit: its threads split each matrix and meet at a
#: barrier after every operation. Measured on the development machine with two threads: a
#: 673 MB Q8_0 file decoded at 39.7 tok/s (~0.7 x 28.4 GB/s); 0.7 puts every quant of the
#: bench ladder within -8 ... +17 % there (README). On a Raspberry Pi 5 it gives ~0.42 of
#: the board's peak, in line with what llama.cpp is reported to reach on such boards.
DECODE_BANDWIDTH_SHARE = 0.7
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
    """What one machine does per second, for the speed model. Every number is positive.

    ``bandwidth``: bytes per second a streaming read reaches with all threads (decode
    reads every weight once per token). ``matvec``: weight bytes per second llama.cpp's
    decode kernels get through when memory is not the limit, and ``matvec_by_type`` the
    same per ggml weight type (``"Q4_K"``, ``"Q8_0"``...: their kernels differ by up to
    3x per byte); ``matvec`` stands in for a type not listed. ``prefill_flops`` and
    ``prefill_by_type``: FLOP/s of llama.cpp's matrix multiplication on a prompt, in
    general and per type. ``token_overhead_s`` and ``layer_overhead_s``: the fixed cost
    of one decoded token (graph, sampling, Python) and what each layer adds to it.
    ``vision_flops``: FLOP/s of libmtmd's vision encoder (F16 weights);
    ``vision_by_backend``: the same for other encoders (``"onnx-int8"``, ``"onnx-fp32"``).
    ``threads``: the thread count they were measured with.
    """

    bandwidth: float
    matvec: float
    prefill_flops: float
    vision_flops: float
    threads: int = 1
    source: str = "defaults"
    matvec_by_type: Mapping[str, float] = field(default_factory=dict)
    prefill_by_type: Mapping[str, float] = field(default_factory=dict)
    vision_by_backend: Mapping[str, float] = field(default_factory=dict)
    token_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("bandwidth", "matvec", "prefill_flops", "vision_flops"):
            value = getattr(self, name)
            if not _positive(value):
                raise ConfigError(f"Rates.{name} must be a positive finite number, not {value!r}.")
        for name in ("token_overhead_s", "layer_overhead_s"):
            value = getattr(self, name)
            if not _number(value) or not math.isfinite(value) or not 0 <= value < 1:
                raise ConfigError(f"Rates.{name} must be a number of seconds from 0 to 1, not {value!r}.")
        for name in ("matvec_by_type", "prefill_by_type", "vision_by_backend"):
            table = getattr(self, name)
            if not isinstance(table, Mapping) or not all(
                    isinstance(k, str) and _positive(v) for k, v in table.items()):
                raise ConfigError(f"Rates.{name} must map names to positive finite numbers, not {table!r}.")
            object.__setattr__(self, name, dict(table))
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1:
            raise ConfigError(f"Rates.threads must be a positive integer, not {self.threads!r}.")

    def to_dict(self) -> dict[str, Any]:
        return {k: dict(v) if isinstance(v, Mapping) else v for k, v in self.__dict__.items()}

    def matvec_for(self, ggml_type: str) -> float:
        """Decode bytes per second for weights of ``ggml_type`` (``matvec`` when not probed)."""
        return self.matvec_by_type.get(ggml_type.upper(), self.matvec)

    def prefill_for(self, ggml_type: str) -> float:
        """Prompt FLOP/s for weights of ``ggml_type`` (``prefill_flops`` when not probed)."""
        return self.prefill_by_type.get(ggml_type.upper(), self.prefill_flops)

    def vision_for(self, backend: str | None) -> float:
        """The vision encoder's FLOP/s with ``backend`` (libmtmd's when None or not probed)."""
        return self.vision_by_backend.get(backend or "", self.vision_flops)


#: Used when probing is switched off (``probe=False`` / ``GGUF_MCV_NO_PROBE=1``): this
#: project's 2-core AVX-512 development machine, the median of seven 2-thread probes on it
#: while nothing else ran (tools/bench_speed.py, README "Speed: predicted vs measured"),
#: rounded to two digits.
DEFAULT_RATES = Rates(
    bandwidth=28e9, matvec=28e9, prefill_flops=240e9, vision_flops=140e9, threads=2, source="defaults",
    matvec_by_type={"Q2_K": 16e9, "Q3_K": 14e9, "Q4_0": 21e9, "Q4_1": 16e9, "Q4_K": 28e9, "Q5_0": 17e9,
                    "Q5_1": 20e9, "Q5_K": 20e9, "Q6_K": 31e9, "Q8_0": 30e9, "F16": 35e9, "IQ3_S": 7e9,
                    "IQ4_XS": 21e9},
    prefill_by_type={"Q2_K": 160e9, "Q3_K": 220e9, "Q4_0": 220e9, "Q4_1": 86e9, "Q4_K": 240e9, "Q5_0": 140e9,
                     "Q5_1": 77e9, "Q5_K": 260e9, "Q6_K": 220e9, "Q8_0": 180e9, "F16": 170e9, "IQ3_S": 290e9,
                     "IQ4_XS": 300e9},
    vision_by_backend={"onnx-fp32": 180e9, "onnx-int8": 390e9},
    token_overhead_s=47e-6, layer_overhead_s=27e-6,
)


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
    return sum(vision_flops_parts(vision, text_width))


def vision_flops_parts(vision: VisionShape | None, text_width: int) -> tuple[float, float]:
    """:func:`vision_flops_per_slice` split into (the ViT blocks, the rest: patch embedding,
    merger, projector). The ONNX int8 encoder runs only the blocks in int8."""
    v = vision or VisionShape()
    p, w, f = v.patches, v.width, v.ff

    def block(n: int) -> int:
        return 4 * n * w * w + 2 * n * w * f + 2 * n * n * w

    patch_embd = p * 3 * v.patch_size**2 * w
    d, q = text_width, v.query_tokens
    if v.full_blocks is not None:
        full = min(v.full_blocks, v.blocks)
        blocks = full * block(p) + (v.blocks - full) * block(p // 4)
        return 2.0 * blocks, 2.0 * (block(p) + patch_embd + (p // 16) * 4 * w * d)
    resampler = p * w * d + 2 * p * d * d + 3 * q * d * d + 2 * q * p * d
    return 2.0 * v.blocks * block(p), 2.0 * (patch_embd + resampler)


def decode_bytes(model_size: int, text: TextShape, quant: str | None) -> int:
    """Weight bytes read for one token: the file less ``token_embd`` (one row of it is read),
    which with tied embeddings is also the output matrix and so is read whole."""
    token_embd, _ = memory.embedding_bytes(text, quant)
    if text.tied_embeddings:
        return model_size
    return max(0, model_size - token_embd)


@dataclass(frozen=True)
class WeightProfile:
    """A text model's weight bytes by ggml type (``{"Q4_K": bytes, ...}``).

    ``layers``: everything but the embeddings; ``output``: the matrix that makes the
    logits (``output.weight``, or ``token_embd`` when the two are tied). A decoded token
    reads both once; a prompt runs every token through the layers and only its last
    through the output. ``token_embd`` is otherwise left out: one row of it is read.
    """

    layers: Mapping[str, int]
    output: Mapping[str, int]

    def per_token(self) -> dict[str, int]:
        """Bytes read per decoded token, by type."""
        out = dict(self.layers)
        for t, n in self.output.items():
            out[t] = out.get(t, 0) + n
        return out

    @property
    def total(self) -> int:
        return sum(self.layers.values()) + sum(self.output.values())


def weight_profile(model_size: int, text: TextShape, quant: str | None,
                   tensors: Iterable[tuple[str, str, int]] | None = None) -> WeightProfile:
    """The :class:`WeightProfile` of a text model file: exact from ``tensors`` -- (name,
    ggml type name, bytes) as :func:`gguf_mcv.models.headers.tensor_list` reads them from a header
    -- else from ``model_size`` and llama.cpp's type mix for ``quant``
    (:data:`gguf_mcv.planning.memory.QUANT_TYPE_MIX`)."""
    if tensors is not None:
        listed = list(tensors)
        names = {name for name, _, _ in listed}
        out_name = "output.weight" if "output.weight" in names else "token_embd.weight"
        layers: dict[str, int] = {}
        output: dict[str, int] = {}
        for name, typ, n in listed:
            if name == out_name:
                output[typ.upper()] = output.get(typ.upper(), 0) + n
            elif name != "token_embd.weight":
                layers[typ.upper()] = layers.get(typ.upper(), 0) + n
        return WeightProfile(layers, output)
    q = (quant or "Q4_K_M").upper()
    token_embd, output_bytes = memory.embedding_bytes(text, q)
    out_type = memory.output_type(q)
    if text.tied_embeddings:
        output_bytes = token_embd  # the same matrix, in the output's type
    rest = max(0, model_size - token_embd - (0 if text.tied_embeddings else output_bytes))
    mix = memory.QUANT_TYPE_MIX.get(q, {_MAIN_TYPE.get(q, q): 1.0})
    return WeightProfile({t: int(rest * share) for t, share in mix.items()}, {out_type: output_bytes})


#: The ggml type most of a file of these quants is made of, where the name is not a type.
_MAIN_TYPE = {"IQ3_M": "IQ3_S", "IQ3_XS": "IQ3_S", "Q3_K_S": "Q3_K", "Q4_K_S": "Q4_K", "Q5_K_S": "Q5_K"}


def type_bits(ggml_type: str) -> float:
    """Bits per weight of a ggml type (its block size), Q4_K's for a name nobody knows."""
    t = ggml_type.upper()
    return memory.GGML_TYPE_BITS.get(t) or BITS_PER_WEIGHT.get(t) or memory.GGML_TYPE_BITS["Q4_K"]


# --- predictions ----------------------------------------------------------------------


def decode_seconds(model_size: int, text: TextShape, quant: str | None, rates: Rates, *,
                   n_past: int = 512, kv_cache_type: str = "f16", gpu_share: float = 0.0,
                   gpu: GpuRates | None = None, weights: WeightProfile | None = None) -> float:
    """Seconds for one decoded token at ``n_past`` cached positions.

    Each weight type's bytes at the slower of llama.cpp's share of the memory bandwidth
    (:data:`DECODE_BANDWIDTH_SHARE`) and that type's measured kernel rate, the KV cache (and
    a hybrid model's recurrent state, read and written) at that share of the bandwidth, plus
    llama.cpp's fixed cost per token and per layer.
    ``weights`` defaults to :func:`weight_profile` from the size and quant. ``gpu_share``
    (0..1) of the layer weights and KV cache run on ``gpu``.
    """
    profile = weights or weight_profile(model_size, text, quant)
    kv = text.kv_bytes_per_token(memory.KV_BYTES_PER_ELEMENT[kv_cache_type]) * max(0, n_past)
    state = 2 * 4 * text.recurrent_values  # f32, read and written back
    share = _share(gpu_share, gpu)
    memory_rate = rates.bandwidth * DECODE_BANDWIDTH_SHARE
    cpu = sum(n * (1 - share) / min(memory_rate, rates.matvec_for(t)) for t, n in profile.per_token().items())
    cpu += (kv + state) * (1 - share) / memory_rate
    cpu += rates.token_overhead_s + rates.layer_overhead_s * text.n_layers
    on_gpu = 0.0
    if share and gpu is not None:
        on_gpu = (profile.total + kv + state) * share / gpu.bandwidth
    return cpu + on_gpu


def prefill_seconds(n_tokens: int, text: TextShape, rates: Rates, *, n_past: int = 0,
                    gpu_share: float = 0.0, gpu: GpuRates | None = None,
                    weights: WeightProfile | None = None) -> float:
    """Seconds to evaluate ``n_tokens`` prompt tokens after ``n_past`` (logits for the last only).

    With ``weights`` each type's multiplications run at that type's measured prompt rate;
    without, the layers' operations (from the shape) at ``rates.prefill_flops``.
    """
    n = max(0, n_tokens)
    attention = attention_flops(text, n_past + n // 2) * n
    if weights is None:
        flops = n * text_flops_per_token(text) + attention + 2.0 * text.n_vocab * text.n_embd
        cpu_seconds = flops / rates.prefill_flops
    else:
        def matmul(table: Mapping[str, int], tokens: int) -> tuple[float, float]:
            ops = {t: 2.0 * tokens * b * 8 / type_bits(t) for t, b in table.items()}
            return sum(ops.values()), sum(f / rates.prefill_for(t) for t, f in ops.items())

        layer_flops, layer_s = matmul(weights.layers, n)
        out_flops, out_s = matmul(weights.output, 1)
        flops = layer_flops + out_flops + attention
        cpu_seconds = layer_s + out_s + attention / rates.prefill_flops
    share = _share(gpu_share, gpu)
    seconds = cpu_seconds * (1 - share)
    if share and gpu is not None:
        seconds += flops * share / gpu.flops
    return seconds


def encode_seconds(vision: VisionShape | None, text_width: int, rates: Rates, *,
                   gpu: GpuRates | None = None, backend: str | None = None) -> float:
    """Seconds for one slice through the vision encoder: on ``gpu`` when given, else on
    the CPU with ``backend`` (``"onnx-int8"``...; None or ``"llama.cpp"``: libmtmd)."""
    if gpu is not None:
        return vision_flops_per_slice(vision, text_width) / gpu.flops
    blocks, rest = vision_flops_parts(vision, text_width)
    if backend == "onnx-int8" and "onnx-fp32" in rates.vision_by_backend:
        # only the blocks' MatMuls are int8; the rest runs in fp32
        return blocks / rates.vision_for(backend) + rest / rates.vision_for("onnx-fp32")
    return (blocks + rest) / rates.vision_for(backend)


def photo_slices(detail: str = "auto", *, vision_on_gpu: bool = False,
                 size: tuple[int, int] = PHOTO_SIZE, slice_size: int = 448) -> int:
    """Encoder passes for a photo of ``size`` at ``detail``: the slices plus the overview."""
    width, height = fit_slices(*size, slice_budget(detail, vision_on_gpu=vision_on_gpu), slice_size)
    return 1 + count_slices(width, height, slice_size)


def slice_budget(detail: str = "auto", *, vision_on_gpu: bool = False) -> int:
    """The most slices (beside the overview) an image is cut into at ``detail``, as
    :func:`gguf_mcv.vision.slicing.detail_size` cuts it: 0 low, 9 high, auto 4 on a CPU encoder
    and 9 on a GPU."""
    if detail not in DETAILS:
        raise ConfigError(f"detail must be one of {', '.join(DETAILS)}, not {detail!r}.")
    return {"low": 0, "high": MAX_SLICES,
            "auto": AUTO_MAX_SLICES_GPU if vision_on_gpu else AUTO_MAX_SLICES_CPU}[detail]


def predict(*, model_size: int, text: TextShape, quant: str | None, vision: VisionShape | None,
            rates: Rates, detail: str = "auto", kv_cache_type: str = "f16", gpu_share: float = 0.0,
            vision_on_gpu: bool = False, gpu: GpuRates | None = None, weights: WeightProfile | None = None,
            vision_backend: str | None = None) -> SpeedPrediction:
    """Decode, prefill and encode rates and first-answer times for one quant on one machine.

    ``weights``: the file's :class:`WeightProfile` when its header was read (else one is
    estimated from the size and quant); ``vision_backend``: the encoder on the CPU
    (``"onnx-int8"``, ``"onnx-fp32"``; None or ``"llama.cpp"``: libmtmd).
    """
    v = vision or VisionShape()
    slice_size = v.image_size or 448
    slices = photo_slices(detail, vision_on_gpu=vision_on_gpu, slice_size=slice_size)
    encode = encode_seconds(v, text.n_embd, rates, gpu=gpu if vision_on_gpu else None, backend=vision_backend)
    weights = weights or weight_profile(model_size, text, quant)
    gpu_args: dict[str, Any] = dict(gpu_share=gpu_share, gpu=gpu, weights=weights)
    per_slice = v.query_tokens + MARKER_TOKENS_PER_SLICE

    def first_answer(n_slices: int, extra_tokens: int) -> float:
        prompt = n_slices * per_slice + extra_tokens + QUESTION_TOKENS
        return (n_slices * encode + prefill_seconds(prompt, text, rates, **gpu_args)
                + decode_seconds(model_size, text, quant, rates, n_past=prompt, kv_cache_type=kv_cache_type,
                                 **gpu_args))

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
    try:
        number = check_number(name, value)
    except ConfigError:
        number = math.nan
    if not number > 0:
        huge = isinstance(value, int) and value.bit_length() > 128  # repr() fails past 4300 digits
        shown = f"an integer of {value.bit_length()} bits" if huge else repr(value)[:60]
        raise ConfigError(f"{name} must be a positive number, not {shown}.")
    return number


#: The per-type tables that scale with each general rate in :func:`scaled`.
_TABLES = {"matvec": "matvec_by_type", "prefill_flops": "prefill_by_type", "vision_flops": "vision_by_backend"}


def scaled(rates: Rates, **factors: float) -> Rates:
    """``rates`` with some rates multiplied (e.g. ``bandwidth=0.5``): for what-if boards.

    ``matvec``, ``prefill_flops`` and ``vision_flops`` scale their per-type tables too."""
    changes: dict[str, Any] = {}
    for name, f in factors.items():
        changes[name] = getattr(rates, name) * f
        if name in _TABLES:
            changes[_TABLES[name]] = {k: v * f for k, v in getattr(rates, _TABLES[name]).items()}
    return replace(rates, **changes)


def _share(gpu_share: float, gpu: GpuRates | None) -> float:
    if gpu is None:
        return 0.0
    return min(1.0, max(0.0, float(gpu_share)))
