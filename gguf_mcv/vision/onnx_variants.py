"""Which int8 kernel the ONNX vision encoder runs on this CPU: the candidates, timed and chosen.

The int8 graph's MatMuls can run three ways (``onnx_graph.INT8_KERNELS``): "u8s8"
(DynamicQuantizeMatMul, int8 weights: VNNI's ``vpdpbusd``, else AVX2's saturating
``vpmaddubsw``), "u8u8" (the same with uint8 weights: 16-bit products, no saturation) and
"nbits8" (MatMulNBits at 8 bits, accuracy_level 4: its own blockwise int8 kernels). Which is
fastest depends on the instruction set, so a conversion builds the candidates of this CPU's
class (:func:`cpu_class`, :data:`CANDIDATES`), keeps those whose embeddings pass the check
against fp32, times them against each other in one alternating run (A B A B, a fresh session
each time: one session's weights in memory at a time) and keeps the fastest; its manifest
names the kernel and the CPU class, and a cache made on another class is converted again.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Mapping

import numpy as np

from ..hardware import cpu_flags
from .vision_backends import int8_passes

#: the kernels a conversion tries on each CPU class, the most promising first (the first is
#: the one kept when none can be validated). On AVX-512 VNNI (AMD EPYC, 2026-12-04,
#: tools/bench_vision.py --variants) u8s8 took 1.13 s a slice of the 2.6 bench preset against
#: u8u8's 1.91 s and nbits8's 2.19 s, so VNNI and AMX try u8s8 alone; without VNNI u8s8's
#: pair sums saturate and are the slow path, so all three are tried there (on AVX2 without VNNI,
#: AMD EPYC, 2026-12-07, u8s8 was still the fastest: 7.0 s against u8u8's 8.9 s and nbits8's 15.0 s)
CANDIDATES: dict[str, tuple[str, ...]] = {
    "amx": ("u8s8",),
    "avx512-vnni": ("u8s8",),
    "avx-vnni": ("u8s8",),
    "avx512": ("u8s8", "nbits8", "u8u8"),
    "avx2": ("u8s8", "nbits8", "u8u8"),
    "arm-i8mm": ("u8s8", "nbits8"),
    "arm-dotprod": ("u8s8", "nbits8"),
    "arm-neon": ("u8s8", "nbits8"),
}
#: what a CPU of no known class tries
DEFAULT_CANDIDATES = ("u8s8",)
#: timing rounds of each pair of candidates (A B A B: the faster of each one's runs counts)
ROUNDS = 2


def cpu_class(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """This CPU's class for the int8 kernels, from its feature flags (``hardware.cpu_flags``):
    ``amx``, ``avx512-vnni``, ``avx-vnni``, ``avx512``, ``avx2``, ``arm-i8mm``, ``arm-dotprod``,
    ``arm-neon``, else the machine's name (``x86_64``...) or ``unknown``."""
    flags = cpu_flags() if flags is None else flags
    for cls, needs in (("amx", "amx_int8"), ("avx512-vnni", "avx512_vnni"), ("avx-vnni", "avx_vnni"),
                       ("avx512", "avx512f"), ("avx2", "avx2"), ("arm-i8mm", "i8mm"),
                       ("arm-dotprod", "asimddp"), ("arm-neon", "asimd")):
        if needs in flags:
            return cls
    return (platform.machine() if machine is None else machine).lower() or "unknown"


def candidates(cls: str) -> tuple[str, ...]:
    """The int8 kernels a conversion on a CPU of class ``cls`` tries (:data:`CANDIDATES`)."""
    return CANDIDATES.get(cls, DEFAULT_CANDIDATES)


def time_alternating(runs: Mapping[str, Callable[[], float]], rounds: int = ROUNDS) -> dict[str, float]:
    """Each of ``runs`` (a name → a call that returns the seconds it measured) called in turn,
    ``rounds`` times (A B A B); the fastest of each one's runs."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    times: dict[str, float] = {}
    for _ in range(rounds):
        for name, run in runs.items():
            seconds = float(run())
            times[name] = min(times.get(name, seconds), seconds)
    return times


def better(a: str, b: str, cosines: Mapping[str, float | None], time: Callable[[str, str], dict[str, float]]) -> str:
    """The one of kernels ``a`` and ``b`` to keep: the one whose cosine passes the check when only
    one does; the closer to fp32 when neither does; the faster (``time(a, b)``, seconds each) when
    both do, ``a`` on a tie. A kernel without a cosine (not validated) counts as passing."""
    ok = [cosines.get(k) is None or int8_passes(float(cosines[k])) for k in (a, b)]  # type: ignore[arg-type]
    if ok[0] != ok[1]:
        return a if ok[0] else b
    if not ok[0]:
        return a if float(cosines[a] or 0.0) >= float(cosines[b] or 0.0) else b
    seconds = time(a, b)
    return b if seconds[b] < seconds[a] else a


def symmetric_blocks(w: np.ndarray, qmax: float, block: int) -> tuple[np.ndarray, np.ndarray]:
    """An (in × out) weight as (N × blocks × ``block`` symmetric integers in ±``qmax``, as floats;
    float32 scale per column and block), the input zero-padded to whole blocks."""
    k, n = w.shape
    blocks = -(-k // block)
    padded = np.zeros((blocks * block, n), np.float32)
    padded[:k] = w
    cols = padded.T.reshape(n, blocks, block)
    scale = (np.abs(cols).max(axis=2) / qmax).astype(np.float32)
    scale[scale == 0] = 1.0
    return np.rint(cols / scale[..., None]), scale


def quantize_blocks8(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The "nbits8" kernel's weights: MatMulNBits' 8-bit layout of an (in × out) weight (uint8
    N × blocks × ``block``, stored as q + 128, its default zero point; float32 scale per column
    and block)."""
    q, scale = symmetric_blocks(w, 127.0, block)
    return (np.clip(q, -127, 127) + 128).astype(np.uint8), scale.reshape(-1)
