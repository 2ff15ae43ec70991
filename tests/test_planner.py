"""Tests of the quant planner on fake machines: Raspberry Pi, Jetson, containers, GPU laptops."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from gguf_mcv import generations as registry
from gguf_mcv import hardware
from gguf_mcv.errors import ConfigError, NoQuantFitsError
from gguf_mcv.hardware import Gpu, Hardware
from gguf_mcv.models.quants import quality_rank
from gguf_mcv.planning import memory, planner, speed
from gguf_mcv.planning.memory import TextShape
from gguf_mcv.planning.planner import QuantCandidate, choose
from gguf_mcv.units import format_size

GB = 10**9
GiB = 2**30

# MiniCPM-V 2.6: Qwen2-7B text model, SigLIP-400M + resampler mmproj (catalog numbers).
QWEN2_7B = TextShape(n_layers=28, n_embd=3584, n_head=28, n_head_kv=4, head_dim=128, n_vocab=151666)
MMPROJ_26 = 1_044_425_152
SIZES_26 = {"Q2_K": 3_010_000_000, "Q3_K_M": 3_810_000_000, "Q4_0": 4_430_000_000,
            "Q4_K_M": 4_681_089_344, "Q5_K_M": 5_440_000_000, "Q6_K": 6_250_000_000,
            "Q8_0": 8_100_000_000}
# MiniCPM-V 4.6: Qwen3.5-0.8B, hybrid (6 of 24 layers keep a KV cache), exact file sizes.
QWEN35_08B = TextShape(n_layers=24, n_kv_layers=6, n_embd=1024, n_head=8, n_head_kv=2,
                       head_dim=256, n_vocab=248320)
MMPROJ_46 = 1_108_746_944
SIZES_46 = {"Q4_0": 501_256_896, "Q4_K_M": 529_101_504, "Q8_0": 811_591_616}
# MiniCPM-V 4.0: MiniCPM4 3.6B.
MINICPM4 = TextShape(n_layers=32, n_embd=2560, n_head=32, n_head_kv=2, head_dim=80, n_vocab=73448)
MMPROJ_40 = 959_000_000
SIZES_40 = {"Q4_0": 2_080_000_000, "Q4_K_M": 2_190_000_000, "Q8_0": 3_834_000_000}
# The benchmark ladder (synthetic.BENCH): file sizes are not monotonic (Q3_K_M > Q4_0).
BENCH = TextShape(n_layers=24, n_embd=896, n_head=14, n_head_kv=2, head_dim=64, n_vocab=151936,
                  n_ff=4864, n_merges=1000)
MMPROJ_BENCH = 864_329_248
SIZES_BENCH = {"Q2_K": 412_642_528, "Q3_K_M": 429_501_664, "Q4_0": 426_190_048,
               "Q4_K_M": 488_859_872, "Q5_K_M": 519_646_432, "Q6_K": 647_838_944,
               "Q8_0": 673_170_656}


def candidates(sizes: dict[str, int]) -> list[QuantCandidate]:
    return [QuantCandidate(q, f"model-{q}.gguf", n) for q, n in sizes.items()]


def machine(total: int, available: int, *, arch: str = "aarch64", cores: int = 4,
            gpus: tuple[Gpu, ...] = (), offload: bool = False, **kw) -> Hardware:
    values = dict(system="Linux", machine=arch, total_ram=total, available_ram=available,
                  memory_limit_source=None, physical_cores=cores, performance_cores=None,
                  cpu_quota=None, allowed_cpus=None, board=None, board_kind=None, gpus=gpus,
                  gpu_offload=offload, gpu_offload_note=None, cache_dir=Path("/tmp"), free_disk=None)
    return Hardware(**{**values, **kw})


PI5_4GB = machine(4 * GB, int(3.4 * GB), board="Raspberry Pi 5 Model B Rev 1.0", board_kind="raspberry-pi")
PI5_8GB = machine(8 * GB, int(7.4 * GB), board="Raspberry Pi 5 Model B Rev 1.0", board_kind="raspberry-pi")
JETSON_ORIN_NANO = machine(
    8 * GB, int(6.8 * GB), cores=6, board="NVIDIA Jetson Orin Nano Developer Kit", board_kind="jetson",
    gpus=(Gpu("NVIDIA Jetson Orin Nano Developer Kit", "cuda", 8 * GB, int(6.8 * GB), True),),
    offload=True)
RTX_4060 = Gpu("NVIDIA GeForce RTX 4060 Laptop GPU", "cuda", 8 * GiB, int(7.5 * GiB), False)
LAPTOP_RTX_8GB = machine(16 * GB, 12 * GB, arch="x86_64", cores=8, gpus=(RTX_4060,), offload=True)


def plan_26(hw: Hardware, **kw) -> planner.Plan:
    return choose(candidates(SIZES_26), arch=QWEN2_7B, mmproj_size=MMPROJ_26, hardware=hw, **kw)


def plan_46(hw: Hardware, **kw) -> planner.Plan:
    return choose(candidates(SIZES_46), arch=QWEN35_08B, mmproj_size=MMPROJ_46, hardware=hw, **kw)


def plan_bench(budget: int | str, **kw) -> planner.Plan:
    return choose(candidates(SIZES_BENCH), arch=BENCH, mmproj_size=MMPROJ_BENCH,
                  hardware=machine(64 * GB, 60 * GB, arch="x86_64"), ram_budget=budget, **kw)


# --- machines ---------------------------------------------------------------------------


def test_raspberry_pi_4gb_cannot_run_minicpm_v_26() -> None:
    with pytest.raises(NoQuantFitsError) as info:
        plan_26(PI5_4GB)
    message = str(info.value)
    assert "Q2_K" in message and "budget is 3.1 GB" in message  # 3.4 GB less 10 %
    assert "kv_cache_type='q8_0'" in message and "minicpm-v-4.6" in message
    assert isinstance(info.value, MemoryError)


def test_raspberry_pi_4gb_runs_minicpm_v_46_at_q8() -> None:
    plan = plan_46(PI5_4GB)
    assert plan.quant == "Q8_0"
    assert plan.predicted_bytes <= plan.budget
    assert plan.files == ("model-Q8_0.gguf", "mmproj-model-f16.gguf")
    assert (plan.n_gpu_layers, plan.vision_on_gpu, plan.n_threads) == (0, False, 4)


def test_raspberry_pi_8gb_takes_a_4bit_26() -> None:
    plan = plan_26(PI5_8GB)
    assert plan.quant in ("Q4_0", "Q4_K_M")
    assert [r.fits for r in plan.rows] == [True, True, True, True, False, False, False]


def test_jetson_orin_nano_offloads_everything_on_unified_memory() -> None:
    plan = choose(candidates(SIZES_40), arch=MINICPM4, mmproj_size=MMPROJ_40, hardware=JETSON_ORIN_NANO)
    assert plan.quant == "Q4_K_M"  # Q8_0's device copies do not fit the shared 6.8 GB
    assert plan.n_gpu_layers == -1 and plan.vision_on_gpu
    # on unified memory the GPU's allocations are part of the RAM need
    assert plan.predicted_bytes > SIZES_40["Q4_K_M"] + MMPROJ_40
    assert plan.estimate.unified and plan.estimate.gpu is not None


def test_unified_memory_too_small_for_offload_falls_back_to_cpu() -> None:
    small = machine(8 * GB, 6 * GB, gpus=(Gpu("Orin", "cuda", 8 * GB, 6 * GB, True),),
                    offload=True)
    plan = choose(candidates(SIZES_26), arch=QWEN2_7B, mmproj_size=MMPROJ_26, hardware=small)
    assert plan.n_gpu_layers == 0 and not plan.vision_on_gpu
    assert any("CPU alone" in w for w in plan.warnings)


def test_container_limit_on_a_big_host_is_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "_llama_gpu_offload", lambda: (False, "CPU-only build"))
    files = {
        "proc/meminfo": f"MemTotal: {64 * GB // 1024} kB\nMemAvailable: {60 * GB // 1024} kB\n",
        "proc/cpuinfo": "".join(f"processor\t: {n}\ncore id\t\t: {n}\n\n" for n in range(16)),
        "proc/self/cgroup": "0::/docker/abc\n",
        "sys/fs/cgroup/docker/abc/memory.max": f"{3 * GB}\n",
        "sys/fs/cgroup/docker/abc/memory.current": f"{100 * 2**20}\n",
        "_fake/platform": "Linux x86_64",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    hw = hardware.probe(tmp_path)
    assert hw.total_ram == 3 * GB
    plan = plan_46(hw)
    # Inside the limit no OS needs the host's max(10 %, 300 MB): only the container's reserve.
    assert plan.budget == hw.available_ram - hardware.CONTAINER_RESERVE
    assert plan.quant == "Q8_0"
    with pytest.raises(NoQuantFitsError, match="budget is 2.8 GB"):
        plan_26(hw)


def test_laptop_gpu_holds_a_whole_quant() -> None:
    plan = plan_26(LAPTOP_RTX_8GB)
    assert plan.quant == "Q5_K_M"  # the best quant the 7.5 GiB of free VRAM holds entirely
    assert plan.n_gpu_layers == -1 and plan.vision_on_gpu
    assert plan.predicted_bytes < 2 * GB  # offloaded weights leave RAM
    assert plan.estimate.gpu.total <= 7.5 * GiB * (1 - planner.GPU_HEADROOM)
    rows = {r.quant: r for r in plan.rows}
    assert rows["Q8_0"].fits and 0 < rows["Q8_0"].n_gpu_layers < 29
    assert "not wholly on the GPU" in rows["Q8_0"].note


def test_laptop_gpu_partial_offload_when_asked_for_a_big_quant() -> None:
    plan = plan_26(LAPTOP_RTX_8GB, quant="Q8_0")
    assert plan.quant == "Q8_0" and plan.fits
    assert 0 < plan.n_gpu_layers < QWEN2_7B.n_layers + 1
    usable = 7.5 * GiB * (1 - planner.GPU_HEADROOM)
    assert plan.estimate.gpu.total <= usable
    one_more = memory.estimate(model_size=SIZES_26["Q8_0"], text=QWEN2_7B, mmproj_size=MMPROJ_26,
                               quant="Q8_0", n_gpu_layers=plan.n_gpu_layers + 1, vision_on_gpu=True,
                               gpu_backend="cuda")
    assert one_more.gpu.total > usable
    assert plan.predicted_bytes > plan_26(LAPTOP_RTX_8GB).predicted_bytes  # CPU layers stay in RAM


def test_small_gpu_keeps_vision_on_the_cpu() -> None:
    tiny_gpu = machine(32 * GB, 24 * GB, arch="x86_64",
                       gpus=(Gpu("GT 1030", "cuda", 2 * GiB, int(0.9 * GiB), False),), offload=True)
    plan = plan_26(tiny_gpu)
    assert not plan.vision_on_gpu
    assert plan.n_gpu_layers >= 0


def test_gpu_ignored_when_llama_cpp_cannot_offload() -> None:
    hw = machine(16 * GB, 12 * GB, arch="x86_64", gpus=LAPTOP_RTX_8GB.gpus, offload=False)
    plan = plan_26(hw)
    assert plan.n_gpu_layers == 0 and not plan.vision_on_gpu and plan.estimate.gpu is None


# --- budgets ----------------------------------------------------------------------------


def test_default_budget_keeps_a_reserve() -> None:
    assert planner.resolve_budget(machine(64 * GB, 40 * GB), None)[0] == 36 * GB  # 10 %
    assert planner.resolve_budget(machine(4 * GB, 2 * GB), None)[0] == 2 * GB - 300_000_000


@pytest.mark.parametrize("text, value", [("6GB", 6 * GB), ("6 GB", 6 * GB), ("512MiB", 512 * 2**20),
                                         ("3.5G", 3_500_000_000), ("2.5 GiB", int(2.5 * GiB)), (1234, 1234)])
def test_budget_strings_parse(text, value) -> None:
    budget, note = planner.resolve_budget(PI5_4GB, text)
    assert budget == value and "(given)" in note


def test_a_given_budget_replaces_the_default() -> None:
    plan = plan_bench("6GB")
    assert plan.budget == 6 * GB and plan.quant == "Q8_0"
    assert plan.table().startswith("RAM budget 6.0 GB (given).")


def test_bad_budget_string_is_refused() -> None:
    with pytest.raises(ConfigError):
        plan_bench("lots")


def _needs() -> dict[str, int]:
    return {r.quant: r.needed for r in plan_bench(10**12).rows}


@pytest.mark.parametrize("quant", list(SIZES_BENCH))
def test_budget_at_each_step_picks_the_best_quant_that_fits(quant: str) -> None:
    needs = _needs()
    order = list(SIZES_BENCH)  # worst to best quality
    at = plan_bench(needs[quant])
    expected = max((q for q in order if needs[q] <= needs[quant]), key=order.index)
    assert at.quant == expected
    assert at.predicted_bytes == needs[expected] <= at.budget
    below = [q for q in order if needs[q] <= needs[quant] - 1]
    if below:
        assert plan_bench(needs[quant] - 1).quant == max(below, key=order.index)
    else:
        with pytest.raises(NoQuantFitsError):
            plan_bench(needs[quant] - 1, n_ctx=4096, kv_cache_type="f16")  # given: never shrunk


def test_non_monotonic_sizes_prefer_quality_not_size() -> None:
    needs = _needs()
    assert needs["Q4_0"] < needs["Q3_K_M"]  # Q3_K_M's file is the bigger one at this width
    assert plan_bench(needs["Q3_K_M"]).quant == "Q4_0"


def test_prefer_size_and_speed_take_the_smallest_that_fits() -> None:
    assert plan_bench(10**12, prefer="size").quant == "Q2_K"
    assert plan_bench(10**12, prefer="speed").quant == "Q2_K"
    assert plan_bench(10**12).quant == "Q8_0"
    with pytest.raises(ConfigError, match="prefer"):
        plan_bench(10**12, prefer="fast")


# --- explicit quants, failures, output --------------------------------------------------


def test_explicit_quant_that_does_not_fit_is_planned_with_a_warning() -> None:
    plan = plan_46(PI5_4GB, quant="q8_0")
    assert plan.quant == "Q8_0" and plan.fits and not plan.warnings
    big = plan_26(PI5_8GB, quant="Q8_0")
    assert big.quant == "Q8_0" and not big.fits
    assert "budget" in big.warnings[0]
    assert "does not fit" in next(r.note for r in big.rows if r.chosen)


def test_explicit_quant_must_exist() -> None:
    with pytest.raises(ConfigError, match="Q2_K, Q3_K_M"):
        plan_26(PI5_8GB, quant="Q5_0")


def test_nothing_fits_names_the_context_that_would() -> None:
    needs = _needs()
    with pytest.raises(NoQuantFitsError) as info:
        plan_bench(needs["Q2_K"] - 30 * 2**20, n_ctx=8192, kv_cache_type="f16")
    message = str(info.value)
    assert "n_ctx=8192" in message and "a smaller context: n_ctx=" in message
    suggested = int(message.split("a smaller context: n_ctx=")[1].split()[0])
    assert 1024 <= suggested < 8192
    assert plan_bench(needs["Q2_K"] - 30 * 2**20, n_ctx=suggested, kv_cache_type="f16").quant == "Q2_K"


def test_unknown_quant_names_are_dropped_and_empty_lists_refused() -> None:
    plan = choose([*candidates(SIZES_46), QuantCandidate("Q9_X", "weird.gguf", 1)], arch=QWEN35_08B,
                  mmproj_size=MMPROJ_46, hardware=PI5_8GB)
    assert [r.quant for r in plan.rows] == ["Q4_0", "Q4_K_M", "Q8_0"]
    with pytest.raises(ConfigError):
        choose([], arch=QWEN35_08B, mmproj_size=MMPROJ_46, hardware=PI5_8GB)


def test_default_image_tokens_is_one_full_detail_image() -> None:
    assert planner.default_image_tokens() == 640
    low = plan_46(PI5_4GB, image_tokens=64)
    assert low.predicted_bytes < plan_46(PI5_4GB).predicted_bytes


@pytest.mark.parametrize("gpu", [False, True])
def test_the_decoded_image_follows_the_detail_the_plan_assumes(gpu: bool) -> None:
    """A 12 MP photo at detail="auto" on a CPU encoder is cut into at most 4 slices and so
    JPEG-draft-decoded at half size; detail="high" (9 slices) decodes it whole. The plan counts
    the photo its ``detail`` decodes on this machine, says which, and what "high" adds."""
    hw = JETSON_ORIN_NANO if gpu else PI5_4GB
    auto, high = plan_46(hw), plan_46(hw, detail="high")
    low = plan_46(hw, detail="low")
    full = memory.image_bytes(memory.DEFAULT_IMAGE_PIXELS, planner.default_image_tokens(), memory.VisionShape())
    assert high.estimate.images == full and high.high_detail_extra == 0
    assert low.estimate.images < auto.estimate.images
    if gpu:  # auto allows 9 slices on a GPU encoder: the whole photo, as high
        assert auto.vision_on_gpu and auto.estimate.images == full and auto.high_detail_extra == 0
    else:
        assert auto.estimate.images < full / 2
        assert auto.high_detail_extra == full - auto.estimate.images
        assert high.predicted_bytes - auto.predicted_bytes == auto.high_detail_extra
    assert auto.image_detail == "auto" and high.image_detail == "high"
    assert "detail='auto'" in auto.table() and json.loads(json.dumps(auto.to_dict()))["image_detail"] == "auto"


def test_table_lists_every_quant_aligned() -> None:
    plan = plan_26(PI5_8GB)
    lines = plan.table().splitlines()
    assert lines[0].startswith("RAM budget 6.7 GB")
    rows = lines[2:9]
    assert [line.split()[0] for line in rows if not line.startswith("->")] == [
        r.quant for r in plan.rows if not r.chosen]
    assert len({line.index(" GB  ") for line in rows}) == 1  # the size column lines up
    assert any(line.startswith("->") and plan.quant in line for line in rows)
    assert "needs" in lines[1] and "Chosen" in lines[-1]


def test_to_dict_is_json() -> None:
    d = json.loads(json.dumps(plan_26(LAPTOP_RTX_8GB).to_dict()))
    assert d["quant"] == "Q5_K_M" and d["n_gpu_layers"] == -1 and len(d["rows"]) == 7
    assert d["estimate"]["gpu"]["total"] > 0


# --- speed predictions and limits (gguf_mcv.planning.speed) --------------------------------------

RATES = speed.Rates(bandwidth=20e9, matvec=25e9, prefill_flops=100e9, vision_flops=100e9, threads=4,
                    source="test rates")
MACHINES = {"pi5-4gb": PI5_4GB, "pi5-8gb": PI5_8GB, "jetson": JETSON_ORIN_NANO, "laptop-rtx": LAPTOP_RTX_8GB,
            "box-64gb": machine(64 * GB, 60 * GB, arch="x86_64")}


@pytest.mark.parametrize("name", sorted(MACHINES))
@pytest.mark.parametrize("prefer", planner.PREFERENCES)
def test_rates_without_limits_change_no_choice(name: str, prefer: str) -> None:
    hw = MACHINES[name]
    for plan_fn in (plan_26, plan_46):
        try:
            before = plan_fn(hw, prefer=prefer)
        except NoQuantFitsError:
            with pytest.raises(NoQuantFitsError):
                plan_fn(hw, prefer=prefer, rates=RATES)
            continue
        after = plan_fn(hw, prefer=prefer, rates=RATES)
        assert (after.quant, after.n_gpu_layers, after.vision_on_gpu, after.predicted_bytes) == (
            before.quant, before.n_gpu_layers, before.vision_on_gpu, before.predicted_bytes)
        assert [(r.quant, r.fits, r.chosen, r.note) for r in after.rows] == [
            (r.quant, r.fits, r.chosen, r.note) for r in before.rows]
        assert before.speed is None and all(r.decode_tokens_per_s is None for r in before.rows)
        assert after.speed is not None and all(r.decode_tokens_per_s for r in after.rows)


def test_rows_predict_faster_decoding_for_smaller_files() -> None:
    p = plan_26(PI5_8GB, rates=RATES)
    by_quant = {r.quant: r for r in p.rows}
    assert by_quant["Q2_K"].decode_tokens_per_s > by_quant["Q4_K_M"].decode_tokens_per_s > by_quant[
        "Q8_0"].decode_tokens_per_s
    assert all(r.video_first_answer_s > r.first_answer_s > 0 for r in p.rows)
    assert p.speed == speed.predict(model_size=SIZES_26[p.quant], text=QWEN2_7B, quant=p.quant, vision=None,
                                    rates=RATES)


def test_first_answers_are_predicted_with_the_vision_backend_the_plan_assumes() -> None:
    """auto on a CPU with onnxruntime is onnx-int8: its measured encoder rate times the photo,
    and a llama.cpp plan keeps libmtmd's."""
    rates = replace(RATES, vision_by_backend={"onnx-int8": 400e9, "onnx-fp32": 150e9})
    onnx = plan_26(PI5_8GB, rates=rates, vision_backend="auto", onnxruntime="1.0")
    mtmd = plan_26(PI5_8GB, rates=rates, vision_backend="llama.cpp", onnxruntime="1.0")
    assert onnx.vision_backend == "onnx-int8" and mtmd.vision_backend == "llama.cpp"
    assert onnx.speed.encode_s_per_slice == pytest.approx(speed.encode_seconds(None, QWEN2_7B.n_embd, rates,
                                                                               backend="onnx-int8"))
    assert mtmd.speed.encode_s_per_slice == pytest.approx(speed.encode_seconds(None, QWEN2_7B.n_embd, rates))
    assert onnx.speed.first_answer_s < mtmd.speed.first_answer_s


def test_min_tokens_per_s_takes_the_best_quant_fast_enough() -> None:
    free = plan_26(PI5_8GB, rates=RATES)
    rows = {r.quant: r for r in free.rows}
    limit = (rows["Q3_K_M"].decode_tokens_per_s + rows["Q4_0"].decode_tokens_per_s) / 2
    limited = plan_26(PI5_8GB, rates=RATES, min_tokens_per_s=limit)
    fast_enough = [r for r in free.rows if r.fits and r.decode_tokens_per_s >= limit]
    assert limited.quant == max(fast_enough, key=lambda r: quality_rank(r.quant)).quant == "Q3_K_M"
    assert limited.speed.decode_tokens_per_s >= limit
    slow_notes = [r.note for r in limited.rows if r.fits and not r.chosen and "too slow" in r.note]
    assert slow_notes and all("tok/s <" in n for n in slow_notes)


def test_max_first_answer_s_on_a_gpu_prefers_what_the_gpu_holds() -> None:
    free = plan_26(LAPTOP_RTX_8GB, rates=RATES)
    limited = plan_26(LAPTOP_RTX_8GB, rates=RATES, max_first_answer_s=free.speed.first_answer_s * 1.01)
    assert limited.quant == free.quant and limited.speed.first_answer_s <= free.speed.first_answer_s * 1.01


def test_limits_nothing_meets_name_the_fastest_fitting_quant() -> None:
    free = plan_26(PI5_8GB, rates=RATES)
    fitting = [r for r in free.rows if r.fits]
    fastest = max(fitting, key=lambda r: r.decode_tokens_per_s)
    with pytest.raises(NoQuantFitsError) as caught:
        plan_26(PI5_8GB, rates=RATES, min_tokens_per_s=1e6)
    message = str(caught.value)
    assert f"the fastest that fits is {fastest.quant} at {fastest.decode_tokens_per_s:.1f} tokens/s" in message
    assert "detail='low'" in message and "minicpm-v-4.6" in message
    with pytest.raises(NoQuantFitsError, match="first answer within 0.001 s"):
        plan_26(PI5_8GB, rates=RATES, max_first_answer_s=0.001)


def test_limits_do_not_hide_that_nothing_fits() -> None:
    with pytest.raises(NoQuantFitsError, match="No quantization fits"):
        plan_26(PI5_4GB, rates=RATES, min_tokens_per_s=1)


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, "fast", True])
@pytest.mark.parametrize("name", ["min_tokens_per_s", "max_first_answer_s"])
def test_bad_limits_are_refused(name: str, value) -> None:
    with pytest.raises(ConfigError, match=name):
        plan_26(PI5_8GB, rates=RATES, **{name: value})


def test_limits_need_rates_and_rates_must_be_rates() -> None:
    with pytest.raises(ConfigError, match="rates"):
        plan_26(PI5_8GB, min_tokens_per_s=1)
    with pytest.raises(ConfigError, match="rates"):
        plan_26(PI5_8GB, rates={"bandwidth": 1e9})
    with pytest.raises(ConfigError, match="detail"):
        plan_26(PI5_8GB, rates=RATES, detail="maximal")


def test_explicit_quant_too_slow_is_planned_with_a_warning() -> None:
    p = plan_26(PI5_8GB, rates=RATES, quant="Q4_K_M", min_tokens_per_s=1e6)
    assert p.quant == "Q4_K_M" and any("speed limits" in w for w in p.warnings)


def test_detail_low_shortens_the_first_answer() -> None:
    auto = plan_46(PI5_4GB, rates=RATES)
    low = plan_46(PI5_4GB, rates=RATES, detail="low")
    assert low.speed.photo_slices == 1 and auto.speed.photo_slices == 5
    assert low.speed.first_answer_s < auto.speed.first_answer_s


def test_table_and_json_show_the_predictions() -> None:
    p = plan_26(PI5_8GB, rates=RATES)
    table = p.table()
    assert "tok/s" in table and "photo" in table and "test rates" in table
    chosen = next(line for line in table.splitlines() if line.startswith("->"))
    assert f"{p.speed.decode_tokens_per_s:.1f}" in chosen
    data = json.loads(json.dumps(p.to_dict()))
    assert all({"decode_tokens_per_s", "first_answer_s", "video_first_answer_s"} <= set(r) for r in data["rows"])
    assert data["rates"]["source"] == "test rates" and data["speed"]["photo_slices"] == 5
    assert "tok/s" not in plan_26(PI5_8GB).table()


# --- every generation in the catalog ----------------------------------------------------

GENERATIONS = [name for g in registry.GENERATIONS.values() for name in g.catalog_names]


def plan_entry(name: str, budget: int | str, **kw) -> planner.Plan:
    from gguf_mcv.models.catalog import lookup

    entry = lookup(name)
    assert entry is not None
    return choose(planner.candidates_from(entry.quants), arch=entry.arch, vision=entry.vision,
                  mmproj_size=entry.mmproj.size, hardware=machine(64 * GB, 60 * GB, arch="x86_64"),
                  ram_budget=budget, **kw)


@pytest.mark.parametrize("name", GENERATIONS)
def test_every_generation_plans_the_best_quant_that_fits_a_small_budget(name: str) -> None:
    needs = {r.quant: r.needed for r in plan_entry(name, 10**12).rows}
    order = list(needs)  # the catalog lists quants worst to best
    smallest = min(needs.values())
    tight = smallest + (sorted(needs.values())[1] - smallest) // 2 if len(needs) > 1 else smallest
    chosen = plan_entry(name, tight)
    assert chosen.quant == max((q for q in order if needs[q] <= tight), key=order.index)
    assert chosen.predicted_bytes <= tight
    with pytest.raises(NoQuantFitsError):
        plan_entry(name, smallest - 1, n_ctx=4096, kv_cache_type="f16")


def test_the_hybrid_46_needs_less_kv_and_carries_its_recurrent_state() -> None:
    at_4k = plan_entry("minicpm-v-4.6", 10**12, quant="Q4_K_M").estimate
    at_32k = plan_entry("minicpm-v-4.6", 10**12, quant="Q4_K_M", n_ctx=32768).estimate
    # 6 of 24 layers keep a KV cache: 8x the context costs 8x that term, on 6 layers only
    assert at_32k.kv_cache == 8 * at_4k.kv_cache == 8 * memory.kv_cache_bytes(QWEN35_08B, 4096)
    assert at_4k.recurrent > 0 and at_32k.recurrent == at_4k.recurrent
def test_the_plan_shows_the_parallel_slots_the_budget_holds() -> None:
    small, big = plan_26(PI5_8GB), plan_26(machine(64 * GB, 60 * GB, arch="x86_64"))
    assert small.slot_bytes == big.slot_bytes > 0
    assert 1 <= small.slots < big.slots == 8
    assert f"Parallel slots (parallel=\"auto\"): {small.slots}" in small.table()
    assert small.to_dict()["slots"] == small.slots


# --- the vision backend the plan assumes ------------------------------------------------------

ORT = "1.32.0"  # an onnxruntime version that imports on the machine planned for


def test_auto_plans_int8_vision_on_a_cpu_where_onnxruntime_imports() -> None:
    plan = plan_26(PI5_8GB, onnxruntime=ORT)
    assert plan.vision_backend == "onnx-int8" and "CPU encoder" in plan.vision_backend_reason
    assert plan.estimate.vision_backend == "onnx-int8"
    assert {r.vision_backend for r in plan.rows} == {"onnx-int8"}
    without = plan_26(PI5_8GB)  # onnxruntime does not import: libmtmd, as load() would do
    assert without.vision_backend == "llama.cpp" and "onnxruntime is not installed" in without.vision_backend_reason
    same_quant = plan_26(PI5_8GB, quant=plan.quant)
    assert plan.predicted_bytes < same_quant.predicted_bytes


def test_a_tight_budget_keeps_the_text_quant_with_int8_vision() -> None:
    llama = {r.quant: r.needed for r in plan_26(PI5_8GB, ram_budget=10**12, vision_backend="llama.cpp").rows}
    int8 = {r.quant: r.needed for r in plan_26(PI5_8GB, ram_budget=10**12, onnxruntime=ORT).rows}
    assert all(int8[q] < llama[q] for q in llama)
    # a budget where libmtmd's F16 tower would cost the text model a quant step
    budget = int8["Q5_K_M"]
    assert llama["Q5_K_M"] > budget
    assert plan_26(PI5_8GB, ram_budget=budget, onnxruntime=ORT).quant == "Q5_K_M"
    assert quality_rank(plan_26(PI5_8GB, ram_budget=budget, vision_backend="llama.cpp").quant) < quality_rank("Q5_K_M")


def test_explicit_backends_are_counted_as_asked() -> None:
    fp32 = plan_26(PI5_8GB, ram_budget=10**12, quant="Q4_K_M", vision_backend="onnx-fp32", onnxruntime=ORT)
    llama = plan_26(PI5_8GB, ram_budget=10**12, quant="Q4_K_M", vision_backend="llama.cpp", onnxruntime=ORT)
    assert (fp32.vision_backend, llama.vision_backend) == ("onnx-fp32", "llama.cpp")
    assert fp32.vision_backend_reason == llama.vision_backend_reason == "asked for"
    assert fp32.predicted_bytes > llama.predicted_bytes  # fp32 weights: twice the F16 mmproj
    assert llama.estimate.vision_weights == MMPROJ_26


def test_a_vision_tower_on_the_gpu_is_libmtmds_and_onnx_keeps_it_on_the_cpu() -> None:
    auto = plan_26(LAPTOP_RTX_8GB, onnxruntime=ORT)
    assert auto.vision_on_gpu and auto.vision_backend == "llama.cpp"
    assert "GPU" in auto.vision_backend_reason
    onnx = plan_26(LAPTOP_RTX_8GB, onnxruntime=ORT, vision_backend="onnx-int8")
    assert not onnx.vision_on_gpu and onnx.vision_backend == "onnx-int8"
    jetson = plan_26(JETSON_ORIN_NANO, onnxruntime=ORT, vision_backend="onnx-int8")  # unified memory
    assert not jetson.vision_on_gpu and jetson.vision_backend == "onnx-int8"


def test_the_planner_resolves_auto_by_the_loaders_rule() -> None:
    from gguf_mcv.vision import onnx_graph, onnx_vision, vision_backends

    assert onnx_vision.choose_backend is vision_backends.choose_backend  # the loader's rule
    assert set(vision_backends.ONNX_PROJECTORS) <= set(onnx_graph.PROJECTORS)  # a builder for each
    for ort in (ORT, None):
        for hw in (PI5_8GB, LAPTOP_RTX_8GB):
            plan = plan_26(hw, onnxruntime=ort)
            expected = vision_backends.choose_backend("auto", vision_gpu=plan.vision_on_gpu,
                                                      projector_type="resampler", ort_version=ort)
            assert (plan.vision_backend, plan.vision_backend_reason) == expected


def test_the_table_and_json_say_which_vision_backend() -> None:
    plan = plan_26(PI5_8GB, onnxruntime=ORT)
    assert "Vision encoder: onnx-int8 (auto: CPU encoder, onnxruntime 1.32.0)" in plan.table()
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["vision_backend"] == "onnx-int8" and data["estimate"]["vision_backend"] == "onnx-int8"
    assert {r["vision_backend"] for r in data["rows"]} == {"onnx-int8"}


def test_the_plan_carries_int8s_fallback_and_counts_it() -> None:
    plan = plan_26(PI5_8GB, ram_budget=10**12, quant="Q4_K_M", onnxruntime=ORT)
    fp32 = plan_26(PI5_8GB, ram_budget=10**12, quant="Q4_K_M", vision_backend="onnx-fp32", onnxruntime=ORT)
    assert plan.vision is not None and (plan.vision.backend, plan.vision.fallback) == ("onnx-int8", "onnx-fp32")
    assert plan.fallback_bytes == fp32.predicted_bytes > plan.predicted_bytes
    assert "runs onnx-fp32 instead" in plan.table()
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["vision"]["fallback"] == "onnx-fp32" and data["fallback_bytes"] == plan.fallback_bytes
    # parallel="auto" counts the larger of the two
    assert plan.slots == memory.parallel_for_budget(fp32.predicted_bytes, plan.slot_bytes, plan.budget)
    assert fp32.vision.fallback is None and fp32.fallback_bytes is None  # asked for: nothing to fall back to


def test_a_budget_that_does_not_hold_fp32_keeps_int8() -> None:
    roomy = plan_26(PI5_8GB, ram_budget=10**12, quant="Q4_K_M", onnxruntime=ORT)
    tight = plan_26(PI5_8GB, ram_budget=(roomy.predicted_bytes + roomy.fallback_bytes) // 2, quant="Q4_K_M",
                    onnxruntime=ORT)
    assert (tight.vision.backend, tight.vision.fallback, tight.vision.over_budget) == ("onnx-int8", None, "onnx-fp32")
    assert tight.predicted_bytes == roomy.predicted_bytes and tight.fallback_bytes is None
    assert "int8 is kept" in tight.table()


def test_a_known_int8_check_and_the_native_verdict_decide_the_plans_backend() -> None:
    poor = plan_26(PI5_8GB, ram_budget=10**12, quant="Q4_K_M", onnxruntime=ORT, int8_cosine=0.9)
    fp32 = plan_26(PI5_8GB, ram_budget=10**12, quant="Q4_K_M", vision_backend="onnx-fp32", onnxruntime=ORT)
    assert (poor.vision_backend, poor.vision.fallback) == ("onnx-fp32", None)
    assert poor.predicted_bytes == fp32.predicted_bytes and "0.9000" in poor.vision_backend_reason
    moved = plan_26(PI5_8GB, ram_budget=10**12, quant="Q4_K_M", onnxruntime=ORT,
                    vision_moves=lambda b: "llama.cpp" if b.startswith("onnx") else b)
    assert moved.vision_backend == moved.estimate.vision_backend == "llama.cpp"
    assert "onnx-int8 crashed" in moved.vision_backend_reason
    gpu = plan_26(LAPTOP_RTX_8GB, onnxruntime=ORT, vision_moves=lambda b: pytest.fail("a GPU tower is not checked"))
    assert gpu.vision.vision_gpu and gpu.vision_backend == "llama.cpp"


@pytest.mark.parametrize("value", ["ONNX", "onnx", "", None, 3, "llama"])
def test_a_wrong_vision_backend_is_refused(value) -> None:
    with pytest.raises(ConfigError, match="vision_backend"):
        plan_26(PI5_8GB, vision_backend=value, onnxruntime=ORT)


def test_an_onnx_backend_without_onnxruntime_is_refused() -> None:
    with pytest.raises(ConfigError, match="onnxruntime is not installed"):
        plan_26(PI5_8GB, vision_backend="onnx-int8")


def test_nothing_fits_with_libmtmds_tower_suggests_int8_vision() -> None:
    smallest = plan_26(PI5_8GB, ram_budget=10**12, quant="Q2_K", vision_backend="llama.cpp").predicted_bytes
    with pytest.raises(NoQuantFitsError) as info:
        plan_26(PI5_8GB, ram_budget=smallest - 1, vision_backend="llama.cpp", onnxruntime=ORT,
                n_ctx=4096, kv_cache_type="f16")
    assert "vision_backend='onnx-int8'" in str(info.value) and "(fits)" in str(info.value)
    with pytest.raises(NoQuantFitsError) as info:
        plan_26(PI5_8GB, ram_budget=smallest - 1, vision_backend="llama.cpp",  # no onnxruntime: no such advice
                n_ctx=4096, kv_cache_type="f16")
    assert "onnx-int8" not in str(info.value)


# --- shrinking the defaults before refusing ---------------------------------------------

BIG = machine(64 * GB, 60 * GB, arch="x86_64")


def need_26(quant: str, n_ctx: int, kv: str) -> int:
    """The 2.6 quant's need with these settings (llama.cpp vision: its KV cache matters most)."""
    return plan_26(BIG, ram_budget=10**12, quant=quant, n_ctx=n_ctx, kv_cache_type=kv,
                   vision_backend="llama.cpp").predicted_bytes


def test_a_default_kv_cache_is_shrunk_to_q8_0_before_refusing() -> None:
    budget = need_26("Q2_K", 4096, "f16") - 1
    plan = plan_26(BIG, ram_budget=budget, vision_backend="llama.cpp")
    assert (plan.quant, plan.n_ctx, plan.kv_cache_type) == ("Q2_K", 4096, "q8_0")
    assert plan.shrunk == (planner.Shrink("kv_cache_type", "f16", "q8_0"),)
    assert plan.predicted_bytes == need_26("Q2_K", 4096, "q8_0") <= budget
    assert all(r.needed == need_26(r.quant, 4096, "q8_0") for r in plan.rows if r.quant == "Q2_K")
    assert "Shrunk to fit" in plan.table() and "kv_cache_type f16 -> q8_0" in plan.table()
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["shrunk"] == [{"setting": "kv_cache_type", "default": "f16", "planned": "q8_0"}]
    assert d["kv_cache_type"] == "q8_0"
    assert plan_26(BIG, ram_budget=10**12).shrunk == () and "Shrunk" not in plan_26(BIG, ram_budget=10**12).table()


def test_a_default_context_is_shrunk_to_the_largest_that_fits() -> None:
    budget = need_26("Q2_K", 3072, "q8_0")
    plan = plan_26(BIG, ram_budget=budget, vision_backend="llama.cpp")
    assert (plan.quant, plan.n_ctx, plan.kv_cache_type) == ("Q2_K", 3072, "q8_0")
    assert plan.shrunk == (planner.Shrink("n_ctx", 4096, 3072), planner.Shrink("kv_cache_type", "f16", "q8_0"))
    assert plan.predicted_bytes <= budget < need_26("Q2_K", 3328, "q8_0")
    assert json.loads(json.dumps(plan.to_dict()))["n_ctx"] == 3072


def test_a_given_setting_is_never_shrunk() -> None:
    budget = need_26("Q2_K", 3072, "q8_0")
    kept_kv = plan_26(BIG, ram_budget=need_26("Q2_K", 3072, "f16"), kv_cache_type="f16", vision_backend="llama.cpp")
    assert (kept_kv.n_ctx, kept_kv.kv_cache_type) == (3072, "f16")
    assert kept_kv.shrunk == (planner.Shrink("n_ctx", 4096, 3072),)
    with pytest.raises(NoQuantFitsError) as info:  # q8_0 alone does not fit at the asked 4096
        plan_26(BIG, ram_budget=budget, n_ctx=4096, vision_backend="llama.cpp")
    assert "n_ctx=4096" in str(info.value) and "a smaller context: n_ctx=" in str(info.value)
    with pytest.raises(NoQuantFitsError):
        plan_26(BIG, ram_budget=budget, n_ctx=4096, kv_cache_type="f16", vision_backend="llama.cpp")


def test_shrinking_stops_at_2048_positions() -> None:
    assert planner.MIN_SHRUNK_CTX == 2048
    at_floor = need_26("Q2_K", 2048, "q8_0")
    assert plan_26(BIG, ram_budget=at_floor, vision_backend="llama.cpp").n_ctx == 2048
    with pytest.raises(NoQuantFitsError) as info:
        plan_26(BIG, ram_budget=at_floor - 1, vision_backend="llama.cpp")
    assert "ram_budget" in str(info.value)


def test_an_asked_quant_is_shrunk_too_and_must_fit_refuses_with_the_ways_out() -> None:
    budget = need_26("Q8_0", 4096, "q8_0")
    plan = plan_26(BIG, ram_budget=budget, quant="Q8_0", vision_backend="llama.cpp")
    assert plan.quant == "Q8_0" and plan.fits and plan.kv_cache_type == "q8_0" and not plan.warnings
    assert plan_26(BIG, ram_budget=budget, quant="Q8_0", vision_backend="llama.cpp", must_fit=True).fits
    small = need_26("Q8_0", 2048, "q8_0") - 1
    unfit = plan_26(BIG, ram_budget=small, quant="Q8_0", vision_backend="llama.cpp")
    assert not unfit.fits and unfit.shrunk == () and (unfit.n_ctx, unfit.kv_cache_type) == (4096, "f16")
    with pytest.raises(NoQuantFitsError) as info:
        plan_26(BIG, ram_budget=small, quant="Q8_0", vision_backend="llama.cpp", must_fit=True)
    message = str(info.value)
    assert "Q8_0" in message and "smaller quant" in message and "ram_budget" in message
    assert "kv_cache_type='q8_0'" in message


# --- a 2 GB board: the encoder's weights read from their mapped file --------------------

#: A headless 2 GB Raspberry Pi 4: about 1.7 GB available, a 1.4 GB budget after the reserve.
PI4_2GB = machine(2 * GB, int(1.7 * GB), board="Raspberry Pi 4 Model B Rev 1.5", board_kind="raspberry-pi")


def plan_46_catalog(hw: Hardware, **kw) -> planner.Plan:
    """minicpm-v-4.6 from the catalog, where onnxruntime imports (the int8 encoder may run)."""
    return plan_catalog("minicpm-v-4.6", hw, **kw)


def test_a_2gb_board_runs_minicpm_v_46_with_the_int8_encoder_reading_a_mapped_file() -> None:
    plan = plan_46_catalog(PI4_2GB)
    assert plan.budget == 1_400_000_000
    assert plan.quant == "Q4_0" and plan.n_ctx >= planner.MIN_SHRUNK_CTX and plan.kv_cache_type == "q8_0"
    assert plan.vision is not None and plan.vision.backend == "onnx-int8" and plan.vision.packed is False
    assert plan.shrunk[-1] == planner.MAPPED_VISION and plan.slots == 1
    e = plan.estimate
    # the text pages a Pi reads (token_embd: the layers are repacked into anonymous copies) swap
    # with the encoder's: without that the same setup would not fit
    assert 0 < e.swapped == min(e.weights - e.reclaimable, e.vision_weights)
    assert e.needed == plan.predicted_bytes <= plan.budget < e.needed + e.swapped
    assert "mapped file" in plan.table()
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["vision"]["packed"] is False and d["estimate"]["swapped"] == e.swapped
    assert d["shrunk"][-1] == {"setting": "vision_weights", "default": "packed", "planned": "mapped"}


def test_mapped_vision_weights_are_the_last_shrink_and_only_for_an_onnx_encoder() -> None:
    roomy = plan_46_catalog(PI4_2GB, ram_budget="1.7GB")
    assert roomy.vision is not None and roomy.vision.packed and planner.MAPPED_VISION not in roomy.shrunk
    assert roomy.estimate.swapped == 0 and roomy.slots >= 1
    with pytest.raises(NoQuantFitsError):  # libmtmd reads the mmproj into its own buffers: nothing maps
        plan_46_catalog(PI4_2GB, vision_backend="llama.cpp")
    with pytest.raises(NoQuantFitsError):
        plan_46_catalog(PI4_2GB, ram_budget="1.0GB")


def test_a_model_is_not_suggested_as_a_smaller_model_for_itself() -> None:
    with pytest.raises(NoQuantFitsError) as info:
        plan_46_catalog(PI4_2GB, ram_budget="1.0GB")
    assert "a smaller model, e.g. minicpm-v-4.6" not in str(info.value)
    with pytest.raises(NoQuantFitsError) as info:
        plan_26(PI5_4GB)
    assert "a smaller model, e.g. minicpm-v-4.6" in str(info.value)


def test_vision_weights_given_are_kept() -> None:
    mapped = plan_46_catalog(PI4_2GB, ram_budget="8GB", vision_weights="mapped")
    assert mapped.vision is not None and mapped.vision.packed is False and mapped.shrunk == ()
    assert mapped.estimate.swapped > 0 and mapped.slots == 1
    assert mapped.quant == "Q8_0"  # both weight sets fit beside each other: nothing re-read, quality wins
    with pytest.raises(NoQuantFitsError):  # never mapped when packed was asked for
        plan_46_catalog(PI4_2GB, vision_weights="packed")
    with pytest.raises(ConfigError, match="vision_weights"):
        plan_46_catalog(PI4_2GB, vision_weights="disk")


def plan_catalog(name: str, hw: Hardware, **kw) -> planner.Plan:
    """A catalog model planned where onnxruntime imports (the int8 encoder may run)."""
    from gguf_mcv.models.catalog import lookup

    entry = lookup(name)
    assert entry is not None
    return choose(planner.candidates_from(entry.quants), arch=entry.arch, vision=entry.vision,
                  mmproj_size=entry.mmproj.size, hardware=hw, onnxruntime="1.32.0", model=entry.name, **kw)


def test_a_variant_is_not_suggested_as_the_smaller_model_of_its_own_generation() -> None:
    for name in ("minicpm-v-4.6", "minicpm-v-4.6-thinking"):
        with pytest.raises(NoQuantFitsError) as info:
            plan_catalog(name, PI4_2GB, ram_budget="0.5GB")
        assert "a smaller model" not in str(info.value)
        with pytest.raises(NoQuantFitsError) as info:  # too slow: the same rule
            plan_catalog(name, PI5_8GB, rates=RATES, min_tokens_per_s=1e6)
        assert "a smaller model" not in str(info.value) and "relax the limits" in str(info.value)


def test_a_refusal_offers_mapped_vision_weights_with_their_computed_need() -> None:
    fixed = dict(n_ctx=4096, kv_cache_type="f16", quant="Q4_0", must_fit=True, vision_backend="onnx-int8")
    packed = plan_46_catalog(PI4_2GB, ram_budget="100GB", vision_weights="packed", **fixed).predicted_bytes
    mapped = plan_46_catalog(PI4_2GB, ram_budget="100GB", vision_weights="mapped", **fixed).predicted_bytes
    assert mapped < packed
    for budget, verdict in ((mapped, "fits"), (mapped - 1, "still does not fit")):
        with pytest.raises(NoQuantFitsError) as info:  # packed was asked for: never mapped on its own
            plan_46_catalog(PI4_2GB, ram_budget=budget, vision_weights="packed", **fixed)
        assert f"vision_weights='mapped' reads the encoder's weights from their file (slices ~25 % slower): " \
               f"Q4_0 then needs {format_size(mapped)} ({verdict})" in str(info.value)
    with pytest.raises(NoQuantFitsError) as info:  # already mapped: nothing more to offer
        plan_46_catalog(PI4_2GB, ram_budget=mapped - 1, vision_weights="mapped", **fixed)
    assert "vision_weights='mapped'" not in str(info.value)
