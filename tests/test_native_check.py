"""The native check: kernels tried in a child, crashes and hangs contained, fallbacks announced.

Faults are simulated with ``GGUF_MCV_NATIVE_FAULT``: the check's child sends itself the
signal (or sleeps) when it reaches the named path, exactly where a real kernel would fault.
On a machine whose AMX kernels trap, ``test_the_real_check_decides_and_the_load_answers``
exercises the real fault too.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gguf_mcv
from gguf_mcv.errors import NativeKernelError
from gguf_mcv.runtime import native_check
from gguf_mcv.runtime.llama_load import uses_extra_bufts
from gguf_mcv.selftest import EXAMPLE_IMAGE
from gguf_mcv.testing.synthetic import SyntheticModel


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache folder and nothing remembered: each test checks from scratch."""
    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    native_check.forget()
    yield tmp_path / native_check.FOLDER
    native_check.forget()


def _fault(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(native_check.ENV_FAULT, value)


@pytest.mark.parametrize("sig", ["SIGILL", "SIGSEGV", "SIGABRT", "SIGBUS"])
def test_a_crashing_extra_buffer_kernel_falls_back_and_says_so_once(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], sig: str) -> None:
    _fault(monkeypatch, f"text:Q4_K:extra={sig}")
    decision = native_check.decide({"Q4_K", "Q6_K"}, what="test model")
    assert decision.extra_bufts is False
    assert len(decision.notices) == 1
    notice = decision.notices[0]
    assert f"killed by {sig}" in notice and "text:Q4_K:extra" in notice
    assert "CMAKE_ARGS=" in notice and "pip install" in notice  # the rebuild that removes the need
    again = native_check.decide({"Q4_K", "Q6_K"}, what="test model")
    assert again.extra_bufts is False
    err = capsys.readouterr().err
    assert err.count("extra buffer types") == 1  # one line, once per process
    assert native_check.notices() == decision.notices


def test_a_hanging_kernel_is_a_failed_path(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fault(monkeypatch, "text:Q8_0:extra=hang")
    monkeypatch.setenv(native_check.ENV_TIMEOUT, "10")  # the plain path must pass under it on a busy machine
    start = time.monotonic()
    found = native_check.outcomes([native_check.text_path("Q8_0", True), native_check.text_path("Q8_0", False)])
    assert time.monotonic() - start < 300  # the hang was cut off: generous, a busy machine is slow to start children
    assert found["text:Q8_0:extra"].status == "hung" and found["text:Q8_0:extra"].limit_s == 10
    assert found["text:Q8_0:plain"].status == "ok"  # the next child ran the rest
    kept = json.loads(next(fresh.glob("*.json")).read_text())["paths"]["text:Q8_0:extra"]
    assert kept["status"] == "hung" and kept["limit_s"] == 10  # the limit is part of the verdict


def test_a_path_slow_under_a_short_limit_is_checked_again_under_the_default(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow first run (here 3 s against a 1.5 s limit) is not kept as a crash for good."""
    _fault(monkeypatch, "text:Q8_0:extra=sleep3,text:Q8_0:plain=sleep3")
    monkeypatch.setenv(native_check.ENV_TIMEOUT, "1.5")
    with pytest.raises(NativeKernelError) as caught:
        native_check.decide({"Q8_0"}, what="slow.gguf")
    assert str(native_check.verdict_path(native_check.fingerprint())) in str(caught.value)  # how to clear it
    native_check.forget()  # a later process, without the variable
    monkeypatch.delenv(native_check.ENV_TIMEOUT)
    decision = native_check.decide({"Q8_0"}, what="slow.gguf")
    assert decision.extra_bufts and not decision.notices
    kept = json.loads(next(fresh.glob("*.json")).read_text())["paths"]
    assert kept["text:Q8_0:extra"]["status"] == "ok"
    assert kept["text:Q8_0:plain"] == {"status": "hung", "detail": "no result after 1.5 s", "limit_s": 1.5}  # not needed


def test_a_hang_is_checked_again_under_doubled_limits_then_kept(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fault(monkeypatch, "text:Q8_0:extra=hang")
    monkeypatch.setenv(native_check.ENV_TIMEOUT, "0.5")
    monkeypatch.setattr(native_check, "HANG_RETRY_CAP_S", 2.0)
    path = native_check.text_path("Q8_0", True)
    limits = []
    for _ in range(3):
        native_check.forget()  # each time a new process
        limits.append(native_check.outcomes([path])[path].limit_s)
    assert limits == [0.5, 1.0, 2.0]
    native_check.forget()

    def no_child(paths: list[str], timeout: float | None = None) -> dict:
        raise AssertionError(f"a child was started for {paths}")

    with monkeypatch.context() as mp:
        mp.setattr(native_check, "run_paths", no_child)
        assert native_check.outcomes([path])[path].status == "hung"  # hung under the cap: kept for good
    monkeypatch.setenv(native_check.ENV_TIMEOUT, "2.5")  # a longer limit asked for: checked again
    native_check.forget()
    assert native_check.outcomes([path])[path].limit_s == 2.5


@settings(max_examples=200, deadline=None)
@given(ran=st.one_of(st.none(), st.floats(0.001, 4000)), limit=st.floats(0.001, 3600))
def test_a_hang_is_run_again_only_under_a_longer_limit(ran: float | None, limit: float) -> None:
    got = native_check.due(native_check.Outcome("hung", "", ran), limit)
    if got is not None:
        assert got > (ran or 0) and got >= limit
        assert got <= max(limit, native_check.HANG_RETRY_CAP_S)
    else:
        assert ran is not None and ran >= min(max(limit, native_check.HANG_RETRY_CAP_S), max(limit, 2 * ran))
    for status in ("ok", "error", "crashed", "unchecked"):
        assert native_check.due(native_check.Outcome(status), limit) is None
    assert native_check.due(None, limit) == limit


@pytest.mark.parametrize("value", ["inf", "1e308", "nan", "-1", "0", "3601", "soon", "-inf"])
def test_an_impossible_timeout_is_a_config_error_naming_the_variable(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from gguf_mcv.errors import ConfigError

    monkeypatch.setenv(native_check.ENV_TIMEOUT, value)
    with pytest.raises(ConfigError, match=r"GGUF_MCV_NATIVE_TIMEOUT.*3600"):
        native_check.outcomes(["text:F16:extra"])
    assert not list(fresh.glob("*.json"))  # refused before anything ran


@pytest.mark.parametrize("value,seconds", [("", 60.0), ("  ", 60.0), ("1.5", 1.5), ("3600", 3600.0), (" 90 ", 90.0)])
def test_a_timeout_in_range_is_taken(monkeypatch: pytest.MonkeyPatch, value: str, seconds: float) -> None:
    monkeypatch.setenv(native_check.ENV_TIMEOUT, value)
    assert native_check.path_timeout() == seconds


@pytest.mark.parametrize("limit", [None, "x", True, -1, 0, float("nan"), float("inf"), 1e400, [2]])
def test_a_kept_hang_with_a_damaged_limit_is_checked_again(fresh: Path, limit: object) -> None:
    from gguf_mcv import native_verdict

    key = native_check.fingerprint()
    path = native_check.verdict_path(key)
    path.parent.mkdir(parents=True)
    native_verdict.write_verdict(path, key, {"text:F16:extra": native_check.Outcome("hung", "old", 1.0)})
    data = json.loads(path.read_text())
    data["paths"]["text:F16:extra"]["limit_s"] = limit
    data.pop("digest")
    from gguf_mcv.cache_files import write_manifest

    write_manifest(path, data)
    found = native_check.read_verdict(path, key)["text:F16:extra"]
    assert found.status == "hung" and found.limit_s is None
    assert native_check.outcomes(["text:F16:extra"])["text:F16:extra"].status == "ok"  # checked again


def test_when_no_kernel_is_safe_the_error_names_it_and_the_rebuild(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fault(monkeypatch, "text:Q4_0:extra=SIGILL,text:Q4_0:plain=SIGSEGV")
    with pytest.raises(NativeKernelError) as caught:
        native_check.decide({"Q4_0"}, what="model.gguf")
    message = str(caught.value)
    assert "model.gguf" in message and "SIGILL" in message and "SIGSEGV" in message
    assert "CMAKE_ARGS=" in message
    assert str(native_check.verdict_path(native_check.fingerprint())) in message  # how to clear the kept verdict
    assert isinstance(caught.value, gguf_mcv.GgufMcvError)


def test_a_crashing_vision_backend_is_replaced_under_auto_and_refused_when_asked_for(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fault(monkeypatch, "vision:onnx-int8=SIGILL")
    auto = native_check.decide((), "onnx-int8", vision_auto=True)
    assert auto.vision_backend == "onnx-fp32" and auto.extra_bufts
    assert "onnx-int8" in auto.notices[0] and "using onnx-fp32" in auto.notices[0]
    with pytest.raises(NativeKernelError, match="vision_backend='auto'"):
        native_check.decide((), "onnx-int8", vision_auto=False)
    assert native_check.decide((), "onnx-fp32").vision_backend == "onnx-fp32"


def test_when_every_vision_backend_crashes_the_error_says_so(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fault(monkeypatch, "vision:onnx-fp32=SIGSEGV,vision:llama.cpp=SIGABRT")
    with pytest.raises(NativeKernelError, match="no vision encoder runs"):
        native_check.decide((), "onnx-int8", vision_auto=True)


def test_a_kept_verdict_runs_no_child(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = native_check.decide({"F16"}, "llama.cpp")
    files = list(fresh.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["paths"]["text:F16:extra"]["status"] == "ok"
    native_check.forget()  # a new process: only the file is left

    def no_child(paths: list[str], timeout: float | None = None) -> dict:
        raise AssertionError(f"a child was started for {paths}")

    monkeypatch.setattr(native_check, "run_paths", no_child)
    assert native_check.decide({"F16"}, "llama.cpp") == first


@pytest.mark.parametrize("damage", ["garbage", "zeroed", "truncated", "directory", "fifo", "huge", "symlink",
                                    "unreadable", "other machine", "deeply nested"])
def test_a_damaged_verdict_is_checked_again(fresh: Path, damage: str) -> None:
    native_check.decide({"F16"})
    path = next(fresh.glob("*.json"))
    text = path.read_text()
    path.unlink()
    if damage == "garbage":
        path.write_bytes(os.urandom(300))
    elif damage == "zeroed":
        path.write_bytes(b"\0" * len(text))
    elif damage == "truncated":
        path.write_text(text[: len(text) // 3])
    elif damage == "directory":
        path.mkdir()
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "huge":
        path.write_text(" " * (native_check.MAX_VERDICT_BYTES + 10))
    elif damage == "symlink":
        path.symlink_to("/dev/zero")
    elif damage == "unreadable":
        path.write_text(text)
        path.chmod(0)
    elif damage == "deeply nested":
        path.write_text("[" * 100_000 + "]" * 100_000)  # 200 KB: json's parser gives up with RecursionError
    elif damage == "other machine":
        path.write_text(text.replace(path.stem, "0" * 24))
    if damage != "unreadable" or os.geteuid() != 0:  # root reads a mode-000 file
        assert native_check.read_verdict(path, path.stem) == {}
    native_check.forget()
    assert native_check.decide({"F16"}).extra_bufts  # checked again, in a child, without hanging


def test_a_child_that_cannot_start_is_not_taken_for_a_crash(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(fresh.parent / "no-such-python"))
    found = native_check.outcomes(["text:F16:extra"])
    assert found["text:F16:extra"].status == "unchecked" and found["text:F16:extra"].safe
    assert native_check.read_verdict(next(fresh.glob("*.json")), native_check.fingerprint()) == {}  # not kept
    monkeypatch.undo()
    found = native_check.run_paths(["text:NOT_A_TYPE:extra"])
    assert found["text:NOT_A_TYPE:extra"].status == "error"  # a Python error, reported, not a crash
    assert found["text:NOT_A_TYPE:extra"].safe


def test_the_fault_variable_never_mixes_with_real_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    clean = native_check.fingerprint()
    _fault(monkeypatch, "text:Q4_K:extra=SIGILL")
    assert native_check.fingerprint() != clean


def test_load_answers_after_a_simulated_amx_crash(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                                    tiny: SyntheticModel) -> None:
    _fault(monkeypatch, "text:Q4_K:extra=SIGILL,text:Q6_K:extra=SIGILL")
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=2048,
                       vision_backend="llama.cpp") as model:
        assert not uses_extra_bufts(model.engine.llama)
        reply = model.ask("What is in this picture?", EXAMPLE_IMAGE, max_tokens=4, seed=1)
        assert reply.timings.slices_encoded >= 1
    assert any("extra buffer types" in n for n in native_check.notices())


def test_load_falls_back_to_fp32_when_int8_crashes(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                                   tiny: SyntheticModel) -> None:
    from gguf_mcv.resolver import plan_local

    _fault(monkeypatch, "vision:onnx-int8=SIGILL")
    planned = plan_local(tiny.quants["Q4_K_M"], tiny.mmproj, n_ctx=2048)  # plan and load agree
    assert planned.vision_backend == "onnx-fp32" and "crashed" in planned.vision_backend_reason
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=2048) as model:
        assert model.info.vision_backend == planned.vision_backend == "onnx-fp32"
        assert "crashed" in model.info.vision_backend_reason
        reply = model.ask("What is in this picture?", EXAMPLE_IMAGE, max_tokens=2, seed=1)
        assert reply.timings.slices_encoded >= 1
    with pytest.raises(NativeKernelError):
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=2048,
                      vision_backend="onnx-int8")


def test_the_chat_handler_refuses_a_llama_whose_kernels_crash(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, tiny: SyntheticModel) -> None:
    from gguf_mcv.runtime.llama_load import open_llama

    _fault(monkeypatch, "text:Q4_K:extra=SIGILL")
    handler = gguf_mcv.MiniCPMVChatHandler(str(tiny.mmproj))
    # the caller's own Llama, with the extra buffer types: its kernels never run (no eval here)
    llama = open_llama(tiny.quants["Q4_K_M"], n_ctx=2048, verbose=False, chat_handler=handler)
    try:
        with pytest.raises(NativeKernelError, match="checked_llama"):
            llama.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    finally:
        llama.close()
    safe = gguf_mcv.checked_llama(str(tiny.quants["Q4_K_M"]), n_ctx=2048, verbose=False,
                                  chat_handler=gguf_mcv.MiniCPMVChatHandler(str(tiny.mmproj)))
    try:
        assert not uses_extra_bufts(safe)
        out = safe.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert out["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        safe.close()


def test_the_speed_probe_runs_in_a_child_that_may_die(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gguf_mcv.errors import EngineError
    from gguf_mcv.runtime import speed_probe

    _fault(monkeypatch, "speed-probe=SIGSEGV")
    with pytest.raises(EngineError, match="killed by SIGSEGV"):
        speed_probe.measure_in_child(1)
    got = speed_probe.rates(probe=True, threads=1, cache=fresh.parent / "speed.json")
    assert "SIGSEGV" in got.source  # the defaults, saying why; the caller lives on


def test_the_real_check_decides_and_the_load_answers(fresh: Path, tiny: SyntheticModel) -> None:
    """On every machine, without simulation: the types of a Q4_K_M file are checked in a child
    (where AMX traps, its extra path is 'crashed' here), and the load answers either way."""
    types = native_check.weight_types(tiny.quants["Q4_K_M"])
    found = native_check.outcomes([native_check.text_path(t, True) for t in types])
    decision = native_check.decide(types)
    assert decision.extra_bufts == all(o.safe for o in found.values())
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=2048) as model:
        assert uses_extra_bufts(model.engine.llama) == decision.extra_bufts
        assert model.ask("Describe it.", EXAMPLE_IMAGE, max_tokens=2, seed=1).usage.image_tokens > 0


def test_plan_and_selftest_lines_name_the_fallback(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                                   tiny: SyntheticModel) -> None:
    import subprocess

    _fault(monkeypatch, "text:Q4_K:extra=SIGILL")
    done = subprocess.run([sys.executable, "-m", "gguf_mcv", "plan", str(tiny.quants["Q4_K_M"]), "--mmproj",
                           str(tiny.mmproj), "--ram", "8GB", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (line,) = json.loads(done.stdout)["native_kernels"]
    assert "extra buffer types" in line and "SIGILL" in line
    assert done.stderr.count("gguf_mcv: llama.cpp's extra buffer types") == 1
    from gguf_mcv import selftest

    assert "SIGILL" in selftest._kernels({})  # the self-test's step reports the same notice


def test_the_plan_counts_no_repacked_copy_where_loads_leave_the_extra_buffer_types_off(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gguf_mcv.hardware import local_repack_family
    from gguf_mcv.native_verdict import loads_repack_family
    from gguf_mcv.planning import memory

    _fault(monkeypatch, "text:Q4_K:extra=SIGILL")
    assert loads_repack_family() == local_repack_family()  # nothing known yet: no check run
    assert not list(fresh.glob("*.json"))
    native_check.decide({"Q4_K"})
    assert loads_repack_family() == "none"
    tensors = [("blk.0.ffn_up.weight", "Q4_K", 1000)]
    assert memory.repacked_bytes(0, None, None, cpu=loads_repack_family(), tensors=tensors) == 0  # type: ignore[arg-type]
    native_check.forget()  # a new process: the kept verdict says the same
    assert loads_repack_family() == "none"
