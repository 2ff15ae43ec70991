"""The MiniCPM-V vision encoder as an ONNX graph, built from the mmproj GGUF's own weights.

The graph is libmtmd's (``clip_graph_minicpmv::build`` and ``clip_graph::build_vit`` in
llama.cpp's ``tools/mtmd``): a 14×14 patch convolution, the learned position embedding
(rows chosen by the caller, see :func:`vit_positions`), SigLIP blocks (LayerNorm,
attention with biases, the GELU variant the mmproj names, residuals), the post-norm,
then the resampler of MiniCPM-V versions 2–6: a kv projection, LayerNorms, 2-D sin/cos
keys (:func:`resampler_positions`), cross-attention of the learned queries with 128-wide
heads, ln_post and the projection. Inputs: ``pixels`` (1×3×H×W), ``pos_ids`` (int64, one
per patch) and ``rpos`` (patches × output width); output ``embeddings`` (1×queries×width).

No PyTorch: the weights are read with the ``gguf`` package and written with ``onnx``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

import numpy as np

from ..errors import CorruptModelError, IncompatibleProjectorError
from .onnx_variants import quantize_blocks8, symmetric_blocks

#: libmtmd's resampler attention head size (clip.cpp: ``const int d_head = 128``)
RESAMPLER_HEAD = 128
#: SigLIP's position grid side (libmtmd buckets every slice into 70×70)
POS_GRID = 70
OPSET = 20  # Gelu with approximate="tanh"
PROJECTORS = ("resampler", "minicpmv4_6")  #: the projector types built below
#: weights at least this large go to the external data file, at offsets aligned to EXTERNAL_ALIGN
EXTERNAL_MIN_BYTES = 1024
EXTERNAL_ALIGN = 4096
#: LayerNorm gamma channels larger than this many times the median are moved into the next
#: MatMul's weights before int8 quantization (exact in fp32; see fold_outliers)
OUTLIER_FACTOR = 4.0
#: MatMulNBits' block along the input (4-bit tower blocks, ``block_bits=4``; the "nbits8" kernel)
INT4_BLOCK = 32
#: how an int8 MatMul runs (``kernel``; ``gguf_mcv.vision.onnx_variants`` picks one per CPU):
#: "u8s8", DynamicQuantizeMatMul with int8 weights; "u8u8", the same with uint8 weights (zero
#: point 128: no vpmaddubsw saturation); "nbits8", MatMulNBits at 8 bits, accuracy_level 4
INT8_KERNELS = ("u8s8", "u8u8", "nbits8")
#: what ``int8`` quantizes (``int8_scope``): "all", every MatMul with a weight; "blocks", the tower
#: blocks' only, the merger/resampler fp32 and unfolded (the older int8 graph). The cache
#: converts "all" for MiniCPM-V 4.6's mergers and "blocks" for the 2.x resampler
#: (``onnx_vision.int8_scope``); tools/vision_fidelity.py --int8 compares the two
INT8_SCOPES = ("all", "blocks")
#: metadata key of the graph's stage boundaries (the tensors after the patch embedding, each
#: block and 4.6's window merger, comma-separated): :func:`gguf_mcv.vision.onnx_vision.run_in_stages`
#: runs the graph one stage at a time, holding one stage's weights
STAGES_KEY = "gguf_mcv.stages"


@dataclass(frozen=True)
class Projector:
    """An mmproj's numbers the graph and the preprocessing need."""

    projector_type: str
    minicpmv_version: int
    width: int  #: vision tower width
    blocks: int
    heads: int
    eps: float
    ffn_op: str  #: "gelu" (tanh), "silu" or "gelu_quick", from clip.use_gelu / clip.use_silu
    image_size: int
    patch_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    n_out: int  #: output (text) width
    query_num: int  #: resampler: tokens per slice (minicpmv4_6: 0, they follow the slice size)
    n_merge: int = 1  #: minicpmv4_6: patches merged per side (4: window merger + final merger)
    merger_layer: int = -1  #: minicpmv4_6: the block after which the window merger runs


class Weights:
    """Tensors of an mmproj GGUF by name, as float32 numpy arrays (numpy order)."""

    def __init__(self, path: str | os.PathLike) -> None:
        import gguf  # lazy: heavy-ish, only for conversion

        try:
            self._reader = gguf.GGUFReader(os.fspath(path))
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise CorruptModelError(f"Could not read {path} as a GGUF file ({exc}); download it again.") from exc
        self._gguf = gguf
        self._path = os.fspath(path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.fields = {name: f.contents() for name, f in self._reader.fields.items()
                       if not name.startswith("GGUF.")}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._tensors.get(name)
        if t is None:
            raise IncompatibleProjectorError(f"The mmproj has no tensor {name!r}; it is not a MiniCPM-V projector "
                                             "this converter knows.")
        # read, not through the reader's map: mapped pages would stay in this process's RSS
        # until the whole file is unmapped (the F16 tower, on top of a conversion's peak)
        with open(self._path, "rb") as f:
            f.seek(int(t.data_offset))
            raw = np.frombuffer(f.read(int(t.n_bytes)), dtype=t.data.dtype).reshape(t.data.shape)
        data = self._gguf.quants.dequantize(raw, t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        return np.asarray(data, dtype=np.float32).reshape(shape)

    def rounding(self, name: str) -> str | None:
        """What ggml's CPU mul_mat rounds the activations to before multiplying them by the stored
        weight ``name``: its ``vec_dot_type`` ("float16" for F16, "bfloat16" for BF16 weights),
        None for F32 weights (and quantized ones, whose activation quantization is not emulated)."""
        t = self._tensors.get(name)
        kind = getattr(t, "tensor_type", None)
        q = self._gguf.GGMLQuantizationType
        return "float16" if kind == q.F16 else "bfloat16" if kind == q.BF16 else None

    def projector(self) -> Projector:
        f = self.fields
        kind = str(f.get("clip.projector_type", ""))
        if kind not in PROJECTORS:
            raise IncompatibleProjectorError(
                f"The ONNX vision backend supports the {' and '.join(PROJECTORS)} projectors (MiniCPM-V 2.5–4.6), "
                f"not {kind!r}: use vision_backend='llama.cpp'.")
        ffn = "gelu" if f.get("clip.use_gelu") else "silu" if f.get("clip.use_silu") else "gelu_quick"
        version = int(f.get("clip.minicpmv_version", 2) or 2)
        if kind == "resampler":
            queries = int(f.get("clip.minicpmv_query_num", 0) or (96 if version == 2 else 64))
            n_out, n_merge, merger_layer = int(self._shape("resampler.proj.weight")[1]), 1, -1
        else:
            n_merge = int(f.get("clip.vision.projector.scale_factor", 4) or 4)
            if n_merge not in (2, 4):
                raise IncompatibleProjectorError(f"A minicpmv4_6 merge factor of {n_merge} is not 2 or 4.")
            layers = f.get("clip.vision.wa_layer_indexes") or [0]
            queries, n_out, merger_layer = 0, int(self._shape("mm.down.weight")[0]), int(layers[0])
        return Projector(
            projector_type=kind, minicpmv_version=version,
            width=int(f["clip.vision.embedding_length"]), blocks=int(f["clip.vision.block_count"]),
            heads=int(f["clip.vision.attention.head_count"]),
            eps=float(f.get("clip.vision.attention.layer_norm_epsilon", 1e-6)), ffn_op=ffn,
            image_size=int(f["clip.vision.image_size"]), patch_size=int(f["clip.vision.patch_size"]),
            mean=tuple(float(x) for x in f["clip.vision.image_mean"]),  # type: ignore[arg-type]
            std=tuple(float(x) for x in f["clip.vision.image_std"]),  # type: ignore[arg-type]
            n_out=n_out, query_num=queries, n_merge=n_merge, merger_layer=merger_layer,
        )

    def _shape(self, name: str) -> tuple[int, ...]:
        t = self._tensors.get(name)
        if t is None:
            raise IncompatibleProjectorError(f"The mmproj has no tensor {name!r}.")
        return tuple(int(s) for s in reversed(t.shape.tolist()))


def vit_positions(h: int, w: int) -> np.ndarray:
    """Rows of the 70×70 position table for an h×w patch grid (libmtmd's bucketing)."""
    bh = np.floor(POS_GRID * np.arange(h) / h).astype(np.int64)
    bw = np.floor(POS_GRID * np.arange(w) / w).astype(np.int64)
    return (bh[:, None] * POS_GRID + bw[None, :]).reshape(-1)


def resampler_positions(h: int, w: int, dim: int) -> np.ndarray:
    """The resampler keys' 2-D sin/cos embedding for an h×w grid: (h*w, dim), float32 as libmtmd."""
    quarter = dim // 4
    omega = (np.float32(1.0) / np.power(np.float32(10000.0),
                                        np.arange(quarter, dtype=np.float32) / np.float32(quarter))).astype(np.float32)
    idx = np.arange(h * w)
    pos_h, pos_w = (idx // w).astype(np.float32), (idx % w).astype(np.float32)
    tx, ty = pos_w[:, None] * omega[None, :], pos_h[:, None] * omega[None, :]
    return np.concatenate([np.sin(tx), np.cos(tx), np.sin(ty), np.cos(ty)], axis=1).astype(np.float32)


def merge_indices(h: int, w: int) -> np.ndarray:
    """The four 2×2 neighbours of each merged token (4 × (h/2 · w/2)), as libmtmd's make_ds_idx."""
    i, j = np.meshgrid(np.arange(h // 2), np.arange(w // 2), indexing="ij")
    return np.stack([((2 * i + r) * w + (2 * j + c)).reshape(-1) for r, c in ((0, 0), (0, 1), (1, 0), (1, 1))])


def window_order(h: int, w: int) -> np.ndarray:
    """Tokens reordered window-major (2×2 windows, 4 consecutive tokens each), as libmtmd's window_idx."""
    return merge_indices(h, w).T.reshape(-1)


def graph_inputs(p: Projector, h: int, w: int) -> dict[str, np.ndarray]:
    """The graph's inputs besides the pixels, for an h×w patch grid."""
    feeds = {"pos_ids": vit_positions(h, w)}
    if p.projector_type == "resampler":
        feeds["rpos"] = resampler_positions(h, w, p.n_out)
        return feeds
    if p.n_merge == 4:
        order = window_order(h, w)
        feeds["win_idx"] = order.astype(np.int64)
        feeds["inv_win_idx"] = np.argsort(order).astype(np.int64)
        feeds["ds_idx"] = merge_indices(h, w).astype(np.int64)
        h, w = h // 2, w // 2
    feeds["merge_idx"] = merge_indices(h, w).astype(np.int64)
    return feeds


def fold_outliers(gamma: np.ndarray, beta: np.ndarray, mats: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Move LayerNorm gamma outliers into the rows of the MatMul weights that follow (in×out).

    ``LN(x)·γ + β`` feeding ``W`` equals ``LN(x)·(γ/s) + β/s`` feeding ``diag(s)·W``; with
    ``s`` the outlier channels' excess, the activation the int8 MatMul quantizes loses its
    few huge channels (dynamic quantization is per tensor). ``mats`` are changed in place.
    """
    mag = np.abs(gamma)
    median = float(np.median(mag)) or 1.0
    s = np.where(mag > OUTLIER_FACTOR * median, mag / median, 1.0).astype(np.float32)
    for m in mats:
        m *= s[:, None]
    return (gamma / s).astype(np.float32), (beta / s).astype(np.float32)


class _Builder:
    """Collects nodes and initializers; names are unique by construction. With ``external``,
    tensors over a few KB are written to that file as they come (ONNX external data), so a
    conversion holds one weight at a time, not the whole tower twice (numpy + protobuf)."""

    def __init__(self, external: IO[bytes] | None = None, location: str = "", int8: bool = False,
                 ggml: bool = False, block_bits: int = 8, int8_scope: str = "all", kernel: str = "u8s8") -> None:
        from onnx import TensorProto, helper, numpy_helper  # lazy: only for conversion

        self.h, self.nh, self.tp = helper, numpy_helper, TensorProto
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._n = 0
        self._external, self._location = external, location
        self.int8 = int8  #: every MatMul with a weight (tower blocks, merger, resampler) as int8
        #: with ``int8``, 4: the tower blocks' MatMuls as 4-bit MatMulNBits instead (evaluated,
        #: not used by the cache: see docs/vision-encoders.md)
        self.block_bits = block_bits
        if int8_scope not in INT8_SCOPES:
            raise ValueError(f"int8_scope must be one of {INT8_SCOPES}, not {int8_scope!r}")
        #: with ``int8``, "blocks": only the tower blocks' MatMuls int8 (:data:`INT8_SCOPES`)
        self.int8_scope = int8_scope
        if kernel not in INT8_KERNELS:  #: how the int8 MatMuls run
            raise ValueError(f"kernel must be one of {INT8_KERNELS}, not {kernel!r}")
        self.kernel = kernel
        self.ggml = ggml  #: round where ggml's CPU kernels round (see :func:`build_model`)
        self.flash = ggml  #: round Q/K/V as ggml's flash attention does (libmtmd's CPU default)

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, hint: str, value: np.ndarray) -> str:
        name = self.name(hint)
        # not np.ascontiguousarray: it turns a scalar into a 1-element vector
        value = np.array(value, order="C", copy=True)
        if self._external is None or value.nbytes < EXTERNAL_MIN_BYTES:
            self.inits.append(self.nh.from_array(value, name))
            return name
        f = self._external
        offset = -(-f.tell() // EXTERNAL_ALIGN) * EXTERNAL_ALIGN  # page-aligned: ORT may mmap it
        f.seek(offset)
        f.write(value.tobytes())
        t = self.tp()
        t.name, t.data_type = name, self.h.np_dtype_to_tensor_dtype(value.dtype)
        t.dims.extend(value.shape)
        t.data_location = self.tp.EXTERNAL
        for key, v in (("location", self._location), ("offset", str(offset)), ("length", str(value.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, v
        self.inits.append(t)
        return name

    def op(self, op: str, inputs: list[str], hint: str | None = None, domain: str = "", **attrs: Any) -> str:
        out = self.name(hint or op)
        self.nodes.append(self.h.make_node(op, inputs, [out], name=out, domain=domain, **attrs))
        return out

    def rounded(self, x: str, dtype: str | None) -> str:
        """``x`` rounded to ``dtype`` ("float16"/"bfloat16") and back to float32, when emulating ggml."""
        if not self.ggml or dtype is None:
            return x
        to = self.tp.FLOAT16 if dtype == "float16" else self.tp.BFLOAT16
        return self.op("Cast", [self.op("Cast", [x], "round", to=to)], "round", to=self.tp.FLOAT)

    def linear(self, x: str, w: np.ndarray, b: np.ndarray | None, hint: str, rnd: str | None = None) -> str:
        """x @ w.T (+ b): ggml's mul_mat with a (out, in) weight; ``rnd`` is :meth:`Weights.rounding`'s."""
        return self.matmul_in_out(x, w.T, b, hint, rnd)

    def matmul_in_out(self, x: str, w_in_out: np.ndarray, b: np.ndarray | None, hint: str,
                      rnd: str | None = None) -> str:
        if self.int8 and self.block_bits == 4 and hint.startswith("v.blk."):
            return self._nbits_matmul(x, w_in_out, b, hint, 4)
        if self.int8 and (self.projector_int8 or hint.startswith("v.blk.")):
            if self.kernel == "nbits8":
                return self._nbits_matmul(x, w_in_out, b, hint, 8)
            return self._int8_matmul(x, w_in_out, b, hint)
        y = self.op("MatMul", [self.rounded(x, rnd), self.const(hint + ".w", w_in_out)], hint + ".matmul")
        return self.op("Add", [y, self.const(hint + ".b", b)], hint) if b is not None else y

    @property
    def projector_int8(self) -> bool:
        """Whether the MatMuls after the tower blocks (4.6's mergers, the resampler) are int8."""
        return self.int8 and self.int8_scope == "all"

    def _int8_matmul(self, x: str, w_in_out: np.ndarray, b: np.ndarray | None, hint: str) -> str:
        """ONNX Runtime's DynamicQuantizeMatMul (what its quantize_dynamic + graph fusion give for
        a MatMul): symmetric int8 weights with one scale per output column, the activation
        quantized per call, the bias added in the same op; kernel "u8u8": the weights as uint8
        (q + 128, zero point 128), which ORT multiplies without 8-bit pair sums."""
        w_q, scale = quantize_columns(w_in_out)
        zero = ""
        if self.kernel == "u8u8":
            w_q = (w_q.astype(np.int16) + 128).astype(np.uint8)
            zero = self.const(hint + ".wz", np.full(scale.shape, 128, np.uint8))
        inputs = [x, self.const(hint + ".wq", w_q), self.const(hint + ".ws", scale), zero]
        if b is not None:
            inputs.append(self.const(hint + ".b", b.astype(np.float32)))
        return self.op("DynamicQuantizeMatMul", inputs, hint, domain="com.microsoft")

    def _nbits_matmul(self, x: str, w_in_out: np.ndarray, b: np.ndarray | None, hint: str, bits: int) -> str:
        """ONNX Runtime's MatMulNBits: ``bits``-bit (4 or 8) symmetric weights in blocks of
        :data:`INT4_BLOCK` along the input, a scale per block and column; computed in int8."""
        k, n = w_in_out.shape
        packed, scales = quantize_blocks4(w_in_out) if bits == 4 else quantize_blocks8(w_in_out, INT4_BLOCK)
        y = self.op("MatMulNBits", [x, self.const(hint + f".w{bits}", packed), self.const(hint + f".s{bits}", scales)],
                    hint + ".matmul", domain="com.microsoft", K=k, N=n, bits=bits, block_size=INT4_BLOCK,
                    accuracy_level=4)
        return self.op("Add", [y, self.const(hint + ".b", b.astype(np.float32))], hint) if b is not None else y

    def norm(self, x: str, g: np.ndarray, b: np.ndarray, eps: float, hint: str) -> str:
        return self.op("LayerNormalization", [x, self.const(hint + ".g", g), self.const(hint + ".b", b)],
                       hint, axis=-1, epsilon=eps)

    def attention(self, q: str, k: str, v: str, heads: int, hint: str) -> str:
        # ggml's flash attention (libmtmd's default on the CPU) casts K and V to F16 and rounds
        # Q to F16 for the K·Q dot products
        if self.flash:
            q, k, v = (self.rounded(t, "float16") for t in (q, k, v))
        return self.op("MultiHeadAttention", [q, k, v], hint, domain="com.microsoft", num_heads=heads)

    def act(self, x: str, kind: str, hint: str) -> str:
        if kind == "gelu":  # ggml_gelu: the tanh approximation
            if self.ggml:
                return self._gelu_table(x, hint)
            return self.op("Gelu", [x], hint, approximate="tanh")
        alpha = 1.702 if kind == "gelu_quick" else 1.0
        if kind == "gelu_quick" and self.ggml:  # GGML_GELU_QUICK_FP16: a table over F16 inputs
            x = self.rounded(x, "float16")
        scaled = self.op("Mul", [x, self.const(hint + ".a", np.asarray(alpha, np.float32))]) if alpha != 1 else x
        y = self.op("Mul", [x, self.op("Sigmoid", [scaled])], hint)
        return self.rounded(y, "float16") if kind == "gelu_quick" else y

    def _gelu_table(self, x: str, hint: str) -> str:
        """ggml's CPU GELU (GGML_GELU_FP16 in ggml-cpu/vec.h): 0 at or below -10, x at or above 10,
        else the F16 table entry: gelu of the input rounded to F16, rounded to F16."""
        y = self.rounded(self.op("Gelu", [self.rounded(x, "float16")], approximate="tanh"), "float16")
        low = self.op("LessOrEqual", [x, self.const("gelu_lo", np.asarray(-10.0, np.float32))])
        high = self.op("GreaterOrEqual", [x, self.const("gelu_hi", np.asarray(10.0, np.float32))])
        y = self.op("Where", [high, x, y])
        return self.op("Where", [low, self.const("zero", np.asarray(0.0, np.float32)), y], hint)


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """LayerNormalization over the last axis, in float32 (as ONNX's)."""
    x = x.astype(np.float32)
    mean = x.mean(axis=-1, keepdims=True)
    var = np.square(x - mean).mean(axis=-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + np.float32(eps)) * gamma + beta).astype(np.float32)


def quantize_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-column int8 of an (in × out) weight: (int8 weight, float32 scale per column)."""
    scale = (np.abs(w).max(axis=0) / 127.0).astype(np.float32)
    scale[scale == 0] = 1.0
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


def quantize_blocks4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' layout of an (in × out) weight at 4 bits: (uint8 N × blocks × block/2, two
    values a byte, low nibble first, stored as q + 8; float32 scale per column and block)."""
    q4, scale = symmetric_blocks(w, 7.0, INT4_BLOCK)
    q = (np.clip(q4, -8, 7) + 8).astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), scale.reshape(-1)


def build_model(weights: Weights, *, fold: bool = False, int8: bool = False, ggml: bool = False,
                external: Path | None = None, block_bits: int = 8, int8_scope: str = "all", kernel: str = "u8s8",
                progress: Callable[[int, int], None] | None = None) -> tuple[Any, list[str]]:
    """The ONNX model of ``weights``' vision encoder, and the names of the tower's MatMul
    nodes. ``fold`` applies :func:`fold_outliers` to each LayerNorm that feeds MatMuls (the
    blocks' and the 4.6 mergers'); ``int8`` makes every MatMul with a weight int8 (the blocks',
    the merger's and the resampler's: :func:`quantize_columns`; the resampler's constant
    queries are projected at conversion; the patch embedding stays fp32);
    ``ggml`` rounds where ggml's CPU kernels round (activations to F16/BF16 before a MatMul
    with an F16/BF16 weight and before the patch convolution, Q/K/V to F16 for flash
    attention, GELU through its F16 table), so fp32 embeddings follow libmtmd's closely;
    ``external`` is the data file for the weights (the model must be saved beside it);
    ``block_bits=4`` (with ``int8``) makes the tower blocks' MatMuls 4-bit MatMulNBits;
    ``int8_scope="blocks"`` (with ``int8``) quantizes the tower blocks only, as the older int8 graph did:
    the mergers' and resampler's MatMuls stay fp32, their LayerNorms unfolded, the resampler's
    queries projected in the graph (:data:`INT8_SCOPES`; which one the cache converts is
    ``onnx_vision.int8_scope``'s); ``kernel``: how the int8 MatMuls run (:data:`INT8_KERNELS`)."""
    if external is None:
        builder = _Builder(int8=int8, ggml=ggml, block_bits=block_bits, int8_scope=int8_scope, kernel=kernel)
        return _build(weights, builder, fold, progress)
    with open(external, "wb") as f:
        builder = _Builder(f, external.name, int8=int8, ggml=ggml, block_bits=block_bits, int8_scope=int8_scope,
                           kernel=kernel)
        return _build(weights, builder, fold, progress)


def _build(weights: Weights, g: _Builder, fold: bool,
           progress: Callable[[int, int], None] | None) -> tuple[Any, list[str]]:
    from onnx import TensorProto, helper

    p = weights.projector()
    total = p.blocks + 2
    x = _patch_embedding(g, weights, p)
    stages = [x]
    if progress:
        progress(1, total)
    for i in range(p.blocks):
        x = _block(g, weights, p, i, x, fold)
        stages.append(x)
        if i == p.merger_layer and p.n_merge == 4:
            x = _window_merger(g, weights, p, x, fold and g.int8_scope == "all")
            stages.append(x)
        if progress:
            progress(i + 2, total)
    if "v.post_ln.weight" in weights:
        x = g.norm(x, weights["v.post_ln.weight"], weights["v.post_ln.bias"], p.eps, "post_ln")
    quantizable = [n.name for n in g.nodes if n.op_type == "MatMul" and n.name.startswith("v.blk.")]
    if p.projector_type == "resampler":
        out = _resampler(g, weights, p, x)
        extra = [helper.make_tensor_value_info("rpos", TensorProto.FLOAT, ["N", p.n_out])]
    else:
        out = _final_merger(g, weights, p, x, fold and g.int8_scope == "all")
        extra = [helper.make_tensor_value_info("merge_idx", TensorProto.INT64, [4, "M"])]
        if p.n_merge == 4:
            extra += [helper.make_tensor_value_info(n, TensorProto.INT64, ["N"]) for n in ("win_idx", "inv_win_idx")]
            extra.append(helper.make_tensor_value_info("ds_idx", TensorProto.INT64, [4, "D"]))
    nodes = g.nodes + [helper.make_node("Identity", [out], ["embeddings"], name="output")]
    graph = helper.make_graph(
        nodes, "minicpmv_vision",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, [1, 3, "H", "W"]),
         helper.make_tensor_value_info("pos_ids", TensorProto.INT64, ["N"]), *extra],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, [1, p.query_num or "T", p.n_out])],
        initializer=g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name="gguf_mcv")
    model.ir_version = 9
    helper.set_model_props(model, {STAGES_KEY: ",".join(stages)})
    if progress:
        progress(total, total)
    return model, quantizable


def _patch_embedding(g: _Builder, w: Weights, p: Projector) -> str:
    # ggml_conv_2d's im2col writes the pixels in the kernel's type (F16 in every converter's mmproj)
    conv_inputs = [g.rounded("pixels", w.rounding("v.patch_embd.weight")), g.const("patch.w", w["v.patch_embd.weight"])]
    if "v.patch_embd.bias" in w:
        conv_inputs.append(g.const("patch.b", w["v.patch_embd.bias"]))
    y = g.op("Conv", conv_inputs, "patch", kernel_shape=[p.patch_size] * 2, strides=[p.patch_size] * 2)
    y = g.op("Reshape", [y, g.const("shape", np.asarray([1, p.width, -1], np.int64))])
    y = g.op("Transpose", [y], perm=[0, 2, 1])  # 1 × patches × width
    pos = g.op("Gather", [g.const("pos_table", w["v.position_embd.weight"]), "pos_ids"], axis=0)
    x = g.op("Add", [y, pos], "embed")
    if "v.pre_ln.weight" in w:
        x = g.norm(x, w["v.pre_ln.weight"], w["v.pre_ln.bias"], p.eps, "pre_ln")
    return x


def _ffn_weights(w: Weights, b: str, width: int) -> tuple[tuple[np.ndarray, np.ndarray | None, str | None],
                                                         tuple[np.ndarray, np.ndarray | None, str | None]]:
    """((up, up bias, rounding), (down, down bias, rounding)), swapped back as libmtmd does when
    a converter named fc1 "ffn_down" (ggml ne[0] of ffn_down == tower width)."""
    up = (w[f"{b}.ffn_up.weight"], _optional(w, f"{b}.ffn_up.bias"), w.rounding(f"{b}.ffn_up.weight"))
    down = (w[f"{b}.ffn_down.weight"], _optional(w, f"{b}.ffn_down.bias"), w.rounding(f"{b}.ffn_down.weight"))
    return (down, up) if down[0].shape[-1] == width else (up, down)


def _block(g: _Builder, w: Weights, p: Projector, i: int, x: str, fold: bool) -> str:
    b = f"v.blk.{i}"
    qkv = [w[f"{b}.attn_{n}.weight"].T.copy() for n in ("q", "k", "v")]  # in × out
    (up, up_b, up_r), (down, down_b, down_r) = _ffn_weights(w, b, p.width)
    up_io = up.T.copy()
    g1, b1, g2, b2 = w[f"{b}.ln1.weight"], w[f"{b}.ln1.bias"], w[f"{b}.ln2.weight"], w[f"{b}.ln2.bias"]
    if fold:
        g1, b1 = fold_outliers(g1, b1, qkv)
        g2, b2 = fold_outliers(g2, b2, [up_io])
    h = g.norm(x, g1, b1, p.eps, f"{b}.ln1")
    q, k, v = (g.matmul_in_out(h, m, w[f"{b}.attn_{n}.bias"], f"{b}.{n}", w.rounding(f"{b}.attn_{n}.weight"))
               for m, n in zip(qkv, "qkv", strict=True))
    a = g.attention(q, k, v, p.heads, f"{b}.attn")
    o = g.linear(a, w[f"{b}.attn_out.weight"], w[f"{b}.attn_out.bias"], f"{b}.out", w.rounding(f"{b}.attn_out.weight"))
    x = g.op("Add", [x, o], f"{b}.res1")
    h = g.norm(x, g2, b2, p.eps, f"{b}.ln2")
    f = g.act(g.matmul_in_out(h, up_io, up_b, f"{b}.up", up_r), p.ffn_op, f"{b}.act")
    f = g.linear(f, down, down_b, f"{b}.down", down_r)
    return g.op("Add", [x, f], f"{b}.res2")


def _resampler(g: _Builder, w: Weights, p: Projector, x: str) -> str:
    if p.n_out % RESAMPLER_HEAD:
        raise IncompatibleProjectorError(f"The resampler width {p.n_out} is not a multiple of {RESAMPLER_HEAD}.")
    r = "resampler"
    v = g.linear(x, w[f"{r}.kv.weight"], None, "rs.kv", w.rounding(f"{r}.kv.weight"))
    v = g.norm(v, w[f"{r}.ln_kv.weight"], w[f"{r}.ln_kv.bias"], p.eps, "rs.ln_kv")
    k = g.op("Add", [v, "rpos"], "rs.k_in")
    proj = {n: g.linear(src, w[f"{r}.attn.{n}.weight"], w[f"{r}.attn.{n}.bias"], f"rs.{n}",
                        w.rounding(f"{r}.attn.{n}.weight"))
            for n, src in (("k", k), ("v", v))}
    if g.projector_int8:  # the queries are constants: projected here in fp32, no weight kept for them
        q_in = layer_norm(w[f"{r}.query"], w[f"{r}.ln_q.weight"], w[f"{r}.ln_q.bias"], p.eps)
        q_out = q_in @ w[f"{r}.attn.q.weight"].T + w[f"{r}.attn.q.bias"]
        proj["q"] = g.const("rs.q", q_out[None].astype(np.float32))
    else:
        q = g.norm(g.const("rs.query", w[f"{r}.query"][None]), w[f"{r}.ln_q.weight"], w[f"{r}.ln_q.bias"],
                   p.eps, "rs.ln_q")
        proj["q"] = g.linear(q, w[f"{r}.attn.q.weight"], w[f"{r}.attn.q.bias"], "rs.q",
                             w.rounding(f"{r}.attn.q.weight"))
    a = g.attention(proj["q"], proj["k"], proj["v"], p.n_out // RESAMPLER_HEAD, "rs.attn")
    o = g.linear(a, w[f"{r}.attn.out.weight"], w[f"{r}.attn.out.bias"], "rs.out", w.rounding(f"{r}.attn.out.weight"))
    o = g.norm(o, w[f"{r}.ln_post.weight"], w[f"{r}.ln_post.bias"], p.eps, "rs.ln_post")
    return g.linear(o, w[f"{r}.proj.weight"], None, "rs.proj", w.rounding(f"{r}.proj.weight"))


def _gather_merge(g: _Builder, x: str, idx: str) -> tuple[list[str], str]:
    """The four 2×2 neighbours of each merged token (rows of ``x`` (1×N×D) chosen by the 4×M
    ``idx``) and their concatenation (1×M×4D)."""
    parts = []
    for k in range(4):
        row = g.op("Gather", [idx, g.const("k", np.asarray(k, np.int64))], axis=0)
        parts.append(g.op("Gather", [x, row], axis=1))
    return parts, g.op("Concat", parts, axis=-1)


def _optional(w: Weights, name: str) -> np.ndarray | None:
    return w[name] if name in w else None


def _lin(g: _Builder, w: Weights, x: str, name: str, hint: str) -> str:
    """The linear layer ``name`` (``.weight``, optional ``.bias``) applied to ``x``."""
    return g.linear(x, w[f"{name}.weight"], _optional(w, f"{name}.bias"), hint, w.rounding(f"{name}.weight"))


def _norm_mlp(g: _Builder, w: Weights, x: str, norm: str, up: str, down: str, act: str, hint: str, eps: float,
              fold: bool) -> str:
    """LayerNorm ``norm`` (a missing bias is zero), then the MLP ``up`` → ``act`` → ``down``;
    ``fold`` moves the norm's gamma outliers into ``up`` (:func:`fold_outliers`)."""
    gamma = w[f"{norm}.weight"]
    beta = w[f"{norm}.bias"] if f"{norm}.bias" in w else np.zeros_like(gamma)
    up_io = w[f"{up}.weight"].T.copy()
    if fold:
        gamma, beta = fold_outliers(gamma, beta, [up_io])
    y = g.norm(x, gamma, beta, eps, hint + ".norm")
    y = g.matmul_in_out(y, up_io, _optional(w, f"{up}.bias"), hint + ".up", w.rounding(f"{up}.weight"))
    y = g.act(y, "gelu", hint + ".act") if act == "gelu" else g.op("Gelu", [y], hint + ".act")
    return _lin(g, w, y, down, hint + ".down")


def _window_merger(g: _Builder, w: Weights, p: Projector, x: str, fold: bool) -> str:
    """MiniCPM-V 4.6's ViT merger: attention inside each 2×2 window, then a 2×2 downsample MLP
    added to the windows' mean (clip_graph_minicpmv4_6::build)."""
    m = "v.vit_merger"
    mats = {n: w[f"{m}.attn_{n}.weight"].T.copy() for n in "qkv"}  # in × out
    gamma, beta = w[f"{m}.ln1.weight"], w[f"{m}.ln1.bias"]
    if fold:
        gamma, beta = fold_outliers(gamma, beta, list(mats.values()))
    h = g.norm(x, gamma, beta, p.eps, "wm.ln1")
    h = g.op("Gather", [h, "win_idx"], axis=1)  # a permutation of tokens: the fold still holds
    qkv = {n: g.matmul_in_out(h, mats[n], _optional(w, f"{m}.attn_{n}.bias"), f"wm.{n}",
                              w.rounding(f"{m}.attn_{n}.weight")) for n in "qkv"}
    windows = g.const("wshape", np.asarray([-1, 4, p.width], np.int64))  # one batch entry per window
    q, k, v = (g.op("Reshape", [qkv[n], windows]) for n in "qkv")
    a = g.op("Reshape", [g.attention(q, k, v, p.heads, "wm.attn"), g.const("shape", np.asarray([1, -1, p.width],
                                                                                                    np.int64))])
    a = _lin(g, w, a, f"{m}.attn_out", "wm.out")
    x = g.op("Add", [g.op("Gather", [a, "inv_win_idx"], axis=1), x], "wm.res")
    parts, cat = _gather_merge(g, x, "ds_idx")
    mean = g.op("Mul", [g.op("Sum", parts), g.const("quarter", np.asarray(0.25, np.float32))])
    y = _norm_mlp(g, w, cat, f"{m}.ds_ln", f"{m}.ds_ffn_up", f"{m}.ds_ffn_down", "gelu", "wm.ds", p.eps, fold)
    return g.op("Add", [y, mean], "wm.ds_out")


def _final_merger(g: _Builder, w: Weights, p: Projector, x: str, fold: bool) -> str:
    """MiniCPM-V 4.6's final 2×2 merger: LayerNorm over 4 neighbours, MLP with erf GELU."""
    _, cat = _gather_merge(g, x, "merge_idx")
    return _norm_mlp(g, w, cat, "mm.input_norm", "mm.up", "mm.down", "gelu_erf", "mm", p.eps, fold)
