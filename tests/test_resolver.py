"""The resolver: a model name to a plan and fetched files, against the local Hub and real memory limits."""

from __future__ import annotations

import os as _os
import subprocess as _subprocess
import sys as _sys
import time
import uuid as _uuid

import pytest

import gguf_mcv
from gguf_mcv.errors import ConfigError, NoQuantFitsError
from gguf_mcv.resolver import plan as _plan

_REPO = "acme/planned-gguf"


def _publish(hub, tiny) -> None:
    files = {f"ggml-model-{q}.gguf": p for q, p in tiny.quants.items()}
    hub.add_repo(_REPO, {**files, "mmproj-model-f16.gguf": tiny.mmproj})


def test_load_picks_the_quant_the_plan_predicts_around_each_step(hub, tiny) -> None:
    import gguf_mcv

    _publish(hub, tiny)
    generous = _plan(_REPO, ram_budget="64GB", n_ctx=1024)
    needs = {row.quant: row.needed for row in generous.rows}
    ladder = sorted(needs, key=lambda q: needs[q])
    for lower, upper in zip(ladder, ladder[1:], strict=False):
        if needs[lower] == needs[upper]:
            continue
        at = _plan(_REPO, ram_budget=needs[upper], n_ctx=1024)
        below = _plan(_REPO, ram_budget=needs[upper] - 1, n_ctx=1024)
        assert needs[at.quant] <= needs[upper] and needs[below.quant] < needs[upper]
    budget = needs[ladder[len(ladder) // 2]]
    expected = _plan(_REPO, ram_budget=budget, n_ctx=1024)
    with gguf_mcv.load(_REPO, ram_budget=budget, n_ctx=1024) as model:
        assert model.info.quant == expected.quant
        assert model.ask("?", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(gguf_mcv.NoQuantFitsError, match="budget"):
        gguf_mcv.load(_REPO, ram_budget=min(needs.values()) - 1, n_ctx=1024, kv_cache_type="f16",
                      vision_weights="packed")


def test_plan_for_a_repo_the_catalog_does_not_know_reads_the_header(hub, tiny) -> None:
    _publish(hub, tiny)
    result = _plan(_REPO, ram_budget="64GB", n_ctx=1024)
    assert result.model == _REPO and result.quant == "Q8_0"
    ranged = [r for r in hub.requests(method="GET", path="*/resolve/*") if r.range]
    assert len(ranged) == 1 and ranged[0].range.startswith("bytes=0-")


def _memory_cgroup(limit: int) -> tuple[str, str] | None:
    """(folder, procs file) of a new memory cgroup limited to ``limit`` bytes, or None."""
    name = f"gguf_mcv_test_{_uuid.uuid4().hex[:8]}"
    for root, limit_file in (("/sys/fs/cgroup", "memory.max"),
                             ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")):
        if not _os.path.exists(_os.path.join(root, limit_file if root.endswith("memory") else
                                             "cgroup.controllers")):
            continue
        folder = _os.path.join(root, name)
        try:
            _os.mkdir(folder)
            with open(_os.path.join(folder, limit_file), "w") as f:
                f.write(str(limit))
            return folder, _os.path.join(folder, "cgroup.procs")
        except OSError:
            if _os.path.isdir(folder):
                _os.rmdir(folder)
    return None


def test_planned_load_runs_inside_a_real_memory_limit(hub, tiny) -> None:
    _publish(hub, tiny)
    limit = 2**30  # the planner keeps a 300 MB reserve below it
    made = _memory_cgroup(limit)
    if made is None:
        pytest.skip("cannot create a memory-limited cgroup here (needs root and a writable "
                    "cgroup v1 or v2 memory controller)")
    folder, procs = made
    script = (
        "import os, sys, numpy as np\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "import gguf_mcv\n"
        "hw = gguf_mcv.probe()\n"
        "print(hw.memory_limit_source, hw.available_ram, sep='|')\n"
        "with gguf_mcv.load(sys.argv[2], n_ctx=2048) as m:\n"
        "    r = m.ask('?', np.zeros((900, 900, 3), np.uint8), max_tokens=4)\n"
        "    print(m.info.quant, r.usage.image_tokens)\n"
    )
    try:
        done = _subprocess.run([_sys.executable, "-c", script, procs, _REPO], env=_os.environ,
                               capture_output=True, text=True, timeout=180)
    finally:
        _os.rmdir(folder)
    assert done.returncode == 0, f"killed or failed ({done.returncode}): {done.stderr[-2000:]}"
    source, available = done.stdout.splitlines()[0].split("|")
    assert source.startswith("cgroup") and int(available) <= limit
    quant, image_tokens = done.stdout.splitlines()[1].split()
    assert quant in tiny.quants and int(image_tokens) > 0


def test_auto_picks_the_most_capable_catalog_model_that_fits() -> None:
    import gguf_mcv
    from gguf_mcv.models.catalog import load_catalog

    hardware = _laptop_like()
    ranked = load_catalog().entries()
    roomy = _plan("auto", ram_budget="64GB", hardware=hardware)
    assert roomy.model == ranked[0].name
    small = _plan("auto", ram_budget="3GB", hardware=hardware)
    assert small.model != ranked[0].name and small.quant
    assert small.shrunk == ()  # a model that fits with the defaults before one that fits shrunk
    with pytest.raises(gguf_mcv.NoQuantFitsError, match="No catalog model fits"):
        _plan("auto", ram_budget="100MB", hardware=hardware)


def _laptop_like():
    import gguf_mcv.hardware as hw

    return hw.probe()  # this machine; budgets are given explicitly


def test_an_absurd_context_is_refused_or_planned_at_once(hub, tiny) -> None:
    """plan(n_ctx=10**10) searched downward 256 positions at a time for hours."""
    _publish(hub, tiny)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="n_ctx must be between"):
        _plan(_REPO, ram_budget="64GB", n_ctx=10**10)
    for bad in (0, -1, 4096.5):
        with pytest.raises(ConfigError, match="n_ctx"):
            _plan(_REPO, ram_budget="64GB", n_ctx=bad)
    # the largest context that fits is bisected, not walked: a 1M context on a small budget
    with pytest.raises(NoQuantFitsError, match="n_ctx="):
        _plan(_REPO, ram_budget="200MB", n_ctx=2**20)
    assert time.perf_counter() - start < 120  # generous: walking took hours



def test_catalog_name_resolves_to_its_repo() -> None:
    from gguf_mcv.resolver import resolve

    repo, entry = resolve("minicpm-v:8b")
    assert repo == "openbmb/MiniCPM-V-2_6-gguf" and entry is not None
    repo, entry = resolve("someone/else-gguf")
    assert (repo, entry) == ("someone/else-gguf", None)
    with pytest.raises(gguf_mcv.ModelNotFoundError):
        resolve("minicpm-v-9000")


def test_auto_with_speed_limits_picks_the_most_capable_model_fast_enough() -> None:
    """model='auto' with a decode floor: a model ranked lower than the memory-only choice, whose
    own predicted speed meets the floor; the limits excluding everything name each model's
    fastest option."""
    from gguf_mcv.models.catalog import load_catalog
    from gguf_mcv.planning.speed import Rates

    rates = Rates(bandwidth=20e9, matvec=25e9, prefill_flops=100e9, vision_flops=100e9, threads=2, source="test")
    hardware = _laptop_like()
    free = _plan("auto", ram_budget="64GB", hardware=hardware, rates=rates)
    assert free.model == load_catalog().entries()[0].name  # limits absent: as before
    floor = free.speed.decode_tokens_per_s * 3
    fast = _plan("auto", ram_budget="64GB", hardware=hardware, rates=rates, min_tokens_per_s=floor)
    assert fast.model != free.model and fast.speed.decode_tokens_per_s >= floor
    ranks = {e.name: e.rank for e in load_catalog().entries()}
    assert ranks[fast.model] < ranks[free.model]
    for entry in load_catalog().entries():  # nothing more capable meets the floor
        if entry.rank > ranks[fast.model]:
            with pytest.raises(NoQuantFitsError):
                _plan(entry.name, ram_budget="64GB", hardware=hardware, rates=rates, min_tokens_per_s=floor)
    with pytest.raises(NoQuantFitsError, match="meets the speed limits") as caught:
        _plan("auto", ram_budget="64GB", hardware=hardware, rates=rates, min_tokens_per_s=1e9)
    assert "minicpm-v-4.6: No quantization that fits is predicted" in str(caught.value)
    assert "the fastest that fits is" in str(caught.value)


def test_plan_predicts_from_the_default_rates_when_probing_is_off() -> None:
    from gguf_mcv.planning.speed import DEFAULT_RATES

    p = _plan("auto", ram_budget="8GB", hardware=_laptop_like(), speed_probe=False)
    assert p.rates == DEFAULT_RATES and all(r.decode_tokens_per_s for r in p.rows)


def test_a_fake_raspberry_pi_5_with_a_speed_floor_gets_minicpm_v_46(tmp_path) -> None:
    """The issue's case: on an 8 GB Pi 5 memory alone picks a big model that decodes at a
    token or two a second; a floor of 8 tokens/s picks 4.6 (rates: the Pi 5's published
    17 GB/s at 60 %, arithmetic rates of its four A76 cores, as tools/bench_speed.py scales them)."""
    from gguf_mcv import hardware
    from gguf_mcv.planning.speed import Rates

    files = {
        "proc/meminfo": f"MemTotal: {8 * 2**30 // 1024} kB\nMemAvailable: {int(7.4 * 2**30) // 1024} kB\n",
        "proc/cpuinfo": "\n".join(f"processor\t: {n}\nCPU part\t: 0xd0b\n" for n in range(4)),
        "sys/devices/system/cpu/online": "0-3\n",
        "proc/device-tree/model": "Raspberry Pi 5 Model B Rev 1.0\0",
        "_fake/platform": "Linux aarch64",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    pi5 = hardware.probe(tmp_path, cache_dir=tmp_path)
    assert pi5.board_kind == "raspberry-pi" and pi5.recommended_threads == 4
    rates = Rates(bandwidth=10.3e9, matvec=15e9, prefill_flops=60e9, vision_flops=45e9, threads=4, source="pi5")
    by_memory = _plan("auto", hardware=pi5, rates=rates)
    assert by_memory.model != "minicpm-v-4.6" and by_memory.speed.decode_tokens_per_s < 8
    fast = _plan("auto", hardware=pi5, rates=rates, min_tokens_per_s=8)
    assert fast.model == "minicpm-v-4.6" and fast.speed.decode_tokens_per_s >= 8
    assert fast.speed.decode_tokens_per_s > 5 * by_memory.speed.decode_tokens_per_s


def test_a_local_plan_counts_the_vision_backend_load_would_use(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("onnxruntime")
    from gguf_mcv.resolver import plan_local, vision_options
    from gguf_mcv.vision import onnx_vision

    files = (tiny.quants["Q4_K_M"], tiny.mmproj)
    auto = plan_local(*files, ram_budget="8GB")
    assert auto.vision_backend == "onnx-int8" and auto.estimate.vision_backend == "onnx-int8"
    asked = plan_local(*files, ram_budget="8GB", vision_backend="llama.cpp")
    assert asked.vision_backend == "llama.cpp" and asked.estimate.vision_weights == tiny.mmproj.stat().st_size
    assert vision_options("llama.cpp") == {"vision_backend": "llama.cpp", "onnxruntime": None}
    monkeypatch.setattr(onnx_vision, "onnxruntime_version", lambda: None)  # as if it did not import
    assert plan_local(*files, ram_budget="8GB").vision_backend == "llama.cpp"
    with pytest.raises(ConfigError, match="onnxruntime is not installed"):
        plan_local(*files, ram_budget="8GB", vision_backend="onnx-fp32")


def test_plan_on_the_command_line_takes_the_vision_backend(tiny, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from gguf_mcv.cli import main

    for backend in ("llama.cpp", "onnx-fp32"):
        assert main(["plan", str(tiny.quants["Q4_K_M"]), "--ram", "8GB", "--json", "--no-probe",
                     "--vision-backend", backend]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["vision_backend"] == data["rows"][0]["vision_backend"] == backend
    with pytest.raises(SystemExit) as info:  # argparse: bad usage
        main(["plan", str(tiny.quants["Q4_K_M"]), "--vision-backend", "onnx"])
    assert info.value.code == 2 and "--vision-backend" in capsys.readouterr().err


def test_a_local_files_speed_comes_from_its_own_weight_types(tiny) -> None:
    """plan_local reads the file's tensor types: a slow kernel for one of them shows in the
    prediction, which the size-and-quant estimate alone could not know."""
    from dataclasses import replace

    from gguf_mcv.models.headers import read_tensors, read_text_header, tensor_list
    from gguf_mcv.planning import speed
    from gguf_mcv.resolver import plan_local

    path = tiny.quants["Q4_K_M"]
    header = read_text_header(path)
    profile = speed.weight_profile(header.size, header.shape, "Q4_K_M", tensor_list(read_tensors(path)))
    assert set(profile.per_token()) >= {"Q4_K", "Q6_K"}
    rates = speed.Rates(bandwidth=1e15, matvec=20e9, prefill_flops=100e9, vision_flops=100e9, threads=2,
                        source="test", matvec_by_type={"Q4_K": 20e9, "Q6_K": 20e9})
    slow_q6 = replace(rates, matvec_by_type={"Q4_K": 20e9, "Q6_K": 1e9})
    fast = plan_local(path, tiny.mmproj, hardware=_laptop_like(), rates=rates, ram_budget="8GB")
    slow = plan_local(path, tiny.mmproj, hardware=_laptop_like(), rates=slow_q6, ram_budget="8GB")
    expected = speed.decode_seconds(header.size, header.shape, "Q4_K_M", slow_q6, n_past=0, weights=profile)
    assert slow.speed.decode_tokens_per_s < fast.speed.decode_tokens_per_s / 2
    assert 1 / slow.speed.decode_tokens_per_s >= expected  # the KV cache at the photo's length on top
