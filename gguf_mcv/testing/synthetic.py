"""Small random-weight MiniCPM-V models, laid out like the real GGUF files.

No real weights are needed to test loading, projector matching, image slicing,
quant selection or the chat path: :func:`build` writes a text model (F16 source
plus a ladder of quants made by llama.cpp's own quantizer) and an mmproj with the
tensor names, types and metadata of the official GGUFs. The specs (:data:`TINY`,
:data:`GENERATIONS`, :data:`PRESETS`) live in :mod:`.synthetic_specs`, the
vocabularies in :mod:`.synthetic_vocab` and the tensor layouts in
:mod:`.synthetic_tensors`; this module writes, quantizes and caches the files. The
answers are gibberish; the plumbing is real.

Tensors are streamed to disk one at a time (the ``bench`` preset is ~1.3 GB of
F16), each drawn from its own numpy generator seeded by ``(seed, crc32(name))``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from .. import llama_log
from ..errors import ConfigError, EngineError
from .synthetic_specs import (
    BENCH,
    CHAT_TEMPLATE,
    GENERATIONS,
    LADDER,
    PRESETS,
    QUANT_NAMES,
    TINY,
    TOKENIZERS,
    SyntheticSpec,
)
from .synthetic_tensors import SSM_CONV_KERNEL, TensorPlan, fill_tensor, mmproj_tensors, text_tensors
from .synthetic_vocab import spm_vocabulary, vocabulary

#: Bump when the files written for the same spec change, so cached builds are redone.
GENERATOR_VERSION = 1
MANIFEST_NAME = "synthetic-manifest.json"
MMPROJ_NAME = "mmproj-model-f16.gguf"
F16_NAME = "ggml-model-f16.gguf"
_GGML_F16, _GGML_F32 = 1, 0  # general.file_type values

__all__ = ["BENCH", "GENERATIONS", "LADDER", "PRESETS", "TINY", "SyntheticModel", "SyntheticSpec", "build",
           "quant_filename", "quantize", "write_mmproj", "write_text_model"]


@dataclass(frozen=True)
class SyntheticModel:
    """The files of one build: mmproj, the F16 text source and one file per quant."""

    out_dir: Path
    spec: SyntheticSpec
    mmproj: Path
    f16: Path
    quants: dict[str, Path]


# --- writing -----------------------------------------------------------------


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; rename it over ``path`` only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


#: Every byte of a random block is masked to its low 4 bits: as the high byte of an f16
#: (a block's scale) that keeps the scale below 2**-11, as small as a real model's, so
#: activations stay finite. Larger random scales overflow to inf and NaN, which some of
#: ggml's kernels then process up to 2x slower than real weights (measured: Q8_0, Q5_0).
_SAFE_MASK = 0x0F


def _raw_blocks(shape: tuple[int, ...], ggml_type: str, seed: int, name: str) -> np.ndarray:
    """Random bytes laid out as ``ggml_type`` blocks for a (rows, cols) matrix: meaningless
    weights that cost llama.cpp exactly what real ones of that type cost."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    rows, cols = shape
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    raw = np.frombuffer(rng.bytes(rows * (cols // block) * size), np.uint8).reshape(rows, -1)
    return raw & np.uint8(_SAFE_MASK)


def _write_gguf(path: Path, arch: str, add_kv: Callable[[Any], None], plans: list[TensorPlan], seed: int,
                weight_type: str | None = None) -> Path:
    """Write a GGUF file tensor by tensor (never all weights in memory at once).

    With ``weight_type`` (a ggml type name) every 2-D F16 matrix is written as random
    blocks of that type instead (see :func:`write_text_model`).
    """
    import gguf  # lazy: ~0.2 s to import, only to build models

    def raw(shape: tuple[int, ...], dtype: type) -> bool:
        return weight_type is not None and len(shape) == 2 and dtype is np.float16

    with _atomic(Path(path)) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        add_kv(writer)
        for name, shape, dtype, _ in plans:
            if raw(shape, dtype):
                data = _raw_blocks(shape, str(weight_type), seed, name)
                writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes,
                                       raw_dtype=gguf.GGMLQuantizationType[str(weight_type)])
            else:
                writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for plan in plans:
            name, shape, dtype, _ = plan
            writer.write_tensor_data(_raw_blocks(shape, str(weight_type), seed, name) if raw(shape, dtype)
                                     else fill_tensor(plan, seed))
        writer.close()
    return Path(path)


def write_text_model(path: str | os.PathLike[str], spec: SyntheticSpec = TINY, *,
                     weight_type: str | None = None) -> Path:
    """Write the F16 text model (with tokenizer and chat template) to ``path``.

    ``weight_type`` (a ggml type name such as ``"Q5_1"``) writes every weight matrix as
    random blocks of that type instead, in milliseconds and without llama.cpp's
    quantizer: the model then answers nonsense at exactly the speed of that type, which
    is what the speed probe times. Every matrix's row length must be a multiple of the
    type's block size.
    """
    spec.validate()
    if weight_type is not None:
        _check_weight_type(spec, weight_type)

    def add_kv(w: Any) -> None:
        w.add_name(f"{spec.name} synthetic (random weights)")
        w.add_context_length(spec.n_ctx_train)
        w.add_embedding_length(spec.n_embd)
        w.add_block_count(spec.n_layer)
        w.add_feed_forward_length(spec.n_ff)
        w.add_head_count(spec.n_head)
        w.add_head_count_kv(spec.n_head_kv)
        w.add_rope_freq_base(spec.rope_theta)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_file_type(_GGML_F16)
        _add_arch_kv(w, spec)
        _add_tokenizer(w, spec)
        w.add_chat_template(_chat_template(spec))

    return _write_gguf(Path(path), spec.text_arch, add_kv, text_tensors(spec), spec.seed, weight_type)


def _check_weight_type(spec: SyntheticSpec, weight_type: str) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block = GGML_QUANT_SIZES[GGMLQuantizationType[weight_type]][0]
    except KeyError:
        raise ConfigError(f"unknown ggml type {weight_type!r}") from None
    rows = {shape[1] for _, shape, dtype, _ in text_tensors(spec) if len(shape) == 2 and dtype is np.float16}
    if any(n % block for n in rows):
        raise ConfigError(f"{weight_type} packs {block} weights per block: every matrix row "
                          f"({', '.join(map(str, sorted(rows)))} wide here) must be a multiple of it")


def _add_arch_kv(w: Any, spec: SyntheticSpec) -> None:
    """The metadata only some architectures have."""
    arch = spec.text_arch
    if spec.head_dim or arch in ("qwen3", "qwen35"):  # Qwen3 GGUFs always state the head size
        w.add_key_length(spec.head_size)
        w.add_value_length(spec.head_size)
    if arch == "minicpm":
        # MiniCPM4 (llama.cpp LLM_ARCH_MINICPM): scale_emb 12; residual scale_depth / sqrt(layers);
        # logits divided by hidden / dim_model_base (256)
        w.add_float32(f"{arch}.embedding_scale", 12.0)
        w.add_float32(f"{arch}.residual_scale", 1.4 / spec.n_layer**0.5)
        w.add_float32(f"{arch}.logit_scale", spec.n_embd / 256)
    if arch == "qwen35":
        inner = spec.ssm_heads * spec.ssm_head_dim
        rot = spec.head_size // 4  # Qwen3.5: partial_rotary_factor 0.25
        w.add_rope_dimension_count(rot)
        # interleaved M-RoPE sections (t, h, w, -), as Qwen3.5's 11/11/10 of 32 rotary pairs
        half = rot // 2
        w.add_rope_dimension_sections([half - 2 * (half // 3), half // 3, half // 3, 0])
        w.add_ssm_conv_kernel(SSM_CONV_KERNEL)
        w.add_ssm_inner_size(inner)
        w.add_ssm_state_size(spec.ssm_head_dim)
        w.add_ssm_time_step_rank(spec.ssm_heads)
        w.add_ssm_group_count(spec.ssm_heads)
        w.add_uint32(f"{arch}.full_attention_interval", spec.full_attention_interval)


def _add_tokenizer(w: Any, spec: SyntheticSpec) -> None:
    kind = TOKENIZERS[spec.tokenizer]
    if kind.model == "llama":
        tokens, types, scores = spm_vocabulary(spec)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
    else:
        tokens, types, merges = vocabulary(spec)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(kind.pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    # As in Qwen2 GGUFs: BPE's built-in default bos (id 11) would be a byte token.
    w.add_bos_token_id(ids[kind.bos])
    w.add_eos_token_id(ids[kind.eos])
    w.add_pad_token_id(ids[kind.pad])
    w.add_unk_token_id(ids["<unk>"])
    w.add_add_bos_token(kind.add_bos)


def _chat_template(spec: SyntheticSpec) -> str:
    if spec.chat_template == "chatml":
        return CHAT_TEMPLATE
    from ..prompt.templates import FAMILIES  # the same Llama-3 / Qwen3 (enable_thinking) templates

    return FAMILIES[spec.chat_template]


def write_mmproj(path: str | os.PathLike[str], spec: SyntheticSpec = TINY) -> Path:
    """Write the F16 vision projector (SigLIP tower + projector, output width ``spec.n_embd``)."""
    spec.validate()

    def add_kv(w: Any) -> None:
        w.add_name(f"{spec.name} synthetic image encoder (random weights)")
        w.add_description("image encoder for MiniCPM-V")
        w.add_file_type(_GGML_F16)
        w.add_bool("clip.has_text_encoder", False)
        w.add_bool("clip.has_vision_encoder", True)
        w.add_string("clip.projector_type", spec.projector)
        if spec.projector == "resampler":
            w.add_bool("clip.has_minicpmv_projector", True)
            w.add_int32("clip.minicpmv_version", spec.minicpmv_version)
            w.add_uint32("clip.minicpmv_query_num", spec.query_num)
        else:
            # clip.cpp borrows wa_layer_indexes[0] as the merger's insertion block; the
            # merge factor (clip.vision.projector.scale_factor) defaults to 4 (16x fewer tokens)
            w.add_array("clip.vision.wa_layer_indexes", [spec.merger_layer])
            w.add_uint32("clip.vision.projector.scale_factor", 4)
        w.add_bool("clip.use_gelu", True)
        w.add_uint32("clip.vision.image_size", spec.image_size)
        w.add_uint32("clip.vision.patch_size", spec.patch_size)
        w.add_uint32("clip.vision.embedding_length", spec.v_embd)
        w.add_uint32("clip.vision.feed_forward_length", spec.v_ff)
        w.add_uint32("clip.vision.projection_dim", 0)
        w.add_uint32("clip.vision.attention.head_count", spec.v_head)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        w.add_uint32("clip.vision.block_count", spec.v_layer)
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    return _write_gguf(Path(path), "clip", add_kv, mmproj_tensors(spec), spec.seed)


# --- quantizing --------------------------------------------------------------

def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], quant: str, *, verbose: bool = False) -> Path:
    """Quantize a GGUF text model with llama.cpp's own quantizer (``llama_model_quantize``)."""
    name = quant.upper()
    if name not in QUANT_NAMES:
        raise ConfigError(f"unknown quant {quant!r}; choose one of {', '.join(QUANT_NAMES)}")
    import llama_cpp  # lazy: ~0.2 s to import, only to build models

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
    with _atomic(Path(dst)) as tmp, llama_log.shown(verbose):
        rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), ctypes.byref(params))
        if rc != 0:
            raise EngineError(f"llama.cpp failed to quantize {src} to {name} (code {rc}); rerun with verbose=True")
    return Path(dst)


# --- building a ladder -------------------------------------------------------


def quant_filename(quant: str) -> str:
    """File name of a quant in a build folder, as in the real repos: ``ggml-model-Q4_K_M.gguf``."""
    return f"ggml-model-{quant.upper()}.gguf"


def _manifest(spec: SyntheticSpec) -> dict[str, Any]:
    return {"generator": GENERATOR_VERSION, "spec": dataclasses.asdict(spec)}


def _reusable(out_dir: Path, spec: SyntheticSpec) -> dict[str, int]:
    """Names and sizes of files a previous build of the same spec left in ``out_dir``."""
    try:
        recorded = json.loads((out_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict) or {k: recorded.get(k) for k in ("generator", "spec")} != _manifest(spec):
        return {}
    files = recorded.get("files", {})
    return {n: s for n, s in files.items() if (out_dir / n).is_file() and (out_dir / n).stat().st_size == s}


def build(
    out_dir: str | os.PathLike[str],
    spec: SyntheticSpec = TINY,
    quants: Sequence[str] = LADDER,
    *,
    verbose: bool = False,
) -> SyntheticModel:
    """Write (or reuse) the mmproj, the F16 text source and the requested quants in ``out_dir``."""
    spec.validate()
    out, names = Path(out_dir), [q.upper() for q in ([quants] if isinstance(quants, str) else quants)]
    for q in names:
        if q not in QUANT_NAMES:
            raise ConfigError(f"unknown quant {q!r}; choose one of {', '.join(QUANT_NAMES)}")
    have = _reusable(out, spec)
    if not have:  # a stale manifest must not vouch for files being rewritten
        (out / MANIFEST_NAME).unlink(missing_ok=True)
    jobs: list[tuple[str, Callable[[Path], object]]] = [
        (MMPROJ_NAME, lambda p: write_mmproj(p, spec)),
        (F16_NAME, lambda p: write_text_model(p, spec)),
    ]
    jobs += [(quant_filename(q), partial(_quantize_from_f16, out / F16_NAME, quant=q, verbose=verbose))
             for q in names]
    for name, make in jobs:
        if name not in have:
            start = time.perf_counter()
            make(out / name)
            have[name] = (out / name).stat().st_size
            if verbose:
                print(f"wrote {out / name} ({have[name]} bytes, {time.perf_counter() - start:.1f}s)", file=sys.stderr)
            _write_manifest(out, spec, have)
    return SyntheticModel(out, spec, out / MMPROJ_NAME, out / F16_NAME, {q: out / quant_filename(q) for q in names})


def _write_manifest(out_dir: Path, spec: SyntheticSpec, files: dict[str, int]) -> None:
    with _atomic(out_dir / MANIFEST_NAME) as tmp:
        tmp.write_text(json.dumps({**_manifest(spec), "files": dict(sorted(files.items()))}, indent=2) + "\n")


def _quantize_from_f16(f16: Path, out: Path, *, quant: str, verbose: bool) -> None:
    quantize(f16, out, quant, verbose=verbose)
