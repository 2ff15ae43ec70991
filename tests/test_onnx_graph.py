"""The ONNX graph built from an mmproj against libmtmd's own encoder, for every projector in
the catalog (the resampler of 2.5, 2.6, o-2.6, 4.0, 4.5; 4.6's merger): per-token cosine
>= 0.9999 on every slice of images that exercise the slicing (upscaled to one slice, a grid),
and the graph that rounds as ggml does (``ggml=True``, the onnx-fp32 backend's) closer to
libmtmd than the plain fp32 graph."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import gguf_mcv
from gguf_mcv import generations as registry
from gguf_mcv.errors import CorruptModelError, IncompatibleProjectorError
from gguf_mcv.testing import synthetic
from gguf_mcv.vision.embed_cache import EmbeddingCache
from gguf_mcv.vision.media import Image
from gguf_mcv.vision.onnx_graph import (
    Weights,
    build_model,
    fold_outliers,
    merge_indices,
    resampler_positions,
    vit_positions,
    window_order,
)
from gguf_mcv.vision.onnx_vision import OnnxEncoder, save_graph, token_cosines

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("llama_cpp")

#: one per mmproj layout in the catalog: the resampler of versions 2 (96 queries), 3, 4, 5, 6 and
#: MiniCPM-V 4.6's minicpmv4_6 merger (4.6 Thinking has the same mmproj layout as 4.6)
GENERATIONS = {g.key: g.catalog_names[0] for g in registry.GENERATIONS.values()
               if g.onnx_encoder and g.catalog_names and not g.thinking_default}
SIZES = [(300, 200), (1000, 700)]  # upscaled to one slice; overview + a 2x2 grid


@pytest.fixture(scope="module", params=sorted(GENERATIONS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    gen = request.param
    out = tmp_path_factory.mktemp(f"onnx-{gen}")
    files = synthetic.build(out, synthetic.PRESETS[gen], ["Q4_K_M"])
    weights = Weights(files.mmproj)
    encoders = {}
    for ggml in (True, False):
        model, _ = build_model(weights, ggml=ggml)
        save_graph(onnx, model, out / f"fp32-{ggml}.onnx")
        encoders[ggml] = OnnxEncoder(out / f"fp32-{ggml}.onnx", weights.projector(), n_threads=2)
    with gguf_mcv.load(GENERATIONS[gen], model_path=files.quants["Q4_K_M"], mmproj_path=files.mmproj,
                       n_ctx=4096, n_threads=2, vision_backend="llama.cpp", embed_cache=EmbeddingCache()) as m:
        yield m, encoders, gen


def test_fp32_graph_matches_libmtmd_on_every_slice(pair: tuple) -> None:
    model, encoders, gen = pair
    engine = model.engine
    rng = np.random.default_rng(7)
    n_slices = 0
    error = {True: 0.0, False: 0.0}  # mean |ONNX - libmtmd| with and without ggml's roundings
    for width, height in SIZES:
        image = Image(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "random")
        with engine.tokenize(engine.marker, [image]) as prompt:
            for index, (unit_index, chunk) in enumerate(prompt.image_chunks()):
                ref = engine._encode(chunk, prompt.units[unit_index]).reshape(-1, engine.n_embd)
                for ggml, encoder in encoders.items():
                    got = encoder.encode_rgb(image.rgb, index, image.digest)
                    assert got.shape == ref.shape
                    cos = token_cosines(ref, got)
                    assert cos.min() >= 0.9999, (gen, ggml, (width, height), index, cos.min())
                    error[ggml] += float(np.abs(got - ref).mean())
                n_slices += 1
    assert n_slices == 1 + 5
    # measured: 2.6 4.7e-5 vs 6.5e-5 per element, 4.6 9.7e-6 vs 1.3e-5 (see README)
    assert error[True] < 0.9 * error[False], (gen, error)


def test_positions_follow_libmtmd() -> None:
    # clip.cpp: bucket = floor(70 * i / n), id = bucket_h * 70 + bucket_w
    ids = vit_positions(2, 3)
    assert ids.tolist() == [0, 23, 46, 35 * 70, 35 * 70 + 23, 35 * 70 + 46]
    rpos = resampler_positions(2, 3, 256)
    assert rpos.shape == (6, 256) and rpos.dtype == np.float32
    # patch 4 is row 1, column 1: sin(w*omega0) = sin(1), cos(h*omega0) = cos(1)
    assert rpos[4, 0] == pytest.approx(np.sin(1.0), abs=1e-6)
    assert rpos[4, 192] == pytest.approx(np.cos(1.0), abs=1e-6)
    assert rpos[0, 64] == pytest.approx(1.0)  # cos(0)


def test_folding_outliers_is_exact_in_fp32() -> None:
    rng = np.random.default_rng(0)
    gamma = np.ones(64, np.float32)
    gamma[[3, 40]] = [80.0, -60.0]
    beta = rng.standard_normal(64).astype(np.float32)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.standard_normal((10, 64)).astype(np.float32)
    xn = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-6)
    before = (xn * gamma + beta) @ w
    w2 = w.copy()
    g2, b2 = fold_outliers(gamma, beta, [w2])
    assert np.abs(g2).max() <= 1.0 + 1e-6  # the outliers left the activation
    np.testing.assert_allclose((xn * g2 + b2) @ w2, before, rtol=1e-4, atol=1e-4)


def test_a_damaged_mmproj_is_a_corrupt_model_error(tmp_path: Path) -> None:
    bad = tmp_path / "mmproj.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 100)
    with pytest.raises(CorruptModelError, match="download it again"):
        Weights(bad)


def test_another_projector_is_refused_with_what_to_do(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "mmproj-llava.gguf"
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "mlp")
    writer.add_tensor("mm.0.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(IncompatibleProjectorError, match="vision_backend='llama.cpp'"):
        Weights(path).projector()


def test_merger_indices_follow_libmtmd() -> None:
    # make_ds_idx(off_r, off_c, h/2, w/2, w) and the window-major order of clip.cpp, on a 4x4 grid
    assert merge_indices(4, 4).tolist() == [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]]
    assert window_order(4, 4)[:8].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


@pytest.mark.parametrize("gen", ["2.6", "4.6"])
def test_int8_scope_blocks_keeps_the_projector_fp32(gen: str, tmp_path: Path) -> None:
    # int8_scope="blocks" rebuilds the older int8 graph (tools/vision_fidelity.py --int8):
    # only the tower blocks' MatMuls int8; "all" (the default, what the cache converts) every MatMul
    mmproj = synthetic.write_mmproj(tmp_path / "mmproj.gguf", synthetic.PRESETS[gen])
    weights = Weights(mmproj)
    ops = {}
    for scope in ("all", "blocks"):
        model, _ = build_model(weights, fold=True, int8=True, int8_scope=scope)
        ops[scope] = [(n.op_type, n.name) for n in model.graph.node
                      if n.op_type in ("MatMul", "DynamicQuantizeMatMul")]
        save_graph(onnx, model, tmp_path / f"int8-{scope}.onnx")
    projector = [name for op, name in ops["all"] if not name.startswith("v.blk.")]
    assert projector and all(op == "DynamicQuantizeMatMul" for op, _ in ops["all"])
    blocks = {name for op, name in ops["blocks"] if op == "DynamicQuantizeMatMul"}
    assert blocks == {name for _, name in ops["all"] if name.startswith("v.blk.")}
    plain = [name for op, name in ops["blocks"] if op == "MatMul"]
    assert plain and all(not name.startswith("v.blk.") for name in plain)
    assert len(plain) >= len(projector)  # the resampler's query projection is in the graph again
    fp32, _ = build_model(weights)
    save_graph(onnx, fp32, tmp_path / "fp32.onnx")
    rgb = np.random.default_rng(3).integers(0, 256, (300, 200, 3), dtype=np.uint8)
    ref = OnnxEncoder(tmp_path / "fp32.onnx", weights.projector()).encode_rgb(rgb, 0)
    for scope in ops:
        got = OnnxEncoder(tmp_path / f"int8-{scope}.onnx", weights.projector()).encode_rgb(rgb, 0)
        assert got.shape == ref.shape and token_cosines(ref, got).min() > 0.9, (gen, scope)
    with pytest.raises(ValueError, match="int8_scope"):
        build_model(weights, int8=True, int8_scope="merger")
