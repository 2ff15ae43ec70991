"""The stand-in mmproj: the same metadata and tensor names, a few bytes of weights."""

from __future__ import annotations

from pathlib import Path

import damage as damages  # tests/ is on sys.path
import pytest
from damage import run_child

from gguf_mcv.errors import CorruptModelError
from gguf_mcv.models.headers import read_fields
from gguf_mcv.vision.mmproj_standin import write_standin

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


def test_an_identical_standin_keeps_its_inode_and_a_damaged_one_is_replaced(tiny, tmp_path: Path) -> None:
    # a model loaded from the stand-in watches its inode (runtime/file_watch): the next load must
    # not replace it with the same bytes, or every model loaded before would refuse to answer
    out = write_standin(tiny.mmproj, tmp_path / "standin.gguf")
    first, whole = out.stat(), out.read_bytes()
    write_standin(tiny.mmproj, out)
    assert (out.stat().st_ino, out.stat().st_ctime_ns) == (first.st_ino, first.st_ctime_ns)
    out.write_bytes(whole[: len(whole) // 2])
    write_standin(tiny.mmproj, out)
    assert out.read_bytes() == whole
    assert not list(tmp_path.glob("*.part"))


def test_a_damaged_mmproj_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "mmproj.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(CorruptModelError, match="download it again"):
        write_standin(bad, tmp_path / "standin.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mmproj.gguf"]


_STANDIN_AFTER_DAMAGE = """
from gguf_mcv.vision import onnx_vision
from gguf_mcv.models.headers import read_fields
out = onnx_vision.standin(sys.argv[1], "dmg")
RESULT["wrong"] = read_fields(out)[0] != read_fields(sys.argv[1])[0]
RESULT["regular"] = out.is_file() and not out.is_symlink()
"""


@pytest.mark.parametrize("damage", damages.DAMAGES, ids=lambda f: f.__name__)
def test_a_damaged_standin_is_written_again_in_a_child(tiny, tmp_path: Path, monkeypatch, damage) -> None:
    from gguf_mcv.vision import onnx_vision

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path / "cache"))
    out = onnx_vision.standin(tiny.mmproj, "dmg")
    other = out.with_name("other.gguf")
    other.write_bytes(b"GGUF not really")
    damage(out, other)
    result = run_child(_STANDIN_AFTER_DAMAGE, str(tiny.mmproj), timeout=60)
    assert not result["wrong"] and result["regular"], result
    assert len(result["warnings"]) == (1 if damage.__name__ == "directory" else 0), result  # set aside
    outside = out.parent.parent / f"outside-{out.name}"
    assert not outside.exists() or read_fields(outside)[0] == read_fields(tiny.mmproj)[0]  # left alone


def test_a_killed_writers_temporary_file_is_removed_by_the_next(tiny, tmp_path: Path, monkeypatch) -> None:
    from gguf_mcv.vision import onnx_vision

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path / "cache"))
    out = onnx_vision.standin(tiny.mmproj, "dmg")
    left = out.with_name(f".{out.name}-k1ll3d00.part")
    left.write_bytes(b"half a stand-in")
    onnx_vision.standin(tiny.mmproj, "dmg")
    assert not left.exists() and not list(out.parent.glob(".*.part"))
