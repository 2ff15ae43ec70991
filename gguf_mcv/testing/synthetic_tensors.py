"""The tensors of synthetic models, named, shaped and typed as the official converters
write them, and the values each is filled with."""

from __future__ import annotations

import zlib

import numpy as np

from .synthetic_specs import POS_GRID, SyntheticSpec

#: One tensor to write: name, numpy shape (ggml's reversed), dtype, and how to fill it.
TensorPlan = tuple[str, tuple[int, ...], type, str]


def _linear(name: str, n_out: int, n_in: int, bias: bool = True) -> list[TensorPlan]:
    plans: list[TensorPlan] = [(f"{name}.weight", (n_out, n_in), np.float16, "normal")]
    return plans + [(f"{name}.bias", (n_out,), np.float32, "normal")] if bias else plans


def _layer_norm(name: str, n: int) -> list[TensorPlan]:
    return [(f"{name}.weight", (n,), np.float32, "ones"), (f"{name}.bias", (n,), np.float32, "zeros")]


def _rms_norm(name: str, n: int) -> list[TensorPlan]:
    return [(f"{name}.weight", (n,), np.float32, "ones")]


def text_tensors(spec: SyntheticSpec) -> list[TensorPlan]:
    """The text model's tensors as convert_hf_to_gguf writes them at F16 (1-D tensors stay F32)."""
    d = spec.n_embd
    plans: list[TensorPlan] = [("token_embd.weight", (spec.n_vocab, d), np.float16, "normal")]
    for i in range(spec.n_layer):
        plans += _block(spec, f"blk.{i}", recurrent=_is_recurrent(spec, i))
    plans += _rms_norm("output_norm", d)
    return plans if spec.tied_embeddings else plans + [("output.weight", (spec.n_vocab, d), np.float16, "normal")]


def _is_recurrent(spec: SyntheticSpec, layer: int) -> bool:
    # llama.cpp src/models/qwen35.cpp: without attention.recurrent_layers, layer i is
    # recurrent unless (i + 1) % full_attention_interval == 0.
    return spec.text_arch == "qwen35" and (layer + 1) % spec.full_attention_interval != 0


def _block(spec: SyntheticSpec, b: str, *, recurrent: bool) -> list[TensorPlan]:
    d, f = spec.n_embd, spec.n_ff
    mixer = _gated_delta_net(spec, b) if recurrent else _attention(spec, b)
    # qwen35 names the pre-FFN norm post_attention_norm (llama-arch.cpp LLM_TENSOR_ATTN_POST_NORM)
    ffn_norm = "post_attention_norm" if spec.text_arch == "qwen35" else "ffn_norm"
    return [
        *_rms_norm(f"{b}.attn_norm", d), *mixer, *_rms_norm(f"{b}.{ffn_norm}", d),
        *_linear(f"{b}.ffn_gate", f, d, bias=False), *_linear(f"{b}.ffn_up", f, d, bias=False),
        *_linear(f"{b}.ffn_down", d, f, bias=False),
    ]  # fmt: skip


def _attention(spec: SyntheticSpec, b: str) -> list[TensorPlan]:
    d, hd = spec.n_embd, spec.head_size
    q, kv = hd * spec.n_head, hd * spec.n_head_kv
    bias = spec.text_arch == "qwen2"  # llama.cpp's qwen2 loads q/k/v biases unconditionally
    # qwen35's attention query carries its output gate: 2 x (heads x head size) rows
    q_rows = 2 * q if spec.text_arch == "qwen35" else q
    plans = _linear(f"{b}.attn_q", q_rows, d, bias) + _linear(f"{b}.attn_k", kv, d, bias)
    plans += _linear(f"{b}.attn_v", kv, d, bias) + _linear(f"{b}.attn_output", d, q, bias=False)
    if spec.text_arch in ("qwen3", "qwen35"):  # per-head RMS norms on q and k
        plans += _rms_norm(f"{b}.attn_q_norm", hd) + _rms_norm(f"{b}.attn_k_norm", hd)
    return plans


def _gated_delta_net(spec: SyntheticSpec, b: str) -> list[TensorPlan]:
    """A qwen35 linear-attention layer (llama.cpp src/models/qwen35.cpp, load_arch_tensors)."""
    d, heads, hd = spec.n_embd, spec.ssm_heads, spec.ssm_head_dim
    inner = heads * hd  # key_dim = value_dim: as many key heads as value heads here
    return [
        *_linear(f"{b}.attn_qkv", 3 * inner, d, bias=False),
        *_linear(f"{b}.attn_gate", inner, d, bias=False),
        # ggml_ssm_conv wants an F32 kernel; the converter keeps it F32 too
        (f"{b}.ssm_conv1d.weight", (3 * inner, SSM_CONV_KERNEL), np.float32, "normal"),
        (f"{b}.ssm_dt.bias", (heads,), np.float32, "zeros"),
        (f"{b}.ssm_a", (heads,), np.float32, "minus_ones"),  # A = -exp(A_log): negative decay
        *_linear(f"{b}.ssm_beta", heads, d, bias=False),
        *_linear(f"{b}.ssm_alpha", heads, d, bias=False),
        *_rms_norm(f"{b}.ssm_norm", hd),
        *_linear(f"{b}.ssm_out", d, inner, bias=False),
    ]  # fmt: skip


SSM_CONV_KERNEL = 4  # Qwen3.5's linear_conv_kernel_dim


def mmproj_tensors(spec: SyntheticSpec) -> list[TensorPlan]:
    """SigLIP tower + projector tensors as the MiniCPM-V converters write them (2-D weights F16)."""
    head = _resampler(spec) if spec.projector == "resampler" else []
    tail = _merger(spec) if spec.projector == "minicpmv4_6" else []
    return head + _vision_tower(spec) + tail


def _resampler(spec: SyntheticSpec) -> list[TensorPlan]:
    d, dv, n_pos = spec.n_embd, spec.v_embd, POS_GRID * POS_GRID
    plans: list[TensorPlan] = [
        ("resampler.pos_embed_k", (n_pos, d), np.float32, "sincos"),
        ("resampler.query", (spec.query_num, d), np.float32, "normal"),
        ("resampler.proj.weight", (d, d), np.float16, "normal"),
        ("resampler.kv.weight", (d, dv), np.float16, "normal"),
    ]
    for part in ("q", "k", "v", "out"):
        plans += _linear(f"resampler.attn.{part}", d, d)
    for part in ("q", "kv", "post"):
        plans += _layer_norm(f"resampler.ln_{part}", d)
    return plans


def _vision_tower(spec: SyntheticSpec) -> list[TensorPlan]:
    dv, p, n_pos = spec.v_embd, spec.patch_size, POS_GRID * POS_GRID
    # The converter always writes the conv kernel F16 (ggml's conv once had no F32 kernel).
    plans: list[TensorPlan] = [("v.patch_embd.weight", (dv, 3, p, p), np.float16, "normal")]
    plans += [("v.patch_embd.bias", (dv,), np.float32, "normal")]
    plans += [("v.position_embd.weight", (n_pos, dv), np.float16, "normal")]
    for i in range(spec.v_layer):
        b = f"v.blk.{i}"
        for part in ("attn_k", "attn_v", "attn_q", "attn_out"):
            plans += _linear(f"{b}.{part}", dv, dv)
        plans += _layer_norm(f"{b}.ln1", dv)
        # Real files name fc1 "ffn_down" and fc2 "ffn_up"; libmtmd swaps them back by shape.
        plans += _linear(f"{b}.ffn_down", spec.v_ff, dv) + _linear(f"{b}.ffn_up", dv, spec.v_ff)
        plans += _layer_norm(f"{b}.ln2", dv)
    return plans + _layer_norm("v.post_ln", dv)


def _merger(spec: SyntheticSpec) -> list[TensorPlan]:
    """MiniCPM-V 4.6's mergers (libmtmd clip.cpp, PROJECTOR_TYPE_MINICPMV4_6): a window
    attention + 2x2 downsample MLP inside the ViT, then a final 2x2 DownsampleMLP."""
    dv, d, hidden = spec.v_embd, spec.n_embd, spec.v_ff
    plans = _layer_norm("v.vit_merger.ln1", dv)
    for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
        plans += _linear(f"v.vit_merger.{part}", dv, dv)
    plans += _layer_norm("v.vit_merger.ds_ln", 4 * dv)  # 4 neighbouring patches concatenated
    plans += _linear("v.vit_merger.ds_ffn_up", hidden, 4 * dv) + _linear("v.vit_merger.ds_ffn_down", dv, hidden)
    plans += _layer_norm("mm.input_norm", 4 * dv)
    return plans + _linear("mm.up", hidden, 4 * dv) + _linear("mm.down", d, hidden)


def _sincos_2d(dim: int, grid: int) -> np.ndarray:
    """MAE-style 2-D sin/cos table, (grid*grid, dim): what the converter stores as pos_embed_k."""
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))
    h, w = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))
    halves = [np.outer(pos.reshape(-1), omega) for pos in (h, w)]
    return np.concatenate([f(x) for x in halves for f in (np.sin, np.cos)], axis=1)


def fill_tensor(plan: TensorPlan, seed: int) -> np.ndarray:
    """Materialise one tensor: each from its own generator, so shapes elsewhere don't shift it."""
    name, shape, dtype, kind = plan
    if kind == "ones":
        return np.ones(shape, dtype)
    if kind == "minus_ones":
        return -np.ones(shape, dtype)
    if kind == "zeros":
        return np.zeros(shape, dtype)
    if kind == "sincos":
        return _sincos_2d(shape[1], POS_GRID).astype(dtype)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape, np.float32) * np.float32(0.02)).astype(dtype)
