"""The ONNX vision backend end to end on the tiny model: conversion cache (atomic, validated,
rebuilt when damaged), int8 self-validation, the backend choice, no double loading (the
stand-in mmproj), cache keys per backend, threads, and hostile inputs."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import damage as damage_mod  # tests/ is on sys.path
import numpy as np
import pytest

import gguf_mcv
from gguf_mcv.errors import ConfigError, EngineError, NotEnoughDiskError
from gguf_mcv.runtime.engine import file_identity
from gguf_mcv.vision import onnx_vision
from gguf_mcv.vision.embed_cache import EmbeddingCache
from gguf_mcv.vision.media import Image
from gguf_mcv.vision.onnx_vision import INT8_MIN_COSINE, choose_backend, prepare

pytest.importorskip("onnxruntime")
pytest.importorskip("llama_cpp")


def picture(seed: int, size: tuple[int, int]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def converted(tiny):
    return prepare(tiny.mmproj, file_identity(tiny.mmproj))  # into the session's private cache (conftest)


def _load(tiny, backend: str, cache: EmbeddingCache | None = None, **kw):
    return gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096, n_threads=2,
                         vision_backend=backend, embed_cache=cache if cache is not None else EmbeddingCache(), **kw)


# --- the backend choice (pure) ----------------------------------------------------------


def test_auto_takes_int8_on_a_cpu_and_llama_cpp_otherwise() -> None:
    assert choose_backend("auto", vision_gpu=False, projector_type="resampler", ort_version="1.32.0")[0] == "onnx-int8"
    backend, reason = choose_backend("auto", vision_gpu=True, projector_type="resampler", ort_version="1.32.0")
    assert backend == "llama.cpp" and "GPU" in reason
    backend, reason = choose_backend("auto", vision_gpu=False, projector_type="resampler", ort_version=None)
    assert backend == "llama.cpp" and "onnxruntime is not installed" in reason
    backend, reason = choose_backend("auto", vision_gpu=False, projector_type="mlp", ort_version="1.32.0")
    assert backend == "llama.cpp" and "'mlp'" in reason
    assert choose_backend("auto", vision_gpu=False, projector_type="minicpmv4_6", ort_version="1")[0] == "onnx-int8"
    assert choose_backend("llama.cpp", vision_gpu=False, projector_type="resampler", ort_version=None)[0] == "llama.cpp"


def test_an_onnx_backend_that_cannot_run_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="onnxruntime is not installed"):
        choose_backend("onnx-int8", vision_gpu=False, projector_type="resampler", ort_version=None)
    with pytest.raises(ConfigError, match="'mlp'"):
        choose_backend("onnx-fp32", vision_gpu=False, projector_type="mlp", ort_version="1.32.0")


@pytest.mark.parametrize("value", ["onnx", "ONNX-INT8", "", None, 3, "llama"])
def test_a_wrong_vision_backend_is_refused_before_loading(tiny, value) -> None:
    with pytest.raises(ConfigError, match="vision_backend"):
        _load(tiny, value)


def test_onnx_with_vision_gpu_is_refused(tiny) -> None:
    with pytest.raises(ConfigError, match="runs on the CPU"):
        _load(tiny, "onnx-int8", vision_gpu=True)


def test_auto_without_onnxruntime_falls_back_and_says_why(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onnx_vision, "onnxruntime_version", lambda: None)
    with _load(tiny, "auto") as model:
        assert model.info.vision_backend == "llama.cpp"
        assert "onnxruntime is not installed" in model.info.vision_backend_reason


# --- conversion cache -------------------------------------------------------------------


def test_conversion_is_cached_and_validated(tiny, converted) -> None:
    assert converted.fp32.is_file() and converted.int8.is_file()
    assert converted.int8_cosine >= INT8_MIN_COSINE and converted.int8_ok
    again = prepare(tiny.mmproj, file_identity(tiny.mmproj))
    assert again.convert_s == 0.0 and again.int8 == converted.int8  # from the cache
    manifest = json.loads(next(converted.fp32.parent.glob(f"{file_identity(tiny.mmproj)}-*.json")).read_text())
    assert manifest["threshold"] == INT8_MIN_COSINE and len(manifest["files"]) == 4  # 2 graphs + 2 data files


@pytest.mark.parametrize("damage", ["truncate-and-flip", "manifest"])
def test_a_damaged_cache_is_rebuilt_not_used(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             damage: str) -> None:
    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    identity = file_identity(tiny.mmproj)
    first = prepare(tiny.mmproj, identity)
    data = first.int8.with_name(first.int8.name + ".data")
    if damage == "truncate-and-flip":  # one byte changed in the middle, another file cut short
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        first.fp32.write_bytes(first.fp32.read_bytes()[:-10])
    else:
        next(tmp_path.glob("onnx/*.json")).write_text("{not json")
    second = prepare(tiny.mmproj, identity)
    assert second.convert_s > 0  # converted again
    assert prepare(tiny.mmproj, identity).convert_s == 0.0


@pytest.mark.parametrize("fault", ["SIGKILL", "KeyboardInterrupt", "EngineError"])
def test_an_interrupted_conversion_leaves_nothing_that_is_used(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               fault: str) -> None:
    """The converting child killed (as by the OOM killer), interrupted or failing after it wrote
    the graphs: a clear error here, nothing cached, no temporary folder; the next call converts."""
    from gguf_mcv.vision import onnx_child

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    monkeypatch.setenv(onnx_child.ENV_FAULT, fault)
    expected = {"SIGKILL": pytest.raises(EngineError, match="SIGKILL"),
                "KeyboardInterrupt": pytest.raises(KeyboardInterrupt),
                "EngineError": pytest.raises(EngineError, match=onnx_child.ENV_FAULT)}[fault]
    with expected:
        prepare(tiny.mmproj, file_identity(tiny.mmproj))
    assert not list(tmp_path.glob("onnx/*.json")) and not list(tmp_path.glob("onnx/*.onnx"))
    assert not [p for p in tmp_path.glob("onnx/.*") if p.is_dir()]  # no temporary folder left
    monkeypatch.delenv(onnx_child.ENV_FAULT)
    assert prepare(tiny.mmproj, file_identity(tiny.mmproj)).convert_s > 0


def test_auto_falls_back_to_llama_cpp_when_the_converting_child_cannot_write(tiny, tmp_path, monkeypatch) -> None:
    """An OSError in the child (the cache cannot be written) is an OSError here: ``auto`` falls
    back to libmtmd as when the conversion ran in this process."""
    from gguf_mcv.vision import onnx_child

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    monkeypatch.setenv(onnx_child.ENV_FAULT, "OSError")
    with _load(tiny, "auto") as model:
        assert model.info.vision_backend == "llama.cpp"
        assert "ONNX conversion cannot be made" in model.info.vision_backend_reason
    with pytest.raises(OSError, match=onnx_child.ENV_FAULT):
        _load(tiny, "onnx-int8")


def test_the_converting_process_never_imports_onnx(tiny, tmp_path: Path) -> None:
    import subprocess
    import sys

    child = ("import sys; from gguf_mcv.vision import onnx_vision; from gguf_mcv.runtime.engine import file_identity; "
             "c = onnx_vision.prepare(sys.argv[1], file_identity(sys.argv[1])); "
             "print(c.convert_s > 0, 'onnx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", child, str(tiny.mmproj)], capture_output=True, text=True,
                         timeout=300, check=True, env={**os.environ, "GGUF_MCV_CACHE": str(tmp_path)})
    assert out.stdout.strip().splitlines()[-1] == "True False"


def test_concurrent_loads_convert_once(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(prepare(tiny.mmproj, file_identity(tiny.mmproj))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and sum(r.convert_s > 0 for r in results) == 1


def test_int8_below_the_threshold_makes_auto_use_fp32(tiny, converted, monkeypatch: pytest.MonkeyPatch) -> None:
    poor = onnx_vision.Converted(converted.fp32, converted.int8, converted.projector, 0.97, 0.0)
    monkeypatch.setattr(onnx_vision, "prepare", lambda *a, **k: poor)
    # the plan reads the cached conversion's check too (the vision setup is decided once, from it)
    monkeypatch.setattr(onnx_vision, "known_int8_cosine", lambda identity: poor.int8_cosine)
    with _load(tiny, "auto") as model:
        assert model.info.vision_backend == "onnx-fp32"
        assert "0.9700" in model.info.vision_backend_reason and str(INT8_MIN_COSINE) in model.info.vision_backend_reason
    with _load(tiny, "onnx-int8") as model:  # asked for explicitly: used, with the number
        assert model.info.vision_backend == "onnx-int8" and "0.9700" in model.info.vision_backend_reason


# --- the engine with an ONNX encoder ----------------------------------------------------


def test_standin_gives_the_same_prompt_layout(tiny, converted) -> None:
    sizes = [(448, 448), (200, 300), (1000, 700), (1344, 1344), (2000, 500), (50, 900)]
    with _load(tiny, "llama.cpp") as ref, _load(tiny, "onnx-int8") as onnx:
        standin = Path(onnx.engine.mmproj_path)
        assert standin.stat().st_size < 64 * 1024 < Path(tiny.mmproj).stat().st_size
        for i, size in enumerate(sizes):
            image = Image(picture(i, size), "p")
            text = f"<|im_start|>user\n{ref.engine.marker}\nWhat?<|im_end|>\n<|im_start|>assistant\n"
            with ref.engine.tokenize(text, [image]) as a, onnx.engine.tokenize(text, [image]) as b:
                assert [u if isinstance(u, int) else u.n_pos for u in a.units] == \
                       [u if isinstance(u, int) else u.n_pos for u in b.units]
                assert a.image_tokens == b.image_tokens > 0


def test_onnx_answers_encode_each_slice_once_and_report_the_backend(tiny, converted) -> None:
    rgb = picture(3, (1000, 700))
    with _load(tiny, "onnx-int8") as model:
        reply = model.ask("Describe.", rgb, max_tokens=4, temperature=0, detail="high")
        assert reply.timings.vision_backend == "onnx-int8" and model.info.vision_backend == "onnx-int8"
        assert reply.timings.slices_encoded == 5 and model.engine.encoder_calls == 5
        assert model.engine.encoder.encoder.calls == 5  # ONNX ran them, not libmtmd
        chat = model.chat()
        chat.send("What?", rgb, max_tokens=2, temperature=0)
        follow = chat.send("And?", max_tokens=2, temperature=0)
        assert follow.timings.slices_encoded == 0
        again = model.ask("Again.", rgb, max_tokens=2, temperature=0, detail="high")
        assert again.timings.slices_encoded == 0 and model.engine.encoder.encoder.calls == 5


def test_same_embeddings_give_the_same_greedy_answer(tiny, converted) -> None:
    """The stand-in decode path is libmtmd's: fed libmtmd's own embeddings, the ONNX-backed
    model answers token for token as the llama.cpp one."""
    rgb = picture(4, (900, 600))
    cache = EmbeddingCache()
    with _load(tiny, "llama.cpp", cache) as ref:
        want = ref.ask("Describe.", rgb, max_tokens=8, temperature=0, detail="high")
        ref_tag = f"{ref.engine.vision_backend}:{ref.engine.mmproj_id}:"  # how cache keys begin
    with _load(tiny, "onnx-fp32", cache) as onnx:
        tag = f"{onnx.engine.vision_backend}:{onnx.engine.mmproj_id}:"
        assert tag != ref_tag  # backends never share cache entries ...
        for key in [k for k in cache._items if k.startswith(ref_tag)]:  # ... unless copied, as here
            cache.put(tag + key[len(ref_tag):], cache.get(key))
        got = onnx.ask("Describe.", rgb, max_tokens=8, temperature=0, detail="high")
    assert got.timings.slices_encoded == 0
    assert str(got) == str(want)


def test_ort_threads_follow_the_encoder_threads(tiny, converted) -> None:
    with _load(tiny, "onnx-int8", n_threads_batch=1) as model:
        session = model.engine.encoder.encoder._session
        assert session.get_session_options().intra_op_num_threads == 1


def test_a_slice_libmtmd_does_not_have_is_an_engine_error(converted) -> None:
    encoder = onnx_vision.OnnxEncoder(converted.int8, converted.projector, n_threads=1)
    with pytest.raises(EngineError, match="slicing"):
        encoder.encode_rgb(picture(6, (300, 300)), 3)


def test_unpacked_weights_stay_in_the_mapped_file_and_encode_the_same(converted) -> None:
    rgb = picture(7, (448, 448))
    data = f"{converted.int8}.data"

    def resident_from_data() -> int:
        """kB of the data file's mapping resident in this process (/proc/self/smaps)."""
        total, inside = 0, False
        with open("/proc/self/smaps", encoding="utf-8") as f:
            for line in f:
                if "-" in line.split(" ", 1)[0]:  # a mapping's header line
                    inside = line.rstrip().endswith(data)
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1])
        return total

    packed = onnx_vision.OnnxEncoder(converted.int8, converted.projector, n_threads=1)
    want = packed.encode_rgb(rgb, 0)
    from_file_packed = resident_from_data()  # the f32 rest: the quantized weights were copied and packed
    del packed
    unpacked = onnx_vision.OnnxEncoder(converted.int8, converted.projector, n_threads=1, packed=False)
    np.testing.assert_allclose(unpacked.encode_rgb(rgb, 0), want, rtol=1e-5, atol=1e-5)
    import onnx

    graph = onnx.load(str(converted.int8), load_external_data=False).graph
    # the quantized weights: int8 (kernel u8s8) or uint8 (u8u8, nbits8), whichever this CPU class timed fastest
    quantized = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
    int8_kb = sum(int(dict((e.key, e.value) for e in t.external_data)["length"]) for t in graph.initializer
                  if t.data_type in quantized and t.external_data) // 1024
    # without packing the quantized weights are read from the file's pages too
    assert not unpacked.packed and resident_from_data() - from_file_packed >= 0.9 * int8_kb > 0


def test_a_garbage_onnx_file_is_an_engine_error(converted, tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(EngineError, match="could not load"):
        onnx_vision.OnnxEncoder(bad, converted.projector)


def test_too_little_disk_is_refused_before_writing(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import collections

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(onnx_vision.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(NotEnoughDiskError, match="vision_backend='llama.cpp'"):
        prepare(tiny.mmproj, file_identity(tiny.mmproj))
    assert not [p for p in (tmp_path / "onnx").iterdir() if not p.name.endswith(".lock")]


def test_46_merger_end_to_end_with_the_standin(tmp_path_factory: pytest.TempPathFactory) -> None:
    """MiniCPM-V 4.6 (minicpmv4_6 merger, slices whose token count follows their shape): the
    stand-in tokenizes as the real mmproj does, and every slice is encoded by ONNX once."""
    from gguf_mcv.testing import synthetic

    files = synthetic.build(tmp_path_factory.mktemp("v46"), synthetic.PRESETS["4.6"], ["Q4_K_M"])
    load = dict(model_path=files.quants["Q4_K_M"], mmproj_path=files.mmproj, n_ctx=4096, n_threads=2)
    with gguf_mcv.load("minicpm-v-4.6", vision_backend="llama.cpp", **load) as ref, \
            gguf_mcv.load("minicpm-v-4.6", vision_backend="onnx-int8", **load) as onnx:
        for i, size in enumerate([(1000, 700), (300, 200)]):
            image = Image(picture(10 + i, size), "p")
            with ref.engine.tokenize(ref.engine.marker, [image]) as a, \
                    onnx.engine.tokenize(onnx.engine.marker, [image]) as b:
                assert [u if isinstance(u, int) else u.n_pos for u in a.units] == \
                       [u if isinstance(u, int) else u.n_pos for u in b.units]
        reply = onnx.ask("Describe.", picture(12, (1000, 700)), max_tokens=2, detail="high")
        assert reply.timings.slices_encoded == 5 == onnx.engine.encoder.encoder.calls


def test_a_new_onnxruntime_version_replaces_the_old_conversion(tiny, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    identity = file_identity(tiny.mmproj)
    monkeypatch.setattr(onnx_vision, "onnxruntime_version", lambda: "0.0.1")
    old = prepare(tiny.mmproj, identity)
    monkeypatch.undo()
    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    new = prepare(tiny.mmproj, identity)
    assert new.int8 != old.int8 and new.int8.is_file()
    assert not old.int8.exists() and not old.fp32.exists() and not list(tmp_path.glob("onnx/*ort0.0.1.json"))


def test_the_llama_cpp_backend_does_not_import_onnxruntime(tiny) -> None:
    import subprocess
    import sys

    child = ("import sys, gguf_mcv; m = gguf_mcv.load(model_path=sys.argv[1], mmproj_path=sys.argv[2], "
             "n_threads=1, vision_backend='llama.cpp'); print('onnxruntime' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", child, str(tiny.quants["Q4_K_M"]), str(tiny.mmproj)],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"  # ~25 MiB of RSS saved


def test_int8_columns_round_trip() -> None:
    from gguf_mcv.vision.onnx_graph import quantize_columns

    w = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero column gets scale 1, not a division by zero
    q, scale = quantize_columns(w)
    assert q.dtype == np.int8 and scale.shape == (16,) and np.abs(q).max() <= 127
    np.testing.assert_allclose(q * scale, w, atol=float(scale.max()) / 2 + 1e-7)


def test_the_cli_vision_backend_flag(tiny, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    import PIL.Image

    picture_path = tmp_path / "p.png"
    PIL.Image.fromarray(picture(20, (300, 200))).save(picture_path)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gguf_mcv", "ask", str(tiny.quants["Q4_K_M"]),
                               str(picture_path), "What?", *args], env=os.environ, capture_output=True,
                              text=True, timeout=180)

    for backend in ("llama.cpp", "onnx-fp32"):
        done = run("--max-tokens", "1", "--json", "--vision-backend", backend)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["timings"]["vision_backend"] == backend
    bad = run("--vision-backend", "onnx")
    assert bad.returncode == 2 and "--vision-backend" in bad.stderr


@pytest.mark.slow
def test_fp32_answers_follow_libmtmd_as_closely_as_libmtmd_follows_itself(tiny, converted) -> None:
    """Greedy answers token-identical to libmtmd's need bit-identical embeddings on these
    random-weight models (their logits are near ties), which no graph outside ggml gives:
    ggml's flash attention accumulates V in F16 in key order. libmtmd's own two attention
    paths (flash attention on, its default on the CPU, and off) differ by as much as
    onnx-fp32 differs from it (tools/vision_fidelity.py: 27 vs 28 of 36 answers identical
    over the six generations); so onnx-fp32 must agree with libmtmd's default about as often
    as libmtmd without flash attention does (measured here: 6 vs 4 of 6), with embeddings
    about as far off (measured: mean |difference| 4.6e-5 vs 4.9e-5). The margins allow for
    other CPUs' summation orders."""
    jobs = [(picture(20 + i, size), "high" if i % 2 else "low")
            for i, size in enumerate([(300, 200), (1000, 700), (640, 480), (900, 900), (448, 448), (1200, 500)])]
    answers: dict[str, list[str]] = {}
    embeddings: dict[str, list[np.ndarray]] = {}
    for name, backend, flash in (("libmtmd", "llama.cpp", None), ("libmtmd-no-fa", "llama.cpp", False),
                                 ("onnx-fp32", "onnx-fp32", None)):
        cache = EmbeddingCache()
        with _load(tiny, backend, cache, flash_attn=flash) as model:
            answers[name] = [str(model.ask("Describe.", rgb, max_tokens=12, temperature=0, detail=d))
                             for rgb, d in jobs]
        embeddings[name] = [cache._items[k] for k in sorted(cache._items, key=lambda k: k.split(":", 2)[-1])]
    same = {name: sum(a == b for a, b in zip(answers["libmtmd"], answers[name], strict=True))
            for name in ("libmtmd-no-fa", "onnx-fp32")}
    assert same["onnx-fp32"] >= same["libmtmd-no-fa"] - 1, same
    error = {name: float(np.mean([np.abs(np.asarray(a) - np.asarray(b)).mean()
                                  for a, b in zip(embeddings["libmtmd"], embeddings[name], strict=True)]))
             for name in ("libmtmd-no-fa", "onnx-fp32")}
    assert 0 < error["onnx-fp32"] <= 1.25 * error["libmtmd-no-fa"], error


def test_a_retuned_projector_of_the_same_size_gets_its_own_conversion(tiny, retuned_mmproj: Path,
                                                                      converted) -> None:
    """Same size, same first and last MiB, another middle: never the original's graphs or stand-in."""
    own = prepare(retuned_mmproj, file_identity(retuned_mmproj))  # converted here or by an earlier test
    assert own.fp32 != converted.fp32 and own.int8 != converted.int8
    assert onnx_vision.standin(retuned_mmproj, file_identity(retuned_mmproj)) != \
        onnx_vision.standin(tiny.mmproj, file_identity(tiny.mmproj))
    rgb = picture(31, (448, 448))
    fp32 = [onnx_vision.OnnxEncoder(c.fp32, c.projector, n_threads=1).encode_rgb(rgb, 0) for c in (converted, own)]
    assert not np.allclose(fp32[0], fp32[1], atol=1e-4)  # the middle tensor matters


# --- a damaged conversion folder: rebuilt with one warning, never a signal or a wrong answer -----

_PREPARE_AFTER_DAMAGE = """
import dataclasses
from gguf_mcv.vision import onnx_vision
from gguf_mcv.runtime.engine import file_identity
from gguf_mcv.vision.onnx_graph import Weights
onnx_vision.CONVERT_IN_CHILD = False  # this child is the one a signal may end; rebuild in it
mmproj = sys.argv[1]
got = onnx_vision.prepare(mmproj, file_identity(mmproj), validate_int8=False)
RESULT["hit"] = got.convert_s == 0.0
RESULT["wrong"] = got.projector != Weights(mmproj).projector()
RESULT["after"] = onnx_vision.prepare(mmproj, file_identity(mmproj), validate_int8=False).convert_s == 0.0
"""


@pytest.fixture(scope="module")
def onnx_folder(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A good conversion of the tiny mmproj, copied by the tests that damage it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GGUF_MCV_CACHE", str(tmp_path_factory.mktemp("onnx-good")))
        return prepare(tiny.mmproj, file_identity(tiny.mmproj), validate_int8=False).fp32.parent


def _copy_of(good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import shutil

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "onnx"
    shutil.copytree(good, folder, symlinks=True)
    return folder


@pytest.mark.parametrize("target", ["manifest", "graph"])
@pytest.mark.parametrize("damage", damage_mod.DAMAGES, ids=lambda f: f.__name__)
def test_a_damaged_conversion_is_rebuilt_with_one_warning_in_a_child(tiny, onnx_folder, tmp_path, monkeypatch,
                                                                      damage, target) -> None:
    folder = _copy_of(onnx_folder, tmp_path, monkeypatch)
    manifest = next(folder.glob("*.json"))
    fp32, int8 = next(folder.glob("*-fp32.onnx.data")), next(folder.glob("*-int8-*.onnx.data"))
    harmed = manifest if target == "manifest" else fp32
    damage(harmed, fp32 if target == "manifest" else int8)
    result = damage_mod.run_child(_PREPARE_AFTER_DAMAGE, str(tiny.mmproj), timeout=300)
    assert not result["wrong"] and result["after"], result
    if damage.__name__ == "unreadable":  # root reads mode 000
        assert result["hit"] and not result["warnings"], result
    else:
        assert not result["hit"] and len(result["warnings"]) == 1, result
    outside = tmp_path / "cache" / f"outside-{harmed.name}"
    assert not outside.exists() or outside.stat().st_size > 0  # a symlink's target is left alone


def _edit(m: dict, what: str) -> None:
    if what == "image_size":
        m["projector"]["image_size"] *= 2
    elif what == "mean":
        m["projector"]["mean"][0] = 0.9
    elif what == "huge_size":
        m["projector"]["image_size"] = 10**12
    elif what == "projector_a_list":
        m["projector"] = [1, 2]
    elif what == "absolute_file":
        name = next(iter(m["files"]))
        m["files"]["/etc/hostname"] = m["files"].pop(name)
    elif what == "dotdot_graph":
        m["fp32"] = "../" + m["fp32"]
    elif what == "cosine":
        m["int8_cosine"] = 7.5
    elif what == "size_a_string":
        next(iter(m["files"].values()))[0] = "big"


@pytest.mark.parametrize("digest", ["recomputed", "stale"])
@pytest.mark.parametrize("what", ["image_size", "mean", "huge_size", "projector_a_list", "absolute_file",
                                  "dotdot_graph", "cosine", "size_a_string"])
def test_an_edited_manifest_is_never_trusted(tiny, onnx_folder, tmp_path, monkeypatch, what, digest, caplog) -> None:
    from gguf_mcv import cache_files
    from gguf_mcv.vision.onnx_graph import Weights

    monkeypatch.setattr(onnx_vision, "CONVERT_IN_CHILD", False)  # what is tested is the manifest's reading
    folder = _copy_of(onnx_folder, tmp_path, monkeypatch)
    path = next(folder.glob("*.json"))
    m = json.loads(path.read_text())
    _edit(m, what)
    if digest == "recomputed":  # as if made so on purpose: the mmproj's own values still decide
        m["digest"] = cache_files.digest_of(m)
    path.write_text(json.dumps(m))
    hostname = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else None
    with caplog.at_level("WARNING"):
        got = prepare(tiny.mmproj, file_identity(tiny.mmproj), validate_int8=False)
    assert got.convert_s > 0 and got.projector == Weights(tiny.mmproj).projector()
    assert "unusable" in caplog.text
    assert hostname is None or Path("/etc/hostname").read_bytes() == hostname


def test_a_killed_conversions_temporary_files_are_removed_by_the_next(tiny, onnx_folder, tmp_path, monkeypatch) -> None:
    folder = _copy_of(onnx_folder, tmp_path, monkeypatch)
    stem = next(folder.glob("*.json")).stem
    left = [folder / f".{stem}-abcd_123", folder / f".{stem}-zz99xx00.json.part", folder / f"{stem}.json.part",
            folder / ".other-ort1.0-k1ll3d00"]  # another mmproj's, its lock free: a killed one too
    left[0].mkdir()
    (left[0] / f"{stem}-fp32.onnx.data").write_bytes(bytes(2**20))
    for p in left[1:3]:
        p.write_text("{half")
    left[3].mkdir()
    kept = [folder / ".damaged-x.json-20260101-000000-12345678", folder / "notes.txt"]
    for p in kept:
        p.write_text("the user's")
    assert prepare(tiny.mmproj, file_identity(tiny.mmproj), validate_int8=False).convert_s == 0.0
    assert not any(os.path.lexists(p) for p in left)
    assert all(p.read_text() == "the user's" for p in kept)


def test_a_live_conversions_temporary_folder_is_left_alone(tiny, onnx_folder, tmp_path, monkeypatch) -> None:
    from filelock import FileLock

    folder = _copy_of(onnx_folder, tmp_path, monkeypatch)
    live = folder / ".other-ort1.0-l1ve0000"
    live.mkdir()
    with FileLock(str(folder / "other-ort1.0.lock")):  # its converter is at work
        prepare(tiny.mmproj, file_identity(tiny.mmproj), validate_int8=False)
    assert live.is_dir()


def test_auto_falls_back_to_llama_cpp_when_the_cache_cannot_be_written(tiny, tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GGUF_MCV_CACHE", str(blocker))
    with _load(tiny, "auto") as model:
        assert model.info.vision_backend == "llama.cpp"
        assert "ONNX conversion cannot be made" in model.info.vision_backend_reason


# --- validation one stage at a time; a first run that fits where later runs fit ----------------


@pytest.mark.parametrize("preset", ["2.6", "4.6"])
def test_running_in_stages_gives_the_whole_graphs_embeddings(preset, tmp_path_factory) -> None:
    """Self-validation runs the fp32 graph one stage (block, merger, projector) at a time: it must
    compute what the whole graph computes."""
    from gguf_mcv.testing import synthetic
    from gguf_mcv.vision.mtmd_preprocess import slice_pixels
    from gguf_mcv.vision.onnx_graph import graph_inputs
    from gguf_mcv.vision.onnx_vision import OnnxEncoder, _params, run_in_stages, token_cosines

    files = synthetic.build(tmp_path_factory.mktemp(f"stages{preset}"), synthetic.PRESETS[preset], ["Q4_K_M"])
    converted = prepare(files.mmproj, file_identity(files.mmproj))
    p = converted.projector
    feeds, whole = [], []
    for variant in ("fp32", "int8"):
        encoder = OnnxEncoder(converted.path(variant), p, n_threads=2)
        for size in ((448, 448), (700, 300)):
            pixels = slice_pixels(picture(3, size), _params(p))[-1]
            h, w = pixels.shape[1] // p.patch_size, pixels.shape[2] // p.patch_size
            feeds.append({"pixels": pixels[None], **graph_inputs(p, h, w)})
            whole.append(encoder.encode_pixels(pixels))
        staged = run_in_stages(converted.path(variant), feeds[-2:], n_threads=2)
        for a, b in zip(staged, whole[-2:], strict=True):
            assert a[0].shape == b.shape
            assert token_cosines(a[0], b).min() > 0.99999, variant
            np.testing.assert_allclose(a[0], b, atol=1e-3 * float(np.abs(b).max()))


#: a vision tower whose weights dominate as SigLIP-400M's do (fp32 graph ~100 MB, int8 ~25 MB, F16
#: mmproj ~50 MB) with 224-px slices (256 patches: small activations, a fast test), beside a tiny
#: text model: a conversion that held the fp32 graph or the mapped mmproj peaks far above a cached load
WIDE_TOWER = dict(v_embd=512, v_layer=8, v_head=8, v_ff=2048, image_size=224)

_PEAK_CHILD = """
import json, sys
import numpy as np
import gguf_mcv
from gguf_mcv.vision.embed_cache import EmbeddingCache
model = gguf_mcv.load(model_path=sys.argv[1], mmproj_path=sys.argv[2], n_ctx=1024, n_threads=2,
                      vision_backend="onnx-int8", embed_cache=EmbeddingCache())
rgb = np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8)
reply = model.ask("?", rgb, max_tokens=1, detail="low")
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps({"peak": peak, "reason": model.info.vision_backend_reason}))
"""

@pytest.mark.slow
def test_a_first_run_peaks_no_higher_than_a_cached_run(tmp_path: Path) -> None:
    """The conversion on first use runs in a child process (``onnx_child``): the loading process
    never imports ``onnx`` nor runs the fp32 graph, and then loads the conversion from the cache
    as a later run does, so it peaks where a later run peaks. The 4 MiB allowed is what differs
    between two such processes and is not the conversion's: the 1 MiB blocks the files are
    hashed in, the pipe and bookkeeping of the child and the heap's fragmentation (measured here:
    the first run 1.5 MiB *below* the cached one; on the 2.6 bench shape +0.4 MiB). Before, the
    converting process kept ``onnx`` (~11 MiB), the fp32 kernels' pages (~11 MiB) and leftover
    heap: 26-34 MiB above a cached run."""
    import subprocess
    import sys

    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux's /proc for the peak")
    from gguf_mcv.testing import synthetic

    files = synthetic.build(tmp_path / "model", synthetic.SyntheticSpec(**WIDE_TOWER), ["Q4_K_M"])
    env = {**os.environ, "GGUF_MCV_CACHE": str(tmp_path / "cache")}
    runs = []
    for _ in ("first", "cached"):
        out = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(files.quants["Q4_K_M"]), str(files.mmproj)],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, cached = runs[0]["peak"], runs[1]["peak"]
    assert "int8 vs fp32 cosine" in runs[0]["reason"]  # the first run converted and validated
    assert first <= cached + 4 * 2**20, (first / 2**20, cached / 2**20)


# --- a disk that fills during a conversion -------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path):
    """Mount a small tmpfs (as root) at a fresh folder: yields a function (size in bytes ->
    remount at that size) and the folder; skipped where it cannot be mounted."""
    import subprocess

    where = tmp_path / "small-disk"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")

    def mount(size: int, remount: bool = False) -> None:
        opts = f"{'remount,' if remount else ''}size={-(-size // 4096) * 4096}"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True,
                              text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")

    yield mount, where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _allocated(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.iterdir() if p.is_file())


def test_files_no_manifest_vouches_for_are_removed_not_counted_against_the_disk(tiny, onnx_folder, tmpfs,
                                                                                 monkeypatch) -> None:
    """A conversion that failed once the graphs were under their final names (a full disk, a
    killed child) left them without a manifest: the next load removes them before it checks the
    free space, so once there is room again it converts, never NotEnoughDiskError forever."""
    import shutil

    mount, where = tmpfs
    need = onnx_vision.DISK_FACTOR * tiny.mmproj.stat().st_size
    mount(need + 2**20)
    monkeypatch.setenv("GGUF_MCV_CACHE", str(where))
    folder = where / "onnx"
    folder.mkdir()
    for f in onnx_folder.iterdir():
        if f.name.endswith((".onnx", ".data")):
            shutil.copyfile(f, folder / f.name)  # the graphs of a conversion without its manifest
    assert shutil.disk_usage(folder).free < need  # they would make the check fail
    converted = prepare(tiny.mmproj, file_identity(tiny.mmproj), validate_int8=False)
    assert converted.convert_s > 0 and converted.int8.is_file()
    assert {p.name for p in folder.iterdir()} == {*(f.name for f in onnx_folder.iterdir())}


def test_a_disk_that_fills_during_a_conversion_leaves_no_file(tiny, onnx_folder, tmpfs, monkeypatch) -> None:
    """The disk check passed, then something else filled the disk: with room for a little less
    than the conversion, then a page more each time (the last graph, then the manifest, do not
    fit), each failure is the disk's error and leaves no file under a final name; once there is
    room the next load converts."""
    import errno

    mount, where = tmpfs
    lock = f"{next(onnx_folder.glob('*.json')).stem}.lock"
    files = sum(-(-p.stat().st_size // 4096) * 4096 for p in onnx_folder.iterdir()
                if p.name.endswith((".onnx", ".data")))
    monkeypatch.setenv("GGUF_MCV_CACHE", str(where))
    monkeypatch.setattr(onnx_vision, "CONVERT_IN_CHILD", False)  # the check is patched in this process
    monkeypatch.setattr(onnx_vision, "DISK_FACTOR", 0)
    failures = 0
    for extra in range(0, 8 * 4096, 4096):
        mount(files + extra, remount=extra > 0)
        try:
            converted = prepare(tiny.mmproj, file_identity(tiny.mmproj), validate_int8=False)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            assert [p.name for p in (where / "onnx").iterdir()] == [lock]
            failures += 1
            continue
        assert converted.convert_s > 0 and converted.int8.is_file()
        break
    else:
        pytest.fail("the conversion never fitted")
    assert failures >= 2  # the disk filled at least once with the graphs in place


def test_a_child_killed_before_its_manifest_leaves_no_file(tiny, tmp_path: Path, monkeypatch) -> None:
    from gguf_mcv.vision import onnx_child

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    monkeypatch.setenv(onnx_child.ENV_FAULT, "SIGKILL@manifest")
    with pytest.raises(EngineError, match="SIGKILL"):
        prepare(tiny.mmproj, file_identity(tiny.mmproj), validate_int8=False)
    assert [p.suffix for p in (tmp_path / "onnx").iterdir()] == [".lock"]
    monkeypatch.delenv(onnx_child.ENV_FAULT)
    assert prepare(tiny.mmproj, file_identity(tiny.mmproj), validate_int8=False).convert_s > 0
