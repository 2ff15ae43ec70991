"""Tests of the memory model: each term's behaviour, and one real load of the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.hardware import cpu_family, local_repack_family
from gguf_mcv.planning import memory
from gguf_mcv.planning.gpu_fit import fit_gpu_layers
from gguf_mcv.planning.memory import TextShape, VisionShape
from gguf_mcv.resolver import estimate_files

GB = 10**9
MiB = 2**20

#: Qwen2-7B, the text model of MiniCPM-V 2.6.
QWEN2_7B = TextShape(n_layers=28, n_embd=3584, n_head=28, n_head_kv=4, head_dim=128,
                     n_vocab=151666, n_ff=18944)
Q4_K_M_SIZE = 4_681_089_344
MMPROJ_SIZE = 1_044_425_152


def est(**kw) -> memory.MemoryEstimate:
    args = dict(model_size=Q4_K_M_SIZE, text=QWEN2_7B, mmproj_size=MMPROJ_SIZE, quant="Q4_K_M",
                cpu="x86-avx2")
    return memory.estimate(**{**args, **kw})


# --- terms ----------------------------------------------------------------------------


def test_kv_cache_is_layers_times_heads_times_cells() -> None:
    # 2 (K and V) x 28 layers x 4 KV heads x 128 x 4096 cells x 2 bytes = 224 MiB
    assert memory.kv_cache_bytes(QWEN2_7B, 4096) == 224 * MiB
    assert est(n_ctx=4096).kv_cache == 224 * MiB


def test_kv_cache_cells_round_up_to_256() -> None:
    assert memory.kv_cache_bytes(QWEN2_7B, 4000) == memory.kv_cache_bytes(QWEN2_7B, 4096)
    assert memory.kv_cache_bytes(QWEN2_7B, 4097) == memory.kv_cache_bytes(QWEN2_7B, 4352)


def test_estimate_grows_with_n_ctx() -> None:
    sizes = [est(n_ctx=n) for n in (1024, 2048, 4096, 8192, 16384)]
    for small, big in zip(sizes, sizes[1:]):
        assert small.kv_cache < big.kv_cache
        assert small.total < big.total
        assert small.needed < big.needed


def test_quantized_kv_cache_halves_or_quarters_the_kv_term() -> None:
    f16 = est(kv_cache_type="f16").kv_cache
    assert est(kv_cache_type="q8_0").kv_cache == pytest.approx(f16 * 34 / 64)  # ~1/2
    assert est(kv_cache_type="q4_0").kv_cache == pytest.approx(f16 * 18 / 64)  # ~1/4


def test_unknown_kv_type_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv_cache_type"):
        est(kv_cache_type="q5_1")


def test_hybrid_models_keep_kv_only_for_attention_layers() -> None:
    hybrid = TextShape(n_layers=24, n_kv_layers=6, n_embd=1024, n_head=8, n_head_kv=2,
                       head_dim=256, n_vocab=248320)
    full = TextShape(n_layers=24, n_embd=1024, n_head=8, n_head_kv=2, head_dim=256, n_vocab=248320)
    assert memory.kv_cache_bytes(hybrid, 8192) * 4 == memory.kv_cache_bytes(full, 8192)


def test_weights_and_projector_count_at_file_size() -> None:
    e = est()
    assert e.weights == Q4_K_M_SIZE  # MAP_POPULATE: the whole file is resident
    assert e.vision_weights == MMPROJ_SIZE  # clip reads the mmproj into its own buffer


def test_repacking_adds_to_peak_but_not_to_need() -> None:
    x86, none = est(cpu="x86-avx2"), est(cpu="none")
    assert x86.repacked > 0.6 * (Q4_K_M_SIZE - 600 * MiB)  # Q4_K layers are repacked on AVX2
    assert none.repacked == 0
    assert x86.total - none.total == x86.repacked
    assert x86.needed == none.needed


def test_repacked_bytes_from_a_tensor_list_is_exact() -> None:
    tensors = [("token_embd.weight", "Q4_0", 1000), ("blk.0.attn_q.weight", "Q4_0", 300),
               ("blk.0.attn_q.bias", "F32", 7), ("blk.0.ffn_down.weight", "Q6_K", 500),
               ("output.weight", "Q8_0", 800)]
    assert memory.repacked_bytes(0, QWEN2_7B, "Q4_0", "x86-avx2", tensors) == 300
    assert memory.repacked_bytes(0, QWEN2_7B, "Q4_0", "arm-dotprod", tensors) == 1600
    assert memory.repacked_bytes(0, QWEN2_7B, "Q4_0", "none", tensors) == 0


def test_more_image_tokens_and_pixels_cost_more() -> None:
    one_slice = est(image_tokens=64, image_pixels=448 * 448)
    full = est(image_tokens=640, image_pixels=1344 * 1344)
    assert one_slice.images < full.images < est(image_tokens=640, image_pixels=12_000_000).images


def test_vision_compute_without_flash_attention_adds_the_scores() -> None:
    v = VisionShape()
    with_fa = memory.vision_compute_bytes(v, 3584, flash_attn=True)
    without = memory.vision_compute_bytes(v, 3584, flash_attn=False)
    assert without - with_fa >= 16 * 1024 * 1024 * 4 - 32 * MiB  # 16 heads x 1024^2 f32, less reuse


def test_offloaded_layers_leave_ram() -> None:
    cpu = est(gpu_backend="cuda")
    half = est(n_gpu_layers=15, gpu_backend="cuda")
    full = est(n_gpu_layers=-1, vision_on_gpu=True, gpu_backend="cuda")
    assert cpu.gpu is None
    assert cpu.needed > half.needed > full.needed
    assert full.needed < 2 * GB  # token_embd, the runtime and the images stay in RAM
    assert half.gpu.weights < full.gpu.weights
    assert full.gpu.weights == pytest.approx(Q4_K_M_SIZE, rel=0.1)  # all but token_embd
    assert full.gpu.vision_weights == MMPROJ_SIZE and full.vision_weights == 0
    assert full.gpu.kv_cache == memory.kv_cache_bytes(QWEN2_7B, 4096) and full.kv_cache == 0


def test_unified_memory_offload_frees_no_ram() -> None:
    cpu = est(gpu_backend="cuda", unified_memory=True)
    full = est(n_gpu_layers=-1, vision_on_gpu=True, gpu_backend="cuda", unified_memory=True)
    assert full.needed >= cpu.needed  # device copies come out of the same RAM


def test_metal_wraps_the_mapping_instead_of_copying() -> None:
    full = est(n_gpu_layers=-1, vision_on_gpu=True, gpu_backend="metal", unified_memory=True)
    assert full.gpu.weights == 0
    assert full.needed >= Q4_K_M_SIZE + MMPROJ_SIZE


def test_n_gpu_layers_counts_the_output_first() -> None:
    one = est(n_gpu_layers=1, gpu_backend="cuda")
    token_embd, output = memory.embedding_bytes(QWEN2_7B, "Q4_K_M")
    assert one.gpu.weights == output
    assert est(n_gpu_layers=2, gpu_backend="cuda").gpu.weights == output + memory.layer_bytes(
        Q4_K_M_SIZE, QWEN2_7B, "Q4_K_M")


def test_gpu_layers_need_a_backend() -> None:
    with pytest.raises(ConfigError, match="gpu_backend"):
        est(n_gpu_layers=4)


def test_layer_bytes_excludes_embeddings() -> None:
    per_layer = memory.layer_bytes(Q4_K_M_SIZE, QWEN2_7B, "Q4_K_M")
    token_embd, output = memory.embedding_bytes(QWEN2_7B, "Q4_K_M")
    assert per_layer * 28 + token_embd + output == pytest.approx(Q4_K_M_SIZE, abs=28)
    assert 130e6 < per_layer < 160e6


def test_fit_gpu_layers_fills_free_vram() -> None:
    kw = dict(model_size=Q4_K_M_SIZE, text=QWEN2_7B, quant="Q4_K_M", n_ctx=4096)
    assert fit_gpu_layers(24 * GB, **kw) == 29  # everything, output included
    partial = fit_gpu_layers(4 * GB, **kw)
    assert 10 < partial < 29
    assert fit_gpu_layers(200 * MiB, **kw) == 0
    with_vision = fit_gpu_layers(4 * GB, **kw, mmproj_size=MMPROJ_SIZE, vision_on_gpu=True)
    assert with_vision < partial


def test_long_prompt_headroom_is_part_of_need() -> None:
    e = est()
    assert e.long_prompt > 0
    assert e.needed == e.runtime - e.reclaimable + e.long_prompt
    # the 512-row logits reserve is never touched by the engine (1 output row per batch)
    assert e.long_prompt < memory.reserved_compute_bytes(QWEN2_7B, 4096)


def test_estimate_files_reads_shapes_from_headers(tiny) -> None:
    e = estimate_files(tiny.quants["Q4_0"], tiny.mmproj, n_ctx=4096, cpu="x86-avx2")
    spec = tiny.spec
    assert e.kv_cache == memory.kv_cache_bytes(
        TextShape(spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv,
                  spec.n_embd // spec.n_head, spec.n_vocab), 4096)
    assert e.weights == tiny.quants["Q4_0"].stat().st_size
    assert e.vision_weights == tiny.mmproj.stat().st_size
    assert 0 < e.repacked < e.weights  # the Q4_0 layer matrices, not token_embd
    tokens = spec.n_vocab * memory.VOCAB_BYTES_PER_TOKEN  # merges counted from the header:
    assert tokens < e.vocab <= tokens + spec.n_merges * memory.MERGE_BYTES


def test_to_dict_has_totals() -> None:
    d = est(n_gpu_layers=-1, gpu_backend="cuda").to_dict()
    assert d["total"] >= d["needed"] - d["long_prompt"]
    assert d["gpu"]["total"] > d["gpu"]["weights"]


def test_local_cpu_family_is_known() -> None:
    assert local_repack_family() in memory.REPACKED_TYPES
    assert cpu_family("aarch64") == "arm-dotprod"
    assert cpu_family("riscv64") == "none"


def test_the_repack_family_comes_from_the_flags_and_the_probe_carries_it(tmp_path: Path) -> None:
    from gguf_mcv.hardware import probe, repack_family

    assert repack_family("x86_64", frozenset({"avx2", "avx512f"})) == "x86-avx512"
    assert repack_family("x86_64", frozenset({"avx2"})) == "x86-avx2"
    assert repack_family("x86_64", frozenset({"sse4_2"})) == "none"
    assert repack_family("x86_64", frozenset()) == "x86-avx2"  # no flags known: the architecture's assumption
    assert repack_family("aarch64", frozenset({"asimd"})) == "none"
    assert repack_family("aarch64", frozenset({"asimd", "asimddp"})) == "arm-dotprod"
    for name, text in {"proc/meminfo": "MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n",
                       "proc/cpuinfo": "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    hw = probe(tmp_path, cache_dir=tmp_path)
    assert hw.repack_family == repack_family(hw.machine, frozenset({"fpu", "avx2", "avx512f", "avx512bw"}))


def test_the_plan_counts_the_repacked_copies_of_its_cpu_family() -> None:
    """Q2_K tensors are repacked on AVX-512 and not on AVX2: a plan for each counts what its loads copy."""
    from dataclasses import replace

    from gguf_mcv.hardware import Hardware
    from gguf_mcv.planning.planner import QuantCandidate, choose

    base = Hardware(system="Linux", machine="x86_64", total_ram=2**35, available_ram=2**34,
                    memory_limit_source=None, physical_cores=4, performance_cores=None, cpu_quota=None,
                    allowed_cpus=None, board=None, board_kind=None, gpus=(), gpu_offload=False,
                    gpu_offload_note=None, cache_dir=Path("/tmp"), free_disk=None)
    shape = TextShape(n_layers=24, n_embd=896, n_head=14, n_head_kv=2, head_dim=64, n_vocab=151936, n_ff=4864)
    repacked = {}
    for family in ("x86-avx2", "x86-avx512", None):
        plan = choose([QuantCandidate("Q2_K", "m-Q2_K.gguf", 412_642_528)], mmproj_size=864_329_248, arch=shape,
                      vision=VisionShape(), hardware=replace(base, repack_family=family), quant="Q2_K")
        repacked[family] = plan.estimate.repacked
    assert repacked["x86-avx2"] < repacked["x86-avx512"]  # its Q2_K layers, repacked on AVX-512 only
    assert repacked[None] == repacked["x86-avx2"]  # a machine described by hand: x86 assumed AVX2


# --- one real measurement ---------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import json, sys
    import gguf_mcv
    # the memory model describes libmtmd's encoder (the ONNX backend: tools/bench_vision.py)
    model = gguf_mcv.load(model_path=sys.argv[1], mmproj_path=sys.argv[2], n_ctx=4096, vision_backend="llama.cpp")
    model.ask("What is in this picture?", sys.argv[3], max_tokens=4, detail="high")
    # VmHWM, not ru_maxrss: ru_maxrss inherits the (big) pytest parent's high-water mark
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print(json.dumps({"peak": int(status["VmHWM"].split()[0]) * 1024}))
""")


def test_prediction_matches_a_real_load_of_the_tiny_model(tiny, tmp_path) -> None:
    image = tmp_path / "photo.png"
    rng = np.random.default_rng(0)
    PIL.Image.fromarray(rng.integers(0, 255, (1344, 1344, 3), dtype=np.uint8)).save(image)
    model = tiny.quants["Q4_K_M"]
    out = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(tiny.mmproj), str(image)],
                         capture_output=True, text=True, timeout=300, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    predicted = estimate_files(model, tiny.mmproj, n_ctx=4096, image_tokens=640,
                                      image_pixels=1344 * 1344).total
    assert predicted == pytest.approx(measured, rel=0.15), (predicted / MiB, measured / MiB)


# --- the ONNX vision backend -----------------------------------------------------------------


def test_onnx_int8_tower_is_smaller_than_libmtmds_and_fp32_larger() -> None:
    llama, int8, fp32 = (est(vision_backend=b) for b in ("llama.cpp", "onnx-int8", "onnx-fp32"))
    # SigLIP-400M + 2.6's 3584-wide resampler (fp32 in both graphs: onnx_vision.int8_scope): int8
    # ~ 0.68x the F16 file, fp32 ~ twice it
    assert 0.65 * MMPROJ_SIZE < int8.vision_weights < 0.7 * MMPROJ_SIZE
    assert 1.8 * MMPROJ_SIZE < fp32.vision_weights <= 2 * MMPROJ_SIZE
    assert int8.total < llama.total < fp32.total and int8.needed < llama.needed < fp32.needed
    # the text side is the same whoever runs the encoder
    assert (int8.weights, int8.kv_cache, int8.compute, int8.images) == (
        llama.weights, llama.kv_cache, llama.compute, llama.images)
    assert int8.overhead - llama.overhead == memory.ORT_RUNTIME
    assert (llama.vision_backend, int8.vision_backend) == ("llama.cpp", "onnx-int8")


def test_onnx_weights_and_arena_are_never_reclaimable() -> None:
    llama, int8 = est(vision_backend="llama.cpp"), est(vision_backend="onnx-int8")
    assert int8.reclaimable == llama.reclaimable  # ONNX Runtime reads its weights into anonymous memory
    assert llama.needed - int8.needed == llama.total - int8.total


def test_onnx_arena_is_the_attention_scores_twice() -> None:
    siglip = VisionShape()
    assert memory.onnx_arena_bytes(siglip) == 2 * 16 * 1024 * 1024 * 4  # 128 MiB
    assert memory.onnx_arena_bytes(VisionShape(heads=4)) == memory.onnx_arena_bytes(siglip) // 4
    merger = VisionShape(projector="minicpmv4_6", full_blocks=1)
    assert memory.onnx_arena_bytes(merger) == memory.onnx_arena_bytes(siglip) + 1024 * 1024 * 4  # + window mask
    assert est(vision_backend="onnx-fp32").vision_compute == memory.onnx_arena_bytes(siglip)


def test_onnx_weights_of_an_undescribed_tower_are_bounded_by_the_file() -> None:
    small_file = 6 * MiB  # a tiny mmproj planned with SigLIP-400M's default shape
    for variant in ("int8", "fp32"):
        assert memory.onnx_weight_bytes(VisionShape(), 3584, small_file, variant) <= 2 * small_file
        merger = VisionShape(projector="minicpmv4_6", full_blocks=1)  # merger = file less tower: never negative
        assert 0 <= memory.onnx_weight_bytes(merger, 1024, small_file, variant) <= 2 * small_file
    empty = VisionShape(width=0, blocks=0, heads=0, ff=0, patch_size=0, image_size=0)  # a zeroed header
    assert memory.onnx_weight_bytes(empty, 0, 0) == 0 and memory.onnx_arena_bytes(empty) == 0


@pytest.mark.parametrize("backend", ["auto", "ONNX-INT8", "onnx", "", None, 3])
def test_an_unresolved_or_unknown_vision_backend_is_refused(backend) -> None:
    with pytest.raises(ConfigError, match="vision_backend"):
        est(vision_backend=backend)


def test_onnx_on_the_gpu_and_unknown_variants_are_refused() -> None:
    with pytest.raises(ConfigError, match="CPU"):
        est(vision_backend="onnx-int8", vision_on_gpu=True, gpu_backend="cuda")
    with pytest.raises(ConfigError, match="variant"):
        memory.onnx_weight_bytes(VisionShape(), 3584, MMPROJ_SIZE, "int4")


def test_mapped_onnx_weights_swap_with_the_text_pages_read_while_answering() -> None:
    for cpu in ("none", "x86-avx512"):  # without and with repacked copies of the layers
        packed = est(vision_backend="onnx-int8", cpu=cpu, quant="Q4_0")
        mapped = est(vision_backend="onnx-int8", cpu=cpu, quant="Q4_0", vision_mapped=True)
        text_pages = packed.weights - packed.reclaimable  # what is read from the mapping per token
        assert mapped.swapped == min(text_pages, packed.vision_weights) > 0
        assert mapped.needed == packed.needed - mapped.swapped
        assert mapped.total == packed.total  # with RAM to spare every page stays
    assert est(vision_backend="onnx-int8").swapped == 0
    with pytest.raises(ConfigError, match="ONNX"):
        est(vision_mapped=True)  # libmtmd: nothing is mapped


def _initializer_bytes(path) -> int:
    """What an ONNX file's initializers hold, from their shapes and types (external data not read)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    itemsize = lambda t: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize  # noqa: E731
    return sum(int(np.prod(t.dims, dtype=np.int64)) * itemsize(t) for t in model.graph.initializer)


@pytest.mark.slow
def test_onnx_weights_match_the_tiny_models_conversion(tiny) -> None:
    pytest.importorskip("onnxruntime")
    from gguf_mcv.models.headers import read_projector_header, read_text_header
    from gguf_mcv.runtime.engine import file_identity
    from gguf_mcv.vision import onnx_vision

    converted = onnx_vision.prepare(tiny.mmproj, file_identity(tiny.mmproj))  # cached per test session
    projector, text = read_projector_header(tiny.mmproj), read_text_header(tiny.quants["Q4_K_M"])
    for variant in ("int8", "fp32"):
        predicted = memory.onnx_weight_bytes(projector.shape, text.shape.n_embd, projector.size, variant)
        assert predicted == pytest.approx(_initializer_bytes(converted.path(variant)), rel=0.01), variant


# --- parallel slots -------------------------------------------------------------------------


def test_a_slot_costs_its_kv_cache_and_a_batch_row() -> None:
    per_slot = memory.slot_bytes(QWEN2_7B, 4096)
    assert memory.kv_cache_bytes(QWEN2_7B, 4096) < per_slot < memory.kv_cache_bytes(QWEN2_7B, 4096) + 2 * MiB
    assert memory.slot_bytes(QWEN2_7B, 4096, "q8_0") < per_slot  # a quantized KV cache is smaller
    # a slot whose prompt waits for the encoder holds that image's f32 slices (ONNX: twice)
    waiting = memory.slot_bytes(QWEN2_7B, 4096, vision=VisionShape()) - per_slot
    assert waiting == 10 * 448 * 448 * 12 and 20 * MiB < waiting < 30 * MiB
    assert memory.slot_bytes(QWEN2_7B, 4096, vision=VisionShape(), vision_backend="onnx-int8") == per_slot + 2 * waiting


@pytest.mark.parametrize(("needed", "budget", "expected"), [
    (5 * GB, 4 * GB, 1),            # nothing to spare: still one (the plan said it fits)
    (5 * GB, 5 * GB + 10, 1),       # less than one more slot
    (5 * GB, 5 * GB + 3 * 300 * MiB, 4),
    (1 * GB, 100 * GB, memory.AUTO_MAX_PARALLEL),  # capped
])
def test_parallel_for_budget(needed, budget, expected) -> None:
    assert memory.parallel_for_budget(needed, 300 * MiB, budget) == expected


def test_a_photo_resized_for_its_slices_is_counted_at_its_draft_decode() -> None:
    """A 12 MP JPEG asked about in 4 slices is decoded at half size (JPEG draft mode), in 9 slices
    at full size (libmtmd resizes it then): what gguf_mcv.vision.media does."""
    full = memory.image_bytes(12_000_000, 640)
    assert memory.decoded_size(12_000_000, 640) == ((4000, 3000), (4000, 3000))
    (dw, dh), (rw, rh) = memory.decoded_size(12_000_000, 320)
    assert (dw, dh) == (2000, 1500) and rw <= dw and rh <= dh
    assert memory.image_bytes(12_000_000, 320) < full / 2
    assert memory.image_bytes(1344 * 1344, 640) == int(memory.IMAGE_COPIES * 1344 * 1344 * 3 + 10 * 448 * 448 * 12)
