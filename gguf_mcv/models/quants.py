"""GGUF quantization types: their names, quality order, bits per weight, and file names.

Pure functions only. The size figures come from ``llama-quantize --help`` (llama.cpp's
``tools/quantize/quantize.cpp``), which describes each type either by its bits per
weight or by the size of Llama-3-8B quantized with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from ..errors import ConfigError

# Worst to best expected quality (llama.cpp's perplexity figures), not strictly by size:
# Q2_K is bigger than IQ3_XXS yet worse. Covers every type the official MiniCPM-V GGUF
# repositories publish, plus the i-quants third parties commonly add.
QUANT_ORDER: tuple[str, ...] = (
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "Q2_K",
    "IQ3_XXS", "IQ3_XS", "Q3_K_S", "IQ3_S", "IQ3_M", "Q3_K_M", "Q3_K_L",
    "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M",
    "Q5_0", "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0",
    "F16", "BF16", "F32",
)

# llama-quantize's table: "Q4_K_M : 4.58G, +0.1754 ppl @ Llama-3-8B" (GiB at 8.03e9 weights).
_LLAMA3_8B_GIB: dict[str, float] = {
    "Q2_K": 2.96, "Q3_K_S": 3.41, "Q3_K_M": 3.74, "Q3_K_L": 4.03,
    "Q4_0": 4.34, "Q4_1": 4.78, "Q4_K_S": 4.37, "Q4_K_M": 4.58,
    "Q5_0": 5.21, "Q5_1": 5.65, "Q5_K_S": 5.21, "Q5_K_M": 5.33, "Q6_K": 6.14, "Q8_0": 7.96,
}
_LLAMA3_8B_PARAMS = 8.03e9
# Types the table gives directly in bits per weight ("IQ4_XS : 4.25 bpw"); floats nominal.
_NOMINAL_BPW: dict[str, float] = {
    "IQ2_XXS": 2.06, "IQ2_XS": 2.31, "IQ2_S": 2.5, "IQ2_M": 2.7,
    "IQ3_XXS": 3.06, "IQ3_XS": 3.3, "IQ3_S": 3.44, "IQ3_M": 3.66,
    "IQ4_XS": 4.25, "IQ4_NL": 4.5, "F16": 16.0, "BF16": 16.0, "F32": 32.0,
}

# Spellings that mean a canonical type: llama-quantize's own aliases ("Q4_K : alias for
# Q4_K_M") and the "fp" spellings some file names use.
QUANT_ALIASES: dict[str, str] = {
    "Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M",
    "FP16": "F16", "FP32": "F32", "BFLOAT16": "BF16",
}

_SHARD = re.compile(r"-(\d{5})-of-(\d{5})$", re.IGNORECASE)
_names = sorted([*QUANT_ORDER, *QUANT_ALIASES], key=len, reverse=True)
# A quant token: not glued to letters/digits on the left; on the right not followed by a
# letter/digit or by "_X" (so Q4_K_L, a third-party mix, is not read as Q4_K).
_QUANT_TOKEN = re.compile(
    r"(?<![A-Za-z0-9])(" + "|".join(_names) + r")(?![A-Za-z0-9]|_[A-Za-z0-9])", re.IGNORECASE
)


def _bpw(name: str) -> float:
    if name in _NOMINAL_BPW:
        return _NOMINAL_BPW[name]
    return _LLAMA3_8B_GIB[name] * 2**30 * 8 / _LLAMA3_8B_PARAMS


#: Approximate bits per weight of a whole file of each type (embeddings included).
BITS_PER_WEIGHT: dict[str, float] = {q: round(_bpw(q), 2) for q in QUANT_ORDER}


def normalize_quant(name: str) -> str:
    """Canonical spelling of a quant (``"q4_k_m"`` -> ``"Q4_K_M"``); ConfigError if unknown."""
    key = str(name).strip().upper().replace("-", "_")
    key = QUANT_ALIASES.get(key, key)
    if key not in BITS_PER_WEIGHT:
        raise ConfigError(f"Unknown quantization {name!r}; known: {', '.join(QUANT_ORDER)}.")
    return key


def is_known_quant(name: str) -> bool:
    """Whether ``name`` (any case, or an alias) is a quantization this module knows."""
    try:
        normalize_quant(name)
    except ConfigError:
        return False
    return True


def quality_rank(name: str) -> int:
    """Position in :data:`QUANT_ORDER`: higher means better quality (and usually bigger)."""
    return QUANT_ORDER.index(normalize_quant(name))


def bits_per_weight(name: str) -> float:
    """Approximate bits per weight of a GGUF file of this quantization."""
    return BITS_PER_WEIGHT[normalize_quant(name)]


def estimate_size(n_params: float, name: str) -> int:
    """Rough file size in bytes of ``n_params`` weights at this quantization."""
    return int(n_params * bits_per_weight(name) / 8)


def sort_by_quality(names: list[str] | tuple[str, ...]) -> list[str]:
    """Canonical names sorted worst to best quality."""
    return sorted((normalize_quant(n) for n in names), key=QUANT_ORDER.index)


@dataclass(frozen=True)
class GgufFileInfo:
    """What a GGUF file's name says about it."""

    path: str  #: the path as given (may include folders)
    filename: str  #: the last path component
    is_mmproj: bool  #: a vision projector rather than a text model
    quant: str | None  #: canonical quant name, or None when the name has none we know
    shard: int | None = None  #: 1-based part number of a split file
    shard_count: int | None = None  #: how many parts the split file has

    @property
    def kind(self) -> str:
        """``"mmproj"`` or ``"model"``."""
        return "mmproj" if self.is_mmproj else "model"

    @property
    def is_sharded(self) -> bool:
        """Whether this is one part of a multi-file (``-00001-of-00003``) GGUF."""
        return self.shard is not None


def quant_from_name(name: str) -> str | None:
    """The canonical quant a file name mentions (the rightmost one), or None."""
    found = _QUANT_TOKEN.findall(name)
    return normalize_quant(found[-1]) if found else None


def classify_gguf(path_in_repo: str) -> GgufFileInfo | None:
    """Read kind, quant and shard numbers from a GGUF path; None if it is not a ``.gguf``.

    Handles ``ggml-model-Q4_K_M.gguf``, ``MiniCPM-V-4_5-Q4_K_M.gguf`` (``4_5`` is a
    version), ``mmproj-model-f16.gguf``, subfolders, lowercase names and
    ``-00001-of-00003`` shards. A name without a known quant gets ``quant=None``.
    """
    filename = PurePosixPath(str(path_in_repo).replace("\\", "/")).name
    if not filename.lower().endswith(".gguf"):
        return None
    stem = filename[: -len(".gguf")]
    shard = _SHARD.search(stem)
    if shard:
        stem = stem[: shard.start()]
    return GgufFileInfo(
        path=str(path_in_repo),
        filename=filename,
        is_mmproj="mmproj" in filename.lower(),
        quant=quant_from_name(stem),
        shard=int(shard.group(1)) if shard else None,
        shard_count=int(shard.group(2)) if shard else None,
    )
