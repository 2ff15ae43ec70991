"""The stand-in mmproj: the same metadata and tensor names, a few bytes of weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from gguf_mcv.errors import CorruptModelError
from gguf_mcv.headers import read_fields
from gguf_mcv.mmproj_standin import write_standin

gguf = pytest.importorskip("gguf")


def test_standin_keeps_metadata_names_and_output_width(tiny, tmp_path: Path) -> None:
    out = write_standin(tiny.mmproj, tmp_path / "standin.gguf")
    assert out.stat().st_size < 64 * 1024 < tiny.mmproj.stat().st_size
    real_fields, real_shapes = read_fields(tiny.mmproj)
    fields, shapes = read_fields(out)
    assert {k: v for k, v in fields.items() if not k.startswith("GGUF.")} == \
           {k: v for k, v in real_fields.items() if not k.startswith("GGUF.")}
    assert set(shapes) == set(real_shapes)
    assert shapes["resampler.proj.weight"][-1] == real_shapes["resampler.proj.weight"][-1]  # ggml ne[0]
    assert not list(tmp_path.glob("*.part"))


def test_a_damaged_mmproj_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "mmproj.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(CorruptModelError, match="download it again"):
        write_standin(bad, tmp_path / "standin.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mmproj.gguf"]
