"""``gguf-mcv selftest``: prove the install works, offline, in a few seconds.

Builds (or reuses) the tiny random-weight model in the cache folder, then runs
the whole pipeline on it through llama.cpp: load, an image answer, a follow-up
that must not re-run the vision encoder, streaming, and a bad image that must be
refused with :class:`~gguf_mcv.errors.MediaError`; then the same image question
on a tiny model of the default generation, MiniCPM-V 4.6 (hybrid qwen35 text model,
minicpmv4_6 projector). Random weights give gibberish text; what is checked is
behaviour, never wording.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import environment
from .errors import MediaError

EXAMPLE_IMAGE = Path(__file__).parent / "assets" / "example.png"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float


def run(report: Callable[[str], None] = print, model_dir: Path | None = None) -> bool:
    """Run every check, reporting one line each; True when all passed."""
    checks: list[Check] = []
    state: dict = {}
    steps = [
        ("llama.cpp bindings", _bindings),
        ("native kernels checked in a child", _kernels),
        ("build or reuse the tiny test model", lambda s: _build(s, model_dir)),
        ("load model and vision projector", _load),
        ("answer about an image", _answer),
        ("follow-up reuses the image", _follow_up),
        ("streaming", _stream),
        ("bad image refused", _bad_image),
        ("MiniCPM-V 4.6 layout answers", lambda s: _default_generation(s, model_dir)),
    ]
    for name, step in steps:
        start = time.perf_counter()
        try:
            detail = step(state)
            check = Check(name, True, detail, time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a FAIL line
            check = Check(name, False, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
        checks.append(check)
        report(f"  {'ok  ' if check.ok else 'FAIL'}  {name:<38} {check.seconds:6.2f} s  {check.detail}")
        if not check.ok and name in ("llama.cpp bindings", "build or reuse the tiny test model",
                                     "load model and vision projector"):
            break
    if "model" in state:
        state["model"].close()
    passed = len(checks) == len(steps) and all(c.ok for c in checks)
    report("PASS" if passed else "FAIL")
    return passed


def _bindings(state: dict) -> str:
    import llama_cpp  # lazy: the self-test alone needs it

    gpu = "GPU offload available" if llama_cpp.llama_supports_gpu_offload() else "CPU only"
    return f"llama-cpp-python {llama_cpp.__version__}, {gpu}"


def _kernels(state: dict) -> str:
    from .planning.memory import QUANT_TYPE_MIX, output_type
    from .runtime import native_check  # lazy: the self-test alone needs it

    types = {*QUANT_TYPE_MIX["Q4_K_M"], output_type("Q4_K_M")}
    decision = native_check.decide(types, "onnx-int8", vision_auto=True, what="the self-test model")
    return " | ".join(decision.notices) or f"{', '.join(sorted(types))} and the vision encoders ran"


def _build(state: dict, model_dir: Path | None) -> str:
    from .testing.synthetic import build  # lazy: the self-test alone needs it

    model = build(model_dir or environment.cache_dir() / "selftest-model", quants=("Q4_K_M",))
    state["files"] = model
    return f"{model.out_dir}"


def _load(state: dict) -> str:
    from .loader import load  # lazy: the self-test alone needs it

    files = state["files"]
    state["model"] = load(model_path=files.quants["Q4_K_M"], mmproj_path=files.mmproj, n_ctx=2048)
    return f"template: {state['model'].info.template_origin}"


def _answer(state: dict) -> str:
    reply = state["model"].ask("What is in this picture?", EXAMPLE_IMAGE, max_tokens=8, seed=1)
    _expect(reply.usage.image_tokens > 0, "no image tokens were evaluated")
    _expect(reply.timings.slices_encoded >= 1, "the vision encoder did not run")
    return f"{reply.usage.image_tokens} image tokens, {reply.usage.completion_tokens} generated"


def _follow_up(state: dict) -> str:
    model = state["model"]
    calls = model.engine.encoder_calls
    reply = model.ask("What colour is the sky?", EXAMPLE_IMAGE, max_tokens=4, seed=1)
    _expect(model.engine.encoder_calls == calls, "the vision encoder ran again")
    _expect(reply.usage.cached_tokens >= reply.usage.image_tokens, "the image was evaluated again")
    return f"{reply.usage.cached_tokens} of {reply.usage.prompt_tokens} prompt tokens reused"


def _stream(state: dict) -> str:
    stream = state["model"].ask("Describe it.", EXAMPLE_IMAGE, stream=True, max_tokens=8, seed=2)
    pieces = list(stream)
    _expect(stream.reply is not None and "".join(pieces) == str(stream.reply), "pieces do not add up")
    return f"{len(pieces)} pieces"


def _bad_image(state: dict) -> str:
    try:
        state["model"].ask("?", b"not an image")
    except MediaError as exc:
        return f"MediaError: {str(exc)[:40]}…"
    raise AssertionError("a broken image was accepted")


def _default_generation(state: dict, model_dir: Path | None) -> str:
    from .loader import load  # lazy: the self-test alone needs it
    from .testing.synthetic import GENERATIONS, build  # lazy: the self-test alone needs it

    folder = (model_dir or environment.cache_dir() / "selftest-model").with_name("selftest-model-4.6")
    files = build(folder, GENERATIONS["4.6"][0], quants=("Q4_K_M",))
    with load("minicpm-v-4.6", model_path=files.quants["Q4_K_M"], mmproj_path=files.mmproj, n_ctx=2048) as model:
        reply = model.ask("What is in this picture?", EXAMPLE_IMAGE, max_tokens=4, seed=1)
        _expect(reply.timings.slices_encoded >= 1, "the vision encoder did not run")
        calls = model.engine.encoder_calls
        model.ask("And the colours?", EXAMPLE_IMAGE, max_tokens=2, seed=1)
        _expect(model.engine.encoder_calls == calls, "the vision encoder ran again")
    return f"{reply.usage.image_tokens} image tokens, template {model.info.template_origin}"


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
