"""One shape type per tower, from a GGUF header (local or a remote prefix) and from the catalog."""

from __future__ import annotations

from dataclasses import replace

from gguf_mcv.models.catalog import load_catalog
from gguf_mcv.models.headers import read_projector_header, read_text_header
from gguf_mcv.models.shapes import FF_RATIO, TextShape, VisionShape
from gguf_mcv.planning import memory
from gguf_mcv.resolver import estimate_files
from gguf_mcv.testing import synthetic


def test_text_shape_from_a_gguf_header(tiny) -> None:
    shape = read_text_header(tiny.quants["Q4_K_M"]).shape
    spec = tiny.spec
    assert (shape.architecture, shape.n_layers, shape.n_embd, shape.n_head) == (
        "qwen2", spec.n_layer, spec.n_embd, spec.n_head)
    assert (shape.n_vocab, shape.n_ff) == (spec.n_vocab, spec.n_ff)
    assert shape.n_merges is not None and 0 < shape.n_merges <= spec.n_merges
    assert shape.head_dim == spec.n_embd // spec.n_head and shape.kv_layers == spec.n_layer


def test_text_shape_from_a_header_prefix_takes_the_vocabulary_from_the_token_list() -> None:
    fields = {"general.architecture": "qwen2", "qwen2.block_count": 4, "qwen2.embedding_length": 64,
              "qwen2.attention.head_count": 4, "tokenizer.ggml.tokens": ["a", "b", "c"]}
    shape = TextShape.from_gguf(fields, {})
    assert (shape.n_vocab, shape.n_head_kv, shape.head_dim, shape.n_merges) == (3, 4, 16, None)
    assert not shape.tied_embeddings and shape.ff == round(64 * FF_RATIO)


def test_vision_shape_from_an_mmproj_header(tiny) -> None:
    shape = read_projector_header(tiny.mmproj).shape
    spec = tiny.spec
    assert (shape.width, shape.blocks, shape.heads, shape.ff) == (spec.v_embd, spec.v_layer, spec.v_head, spec.v_ff)
    assert (shape.image_size, shape.patch_size, shape.query_tokens) == (448, 14, 64)
    assert shape.patches == 1024


def test_vision_shape_defaults_the_query_count_by_generation(tmp_path) -> None:
    v25 = synthetic.write_mmproj(tmp_path / "v25.gguf", replace(synthetic.TINY, minicpmv_version=2, query_num=96))
    assert read_projector_header(v25).shape.query_tokens == 96
    assert VisionShape.from_gguf({"clip.minicpmv_version": 2}).query_tokens == 96  # key absent: clip.cpp's default
    assert VisionShape.from_gguf({"clip.minicpmv_version": 3}).query_tokens == 64


def test_vision_shape_knows_where_minicpm_v_46_merges_its_tokens(tmp_path) -> None:
    spec = replace(synthetic.GENERATIONS["4.6"][0], v_layer=4, merger_layer=2)
    v46 = synthetic.write_mmproj(tmp_path / "v46.gguf", spec)
    assert read_projector_header(v46).shape.full_blocks == 3  # blocks 0..2 see every patch
    assert VisionShape.from_gguf({"clip.projector_type": "resampler",
                                  "clip.vision.wa_layer_indexes": [2]}).full_blocks is None
    assert VisionShape.from_gguf({"clip.projector_type": "minicpmv4_6"}).full_blocks is None
    assert load_catalog().get("minicpm-v-4.6").vision.full_blocks == 7
    assert load_catalog().get("minicpm-v-2.6").vision.full_blocks is None


def test_catalog_entries_carry_the_same_types() -> None:
    for entry in load_catalog().entries():
        assert isinstance(entry.arch, TextShape) and isinstance(entry.vision, VisionShape)
        assert entry.arch.architecture and entry.arch.n_ctx_train >= entry.n_ctx
    v46 = load_catalog().get("minicpm-v-4.6")
    assert v46.arch.kv_layers < v46.arch.n_layers  # hybrid: fewer layers keep a KV cache
    assert v46.vision.heads == VisionShape().heads  # the catalog omits it: SigLIP-400M's


def test_memory_estimate_for_files_uses_the_header_shapes(tiny) -> None:
    text = read_text_header(tiny.quants["Q8_0"])
    proj = read_projector_header(tiny.mmproj)
    direct = memory.estimate(model_size=text.size, text=text.shape, mmproj_size=proj.size,
                             vision=proj.shape, quant="Q8_0", cpu="none")
    from_files = estimate_files(tiny.quants["Q8_0"], tiny.mmproj, quant="Q8_0", cpu="none",
                                       tensors=None)
    assert direct.kv_cache == from_files.kv_cache and direct.vision_compute == from_files.vision_compute


def test_a_hybrid_header_gives_its_kv_layers_and_recurrent_state(tmp_path) -> None:
    files = synthetic.build(tmp_path / "v46", synthetic.PRESETS["4.6"], ["Q4_K_M"])
    text = read_text_header(files.quants["Q4_K_M"]).shape
    spec = synthetic.PRESETS["4.6"]
    assert text.kv_layers == spec.n_layer // spec.full_attention_interval == 1
    # llama.cpp's log for this file: "RS buffer size = 0.21 MiB" (R 0.03 + S 0.19, 3 recurrent layers)
    inner = spec.ssm_heads * spec.ssm_head_dim
    per_layer = 3 * (inner + 2 * spec.ssm_heads * spec.ssm_head_dim) + spec.ssm_head_dim * inner
    assert text.recurrent_values == 3 * per_layer
    assert round(text.recurrent_values * 4 / 2**20, 2) == 0.21
    assert read_projector_header(files.mmproj).shape.projector == "minicpmv4_6"


def test_attention_only_models_have_no_recurrent_state(tiny) -> None:
    text = read_text_header(tiny.quants["Q4_K_M"]).shape
    assert text.recurrent_values == 0 and text.kv_layers == text.n_layers
    assert read_projector_header(tiny.mmproj).shape.projector == "resampler"


def test_the_memory_model_counts_as_many_checkpoints_as_the_engine_keeps() -> None:
    from gguf_mcv.runtime import sequence

    assert memory.RECURRENT_CHECKPOINTS == sequence.MAX_CHECKPOINTS


def test_the_catalog_46_entry_has_a_recurrent_state() -> None:
    from gguf_mcv.models import catalog

    entry = catalog.lookup("minicpm-v-4.6")
    assert entry is not None and entry.arch.kv_layers == 6 and entry.arch.recurrent_values > 0
    assert entry.vision.projector == "minicpmv4_6"
    assert catalog.lookup("minicpm-v-2.6").arch.recurrent_values == 0
