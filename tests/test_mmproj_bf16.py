"""The BF16 copy of an mmproj for libmtmd: which tensors change, when ``auto`` makes one, that
libmtmd loads it with embeddings close to F16's, and the cache (reused, damaged or
interrupted copies rebuilt, concurrent loads converting once, disk checked, bad input)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import damage as damages  # tests/ is on sys.path
import numpy as np
import pytest
from damage import run_child

import gguf_mcv
from gguf_mcv.errors import ConfigError, CorruptModelError, NotEnoughDiskError
from gguf_mcv.runtime.engine import file_identity
from gguf_mcv.vision import mmproj_bf16
from gguf_mcv.vision.embed_cache import EmbeddingCache
from gguf_mcv.vision.media import Image
from gguf_mcv.vision.mmproj_bf16 import AUTO_MIN_BYTES, CPU_FLAG, choose, prepare, write_bf16_copy
from gguf_mcv.vision.onnx_vision import token_cosines

gguf = pytest.importorskip("gguf")

BIG = AUTO_MIN_BYTES


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "mmproj"


# --- when (pure) ---------------------------------------------------------------------------


def test_auto_copies_only_for_libmtmd_on_a_bf16_cpu_and_a_big_f16_mmproj() -> None:
    flags = frozenset({"avx512f", CPU_FLAG})
    kw = dict(backend="llama.cpp", vision_gpu=False, cpu_flags=flags, f16_blocks=lambda: True, size=BIG)
    assert choose("auto", **kw) == (True, f"bf16 (auto: the CPU has {CPU_FLAG})")
    assert choose("auto", **{**kw, "cpu_flags": frozenset({"avx512f"})})[0] is False
    assert choose("auto", **{**kw, "vision_gpu": True}) == (False, "as-is (the encoder runs on the GPU)")
    assert choose("auto", **{**kw, "size": BIG - 1})[0] is False
    assert choose("auto", **{**kw, "f16_blocks": lambda: False})[0] is False

    def unread() -> bool:
        raise AssertionError("the mmproj's tensors were read for a decision that did not need them")

    for no in ({"vision_gpu": True}, {"cpu_flags": frozenset()}, {"size": BIG - 1}, {"backend": "onnx-fp32"}):
        assert choose("auto", **{**kw, **no, "f16_blocks": unread})[0] is False
    assert choose("auto", **{**kw, "backend": "onnx-int8"}) == (False, "as-is (onnx-int8 encodes)")
    assert choose("as-is", **kw) == (False, "as-is")
    # asked for: whatever the CPU and size, as long as there is something to convert
    assert choose("bf16", **{**kw, "cpu_flags": frozenset(), "size": 1}) == (True, "bf16 (asked for)")
    assert choose("bf16", **{**kw, "f16_blocks": lambda: False})[0] is False


@pytest.mark.parametrize("value", ["BF16", "f16", "", None, 16])
def test_a_wrong_precision_is_refused_before_loading(tiny, value) -> None:
    with pytest.raises(ConfigError, match="mmproj_precision"):
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, mmproj_precision=value)


def test_bf16_with_an_onnx_backend_is_refused(tiny) -> None:
    with pytest.raises(ConfigError, match="llama.cpp vision backend"):
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, vision_backend="onnx-fp32",
                      mmproj_precision="bf16")


# --- the copy --------------------------------------------------------------------------------


def test_the_copy_converts_the_block_matrices_and_keeps_everything_else(tiny, tmp_path: Path) -> None:
    out = tmp_path / "bf16.gguf"
    n = write_bf16_copy(tiny.mmproj, out)
    src, dst = gguf.GGUFReader(str(tiny.mmproj)), gguf.GGUFReader(str(out))
    assert {k: f.contents() for k, f in src.fields.items() if not k.startswith("GGUF.")} == \
           {k: f.contents() for k, f in dst.fields.items() if not k.startswith("GGUF.")}
    changed = 0
    for a, b in zip(src.tensors, dst.tensors, strict=True):
        assert a.name == b.name and a.shape.tolist() == b.shape.tolist()
        x = gguf.quants.dequantize(a.data, a.tensor_type)
        y = gguf.quants.dequantize(b.data, b.tensor_type)
        if mmproj_bf16.BLOCK_WEIGHT.match(a.name):
            assert b.tensor_type == gguf.GGMLQuantizationType.BF16
            np.testing.assert_allclose(y, x, rtol=2**-8, atol=1e-30)  # bf16: 8 significant bits
            changed += 1
        else:
            assert b.tensor_type == a.tensor_type and np.array_equal(x, y)
    assert changed == n == 6 * tiny.spec.v_layer
    assert not mmproj_bf16.has_f16_blocks(out) and mmproj_bf16.has_f16_blocks(tiny.mmproj)


def test_a_damaged_mmproj_is_a_corrupt_model_error(tmp_path: Path, cache: Path) -> None:
    bad = tmp_path / "mmproj.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(CorruptModelError, match="download it again"):
        prepare(bad, "bad")
    assert not list(cache.glob("*.gguf")) and not list(cache.glob("*.json"))


# --- the cache -------------------------------------------------------------------------------


def test_the_copy_is_cached_and_a_damaged_one_rebuilt(tiny, cache: Path) -> None:
    first = prepare(tiny.mmproj, "id1")
    assert first.convert_s > 0 and first.path.parent == cache and first.converted > 0
    again = prepare(tiny.mmproj, "id1")
    assert again.path == first.path and again.convert_s == 0.0
    good = first.path.read_bytes()
    for damage in (lambda b: b[:-100], lambda b: b[:5000] + bytes([b[5000] ^ 0xFF]) + b[5001:]):
        first.path.write_bytes(damage(good))
        rebuilt = prepare(tiny.mmproj, "id1")
        assert rebuilt.convert_s > 0 and rebuilt.path.read_bytes() == good
    (cache / "id1-bf16.json").write_text("{not json")
    assert prepare(tiny.mmproj, "id1").convert_s > 0
    assert json.loads((cache / "id1-bf16.json").read_text())["sha256"]


def test_an_interrupted_copy_leaves_nothing_that_is_used(tiny, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def dies(src, out):
        Path(out).write_bytes(b"GGUF half")
        raise KeyboardInterrupt

    monkeypatch.setattr(mmproj_bf16, "write_bf16_copy", dies)
    with pytest.raises(KeyboardInterrupt):
        prepare(tiny.mmproj, "id2")
    assert not list(cache.glob("id2-bf16.gguf*")) and not (cache / "id2-bf16.json").exists()
    assert not [p for p in cache.iterdir() if p.name.endswith(".part")]
    monkeypatch.undo()
    monkeypatch.setenv("GGUF_MCV_CACHE", str(cache.parent))
    assert prepare(tiny.mmproj, "id2").convert_s > 0


def test_concurrent_prepares_convert_once(tiny, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = mmproj_bf16.write_bf16_copy
    monkeypatch.setattr(mmproj_bf16, "write_bf16_copy", lambda s, o: calls.append(o) or real(s, o))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(prepare(tiny.mmproj, "id3"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({r.path for r in results}) == 1 and len(results) == 4


def test_too_little_disk_is_refused_before_writing(tiny, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    with pytest.raises(NotEnoughDiskError, match="mmproj_precision='as-is'"):
        prepare(tiny.mmproj, "id4")
    assert not list(cache.glob("*.gguf"))


# --- through libmtmd -------------------------------------------------------------------------


def test_libmtmd_encodes_with_the_copy_close_to_f16(tiny) -> None:
    pytest.importorskip("llama_cpp")
    rgb = np.random.default_rng(5).integers(0, 256, (700, 1000, 3), dtype=np.uint8)
    image = Image(rgb, "random")
    embeddings = {}
    for precision in ("as-is", "bf16"):
        with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096, n_threads=2,
                           vision_backend="llama.cpp", mmproj_precision=precision,
                           embed_cache=EmbeddingCache()) as model:
            engine = model.engine
            note = "bf16 (asked for)" if precision == "bf16" else "as-is"
            assert model.info.vision_backend_reason.endswith(f"mmproj {note}")
            assert (engine.mmproj_path != str(tiny.mmproj)) == (precision == "bf16")
            with engine.tokenize(engine.marker, [image]) as prompt:
                embeddings[precision] = [engine._encode(c, prompt.units[i]).reshape(-1, engine.n_embd)
                                         for i, c in prompt.image_chunks()]
            reply = model.ask("Describe.", rgb, max_tokens=2, temperature=0)
            assert reply.timings.slices_from_cache == len(embeddings[precision]) == 5
    for a, b in zip(embeddings["as-is"], embeddings["bf16"], strict=True):
        assert not np.array_equal(a, b)  # the copy is what libmtmd ran
        assert token_cosines(a, b).min() >= 0.999
    assert file_identity(tiny.mmproj)  # the source is untouched (still readable)


def test_a_retuned_projector_gets_its_own_copy_known_without_a_second_hash(tiny, retuned_mmproj: Path, cache: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from gguf_mcv.models import identity

    original = prepare(tiny.mmproj, file_identity(tiny.mmproj))
    own = prepare(retuned_mmproj, file_identity(retuned_mmproj))
    assert own.convert_s > 0 and own.path != original.path
    assert own.path.read_bytes() != original.path.read_bytes()

    def refuse(f):
        raise AssertionError("the copy was hashed again")

    monkeypatch.setattr(identity, "_sha256", refuse)  # the engine's key for it comes from the manifest's digest
    manifest = json.loads(own.path.with_suffix(".json").read_text())
    assert file_identity(own.path) == manifest["sha256"]


# --- a damaged cache folder: made again with one warning, never a signal or an abort -----------

_PREPARE_AFTER_DAMAGE = """
from gguf_mcv.vision import mmproj_bf16
from gguf_mcv.models.headers import read_projector_header
got = mmproj_bf16.prepare(sys.argv[1], "dmg")
RESULT["hit"] = got.convert_s == 0.0
a, b = read_projector_header(got.path), read_projector_header(sys.argv[1])
RESULT["wrong"] = (a.shape, a.n_embd_out) != (b.shape, b.n_embd_out)
RESULT["after"] = mmproj_bf16.prepare(sys.argv[1], "dmg").convert_s == 0.0
"""


@pytest.fixture(scope="module")
def good_copy(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GGUF_MCV_CACHE", str(tmp_path_factory.mktemp("bf16-good")))
        return prepare(tiny.mmproj, "dmg").path.parent


def _copy_of(good: Path, cache: Path) -> Path:
    import shutil

    shutil.copytree(good, cache, symlinks=True)
    return cache


@pytest.mark.parametrize("target", ["manifest", "copy"])
@pytest.mark.parametrize("damage", damages.DAMAGES, ids=lambda f: f.__name__)
def test_a_damaged_copy_is_made_again_with_one_warning_in_a_child(tiny, good_copy, cache, damage, target) -> None:
    folder = _copy_of(good_copy, cache)
    manifest, copy = folder / "dmg-bf16.json", folder / "dmg-bf16.gguf"
    harmed = manifest if target == "manifest" else copy
    damage(harmed, copy if target == "manifest" else manifest)
    result = run_child(_PREPARE_AFTER_DAMAGE, str(tiny.mmproj), timeout=300)
    assert not result["wrong"] and result["after"], result
    if damage.__name__ == "unreadable":  # root reads mode 000
        assert result["hit"] and not result["warnings"], result
    else:
        assert not result["hit"] and len(result["warnings"]) == 1, result


def test_a_planted_copy_with_impossible_header_values_is_never_loaded(tiny, good_copy, cache, caplog) -> None:
    from gguf_mcv import cache_files
    from gguf_mcv.vision.mmproj_standin import copy_metadata

    folder = _copy_of(good_copy, cache)
    copy = folder / "dmg-bf16.gguf"
    # the copy rewritten with a vision block count llama.cpp asserts on (GGML_ASSERT: exit 134)
    reader = gguf.GGUFReader(str(copy))
    writer = gguf.GGUFWriter(str(folder / "planted.gguf"), "clip")
    copy_metadata(reader, writer)
    writer.add_uint32("clip.vision.block_count", 100_000)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(np.asarray(t.data))
    writer.close()
    del reader
    (folder / "planted.gguf").replace(copy)
    m = json.loads((folder / "dmg-bf16.json").read_text())
    m.update(size=copy.stat().st_size, sha256=mmproj_bf16.sha256_file(copy))
    m["digest"] = cache_files.digest_of(m)  # a manifest that vouches for it
    (folder / "dmg-bf16.json").write_text(json.dumps(m))
    with caplog.at_level("WARNING"):
        again = prepare(tiny.mmproj, "dmg")
    assert again.convert_s > 0 and "unusable" in caplog.text
    mmproj_bf16.read_projector_header(again.path)  # the rebuilt copy's header passes the checks


@pytest.mark.parametrize("edit", ["file_absolute", "file_dotdot", "converted_a_string", "size_a_list"])
def test_an_edited_manifest_is_never_trusted(tiny, good_copy, cache, edit) -> None:
    from gguf_mcv import cache_files

    folder = _copy_of(good_copy, cache)
    m = json.loads((folder / "dmg-bf16.json").read_text())
    m.update({"file_absolute": {"file": str(folder / "dmg-bf16.gguf")},
              "file_dotdot": {"file": "../mmproj/dmg-bf16.gguf"},
              "converted_a_string": {"converted": "many"}, "size_a_list": {"size": [1]}}[edit])
    m["digest"] = cache_files.digest_of(m)
    (folder / "dmg-bf16.json").write_text(json.dumps(m))
    assert prepare(tiny.mmproj, "dmg").convert_s > 0


def test_a_killed_copys_temporary_files_are_removed_by_the_next(tiny, good_copy, cache) -> None:
    folder = _copy_of(good_copy, cache)
    left = [folder / ".dmg-bf16-abcd_123.part", folder / ".dmg-bf16-zz99xx00.json.part", folder / "dmg-bf16.json.part",
            folder / ".other-bf16-k1ll3d00.part"]
    for p in left:
        p.write_bytes(bytes(2**20))
    kept = folder / "notes.part.txt"
    kept.write_text("the user's")
    assert prepare(tiny.mmproj, "dmg").convert_s == 0.0
    assert not any(p.exists() for p in left) and kept.read_text() == "the user's"
