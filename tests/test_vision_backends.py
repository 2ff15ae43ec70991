"""The vision setup, decided in one function: the rule, the native check's verdict, int8's check
against fp32 (known or still to come) and the budget for int8's fallback."""

from __future__ import annotations

import json

import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.vision import vision_backends
from gguf_mcv.vision.vision_backends import INT8_FALLBACK, INT8_MIN_COSINE, VisionSetup, choose_setup

ORT = "1.32.0"
GOOD, POOR = INT8_MIN_COSINE + 0.004, INT8_MIN_COSINE - 0.02


def setup(requested: str = "auto", **kw) -> VisionSetup:
    kw = {"vision_gpu": False, "projector_type": "resampler", "ort_version": ORT, **kw}
    return choose_setup(requested, **kw)


def test_auto_on_a_cpu_is_int8_with_fp32_announced_as_its_fallback() -> None:
    s = setup()
    assert (s.backend, s.precision, s.fallback, s.int8_cosine) == ("onnx-int8", "int8", INT8_FALLBACK, None)
    assert (s.backend, s.reason) == vision_backends.choose_backend("auto", vision_gpu=False,
                                                                   projector_type="resampler", ort_version=ORT)
    assert json.loads(json.dumps(s.to_dict()))["fallback"] == INT8_FALLBACK


def test_int8_failing_its_check_takes_the_fallback_once() -> None:
    s = setup().validated(POOR)
    assert (s.backend, s.precision, s.fallback, s.int8_cosine) == ("onnx-fp32", "fp32", None, POOR)
    assert s.validated(GOOD) == s  # checked once: nothing left to change
    passed = setup().validated(GOOD)
    assert (passed.backend, passed.fallback) == ("onnx-int8", None) and f"{GOOD:.4f}" in passed.reason
    assert setup().validated(None) == setup()  # not checked (int8's kernels crash here): unchanged


def test_a_known_check_settles_the_setup_before_loading() -> None:
    assert setup(int8_cosine=POOR) == setup().validated(POOR)
    assert setup(int8_cosine=GOOD) == setup().validated(GOOD)


def test_a_fallback_the_budget_does_not_hold_is_left_out_and_int8_kept() -> None:
    asked: list[str] = []
    s = setup(fallback_fits=lambda b: asked.append(b) or False)
    assert asked == [INT8_FALLBACK]
    assert (s.backend, s.fallback, s.over_budget) == ("onnx-int8", None, INT8_FALLBACK)
    kept = s.validated(POOR)
    assert kept.backend == "onnx-int8" and "kept" in kept.reason


@pytest.mark.parametrize("requested", ["onnx-int8", "onnx-fp32", "llama.cpp"])
def test_an_explicit_backend_has_no_fallback(requested: str) -> None:
    s = setup(requested, fallback_fits=lambda b: pytest.fail("no fallback to fit"))
    assert (s.backend, s.fallback, s.reason) == (requested, None, "asked for")
    assert s.validated(POOR).backend == requested


def test_the_native_checks_verdict_moves_a_crashing_backend() -> None:
    s = setup(runs_instead=lambda b: "onnx-fp32" if b == "onnx-int8" else b)
    assert s.backend == "onnx-fp32" and "onnx-int8 crashed" in s.reason and s.fallback is None
    gpu = setup(vision_gpu=True, runs_instead=lambda b: pytest.fail("a GPU encoder is not checked"))
    assert (gpu.backend, gpu.vision_gpu, gpu.precision) == ("llama.cpp", True, "mmproj")


def test_an_onnx_backend_that_cannot_run_is_refused_and_a_failed_conversion_is_libmtmd() -> None:
    with pytest.raises(ConfigError, match="onnxruntime is not installed"):
        setup("onnx-int8", ort_version=None)
    assert setup(ort_version=None).backend == "llama.cpp"
    s = setup().unconverted("OSError: read-only")
    assert (s.backend, s.fallback) == ("llama.cpp", None) and "read-only" in s.reason
