"""Small random-weight MiniCPM-V 2.6 models, laid out like the real GGUF files.

No real weights are needed to test loading, projector matching, image slicing,
quant selection or the chat path: :func:`build` writes a Qwen2 text model (F16
source plus a ladder of quants made by llama.cpp's own quantizer) and a
``resampler`` mmproj with the tensor names, types and metadata of
``openbmb/MiniCPM-V-2_6-gguf``. The answers are gibberish; the plumbing is real.

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

from .errors import ConfigError, EngineError

#: Bump when the files written for the same spec change, so cached builds are redone.
GENERATOR_VERSION = 1
MANIFEST_NAME = "synthetic-manifest.json"
MMPROJ_NAME = "mmproj-model-f16.gguf"
F16_NAME = "ggml-model-f16.gguf"

#: The quant ladder a planner chooses from, smallest file first.
LADDER: tuple[str, ...] = ("Q2_K", "Q3_K_M", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
#: Every quant name :func:`quantize` accepts (``llama_cpp.LLAMA_FTYPE_MOSTLY_<name>``).
QUANT_NAMES: tuple[str, ...] = (
    "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M",
    "Q5_0", "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0",
)  # fmt: skip

#: Control tokens after the BPE vocabulary, in Qwen2 order (``<|endoftext|>`` first).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "</image>",
    "<slice>", "</slice>", "<unk>", "<think>", "</think>",
)  # fmt: skip

#: MiniCPM-V 2.6's own chat template (ChatML with a default system message).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: libmtmd indexes the ViT's learned position table on a fixed 70x70 grid (980 px / 14).
POS_GRID = 70

# Frequent English words (roughly by rank); BPE merges are learnt from them.
_WORDS = """
the of and to in a is that for it as was with be by on not he i this are or his
from at which but have an they you were her she there one all we their been has
when who will more no if out so said what up its about into than them can only
other new some could time these two may then do first any my now such like our
over man me even most made after also did many before must through back years
where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old
year off come since against go came right used take three image picture photo
describe show color red green blue white black small large left top bottom
person people cat dog car tree house text number answer question what where
there is are this that which shows contains looks like scene background front
""".split()

_GGML_F16, _GGML_F32 = 1, 0  # general.file_type values


@dataclass(frozen=True)
class SyntheticSpec:
    """Every shape of a synthetic MiniCPM-V pair; the defaults are the ``tiny`` preset."""

    n_embd: int = 256  # text width = resampler output width (multiple of 128)
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 768
    n_vocab: int = 512
    n_merges: int = 240  # fewer if the built-in word list runs out of pairs
    n_ctx_train: int = 32768
    rope_theta: float = 1_000_000.0
    v_embd: int = 64
    v_layer: int = 2
    v_head: int = 4
    v_ff: int = 160  # must differ from v_embd (libmtmd tells fc1 from fc2 by shape)
    image_size: int = 448
    patch_size: int = 14
    query_num: int = 64
    minicpmv_version: int = 3
    seed: int = 0
    #: padding tokens as visible text ("pad123") instead of unused "[PAD123]": random
    #: weights put most probability on padding, which then detokenizes to nothing and
    #: leaves a streaming benchmark nothing to count
    visible_padding: bool = False

    def validate(self) -> None:
        """Raise ConfigError for shapes llama.cpp or libmtmd would refuse."""
        problems = []
        if self.n_embd % 128:
            problems.append(f"n_embd {self.n_embd} is not a multiple of 128 (resampler head size)")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            problems.append("n_head must divide n_embd and n_head_kv must divide n_head")
        elif (self.n_embd // self.n_head) % 2:
            problems.append("text head size must be even (RoPE)")
        if self.v_embd % self.v_head:
            problems.append("v_head must divide v_embd")
        if self.v_ff == self.v_embd:
            problems.append("v_ff must differ from v_embd")
        if self.image_size % self.patch_size:
            problems.append("image_size must be a multiple of patch_size")
        if self.n_vocab < 256 + len(SPECIAL_TOKENS) + self.n_merges:
            problems.append(f"n_vocab {self.n_vocab} < 256 bytes + {self.n_merges} merges + specials")
        if min(self.n_layer, self.v_layer, self.n_ff, self.query_num, self.n_merges) < 1:
            problems.append("layer counts, n_ff, query_num and n_merges must be positive")
        if problems:
            raise ConfigError("invalid synthetic model spec: " + "; ".join(problems))


TINY = SyntheticSpec()
BENCH = SyntheticSpec(
    n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864, n_vocab=151936, n_merges=1000,
    v_embd=1152, v_layer=27, v_head=16, v_ff=4304,
)  # fmt: skip
PRESETS: dict[str, SyntheticSpec] = {"tiny": TINY, "bench": BENCH}


@dataclass(frozen=True)
class SyntheticModel:
    """The files of one build: mmproj, the F16 text source and one file per quant."""

    out_dir: Path
    spec: SyntheticSpec
    mmproj: Path
    f16: Path
    quants: dict[str, Path]


# --- tokenizer ---------------------------------------------------------------


def byte_tokens() -> list[str]:
    """GPT-2's 256 byte tokens (printable bytes as themselves, the rest shifted to U+0100..)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in printable] + [chars[b] for b in range(256) if b not in printable]


def bpe_merges(n_merges: int) -> list[tuple[str, str]]:
    """Learn up to ``n_merges`` BPE merges from a Zipf-weighted English word list."""
    counts: dict[tuple[str, ...], int] = {}
    for rank, word in enumerate(dict.fromkeys(_WORDS)):
        weight = 40_000 // (rank + 200)  # gently Zipf: rarer words still get whole-word merges
        for form, w in (("Ġ" + word, weight), (word, weight // 4), ("Ġ" + word.title(), weight // 8)):
            counts[tuple(form)] = counts.get(tuple(form), 0) + w + 1
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: dict[tuple[str, str], int] = {}
        for syms, c in counts.items():
            for pair in zip(syms, syms[1:], strict=False):
                pairs[pair] = pairs.get(pair, 0) + c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        counts = {_merge(syms, best): c for syms, c in counts.items()}
    return merges


def _merge(syms: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(syms):
        if i + 1 < len(syms) and (syms[i], syms[i + 1]) == pair:
            out.append(syms[i] + syms[i + 1])
            i += 2
        else:
            out.append(syms[i])
            i += 1
    return tuple(out)


def vocabulary(spec: SyntheticSpec) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merge strings: bytes, merged tokens, specials, ``[PAD{i}]``."""
    import gguf  # lazy: ~0.2 s to import, only to build models

    tokens = byte_tokens()
    merges = bpe_merges(spec.n_merges)
    for a, b in merges:
        if a + b not in tokens[256:]:
            tokens.append(a + b)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    tokens += SPECIAL_TOKENS
    types += [int(gguf.TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    pad = range(len(tokens), spec.n_vocab)
    if spec.visible_padding:
        tokens += [f"\u0120pad{i}" for i in pad]  # "Ġ" is the byte-level BPE space
        types += [int(gguf.TokenType.NORMAL)] * len(pad)
    else:
        tokens += [f"[PAD{i}]" for i in pad]
        types += [int(gguf.TokenType.UNUSED)] * len(pad)
    return tokens, types, [f"{a} {b}" for a, b in merges]


# --- tensors -----------------------------------------------------------------

#: One tensor to write: name, numpy shape (ggml's reversed), dtype, and how to fill it.
_Plan = tuple[str, tuple[int, ...], type, str]


def _linear(name: str, n_out: int, n_in: int, bias: bool = True) -> list[_Plan]:
    plans: list[_Plan] = [(f"{name}.weight", (n_out, n_in), np.float16, "normal")]
    return plans + [(f"{name}.bias", (n_out,), np.float32, "normal")] if bias else plans


def _layer_norm(name: str, n: int) -> list[_Plan]:
    return [(f"{name}.weight", (n,), np.float32, "ones"), (f"{name}.bias", (n,), np.float32, "zeros")]


def text_tensors(spec: SyntheticSpec) -> list[_Plan]:
    """Qwen2 tensors as convert_hf_to_gguf writes them at F16 (1-D tensors stay F32)."""
    d, kv = spec.n_embd, spec.n_embd // spec.n_head * spec.n_head_kv
    plans: list[_Plan] = [("token_embd.weight", (spec.n_vocab, d), np.float16, "normal")]
    for i in range(spec.n_layer):
        b = f"blk.{i}"
        plans += [(f"{b}.attn_norm.weight", (d,), np.float32, "ones")]
        plans += _linear(f"{b}.attn_q", d, d) + _linear(f"{b}.attn_k", kv, d) + _linear(f"{b}.attn_v", kv, d)
        plans += _linear(f"{b}.attn_output", d, d, bias=False)
        plans += [(f"{b}.ffn_norm.weight", (d,), np.float32, "ones")]
        plans += _linear(f"{b}.ffn_gate", spec.n_ff, d, bias=False)
        plans += _linear(f"{b}.ffn_up", spec.n_ff, d, bias=False)
        plans += _linear(f"{b}.ffn_down", d, spec.n_ff, bias=False)
    return plans + [
        ("output_norm.weight", (d,), np.float32, "ones"),
        ("output.weight", (spec.n_vocab, d), np.float16, "normal"),
    ]


def mmproj_tensors(spec: SyntheticSpec) -> list[_Plan]:
    """Resampler + SigLIP tensors as the MiniCPM-V converter writes them (2-D weights F16)."""
    d, dv, n_pos = spec.n_embd, spec.v_embd, POS_GRID * POS_GRID
    plans: list[_Plan] = [
        ("resampler.pos_embed_k", (n_pos, d), np.float32, "sincos"),
        ("resampler.query", (spec.query_num, d), np.float32, "normal"),
        ("resampler.proj.weight", (d, d), np.float16, "normal"),
        ("resampler.kv.weight", (d, dv), np.float16, "normal"),
    ]
    for part in ("q", "k", "v", "out"):
        plans += _linear(f"resampler.attn.{part}", d, d)
    for part in ("q", "kv", "post"):
        plans += _layer_norm(f"resampler.ln_{part}", d)
    p = spec.patch_size
    # The converter always writes the conv kernel F16 (ggml's conv once had no F32 kernel).
    plans += [("v.patch_embd.weight", (dv, 3, p, p), np.float16, "normal")]
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


def _sincos_2d(dim: int, grid: int) -> np.ndarray:
    """MAE-style 2-D sin/cos table, (grid*grid, dim): what the converter stores as pos_embed_k."""
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))
    h, w = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))
    halves = [np.outer(pos.reshape(-1), omega) for pos in (h, w)]
    return np.concatenate([f(x) for x in halves for f in (np.sin, np.cos)], axis=1)


def _fill(plan: _Plan, seed: int) -> np.ndarray:
    """Materialise one tensor: each from its own generator, so shapes elsewhere don't shift it."""
    name, shape, dtype, kind = plan
    if kind == "ones":
        return np.ones(shape, dtype)
    if kind == "zeros":
        return np.zeros(shape, dtype)
    if kind == "sincos":
        return _sincos_2d(shape[1], POS_GRID).astype(dtype)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape, np.float32) * np.float32(0.02)).astype(dtype)


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


def _write_gguf(path: Path, arch: str, add_kv: Callable[[Any], None], plans: list[_Plan], seed: int) -> Path:
    """Write a GGUF file tensor by tensor (never all weights in memory at once)."""
    import gguf  # lazy: ~0.2 s to import, only to build models

    with _atomic(Path(path)) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        add_kv(writer)
        for name, shape, dtype, _ in plans:
            writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for plan in plans:
            writer.write_tensor_data(_fill(plan, seed))
        writer.close()
    return Path(path)


def write_text_model(path: str | os.PathLike[str], spec: SyntheticSpec = TINY) -> Path:
    """Write the F16 Qwen2 text model (with tokenizer and chat template) to ``path``."""
    spec.validate()
    tokens, types, merges = vocabulary(spec)
    ids = {t: i for i, t in enumerate(tokens)}

    def add_kv(w: Any) -> None:
        w.add_name("MiniCPM-V 2.6 synthetic (random weights)")
        w.add_context_length(spec.n_ctx_train)
        w.add_embedding_length(spec.n_embd)
        w.add_block_count(spec.n_layer)
        w.add_feed_forward_length(spec.n_ff)
        w.add_head_count(spec.n_head)
        w.add_head_count_kv(spec.n_head_kv)
        w.add_rope_freq_base(spec.rope_theta)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_file_type(_GGML_F16)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        # As in Qwen2 GGUFs: BPE's built-in default bos (id 11) would be a byte token.
        w.add_bos_token_id(ids["<|endoftext|>"])
        w.add_eos_token_id(ids["<|im_end|>"])
        w.add_pad_token_id(ids["<|endoftext|>"])
        w.add_unk_token_id(ids["<unk>"])
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)

    return _write_gguf(Path(path), "qwen2", add_kv, text_tensors(spec), spec.seed)


def write_mmproj(path: str | os.PathLike[str], spec: SyntheticSpec = TINY) -> Path:
    """Write the F16 vision projector (SigLIP tower + resampler, output width ``spec.n_embd``)."""
    spec.validate()

    def add_kv(w: Any) -> None:
        w.add_name("MiniCPM-V 2.6 synthetic image encoder (random weights)")
        w.add_description("image encoder for MiniCPM-V")
        w.add_file_type(_GGML_F16)
        w.add_bool("clip.has_text_encoder", False)
        w.add_bool("clip.has_vision_encoder", True)
        w.add_bool("clip.has_minicpmv_projector", True)
        w.add_string("clip.projector_type", "resampler")
        w.add_int32("clip.minicpmv_version", spec.minicpmv_version)
        w.add_uint32("clip.minicpmv_query_num", spec.query_num)
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

_silent_log: Any = None  # the no-op C callback; kept referenced while llama.cpp may call it


@contextlib.contextmanager
def llama_logs(verbose: bool) -> Iterator[None]:
    """Silence llama.cpp/ggml logging for the block unless ``verbose``, then restore it."""
    import llama_cpp  # lazy: ~0.2 s to import, only to build models

    global _silent_log
    if verbose:
        yield
        return
    if _silent_log is None:
        _silent_log = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    old_cb, old_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(old_cb), ctypes.byref(old_data))
    llama_cpp.llama_log_set(_silent_log, ctypes.c_void_p(0))
    try:
        yield
    finally:
        llama_cpp.llama_log_set(old_cb, old_data)


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], quant: str, *, verbose: bool = False) -> Path:
    """Quantize a GGUF text model with llama.cpp's own quantizer (``llama_model_quantize``)."""
    name = quant.upper()
    if name not in QUANT_NAMES:
        raise ConfigError(f"unknown quant {quant!r}; choose one of {', '.join(QUANT_NAMES)}")
    import llama_cpp  # lazy: ~0.2 s to import, only to build models

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
    with _atomic(Path(dst)) as tmp, llama_logs(verbose):
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
