"""Tests of the speed model: decode, prefill and encode times, photo slices, GPU split, limits."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.models.shapes import TextShape, VisionShape
from gguf_mcv.planning import memory, speed
from gguf_mcv.planning.speed import Rates

QWEN2_7B = TextShape(n_layers=28, n_embd=3584, n_head=28, n_head_kv=4, head_dim=128, n_vocab=151666)
BENCH = TextShape(n_layers=24, n_embd=896, n_head=14, n_head_kv=2, head_dim=64, n_vocab=151936, n_ff=4864)
TIED = replace(BENCH, tied_embeddings=True)
RATES = Rates(bandwidth=20e9, matvec=30e9, prefill_flops=60e9, vision_flops=100e9, threads=2, source="test")


@pytest.mark.parametrize("field", ["bandwidth", "matvec", "prefill_flops", "vision_flops"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "20e9", True, None])
def test_rates_refuse_impossible_values(field: str, value) -> None:
    with pytest.raises(ConfigError, match=field):
        replace(RATES, **{field: value})


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", None])
def test_rates_refuse_impossible_thread_counts(value) -> None:
    with pytest.raises(ConfigError, match="threads"):
        replace(RATES, threads=value)


def test_decode_reads_every_weight_but_the_token_embeddings() -> None:
    size = 488_859_872
    token_embd, _ = memory.embedding_bytes(BENCH, "Q4_K_M")
    assert speed.decode_bytes(size, BENCH, "Q4_K_M") == size - token_embd
    # tied: token_embd is the output matrix too, read whole for the logits
    assert speed.decode_bytes(size, TIED, "Q4_K_M") == size


def test_decode_is_bandwidth_bound_for_big_models_and_arithmetic_bound_when_matvec_is_slow() -> None:
    size = 4_681_089_344
    weights = speed.decode_bytes(size, QWEN2_7B, "Q4_K_M")
    kv = QWEN2_7B.kv_bytes_per_token() * 100
    t = speed.decode_seconds(size, QWEN2_7B, "Q4_K_M", RATES, n_past=100)
    memory_rate = RATES.bandwidth * speed.DECODE_BANDWIDTH_SHARE  # what llama.cpp's decode reaches
    assert t == pytest.approx((weights + kv) / memory_rate)
    slow = replace(RATES, matvec=1e9)
    t_slow = speed.decode_seconds(size, QWEN2_7B, "Q4_K_M", slow, n_past=100)
    assert t_slow == pytest.approx(weights / 1e9 + kv / memory_rate)  # the KV cache is read, not multiplied


def test_decode_slows_with_file_size_and_context() -> None:
    small = speed.decode_seconds(3_000_000_000, QWEN2_7B, "Q2_K", RATES)
    big = speed.decode_seconds(8_100_000_000, QWEN2_7B, "Q8_0", RATES)
    assert big > 2 * small
    short = speed.decode_seconds(4_681_089_344, QWEN2_7B, "Q4_K_M", RATES, n_past=10)
    long = speed.decode_seconds(4_681_089_344, QWEN2_7B, "Q4_K_M", RATES, n_past=30_000)
    assert long > short
    q8_kv = speed.decode_seconds(4_681_089_344, QWEN2_7B, "Q4_K_M", RATES, n_past=30_000, kv_cache_type="q8_0")
    assert short < q8_kv < long


def test_gpu_share_moves_work_to_the_gpu() -> None:
    gpu = speed.GpuRates(bandwidth=200e9, flops=10e12, source="test")
    size = 4_681_089_344
    cpu = speed.decode_seconds(size, QWEN2_7B, "Q4_K_M", RATES)
    half = speed.decode_seconds(size, QWEN2_7B, "Q4_K_M", RATES, gpu_share=0.5, gpu=gpu)
    whole = speed.decode_seconds(size, QWEN2_7B, "Q4_K_M", RATES, gpu_share=1.0, gpu=gpu)
    assert whole < half < cpu
    # a share without a GPU, or out of range, is clamped, never negative time
    assert speed.decode_seconds(size, QWEN2_7B, "Q4_K_M", RATES, gpu_share=0.7) == cpu
    assert speed.decode_seconds(size, QWEN2_7B, "Q4_K_M", RATES, gpu_share=5, gpu=gpu) == whole
    assert speed.prefill_seconds(500, QWEN2_7B, RATES, gpu_share=1, gpu=gpu) < speed.prefill_seconds(500, QWEN2_7B, RATES)
    assert speed.encode_seconds(None, 3584, RATES, gpu=gpu) < speed.encode_seconds(None, 3584, RATES)


def test_vision_flops_of_siglip_400m_are_about_a_teraflop_per_slice() -> None:
    # 27 blocks of 1024 patches x 1152 wide: ~36 GFLOP each, the resampler a few more
    flops = speed.vision_flops_per_slice(VisionShape(), 3584)
    assert 0.9e12 < flops < 1.1e12
    block = speed.vision_flops_per_slice(VisionShape(blocks=28), 3584) - flops
    assert block == pytest.approx(2 * (4 * 1024 * 1152**2 + 2 * 1024 * 1152 * 4304 + 2 * 1024**2 * 1152))


def test_minicpm_v_46_merger_makes_later_blocks_cheaper() -> None:
    full = speed.vision_flops_per_slice(VisionShape(), 1024)
    merged = speed.vision_flops_per_slice(VisionShape(full_blocks=7), 1024)
    # 7 + 1 (the merger) blocks on 1024 patches, 20 on 256: under half the plain tower
    assert 0.4 * full < merged < 0.5 * full
    assert speed.vision_flops_per_slice(VisionShape(full_blocks=27), 1024) > full  # merger, no later blocks


def test_prefill_grows_with_tokens_and_model() -> None:
    assert speed.prefill_seconds(0, BENCH, RATES) > 0  # the output row of the last token
    assert speed.prefill_seconds(1000, BENCH, RATES) > 1.9 * speed.prefill_seconds(500, BENCH, RATES)
    assert speed.prefill_seconds(500, QWEN2_7B, RATES) > 5 * speed.prefill_seconds(500, BENCH, RATES)
    per_token = speed.text_flops_per_token(BENCH)
    assert per_token == pytest.approx(2 * 24 * (896 * (2 * 896 + 2 * 128) + 3 * 896 * 4864))


@pytest.mark.parametrize(("detail", "on_gpu", "passes"), [
    ("low", False, 1), ("auto", False, 5), ("auto", True, 10), ("high", False, 10),
])
def test_photo_slices_follow_the_detail_rules(detail: str, on_gpu: bool, passes: int) -> None:
    assert speed.photo_slices(detail, vision_on_gpu=on_gpu) == passes


def test_photo_slices_refuse_an_unknown_detail() -> None:
    with pytest.raises(ConfigError, match="detail"):
        speed.photo_slices("ultra")


def test_predict_puts_the_parts_together() -> None:
    p = speed.predict(model_size=488_859_872, text=BENCH, quant="Q4_K_M", vision=None, rates=RATES)
    encode = speed.encode_seconds(None, BENCH.n_embd, RATES)
    assert p.encode_s_per_slice == pytest.approx(encode)
    assert p.photo_slices == 5 and p.first_answer_s > 5 * encode
    assert p.video_first_answer_s > 16 * encode > p.first_answer_s
    low = speed.predict(model_size=488_859_872, text=BENCH, quant="Q4_K_M", vision=None, rates=RATES,
                        detail="low")
    assert low.first_answer_s < p.first_answer_s and low.video_first_answer_s == p.video_first_answer_s
    assert set(p.to_dict()) >= {"decode_tokens_per_s", "first_answer_s", "video_first_answer_s"}


@pytest.mark.parametrize("value", [0, -3, math.nan, math.inf, -math.inf, "5", True, [5]])
def test_limits_must_be_positive_numbers(value) -> None:
    with pytest.raises(ConfigError, match="min_tokens_per_s"):
        speed.check_limit("min_tokens_per_s", value)


def test_limits_accept_huge_and_tiny_numbers() -> None:
    assert speed.check_limit("x", None) is None
    assert speed.check_limit("x", 10**300) == 1e300
    assert speed.check_limit("x", 1e-300) == 1e-300


def test_default_rates_are_valid_and_labelled() -> None:
    assert speed.DEFAULT_RATES.source == "defaults"
    assert speed.DEFAULT_RATES.to_dict()["bandwidth"] == speed.DEFAULT_RATES.bandwidth


def test_gpu_rates_for_backends() -> None:
    assert speed.gpu_rates_for(None) is None
    assert speed.gpu_rates_for("cuda", "jetson") is speed.GPU_RATES["jetson"]
    assert speed.gpu_rates_for("cuda").bandwidth > speed.gpu_rates_for("cuda", "jetson").bandwidth
    assert speed.gpu_rates_for("vulkan") is speed.GPU_RATES["cuda"]


# --- per-type rates, overheads, weight profiles -------------------------------------------

#: a file's tensors as a header lists them: (name, ggml type, bytes)
TENSORS = [("token_embd.weight", "Q4_K", 1000), ("blk.0.attn_q.weight", "Q4_K", 400),
           ("blk.0.ffn_down.weight", "Q6_K", 300), ("blk.0.attn_norm.weight", "F32", 8),
           ("output.weight", "Q8_0", 600)]


def test_weight_profile_from_a_header_leaves_out_token_embd_but_keeps_the_output() -> None:
    p = speed.weight_profile(0, BENCH, "Q4_K_M", TENSORS)
    assert p.layers == {"Q4_K": 400, "Q6_K": 300, "F32": 8} and p.output == {"Q8_0": 600}
    assert p.per_token() == {"Q4_K": 400, "Q6_K": 300, "F32": 8, "Q8_0": 600} and p.total == 1308
    tied = speed.weight_profile(0, BENCH, "Q4_K_M", [t for t in TENSORS if t[0] != "output.weight"])
    assert tied.output == {"Q4_K": 1000}  # tied: token_embd makes the logits, read whole


def test_weight_profile_from_the_catalog_follows_llama_cpps_quant_mix() -> None:
    size = 488_859_872
    p = speed.weight_profile(size, BENCH, "Q4_K_M")
    token_embd, output = memory.embedding_bytes(BENCH, "Q4_K_M")
    assert p.output == {"Q6_K": output}
    rest = size - token_embd - output
    assert p.layers == {"Q4_K": int(0.8 * rest), "Q6_K": int(0.2 * rest)}
    q8 = speed.weight_profile(size, BENCH, "Q8_0")
    assert q8.layers == {"Q8_0": size - sum(memory.embedding_bytes(BENCH, "Q8_0"))}
    # tied (MiniCPM-V 4.6): token_embd takes the output's type and is read whole
    tied = speed.weight_profile(size, TIED, "Q4_K_M")
    whole = int(TIED.n_vocab * TIED.n_embd * 6.5625 / 8)
    assert tied.output == {"Q6_K": whole} and size - whole - 2 <= sum(tied.layers.values()) <= size - whole


def test_each_weight_type_decodes_at_its_own_rate() -> None:
    rates = replace(RATES, bandwidth=1e15, matvec_by_type={"Q5_1": 1e9, "Q4_K": 4e9})
    slow = speed.WeightProfile({"Q5_1": 10**9}, {})
    fast = speed.WeightProfile({"Q4_K": 10**9}, {})
    other = speed.WeightProfile({"IQ3_S": 10**9}, {})  # not probed: the general matvec rate
    t = {name: speed.decode_seconds(0, BENCH, None, rates, n_past=0, weights=w)
         for name, w in (("slow", slow), ("fast", fast), ("other", other))}
    assert t["slow"] == pytest.approx(1.0) and t["fast"] == pytest.approx(0.25)
    assert t["other"] == pytest.approx(10**9 / RATES.matvec)
    # llama.cpp's share of the memory bandwidth still caps a type whose kernel is faster than memory
    capped = replace(rates, bandwidth=2e9 / speed.DECODE_BANDWIDTH_SHARE)
    assert speed.decode_seconds(0, BENCH, None, capped, n_past=0, weights=fast) == pytest.approx(0.5)


def test_fixed_costs_per_token_and_per_layer_are_added() -> None:
    none = speed.WeightProfile({}, {})
    rates = replace(RATES, token_overhead_s=0.001, layer_overhead_s=0.0001)
    assert speed.decode_seconds(0, BENCH, None, rates, n_past=0, weights=none) == pytest.approx(0.001 + 24 * 0.0001)


def test_a_hybrid_models_recurrent_state_is_read_and_written_per_token() -> None:
    hybrid = replace(BENCH, n_kv_layers=6, ssm_conv_kernel=4, ssm_inner_size=2048, ssm_state_size=128,
                     ssm_group_count=16)
    none = speed.WeightProfile({}, {})
    t = speed.decode_seconds(0, hybrid, None, RATES, n_past=0, weights=none)
    assert t == pytest.approx(8 * hybrid.recurrent_values / (RATES.bandwidth * speed.DECODE_BANDWIDTH_SHARE))


def test_prefill_runs_each_type_at_its_own_rate() -> None:
    w = speed.WeightProfile({"Q5_1": 6 * 10**8}, {"Q8_0": 0})  # 8e8 weights of 6 bits
    rates = replace(RATES, prefill_by_type={"Q5_1": 1e11})
    t = speed.prefill_seconds(100, BENCH, rates, weights=w)
    attention = speed.attention_flops(BENCH, 50) * 100 / RATES.prefill_flops
    assert t == pytest.approx(2 * 100 * 8e8 / 1e11 + attention)
    slower = replace(rates, prefill_by_type={"Q5_1": 5e10})
    assert speed.prefill_seconds(100, BENCH, slower, weights=w) > 1.9 * t - attention


def test_the_onnx_int8_encoder_runs_the_blocks_at_its_rate_and_the_rest_at_fp32s() -> None:
    blocks, rest = speed.vision_flops_parts(VisionShape(), 3584)
    assert blocks + rest == pytest.approx(speed.vision_flops_per_slice(VisionShape(), 3584))
    assert blocks > 10 * rest
    rates = replace(RATES, vision_by_backend={"onnx-int8": 400e9, "onnx-fp32": 150e9})
    assert speed.encode_seconds(None, 3584, rates, backend="onnx-int8") == pytest.approx(blocks / 400e9 + rest / 150e9)
    assert speed.encode_seconds(None, 3584, rates, backend="onnx-fp32") == pytest.approx((blocks + rest) / 150e9)
    for backend in (None, "llama.cpp", "something-new"):  # libmtmd's rate
        assert speed.encode_seconds(None, 3584, rates, backend=backend) == pytest.approx((blocks + rest) / 100e9)
    p = speed.predict(model_size=488_859_872, text=BENCH, quant="Q4_K_M", vision=None, rates=rates,
                      vision_backend="onnx-int8")
    assert p.encode_s_per_slice == pytest.approx(speed.encode_seconds(None, BENCH.n_embd, rates, backend="onnx-int8"))


@pytest.mark.parametrize(("field", "value"), [
    ("matvec_by_type", {"Q4_K": 0}), ("matvec_by_type", {"Q4_K": math.nan}), ("matvec_by_type", {3: 1e9}),
    ("matvec_by_type", [("Q4_K", 1e9)]), ("prefill_by_type", {"Q4_K": "fast"}), ("prefill_by_type", None),
    ("vision_by_backend", {"onnx-int8": -1.0}), ("vision_by_backend", {"onnx-int8": True}),
    ("token_overhead_s", -0.001), ("token_overhead_s", math.inf), ("layer_overhead_s", 5.0),
    ("layer_overhead_s", "0"),
])
def test_rates_refuse_impossible_tables_and_overheads(field: str, value) -> None:
    with pytest.raises(ConfigError, match=field):
        replace(RATES, **{field: value})


def test_scaled_rates_scale_their_tables_and_cached_rates_round_trip() -> None:
    rates = replace(RATES, matvec_by_type={"Q4_K": 4e9}, prefill_by_type={"Q8_0": 1e11},
                    vision_by_backend={"onnx-int8": 3e11}, token_overhead_s=0.001)
    half = speed.scaled(rates, matvec=0.5, prefill_flops=0.5, vision_flops=0.5, bandwidth=2)
    assert half.matvec_by_type == {"Q4_K": 2e9} and half.prefill_by_type == {"Q8_0": 5e10}
    assert half.vision_by_backend == {"onnx-int8": 1.5e11} and half.bandwidth == 40e9
    assert half.token_overhead_s == 0.001
    assert Rates(**rates.to_dict()) == rates
