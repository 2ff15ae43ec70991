"""The int8 kernel choice: CPU classes, the candidates, the alternating timing, the rule that
keeps one, and each kernel's graph against the default one on the tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gguf_mcv.vision import onnx_variants
from gguf_mcv.vision.onnx_graph import INT8_KERNELS
from gguf_mcv.vision.onnx_variants import (
    CANDIDATES,
    better,
    candidates,
    cpu_class,
    quantize_blocks8,
    symmetric_blocks,
    time_alternating,
)
from gguf_mcv.vision.vision_backends import INT8_MIN_COSINE

#: the flags that decide a class, strongest first (a CPU with several gets the first)
DECIDING = ["amx_int8", "avx512_vnni", "avx_vnni", "avx512f", "avx2", "i8mm", "asimddp", "asimd"]
OTHER_FLAGS = ["sse4_2", "fma", "f16c", "fp", "aes", "bmi2"]


@given(st.sets(st.sampled_from(DECIDING + OTHER_FLAGS)))
def test_the_class_is_the_strongest_flag_present_and_always_has_candidates(flags: set[str]) -> None:
    cls = cpu_class(frozenset(flags), machine="X86_64")
    present = [f for f in DECIDING if f in flags]
    expected = {"amx_int8": "amx", "avx512_vnni": "avx512-vnni", "avx_vnni": "avx-vnni", "avx512f": "avx512",
                "avx2": "avx2", "i8mm": "arm-i8mm", "asimddp": "arm-dotprod", "asimd": "arm-neon"}
    assert cls == (expected[present[0]] if present else "x86_64")
    tried = candidates(cls)
    assert tried and set(tried) <= set(INT8_KERNELS) and len(set(tried)) == len(tried)


def test_every_listed_class_tries_known_kernels_and_u8s8_first() -> None:
    for cls, kernels in CANDIDATES.items():
        assert kernels[0] == "u8s8", cls  # kept when int8 cannot be validated, as before
        assert set(kernels) <= set(INT8_KERNELS) and 1 <= len(kernels) <= 3, cls
    assert candidates("a-cpu-nobody-knows") == onnx_variants.DEFAULT_CANDIDATES


def test_this_machines_class_comes_from_its_flags() -> None:
    from gguf_mcv.hardware import cpu_flags

    assert cpu_class() == cpu_class(cpu_flags())


@given(st.dictionaries(st.sampled_from("abcd"), st.lists(st.floats(0.001, 100), min_size=3, max_size=3),
                       min_size=1), st.integers(1, 3))
def test_timing_alternates_and_keeps_each_ones_fastest(runs: dict[str, list[float]], rounds: int) -> None:
    calls: list[str] = []

    def runner(name: str):
        def run() -> float:
            calls.append(name)
            return runs[name][sum(c == name for c in calls) - 1]
        return run

    times = time_alternating({name: runner(name) for name in runs}, rounds)
    assert calls == list(runs) * rounds  # A B A B, never A A B B
    assert times == {name: min(runs[name][:rounds]) for name in runs}


def test_timing_needs_a_round() -> None:
    with pytest.raises(ValueError, match="rounds"):
        time_alternating({"a": lambda: 1.0}, 0)


cosine = st.one_of(st.none(), st.floats(0.9, 1.0))


@given(cosine, cosine, st.floats(0.01, 10), st.floats(0.01, 10))
def test_better_keeps_a_passing_kernel_and_the_faster_of_two(ca, cb, ta, tb) -> None:
    timed: list[tuple[str, str]] = []

    def time(a: str, b: str) -> dict[str, float]:
        timed.append((a, b))
        return {"a": ta, "b": tb}

    kept = better("a", "b", {"a": ca, "b": cb}, time)
    ok_a, ok_b = (c is None or c >= INT8_MIN_COSINE for c in (ca, cb))
    if ok_a != ok_b:
        assert kept == ("a" if ok_a else "b") and not timed  # a failing kernel is never timed
    elif not ok_a:
        assert kept == ("a" if ca >= cb else "b") and not timed
    else:
        assert timed == [("a", "b")] and kept == ("b" if tb < ta else "a")


@given(st.integers(1, 70), st.integers(1, 9), st.sampled_from([16, 32]), st.integers(0, 2**31))
def test_8bit_blocks_round_trip_within_half_a_step(k: int, n: int, block: int, seed: int) -> None:
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    w[:, 0] = 0.0  # an all-zero column keeps a usable scale
    packed, scales = quantize_blocks8(w, block)
    blocks = -(-k // block)
    assert packed.shape == (n, blocks, block) and packed.dtype == np.uint8 and scales.shape == (n * blocks,)
    back = (packed.astype(np.float32) - 128) * scales.reshape(n, blocks, 1)
    back = back.reshape(n, -1)[:, :k].T
    step = np.repeat(scales.reshape(n, blocks), block, axis=1)[:, :k].T
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6)
    q, _ = symmetric_blocks(w, 127.0, block)
    assert np.abs(q).max() <= 127


@pytest.fixture(scope="module")
def kernel_embeddings(tiny, tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    pytest.importorskip("onnxruntime")
    import onnx

    from gguf_mcv.vision.onnx_graph import Weights, build_model
    from gguf_mcv.vision.onnx_session import OnnxEncoder

    folder: Path = tmp_path_factory.mktemp("kernels")
    weights = Weights(tiny.mmproj)
    projector = weights.projector()
    rgb = np.random.default_rng(1).integers(0, 256, (448, 448, 3), dtype=np.uint8)
    out = {}
    for kernel in INT8_KERNELS:
        path = folder / f"int8-{kernel}.onnx"
        model, _ = build_model(weights, fold=True, int8=True, int8_scope="blocks", kernel=kernel,
                               external=path.with_name(path.name + ".data"))
        onnx.save_model(model, str(path))
        ops = {node.op_type for node in model.graph.node}
        assert ("MatMulNBits" in ops) == (kernel == "nbits8")
        out[kernel] = OnnxEncoder(path, projector, n_threads=2).encode_rgb(rgb, 0)
    return out


@pytest.mark.parametrize("kernel", [k for k in INT8_KERNELS if k != "u8s8"])
def test_each_kernel_encodes_what_u8s8_encodes(kernel_embeddings, kernel: str) -> None:
    from gguf_mcv.vision.onnx_session import token_cosines

    a, b = kernel_embeddings["u8s8"], kernel_embeddings[kernel]
    assert a.shape == b.shape and np.isfinite(b).all()
    assert token_cosines(a, b).mean() >= 0.999


def test_an_unknown_kernel_is_refused(tiny) -> None:
    from gguf_mcv.vision.onnx_graph import Weights, build_model

    with pytest.raises(ValueError, match="kernel"):
        build_model(Weights(tiny.mmproj), int8=True, kernel="s8s8")


# --- the choice made by a conversion, and kept per CPU class ------------------------------------


def _manifest(converted) -> dict:
    import json

    return json.loads(next(converted.fp32.parent.glob("*.json")).read_text())


def test_a_conversion_keeps_the_fastest_kernel_that_passes(tiny, tmp_path: Path, monkeypatch) -> None:
    """Every kernel tried on this machine (in the converting child): each validated, the passing
    ones timed against each other, one int8 graph kept, named after its kernel in its file, the
    manifest and the embeddings' cache key."""
    pytest.importorskip("onnxruntime")
    from gguf_mcv.runtime.engine import file_identity
    from gguf_mcv.vision.onnx_vision import OnnxVision, prepare

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    monkeypatch.setitem(CANDIDATES, cpu_class(), ("u8s8", "nbits8", "u8u8"))
    converted = prepare(tiny.mmproj, file_identity(tiny.mmproj))
    m = _manifest(converted)
    assert m["cpu_class"] == cpu_class() == converted.cpu_class and m["kernel"] == converted.kernel
    assert set(m["kernels_tried"]) == {"u8s8", "nbits8", "u8u8"}
    passing = {k for k, c in m["kernels_tried"].items() if c >= INT8_MIN_COSINE}
    assert converted.kernel in passing or not passing
    if len(passing) > 1:
        assert set(m["kernel_seconds"]) == passing and all(s > 0 for s in m["kernel_seconds"].values())
    assert converted.int8_cosine == m["kernels_tried"][converted.kernel]
    graphs = sorted(p.name for p in tmp_path.glob("onnx/*-int8-*.onnx"))
    assert graphs == [converted.int8.name] and converted.int8.name.endswith(f"-int8-{converted.kernel}.onnx")
    assert OnnxVision(converted, "int8", "id").key_tag == f"id+onnx-int8-{converted.kernel}"
    assert OnnxVision(converted, "fp32", "id").key_tag == "id+onnx-fp32"
    assert prepare(tiny.mmproj, file_identity(tiny.mmproj)).convert_s == 0.0  # kept, not chosen again


def test_a_conversion_made_on_another_cpu_class_is_made_again(tiny, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("onnxruntime")
    from gguf_mcv.cache_files import write_manifest
    from gguf_mcv.runtime.engine import file_identity
    from gguf_mcv.vision.onnx_vision import known_int8_cosine, prepare

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    identity = file_identity(tiny.mmproj)
    converted = prepare(tiny.mmproj, identity)
    assert known_int8_cosine(identity) == converted.int8_cosine
    path = next(tmp_path.glob("onnx/*.json"))
    m = _manifest(converted)
    del m["digest"]
    write_manifest(path, {**m, "cpu_class": "arm-neon" if cpu_class() != "arm-neon" else "avx2"})
    assert known_int8_cosine(identity) is None  # the figure was another CPU's
    again = prepare(tiny.mmproj, identity)
    assert again.convert_s > 0 and _manifest(again)["cpu_class"] == cpu_class()
    assert known_int8_cosine(identity) == again.int8_cosine


@pytest.mark.parametrize("field,value", [("kernel", "s8s8"), ("kernel", None), ("cpu_class", 7)])
def test_a_manifest_naming_no_kernel_a_conversion_writes_is_rebuilt(tiny, tmp_path: Path, monkeypatch,
                                                                     field, value, caplog) -> None:
    pytest.importorskip("onnxruntime")
    from gguf_mcv.cache_files import write_manifest
    from gguf_mcv.runtime.engine import file_identity
    from gguf_mcv.vision.onnx_vision import prepare

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    converted = prepare(tiny.mmproj, file_identity(tiny.mmproj), validate_int8=False)
    m = _manifest(converted)
    del m["digest"]
    write_manifest(next(tmp_path.glob("onnx/*.json")), {**m, field: value})
    again = prepare(tiny.mmproj, file_identity(tiny.mmproj), validate_int8=False)
    assert again.convert_s > 0 and "unusable" in caplog.text and again.kernel in INT8_KERNELS


def test_kernels_a_conversion_does_not_know_are_refused_before_writing(tiny, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from gguf_mcv.errors import ConfigError
    from gguf_mcv.vision.onnx_vision import _convert

    with pytest.raises(ConfigError, match="int8 kernels"):
        _convert(tiny.mmproj, tmp_path, "stem", None, kernels=["u8s8", "fp8"])
    assert not list(tmp_path.iterdir())
