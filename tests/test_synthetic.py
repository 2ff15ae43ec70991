"""The synthetic MiniCPM-V generator: files, reuse, determinism, and a real llama.cpp load."""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

import gguf_mcv
from gguf_mcv.errors import ConfigError
from gguf_mcv import generations as registry
from gguf_mcv.testing import synthetic, synthetic_specs
from gguf_mcv.testing.synthetic import LADDER, TINY, SyntheticModel, build

llama_cpp = pytest.importorskip("llama_cpp")
mtmd = pytest.importorskip("llama_cpp.mtmd_cpp")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SyntheticModel:
    return build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(tiny: SyntheticModel) -> Iterator[llama_cpp.Llama]:
    model = gguf_mcv.checked_llama(str(tiny.quants["Q4_K_M"]), n_ctx=2048, n_threads=2, verbose=False)
    yield model
    model.close()


def _fields(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


# --- files, reuse, determinism ------------------------------------------------


def test_ladder_files_exist_and_grow(tiny: SyntheticModel) -> None:
    assert list(tiny.quants) == list(LADDER)
    assert tiny.mmproj.name == "mmproj-model-f16.gguf" and tiny.mmproj.is_file()
    assert tiny.quants["Q4_K_M"].name == "ggml-model-Q4_K_M.gguf"
    sizes = [tiny.quants[q].stat().st_size for q in LADDER] + [tiny.f16.stat().st_size]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes), sizes
    assert not list(tiny.out_dir.glob("*.part"))


def test_rebuild_reuses_files(tiny: SyntheticModel) -> None:
    files = [tiny.mmproj, tiny.f16, *tiny.quants.values()]
    before = {p: p.stat().st_mtime_ns for p in files}
    again = build(tiny.out_dir)
    assert again == tiny
    assert {p: p.stat().st_mtime_ns for p in files} == before


def test_same_seed_is_byte_identical(tiny: SyntheticModel, tmp_path: Path) -> None:
    other = build(tmp_path, quants=["Q4_K_M"])
    for a, b in [(tiny.mmproj, other.mmproj), (tiny.f16, other.f16), (tiny.quants["Q4_K_M"], other.quants["Q4_K_M"])]:
        assert a.read_bytes() == b.read_bytes(), a.name


def test_other_seed_rebuilds_with_other_bytes(tiny: SyntheticModel, tmp_path: Path) -> None:
    first = build(tmp_path, dataclasses.replace(TINY, seed=1), quants=["Q4_0"])
    old = first.quants["Q4_0"].read_bytes()
    assert old != tiny.quants["Q4_0"].read_bytes()
    second = build(tmp_path, dataclasses.replace(TINY, seed=2), quants=["Q4_0"])  # same folder: manifest differs
    assert second.quants["Q4_0"].read_bytes() != old
    assert second.mmproj.read_bytes() != tiny.mmproj.read_bytes()


def test_damaged_file_is_rebuilt(tmp_path: Path) -> None:
    model = build(tmp_path, quants=["Q8_0"])
    good = model.quants["Q8_0"].read_bytes()
    model.quants["Q8_0"].write_bytes(good[: len(good) // 2])  # as if a copy was cut short
    assert build(tmp_path, quants=["Q8_0"]).quants["Q8_0"].read_bytes() == good


def test_extra_quant_reuses_the_rest(tmp_path: Path) -> None:
    model = build(tmp_path, quants=["Q2_K"])
    before = model.f16.stat().st_mtime_ns
    more = build(tmp_path, quants=["Q2_K", "Q5_0"])
    assert more.quants["Q5_0"].is_file() and more.f16.stat().st_mtime_ns == before


def test_bad_names_and_shapes_raise_config_error(tiny: SyntheticModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown quant"):
        synthetic.quantize(tiny.f16, tmp_path / "x.gguf", "Q9_K")
    with pytest.raises(ConfigError):
        build(tmp_path, quants=["IQ1_S"])
    with pytest.raises(ConfigError, match="multiple of 128"):
        dataclasses.replace(TINY, n_embd=192).validate()
    with pytest.raises(ConfigError, match="v_ff"):
        synthetic.write_mmproj(tmp_path / "m.gguf", dataclasses.replace(TINY, v_ff=TINY.v_embd))
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob("*.part"))


# --- GGUF contents --------------------------------------------------------------


def test_text_model_header(tiny: SyntheticModel) -> None:
    kv = _fields(tiny.quants["Q4_K_M"])
    assert kv["general.architecture"] == "qwen2"
    assert kv["qwen2.embedding_length"] == TINY.n_embd and kv["qwen2.block_count"] == TINY.n_layer
    assert kv["qwen2.attention.head_count_kv"] == TINY.n_head_kv
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "qwen2"
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert len(tokens) == TINY.n_vocab and len(kv["tokenizer.ggml.merges"]) > 100
    assert "Ċ" in tokens and tokens[-1] == f"[PAD{TINY.n_vocab - 1}]"
    for special in synthetic_specs.SPECIAL_TOKENS:
        assert types[tokens.index(special)] == gguf.TokenType.CONTROL
    assert types[tokens.index("Ċ")] == gguf.TokenType.NORMAL and types[-1] == gguf.TokenType.UNUSED
    assert tokens[kv["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert tokens[kv["tokenizer.ggml.bos_token_id"]] == "<|endoftext|>"
    assert kv["tokenizer.ggml.add_bos_token"] is False
    assert "<|im_start|>" in kv["tokenizer.chat_template"] and "add_generation_prompt" in kv["tokenizer.chat_template"]
    expected = {"token_embd.weight", "output.weight", "blk.1.attn_q.bias", "blk.1.attn_v.bias", "blk.1.ffn_gate.weight"}
    assert expected <= set(_tensors(tiny.f16))


def test_mmproj_header(tiny: SyntheticModel) -> None:
    kv = _fields(tiny.mmproj)
    assert kv["general.architecture"] == "clip" and kv["clip.projector_type"] == "resampler"
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    assert kv["clip.minicpmv_version"] == 3 and kv["clip.minicpmv_query_num"] == 64
    assert kv["clip.vision.image_size"] == 448 and kv["clip.vision.patch_size"] == 14
    assert kv["clip.vision.projection_dim"] == 0 and kv["clip.vision.block_count"] == TINY.v_layer
    assert kv["clip.vision.image_mean"] == pytest.approx([0.5] * 3)
    t = _tensors(tiny.mmproj)
    assert t["v.patch_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert list(t["v.position_embd.weight"].shape) == [TINY.v_embd, 4900]  # ggml order
    assert list(t["resampler.pos_embed_k"].shape) == [TINY.n_embd, 4900]
    assert list(t["resampler.query"].shape) == [TINY.n_embd, 64]
    assert list(t["resampler.proj.weight"].shape) == [TINY.n_embd, TINY.n_embd]


# --- real loads through llama.cpp and libmtmd ---------------------------------


def _bitmap(width: int, height: int) -> object:
    from PIL import Image

    gradient = np.linspace(0, 255, width * height * 3).astype(np.uint8).reshape(height, width, 3)
    rgb = Image.fromarray(gradient, "RGB").tobytes()
    return mtmd.mtmd_bitmap_init(width, height, (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb))


@pytest.fixture()
def mctx(tiny: SyntheticModel, llm: llama_cpp.Llama) -> Iterator[object]:
    ctx = _mtmd_init(tiny.mmproj, llm)
    assert ctx is not None
    yield ctx
    mtmd.mtmd_free(ctx)


def _mtmd_init(mmproj: Path, llm: llama_cpp.Llama) -> object:
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads = False, 2
    return mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)


def _tokenize(ctx: object, width: int, height: int) -> tuple[object, list[tuple[int, int]]]:
    """Tokenize one image plus text; return the chunks and their (type, n_tokens)."""
    bitmap = _bitmap(width, height)
    prompt = mtmd.mtmd_default_marker() + b"describe"
    text = mtmd.mtmd_input_text(text=prompt, text_len=len(prompt), add_special=True, parse_special=True)
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
    finally:
        mtmd.mtmd_bitmap_free(bitmap)
    found = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
    return chunks, [(mtmd.mtmd_input_chunk_get_type(c), mtmd.mtmd_input_chunk_get_n_tokens(c)) for c in found]


def test_text_model_loads_and_tokenizes(llm: llama_cpp.Llama) -> None:
    text = b"the picture shows a small dog"
    assert len(llm.tokenize(text, add_bos=False)) <= len(text) // 2  # the merges do merge
    assert llm.detokenize(llm.tokenize(text, add_bos=False)) == text
    assert llm.tokenize(b"<|im_start|>", add_bos=False, special=True) == [llm.token_eos() - 1]
    assert llm.n_embd() == TINY.n_embd and llm.n_vocab() == TINY.n_vocab


def test_mtmd_small_image_is_one_overview(mctx: object) -> None:
    assert mtmd.mtmd_support_vision(mctx)
    chunks, kinds = _tokenize(mctx, 320, 240)
    mtmd.mtmd_input_chunks_free(chunks)
    assert [n for t, n in kinds if t == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE] == [64]


def test_mtmd_large_image_is_overview_plus_nine_slices(mctx: object) -> None:
    chunks, kinds = _tokenize(mctx, 1344, 1344)
    mtmd.mtmd_input_chunks_free(chunks)
    assert [n for t, n in kinds if t == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE] == [64] * 10


def test_mtmd_encode_gives_finite_embeddings(mctx: object, llm: llama_cpp.Llama) -> None:
    chunks, kinds = _tokenize(mctx, 448, 448)
    try:
        index = [t for t, _ in kinds].index(mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE)
        assert mtmd.mtmd_encode_chunk(mctx, mtmd.mtmd_input_chunks_get(chunks, index)) == 0
        embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(mctx), shape=(64, llm.n_embd())).copy()
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
    assert np.isfinite(embd).all() and embd.std() > 0


def test_mismatched_width_mmproj_is_refused(llm: llama_cpp.Llama, tmp_path: Path) -> None:
    wrong = synthetic.write_mmproj(tmp_path / "mmproj-wide.gguf", dataclasses.replace(TINY, n_embd=384))
    assert _mtmd_init(wrong, llm) is None


def test_version_2_mmproj_gives_96_tokens(llm: llama_cpp.Llama, tmp_path: Path) -> None:
    spec = dataclasses.replace(TINY, minicpmv_version=2, query_num=96)
    ctx = _mtmd_init(synthetic.write_mmproj(tmp_path / "mmproj-v25.gguf", spec), llm)
    assert ctx is not None
    try:
        chunks, kinds = _tokenize(ctx, 320, 240)
        mtmd.mtmd_input_chunks_free(chunks)
    finally:
        mtmd.mtmd_free(ctx)
    assert [n for t, n in kinds if t == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE] == [96]


def test_chat_completion_through_minicpmv26_handler(tiny: SyntheticModel) -> None:
    from llama_cpp.llama_chat_format import MiniCPMv26ChatHandler
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    handler = MiniCPMv26ChatHandler(clip_model_path=str(tiny.mmproj), verbose=False)
    llm = gguf_mcv.checked_llama(
        model_path=str(tiny.quants["Q2_K"]), chat_handler=handler, n_ctx=2048, n_threads=2, verbose=False, seed=1
    )
    try:
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uri}},
            {"type": "text", "text": "What is in this picture?"},
        ]}]  # fmt: skip
        reply = llm.create_chat_completion(messages=messages, max_tokens=8)
    finally:
        llm.close()
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(reply["choices"][0]["message"]["content"], str)


def test_command_line_overrides_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tools" / "make_test_model.py"
    loader = importlib.util.spec_from_file_location("make_test_model", path)
    assert loader is not None and loader.loader is not None
    tool = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(tool)
    args = tool.parse_args(["--out", str(tmp_path), "--quants", "Q4_0", "--n-embd", "384", "--seed", "7"])
    assert tool.spec_from_args(args) == dataclasses.replace(TINY, n_embd=384, seed=7)
    assert tool.main(["--out", str(tmp_path), "--quants", "Q4_0", "--n-embd", "384"]) == 0
    assert "ggml-model-Q4_0.gguf" in capsys.readouterr().out
    assert _fields(tmp_path / "ggml-model-Q4_0.gguf")["qwen2.embedding_length"] == 384
    assert tool.main(["--out", str(tmp_path), "--n-embd", "200"]) == 2


# --- one preset per MiniCPM-V generation ---------------------------------------

#: generation -> (text architecture, tokenizer.ggml.model, projector type, minicpmv_version, tokens per
#: slice) as the registry says them: llama.cpp and libmtmd must read the same off the files written
EXPECTED = {key: (g.text_arch, synthetic_specs.TOKENIZERS[g.tokenizer].model, g.projector_type, g.minicpmv_version,
                  g.tokens_per_slice)
            for key, g in registry.GENERATIONS.items() if g.synthetic_tiny is not None}


def test_every_generation_has_a_tiny_and_a_bench_preset() -> None:
    assert set(synthetic.GENERATIONS) == set(EXPECTED)
    for generation, (tiny, bench) in synthetic.GENERATIONS.items():
        assert synthetic.PRESETS[generation] == tiny and synthetic.PRESETS[f"{generation}-bench"] == bench
        arch, _, projector, _, _ = EXPECTED[generation]
        assert (tiny.text_arch, tiny.projector) == (bench.text_arch, bench.projector) == (arch, projector)
        assert bench.v_embd == 1152 and bench.v_layer == 27  # the real SigLIP-400M tower
    assert synthetic.PRESETS["2.6"] == synthetic.PRESETS["tiny"] == TINY


@pytest.mark.parametrize("generation", sorted(EXPECTED))
def test_generation_preset_loads_in_llama_cpp_and_libmtmd(generation: str, tmp_path: Path) -> None:
    arch, tokenizer, projector, version, per_slice = EXPECTED[generation]
    built = build(tmp_path, synthetic.PRESETS[generation], ["Q4_K_M"])
    text, proj = _fields(built.quants["Q4_K_M"]), _fields(built.mmproj)
    assert text["general.architecture"] == arch and text["tokenizer.ggml.model"] == tokenizer
    assert proj["clip.projector_type"] == projector and proj.get("clip.minicpmv_version") == version
    llm = gguf_mcv.checked_llama(str(built.quants["Q4_K_M"]), n_ctx=1024, n_threads=2, verbose=False)
    try:
        assert llm.metadata["general.architecture"] == arch
        ctx = _mtmd_init(built.mmproj, llm)
        assert ctx is not None
        try:
            chunks, kinds = _tokenize(ctx, 300, 200)  # fits one slice: the overview alone
            assert [n for kind, n in kinds if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE] == [per_slice]
            mtmd.mtmd_input_chunks_free(chunks)
        finally:
            mtmd.mtmd_free(ctx)
    finally:
        llm.close()


def test_qwen35_preset_mixes_recurrent_and_attention_layers(tmp_path: Path) -> None:
    spec = synthetic.PRESETS["4.6"]
    names = set(_tensors(synthetic.write_text_model(tmp_path / "t.gguf", spec)))
    attention = [i for i in range(spec.n_layer) if f"blk.{i}.attn_output.weight" in names]
    recurrent = [i for i in range(spec.n_layer) if f"blk.{i}.ssm_out.weight" in names]
    assert attention == [spec.full_attention_interval - 1] and len(recurrent) == spec.n_layer - 1
    assert {"blk.0.ssm_a", "blk.0.ssm_conv1d.weight", "blk.3.attn_q_norm.weight"} <= names


def test_command_line_builds_a_generation_preset(tmp_path: Path) -> None:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tools" / "make_test_model.py"
    loader = importlib.util.spec_from_file_location("make_test_model", path)
    assert loader is not None and loader.loader is not None
    tool = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(tool)
    assert tool.main(["--preset", "4.5", "--out", str(tmp_path), "--quants", "Q8_0", "--name", "X"]) == 0
    kv = _fields(tmp_path / "ggml-model-Q8_0.gguf")
    assert kv["general.architecture"] == "qwen3" and kv["general.name"].startswith("X ")
    assert tool.main(["--preset", "2.6", "--out", str(tmp_path / "b"), "--text-arch", "gpt9"]) == 2


def test_every_preset_is_a_valid_spec() -> None:
    for name, spec in synthetic.PRESETS.items():
        spec.validate()  # raises ConfigError naming the problem
        assert spec.n_embd % 256 == 0 or name.endswith("bench"), name  # K-quants need rows of 256


def test_hybrid_preset_quantizes_to_the_whole_ladder(tmp_path: Path) -> None:
    built = build(tmp_path, synthetic.PRESETS["4.6"])
    sizes = [built.quants[q].stat().st_size for q in LADDER] + [built.f16.stat().st_size]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes), sizes


@pytest.mark.parametrize("weight_type", ["Q5_1", "Q4_K", "Q8_0"])
def test_weight_type_writes_random_blocks_llama_cpp_runs_with_finite_logits(weight_type: str, tmp_path: Path) -> None:
    """The speed probe's models: every matrix of one type, written without the quantizer."""
    spec = dataclasses.replace(TINY, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_layer=1)
    path = synthetic.write_text_model(tmp_path / "m.gguf", spec, weight_type=weight_type)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {types[n] for n in types if n.endswith(".weight") and "norm" not in n} == {weight_type}
    assert {types[n] for n in types if "norm" in n} == {"F32"}
    # dequantized, the weights are small and finite, as a real model's (no inf/NaN scales)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    assert np.isfinite(w).all() and 0 < np.abs(w).max() < 1
    llm = gguf_mcv.checked_llama(str(path), n_ctx=64, n_threads=1, verbose=False, logits_all=False)
    try:
        llm.eval(llm.tokenize(b"hello world"))
        assert np.isfinite(np.asarray(llm.scores[llm.n_tokens - 1])).all()
    finally:
        llm.close()


def test_weight_type_refuses_unknown_types_and_rows_that_are_not_whole_blocks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown ggml type"):
        synthetic.write_text_model(tmp_path / "a.gguf", TINY, weight_type="Q9_X")
    with pytest.raises(ConfigError, match="multiple"):  # 128-wide rows hold no 256-weight K-quant block
        narrow = dataclasses.replace(TINY, n_embd=128, n_head=2)
        synthetic.write_text_model(tmp_path / "b.gguf", narrow, weight_type="Q4_K")
    assert not list(tmp_path.iterdir())
