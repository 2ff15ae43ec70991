"""load(): options, impossible combinations, templates and thinking."""

from __future__ import annotations

import logging
from dataclasses import replace

import llama_cpp
import numpy as np
import pytest

import gguf_mcv
from gguf_mcv.errors import ConfigError, NoQuantFitsError
from gguf_mcv.resolver import plan_local


def load_tiny(tiny, **kw):
    return gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj,
                         **{"n_ctx": 1024, **kw})


@pytest.mark.parametrize("kw,match", [
    ({"kv_cache_type": "q8_0", "flash_attn": False}, "needs flash attention"),
    ({"kv_cache_type": "q5_1"}, "kv_cache_type must be"),
    ({"n_ctx": 64}, "n_ctx must be between 256"),
    ({"n_ctx": 4096.5}, "n_ctx must be an integer"),
    ({"n_threads": 100_000}, "n_threads must be between 1 and"),
    ({"n_threads_batch": 0}, "n_threads_batch must be between 1 and"),
    ({"n_threads": 2.5}, "n_threads must be an integer"),
    ({"n_gpu_layers": 10}, "CPU-only"),
    ({"vision_gpu": True}, "CPU-only"),
    ({"n_gpu_layers": "many"}, "n_gpu_layers must be"),
])
def test_impossible_combinations_are_refused(tiny, kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_tiny(tiny, **kw)


def test_only_one_local_file_is_refused(tiny) -> None:
    with pytest.raises(ConfigError, match="both model_path and mmproj_path"):
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"])
    with pytest.raises(ConfigError, match="Name a model"):
        gguf_mcv.load()


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
def test_kv_cache_types_and_threads(tiny, kv: str) -> None:
    with load_tiny(tiny, kv_cache_type=kv, n_threads=1, n_threads_batch=2) as model:
        assert model.engine.llama.n_threads == 1 and model.engine.llama.n_threads_batch == 2
        reply = model.ask("?", np.zeros((64, 64, 3), dtype=np.uint8), max_tokens=2)
        assert reply.usage.image_tokens == 64


def test_flash_attention_on_and_off(tiny) -> None:
    for fa in (True, False):
        with load_tiny(tiny, flash_attn=fa) as model:
            assert model.ask("?", max_tokens=1).usage.completion_tokens == 1


def test_default_threads_come_from_the_probe(tiny) -> None:
    with load_tiny(tiny) as model:
        assert model.engine.llama.n_threads == gguf_mcv.probe().recommended_threads


def test_chat_template_override_and_thinking_switch(tiny) -> None:
    with load_tiny(tiny, chat_template="qwen3") as model:
        assert model.info.template_origin == "family:qwen3" and model.info.can_think
        model.ask("Think?", max_tokens=1, thinking=False)
        off = model.engine.llama.detokenize([u for u in model.engine.units if isinstance(u, int)],
                                            special=True).decode(errors="replace")
        assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" in off
        model.ask("Think?", max_tokens=1, thinking=True)
        on = model.engine.llama.detokenize([u for u in model.engine.units if isinstance(u, int)],
                                           special=True).decode(errors="replace")
        assert "</think>" not in on


def test_thinking_on_a_model_that_cannot_think_is_refused(tiny) -> None:
    with load_tiny(tiny) as model:
        assert model.info.template_origin == "gguf" and not model.info.can_think
        with pytest.raises(ConfigError, match="cannot think"):
            model.ask("?", thinking=True)


def test_catalog_name_with_local_files_takes_the_catalog_traits(tiny) -> None:
    with load_tiny(tiny, model="minicpm-v-2.6") as model:
        assert model.info.name == "MiniCPM-V 2.6"
        assert (model.sampling.temperature, model.sampling.top_p, model.sampling.top_k) == (0.7, 0.8, 100)


def test_auto_gpu_layers_follow_the_plan_on_a_cpu_build(tiny) -> None:
    with load_tiny(tiny, n_gpu_layers="auto") as model:
        assert model.info.vision_gpu is False
        assert model.ask("?", max_tokens=1).usage.completion_tokens == 1


# --- plan and load agree on the vision setup ---------------------------------------------------


def _plan_and_load(tiny, **kw):
    """(the plan for the tiny pair, the backend and reason ``load`` ran) with the same settings."""
    from gguf_mcv.resolver import plan_local

    planned = plan_local(tiny.quants["Q4_K_M"], tiny.mmproj, n_ctx=1024,
                         **{k: v for k, v in kw.items() if k in ("vision_backend", "ram_budget")})
    with load_tiny(tiny, n_threads=2, **kw) as model:
        return planned, model.info.vision_backend, model.info.vision_backend_reason


@pytest.mark.parametrize("kw", [{}, {"vision_backend": "llama.cpp"}, {"vision_backend": "onnx-fp32"},
                                {"vision_backend": "onnx-int8"}, {"n_gpu_layers": "auto"}])
def test_plan_and_load_agree_on_the_vision_backend(tiny, kw) -> None:
    pytest.importorskip("onnxruntime")
    planned, backend, reason = _plan_and_load(tiny, **kw)
    assert planned.vision is not None and planned.vision.vision_gpu is False
    assert backend == planned.vision_backend == planned.vision.backend
    assert reason.startswith(planned.vision.reason.split("; int8 vs fp32")[0])


def test_a_plan_for_the_gpu_is_carried_out_as_planned(tiny) -> None:
    from dataclasses import replace

    from gguf_mcv import loader
    from gguf_mcv.hardware import Gpu, probe
    from gguf_mcv.options import LoadOptions
    from gguf_mcv.resolver import plan_local

    gpu = replace(probe(), gpus=(Gpu("test GPU", "cuda", 8 * 2**30, 7 * 2**30, False),), gpu_offload=True)
    planned = plan_local(tiny.quants["Q4_K_M"], tiny.mmproj, hardware=gpu, n_ctx=1024)
    assert planned.vision_on_gpu and planned.vision is not None and planned.vision.vision_gpu
    assert planned.hardware == gpu  # the snapshot it was made from
    options = loader.carried_out(LoadOptions(n_ctx=1024, n_gpu_layers="auto"), planned)
    assert (options.n_gpu_layers, options.vision_gpu, options.parallel) == (planned.n_gpu_layers, True, planned.slots)
    assert options.n_threads == options.n_threads_batch == gpu.recommended_threads
    assert planned.vision.backend == "llama.cpp"  # the tower on the GPU: libmtmd's


@pytest.mark.parametrize("given, kept", [
    (dict(n_gpu_layers=3, vision_gpu=False, n_threads=1, parallel=2), (3, False, 1, 1, 2)),
    (dict(n_gpu_layers=0, n_threads=2, n_threads_batch=1, parallel=1), (0, False, 2, 1, 1)),
    (dict(n_gpu_layers="auto", vision_gpu=False), (None, False, None, None, None)),
])
def test_the_plan_keeps_what_the_load_fixed(tiny, given, kept) -> None:
    from dataclasses import replace

    from gguf_mcv.hardware import Gpu, probe
    from gguf_mcv.planning.plan import LoadChoices
    from gguf_mcv.resolver import plan_local

    gpu = replace(probe(), gpus=(Gpu("test GPU", "cuda", 8 * 2**30, 7 * 2**30, False),), gpu_offload=True)
    planned = plan_local(tiny.quants["Q4_K_M"], tiny.mmproj, hardware=gpu, n_ctx=1024, ram_budget=10**12,
                         given=LoadChoices(**given))
    got = (planned.n_gpu_layers, planned.vision_on_gpu, planned.n_threads, planned.n_threads_batch, planned.parallel)
    assert all(k is None or g == k for g, k in zip(got, kept, strict=True)), got
    assert planned.vision is not None and planned.vision.vision_gpu == planned.vision_on_gpu


@pytest.mark.parametrize("kwargs", [{}, {"parallel": "auto"}, {"n_gpu_layers": "auto"}, {"n_threads": 1}])
def test_a_local_load_probes_the_machine_once_and_opens_what_its_plan_says(tiny, probe_calls, kwargs) -> None:
    calls = probe_calls
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=1024,
                       vision_backend="llama.cpp", **kwargs) as model:
        assert len(calls) == 1
        planned = model.info.plan
        assert planned is not None and planned.given is not None
        llama = model.engine.llama
        assert (model.info.n_ctx, model.info.parallel, model.info.vision_gpu) == \
            (planned.n_ctx, planned.parallel, planned.vision_on_gpu)
        assert model.info.vision_backend == planned.vision_backend
        assert llama.context_params.n_threads == planned.n_threads
        assert llama.context_params.n_threads_batch == planned.n_threads_batch
        assert llama.context_params.n_batch == llama.context_params.n_ubatch == planned.n_batch
        assert llama.context_params.n_ctx == planned.n_ctx * planned.parallel
        assert planned.n_threads == kwargs.get("n_threads", planned.hardware.recommended_threads)


@pytest.fixture
def own_onnx_cache(tmp_path, monkeypatch):
    """An empty cache (nothing converted yet) that keeps the session's native verdicts."""
    import os
    import shutil
    from pathlib import Path

    from gguf_mcv.runtime import native_check

    verdicts = Path(os.environ["GGUF_MCV_CACHE"]) / native_check.FOLDER
    if verdicts.is_dir():
        shutil.copytree(verdicts, tmp_path / native_check.FOLDER)
    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    return tmp_path


def test_plan_announces_the_int8_fallback_and_load_takes_it(tiny, own_onnx_cache, monkeypatch) -> None:
    pytest.importorskip("onnxruntime")
    from gguf_mcv.vision import vision_backends

    monkeypatch.setattr(vision_backends, "INT8_MIN_COSINE", 1.01)  # int8 fails its check against fp32
    first, backend, reason = _plan_and_load(tiny)  # nothing converted yet: the plan cannot know
    assert (first.vision_backend, first.vision.fallback) == ("onnx-int8", "onnx-fp32")
    assert first.fallback_bytes is not None and first.fallback_bytes > first.predicted_bytes
    assert "onnx-fp32 instead" in first.table() and first.to_dict()["vision"]["fallback"] == "onnx-fp32"
    assert backend == first.vision.fallback and "int8 embeddings agree with fp32 only" in reason
    again, backend, reason = _plan_and_load(tiny)  # converted: the plan knows the check's outcome
    assert (again.vision_backend, again.vision.fallback) == (backend, None) == ("onnx-fp32", None)
    assert again.vision_backend_reason == reason


def test_int8_is_kept_where_the_budget_does_not_hold_its_fallback(tiny, own_onnx_cache, monkeypatch) -> None:
    pytest.importorskip("onnxruntime")
    from gguf_mcv.planning.speed import slice_budget
    from gguf_mcv.resolver import estimate_files
    from gguf_mcv.vision import vision_backends

    monkeypatch.setattr(vision_backends, "INT8_MIN_COSINE", 1.01)
    need = {b: estimate_files(tiny.quants["Q4_K_M"], tiny.mmproj, n_ctx=1024, vision_backend=b,
                              image_slices=slice_budget("auto")).needed  # the photo the plan counts
            for b in ("onnx-int8", "onnx-fp32")}
    budget = (need["onnx-int8"] + need["onnx-fp32"]) // 2
    planned, backend, reason = _plan_and_load(tiny, ram_budget=budget)
    assert (planned.vision_backend, planned.vision.fallback, planned.vision.over_budget) == \
        ("onnx-int8", None, "onnx-fp32")
    assert "int8 is kept" in planned.table()
    assert backend == "onnx-int8" and "kept" in reason


# --- a local load is planned before it starts -------------------------------------------


def local_plan(tiny, **kw):
    """The plan load() makes for the tiny Q4_K_M with everything on the CPU."""
    cpu = replace(gguf_mcv.probe(), gpu_offload=False)
    return plan_local(tiny.quants["Q4_K_M"], tiny.mmproj, hardware=cpu, **{"ram_budget": 10**12, **kw})


def kv_type(model) -> int:
    return model.engine.llama.context_params.type_k


def test_local_files_that_cannot_fit_are_refused_with_the_ways_out(tiny) -> None:
    floor = local_plan(tiny, n_ctx=2048, kv_cache_type="q8_0").predicted_bytes
    with pytest.raises(NoQuantFitsError) as info:  # even the shrunk defaults do not fit
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, ram_budget=floor - 1,
                      vision_weights="packed")  # else the encoder's weights would be mapped to fit
    message = str(info.value)
    assert isinstance(info.value, MemoryError)
    assert "smaller quant" in message and "n_ctx=" in message and "ram_budget" in message
    with pytest.raises(NoQuantFitsError):
        load_tiny(tiny, kv_cache_type="f16", ram_budget=local_plan(tiny, n_ctx=1024).predicted_bytes - 1,
                  vision_weights="packed")
    with load_tiny(tiny, ram_budget=local_plan(tiny, n_ctx=1024).predicted_bytes) as model:
        assert model.info.n_ctx == 1024 and kv_type(model) == llama_cpp.GGML_TYPE_F16


def test_a_default_context_and_kv_cache_are_shrunk_to_fit(tiny, caplog: pytest.LogCaptureFixture) -> None:
    budget = local_plan(tiny, n_ctx=2048, kv_cache_type="q8_0").predicted_bytes
    with caplog.at_level(logging.WARNING, logger="gguf_mcv.loader"):
        model = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, ram_budget=budget)
    with model:
        assert model.info.n_ctx == 2048 == model.engine.llama.n_ctx()
        assert kv_type(model) == llama_cpp.GGML_TYPE_Q8_0
        assert model.ask("?", np.zeros((64, 64, 3), dtype=np.uint8), max_tokens=1).usage.completion_tokens == 1
    assert any("n_ctx 4096 -> 2048" in r.getMessage() for r in caplog.records)


def test_given_settings_are_kept_or_refused_never_shrunk(tiny) -> None:
    budget = local_plan(tiny, n_ctx=4096, kv_cache_type="q8_0").predicted_bytes
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096,
                       ram_budget=budget) as model:  # the KV type was not given: q8_0
        assert model.info.n_ctx == 4096 and kv_type(model) == llama_cpp.GGML_TYPE_Q8_0
    with pytest.raises(NoQuantFitsError):
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096,
                      kv_cache_type="f16", ram_budget=budget)
    at_3072 = local_plan(tiny, n_ctx=3072, kv_cache_type="f16").predicted_bytes
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, flash_attn=False,
                       ram_budget=at_3072) as model:  # no flash attention: the KV cache stays f16
        assert kv_type(model) == llama_cpp.GGML_TYPE_F16 and model.info.n_ctx == 3072


def test_parallel_slots_that_do_not_fit_are_refused(tiny) -> None:
    plan = local_plan(tiny, n_ctx=1024)
    budget = plan.predicted_bytes + plan.slot_bytes
    with pytest.raises(NoQuantFitsError, match="parallel=3"):
        load_tiny(tiny, parallel=3, ram_budget=budget)
    with load_tiny(tiny, parallel=2, ram_budget=budget) as model:
        assert model.info.parallel == 2


def test_a_plan_with_mapped_vision_weights_is_carried_out_as_planned(tiny) -> None:
    pytest.importorskip("onnxruntime")
    from gguf_mcv.planning.planner import MAPPED_VISION

    packed = plan_local(tiny.quants["Q4_K_M"], tiny.mmproj, n_ctx=1024, kv_cache_type="q8_0",
                        vision_backend="onnx-int8", ram_budget=10**12).predicted_bytes  # with a q8_0 KV cache, the planner's first shrink: one byte less needs the mapped weights
    planned = plan_local(tiny.quants["Q4_K_M"], tiny.mmproj, n_ctx=1024, vision_backend="onnx-int8",
                         ram_budget=packed - 1)
    assert planned.vision is not None
    assert planned.shrunk[-1] == MAPPED_VISION and planned.vision.packed is False
    with load_tiny(tiny, vision_backend="onnx-int8", ram_budget=packed - 1, n_threads=2) as model:
        assert model.engine.encoder.encoder.packed is False
        assert model.ask("Look.", np.zeros((448, 448, 3), np.uint8), max_tokens=1).usage.completion_tokens == 1
    with load_tiny(tiny, vision_backend="onnx-int8", n_threads=2, ram_budget=10**12) as model:
        assert model.engine.encoder.encoder.packed is True
    with load_tiny(tiny, vision_backend="onnx-int8", n_threads=2, ram_budget=10**12, vision_weights="mapped") as model:
        assert model.engine.encoder.encoder.packed is False  # asked for: mapped whatever the budget
    with load_tiny(tiny, vision_backend="onnx-int8", n_threads=2, n_gpu_layers=0, vision_weights="mapped",
                   parallel="auto") as model:
        assert model.info.parallel == 1  # mapped weights are counted for one sequence at a time
    with pytest.raises(NoQuantFitsError):
        load_tiny(tiny, vision_backend="onnx-int8", ram_budget=packed - 1, vision_weights="packed")
    with pytest.raises(ConfigError, match="vision_weights"):
        load_tiny(tiny, vision_weights="disk")


@pytest.fixture(scope="module")
def tiny46(tmp_path_factory: pytest.TempPathFactory):
    """The tiny MiniCPM-V 4.6 preset (the generation suggested as the smaller model)."""
    from gguf_mcv.testing import synthetic

    return synthetic.build(tmp_path_factory.mktemp("tiny46"), synthetic.PRESETS["4.6"], ["Q4_K_M"])


def refusal(files, **kw) -> str:
    with pytest.raises(NoQuantFitsError) as info:
        gguf_mcv.load(model_path=files.quants["Q4_K_M"], mmproj_path=files.mmproj, **kw)
    return str(info.value)


def test_a_refusal_of_local_files_suggests_another_generation_only(tiny, tiny46) -> None:
    own = refusal(tiny46, ram_budget="1MB")
    assert "a smaller quant of this model" in own and "minicpm-v-4.6" not in own
    other = refusal(tiny, ram_budget="1MB")  # a 2.6: 4.6 is another, smaller generation
    assert "a smaller quant of this model" in other and "a smaller model, e.g. minicpm-v-4.6" in other


def test_a_refusal_offers_mapped_vision_weights_when_that_alone_fits(tiny46) -> None:
    settings = dict(n_ctx=4096, kv_cache_type="f16", vision_backend="onnx-int8")
    packed = local_plan(tiny46, vision_weights="packed", **settings).predicted_bytes
    mapped = local_plan(tiny46, vision_weights="mapped", **settings).predicted_bytes
    assert mapped < packed
    fits = refusal(tiny46, ram_budget=mapped, vision_weights="packed", **settings)
    assert f"vision_weights='mapped' reads the encoder's weights from their file (slices ~25 % slower): " \
           f"Q4_K_M then needs {gguf_mcv.format_size(mapped)} (fits)" in fits
    short = refusal(tiny46, ram_budget=mapped - 1, vision_weights="packed", **settings)
    assert "vision_weights='mapped'" in short and "(still does not fit)" in short
    # libmtmd reads the mmproj into its own buffers: nothing to map
    assert "vision_weights='mapped'" not in refusal(tiny46, ram_budget="1MB", vision_backend="llama.cpp", **{
        k: v for k, v in settings.items() if k != "vision_backend"})
