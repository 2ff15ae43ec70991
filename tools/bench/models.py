"""The model factories: generated models with each generation's real layout and random weights
(:mod:`gguf_mcv.testing.synthetic`), built once per folder and reused."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from gguf_mcv.environment import DEFAULT_QUANT
from gguf_mcv.testing import synthetic


def build(folder: Path, preset: str = "bench", *, quants: list[str] | None = None,
          visible_padding: bool = False, **changes: Any) -> synthetic.SyntheticModel:
    """``synthetic.build`` of a preset's spec (``synthetic.PRESETS``: ``bench`` is SigLIP-400M vision
    with a Qwen2-0.5B-size text model, ``tiny`` the test suite's model) in ``folder``, reused
    when already built there.

    ``visible_padding``: random weights mostly emit padding, which must show as text for streamed
    pieces to be counted (see ``SyntheticSpec.visible_padding``)."""
    if preset not in synthetic.PRESETS:
        raise SystemExit(f"unknown preset {preset!r}: one of {', '.join(synthetic.PRESETS)}")
    spec = replace(synthetic.PRESETS[preset], visible_padding=visible_padding, **changes)
    return synthetic.build(Path(folder), spec, quants=quants or [DEFAULT_QUANT])


def pair(folder: Path, quant: str = DEFAULT_QUANT, preset: str = "bench", *,
         visible_padding: bool = False) -> tuple[Path, Path]:
    """(model, mmproj) of one quant of a preset in ``folder`` (built there if missing)."""
    built = build(folder, preset, quants=[quant], visible_padding=visible_padding)
    return Path(built.quants[quant]), Path(built.mmproj)


def model_files(model: str | None, mmproj: str | None, *, quant: str = DEFAULT_QUANT) -> tuple[Path, Path]:
    """(model, mmproj): the given local files (mmproj default: the one ``mmproj*.gguf`` beside the
    model), else the tiny generated model (built once, in the temp folder)."""
    if model:
        path = Path(model)
        if mmproj:
            return path, Path(mmproj)
        found = sorted(path.parent.glob("mmproj*.gguf"))
        if len(found) != 1:
            raise SystemExit(f"name the projector with --mmproj ({len(found)} mmproj*.gguf beside {path})")
        return path, found[0]
    return pair(Path(tempfile.gettempdir()) / "gguf_mcv_load_model", quant, "tiny")
