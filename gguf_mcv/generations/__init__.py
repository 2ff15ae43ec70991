"""The MiniCPM-V generations, one module each: what every layer needs to know about one.

The catalog's checks, the GGUF header checks, the prompt's think markers, the synthetic
test models and the vision backends read :data:`GENERATIONS`; none keeps its own list.
Adding a generation is a module here, an entry in :data:`GENERATIONS` and its entries in
``models.toml`` (docs/development.md, "Adding a generation").
"""

from __future__ import annotations

from . import o2_6, o4_5, v2_5, v2_6, v4_0, v4_5, v4_6
from .generation import THINK_MARKERS, Generation

#: key -> generation, oldest first
GENERATIONS: dict[str, Generation] = {g.key: g for g in (
    v2_5.GENERATION, v2_6.GENERATION, o2_6.GENERATION, v4_0.GENERATION, v4_5.GENERATION,
    v4_6.GENERATION, v4_6.THINKING, o4_5.GENERATION)}


def chat_templates() -> tuple[str, ...]:
    """The prompt families the generations use."""
    return tuple(dict.fromkeys(g.chat_template for g in GENERATIONS.values()))


def onnx_projectors() -> tuple[str, ...]:
    """The projector types whose vision encoder the ONNX converter builds."""
    return tuple(dict.fromkeys(g.projector_type for g in GENERATIONS.values() if g.onnx_encoder))


def named_by_version() -> dict[int, str]:
    """``clip.minicpmv_version`` -> the release that writes it."""
    return {g.minicpmv_version: g.name for g in GENERATIONS.values() if g.minicpmv_version is not None}


def of_projector(minicpmv_version: int | None, projector_type: str | None) -> Generation | None:
    """The (first) generation whose mmproj says this version, else this versionless projector type."""
    for g in GENERATIONS.values():
        if minicpmv_version is not None and g.minicpmv_version == minicpmv_version:
            return g
    for g in GENERATIONS.values():
        if g.minicpmv_version is None and g.projector_type == projector_type:
            return g
    return None


def text_arch_of(minicpmv_version: int | None, projector_type: str | None) -> str | None:
    """The text architecture a projector was trained with (None: not known here)."""
    g = of_projector(minicpmv_version, projector_type)
    return g.text_arch if g else None


__all__ = ["GENERATIONS", "THINK_MARKERS", "Generation", "chat_templates", "named_by_version", "of_projector",
           "onnx_projectors", "text_arch_of"]
