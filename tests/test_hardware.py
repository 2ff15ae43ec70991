"""Tests of the hardware probe, on fake machine trees built under tmp_path."""

from __future__ import annotations

import os
import shutil
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_mcv import hardware
from gguf_mcv.errors import ConfigError
from gguf_mcv.hardware import Gpu, Hardware, parse_size, probe

GB = 10**9
GiB = 2**30
MiB = 2**20

_real_llama_gpu_offload = hardware._llama_gpu_offload


@pytest.fixture(autouse=True)
def _no_llama(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep probes fast and machine-independent: don't load the real llama.cpp library."""
    monkeypatch.setattr(hardware, "_llama_gpu_offload", lambda: (True, None))


# --- fake trees ---------------------------------------------------------------------


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def meminfo(total: int, available: int) -> dict[str, str]:
    """``proc/meminfo`` in kB, as the kernel writes it (so sizes should divide by 1024)."""
    text = f"MemTotal:       {total // 1024} kB\nMemFree:        {available // 2048} kB\n"
    text += f"MemAvailable:   {available // 1024} kB\nBuffers:        1024 kB\n"
    return {"proc/meminfo": text}


def arm_cpus(freqs: list[int], key: str = "cpufreq/cpuinfo_max_freq") -> dict[str, str]:
    """An ARM board: one cpuinfo block per core, no ``core id``; sysfs speeds per core."""
    blocks = [
        f"processor\t: {n}\nBogoMIPS\t: 108.00\nCPU part\t: 0xd0b\n" for n in range(len(freqs))
    ]
    files = {"proc/cpuinfo": "\n".join(blocks) + "\nModel\t: fake\n"}
    files["sys/devices/system/cpu/online"] = f"0-{len(freqs) - 1}\n"
    for n, freq in enumerate(freqs):
        files[f"sys/devices/system/cpu/cpu{n}/{key}"] = f"{freq}\n"
    return files


def x86_cpus(cores: int, threads_per_core: int, freq: int = 4_000_000) -> dict[str, str]:
    """An x86 CPU with hyper-threads: cpu n and n+cores are siblings on one core."""
    logical = cores * threads_per_core
    blocks = [
        f"processor\t: {n}\nphysical id\t: 0\ncore id\t\t: {n % cores}\nsiblings\t: {logical}\n"
        for n in range(logical)
    ]
    files = {
        "proc/cpuinfo": "\n".join(blocks),
        "sys/devices/system/cpu/online": f"0-{logical - 1}\n",
    }
    for n in range(logical):
        siblings = ",".join(str(n % cores + k * cores) for k in range(threads_per_core))
        files[f"sys/devices/system/cpu/cpu{n}/topology/thread_siblings_list"] = siblings + "\n"
        files[f"sys/devices/system/cpu/cpu{n}/cpufreq/cpuinfo_max_freq"] = f"{freq}\n"
    return files


def laptop(tmp_path: Path, **extra: str) -> Path:
    """A plain 8-core, 16-thread x86 machine with 32 GB of RAM."""
    return make_tree(tmp_path, {**meminfo(32 * GB, 20 * GB), **x86_cpus(8, 2), **extra})


# --- boards -------------------------------------------------------------------------


def test_raspberry_pi_5_4gb(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        **meminfo(4 * GiB, 3 * GiB),
        **arm_cpus([2_400_000] * 4),
        "proc/device-tree/model": "Raspberry Pi 5 Model B Rev 1.0\0",
        "proc/device-tree/compatible": "raspberrypi,5-model-b\0brcm,bcm2712\0",
        "_fake/platform": "Linux aarch64",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    assert hw.board == "Raspberry Pi 5 Model B Rev 1.0"
    assert hw.board_kind == "raspberry-pi"
    assert (hw.system, hw.machine) == ("Linux", "aarch64")
    assert (hw.total_ram, hw.available_ram) == (4 * GiB, 3 * GiB)
    assert hw.memory_limit_source is None
    assert hw.physical_cores == 4 and hw.performance_cores is None
    assert hw.recommended_threads == 4
    assert hw.gpus == () and hw.gpu is None and not hw.unified_memory


def test_device_tree_under_sys_firmware(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        **meminfo(8 * GB, 7 * GB),
        "sys/firmware/devicetree/base/model": "Raspberry Pi 4 Model B Rev 1.4\0",
    })  # fmt: skip
    assert probe(root, cache_dir=tmp_path).board == "Raspberry Pi 4 Model B Rev 1.4"


def test_jetson_orin_nano_8gb(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        **meminfo(7_600_000_000, 6 * GB),
        **arm_cpus([1_510_400] * 6),
        "etc/nv_tegra_release": "# R36 (release), REVISION: 3.0, GCID: 36923193, BOARD: generic, "
        "EABI: aarch64, DATE: Fri Jul 19 23:24:25 UTC 2024\n",
        "proc/device-tree/model": "NVIDIA Jetson Orin Nano Developer Kit\0",
        "proc/device-tree/compatible": "nvidia,p3768-0000+p3767-0005\0nvidia,tegra234\0",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    assert hw.board == "NVIDIA Jetson Orin Nano Developer Kit"
    assert hw.board_kind == "jetson"
    assert hw.physical_cores == 6 and hw.recommended_threads == 6
    assert hw.unified_memory
    assert hw.gpu == Gpu(
        "NVIDIA Jetson Orin Nano Developer Kit", "cuda", 7_600_000_000, 6 * GB, True
    )


@pytest.mark.parametrize(
    ("files", "board"),
    [
        (
            {"etc/nv_tegra_release": "# R35 (release), REVISION: 4.1, GCID: 1\n"},
            "NVIDIA Jetson (L4T R35.4.1)",
        ),
        ({"proc/device-tree/compatible": "nvidia,p3737-0000\0nvidia,tegra234\0"}, "NVIDIA Jetson"),
    ],
)
def test_jetson_without_model_name(tmp_path: Path, files: dict[str, str], board: str) -> None:
    hw = probe(make_tree(tmp_path, {**meminfo(32 * GB, 30 * GB), **files}), cache_dir=tmp_path)
    assert (hw.board, hw.board_kind) == (board, "jetson")
    assert hw.gpu is not None and hw.gpu.unified and hw.gpu.total_memory == 32 * GB


def test_apple_silicon_has_unified_metal_gpu(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {**meminfo(16 * GB, 10 * GB), "_fake/platform": "Darwin arm64"})
    hw = probe(root, cache_dir=tmp_path)
    assert hw.gpu == Gpu("Apple Silicon GPU", "metal", 16 * GB, 10 * GB, True)
    assert hw.board_kind is None


def test_fake_tree_without_meminfo_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="proc/meminfo"):
        probe(tmp_path / "nowhere", cache_dir=tmp_path)


def test_root_comes_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUF_MCV_HW_ROOT", str(make_tree(tmp_path, meminfo(4 * GB, 3 * GB))))
    assert probe(cache_dir=tmp_path).total_ram == 4 * GB


# --- container memory limits ----------------------------------------------------------


def _v2_limited(tmp_path: Path) -> Path:
    """A cgroup v2 root with a 3 GB limit and half a GB in use, on a 64 GB host."""
    return make_tree(tmp_path, {
        **meminfo(64 * GB, 60 * GB),
        "proc/self/cgroup": "0::/\n",
        "sys/fs/cgroup/memory.max": f"{3 * GB}\n",
        "sys/fs/cgroup/memory.current": f"{GB // 2}\n",
    })  # fmt: skip


def test_cgroup_v2_memory_limit(tmp_path: Path) -> None:
    hw = probe(_v2_limited(tmp_path), cache_dir=tmp_path)
    assert hw.memory_limit_source == "cgroup v2"
    assert hw.total_ram == 3 * GB
    assert hw.available_ram == 3 * GB - GB // 2


def test_available_ram_alone_is_the_probes_figure(tmp_path: Path) -> None:
    root = _v2_limited(tmp_path)
    assert hardware.available_ram(root) == probe(root, cache_dir=tmp_path).available_ram == 3 * GB - GB // 2


def test_cgroup_v2_limit_of_a_parent_cgroup(tmp_path: Path) -> None:
    # A Kubernetes pod: the pod folder holds the limit, the container's own says "max".
    root = make_tree(tmp_path, {
        **meminfo(64 * GB, 60 * GB),
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/memory.current": f"{GB}\n",
        "sys/fs/cgroup/kubepods/pod1/memory.max": f"{3 * GB}\n",
        "sys/fs/cgroup/kubepods/pod1/memory.current": f"{GB}\n",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    assert (hw.total_ram, hw.available_ram, hw.memory_limit_source) == (3 * GB, 2 * GB, "cgroup v2")


def test_cgroup_v2_inactive_page_cache_is_not_usage(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        **meminfo(64 * GB, 60 * GB),
        "sys/fs/cgroup/memory.max": f"{3 * GB}\n",
        "sys/fs/cgroup/memory.current": f"{2 * GB}\n",
        "sys/fs/cgroup/memory.stat": f"anon {GB // 2}\nfile {3 * GB // 2}\ninactive_file {GB}\n",
    })  # fmt: skip
    assert probe(root, cache_dir=tmp_path).available_ram == 2 * GB


def test_cgroup_v2_max_means_unlimited(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        **meminfo(64 * GB, 60 * GB),
        "sys/fs/cgroup/memory.max": "max\n",
        "sys/fs/cgroup/memory.current": f"{GB}\n",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    assert (hw.total_ram, hw.available_ram, hw.memory_limit_source) == (64 * GB, 60 * GB, None)


def test_cgroup_v1_memory_limit(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        **meminfo(64 * GB, 60 * GB),
        "proc/self/cgroup": "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        # Inside the container its own cgroup is mounted at the top; docker/abc is absent.
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{3 * GB}\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GB}\n",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    assert hw.memory_limit_source == "cgroup v1"
    assert hw.total_ram == 3 * GB
    assert hw.available_ram == 2 * GB


def test_cgroup_v1_huge_limit_means_unlimited(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        **meminfo(64 * GB, 60 * GB),
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GB}\n",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    assert (hw.total_ram, hw.memory_limit_source) == (64 * GB, None)


def test_available_is_the_smaller_of_host_and_container(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        **meminfo(64 * GB, GiB),  # the host itself is nearly full
        "sys/fs/cgroup/memory.max": f"{3 * GB}\n",
        "sys/fs/cgroup/memory.current": "0\n",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    assert (hw.total_ram, hw.available_ram) == (3 * GB, GiB)


def test_recorded_second_run_in_a_container_probes_like_the_first(tmp_path: Path) -> None:
    """A second run in the same cgroup (the first run's 192 MiB of page cache still charged,
    recorded on a real cgroup v1) gets the first run's RAM and budget."""
    trees = Path(__file__).parent / "data" / "cgroup_trees"
    seen = []
    for name in ("v1-first-run", "v1-second-run"):
        root = make_tree(tmp_path / name, meminfo(24 * GiB, 20 * GiB))
        shutil.copytree(trees / name, root, dirs_exist_ok=True)
        hw = probe(root, cache_dir=tmp_path)
        seen.append((hw.total_ram, hw.available_ram, hw.available_ram - hw.ram_reserve))
    (total1, available1, budget1), (total2, available2, budget2) = seen
    assert total1 == total2 == 768 * MiB
    assert abs(available1 - available2) <= MiB and abs(budget1 - budget2) <= MiB


# --- the reserve a default budget keeps -----------------------------------------------


def test_a_container_keeps_the_container_reserve_not_an_os_reserve(tmp_path: Path) -> None:
    """The issue's 1.4 GB container, 60 MiB already used: the default model, which answers in
    1.26 GB, is planned (the OS reserve left 1.1 GB)."""
    root = make_tree(tmp_path, {
        **meminfo(24 * GiB, 20 * GiB),
        "sys/fs/cgroup/memory.max": f"{int(1.4 * GB)}\n",
        "sys/fs/cgroup/memory.current": f"{60 * MiB}\n",
        "sys/fs/cgroup/memory.stat": f"anon {60 * MiB}\n",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    assert hw.host_available_ram == 20 * GiB
    assert hw.ram_reserve == hardware.CONTAINER_RESERVE
    assert hw.available_ram - hw.ram_reserve >= int(1.26 * GB)


def test_a_host_fuller_than_the_container_keeps_the_os_reserve(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        **meminfo(8 * GB, GiB),
        "sys/fs/cgroup/memory.max": f"{3 * GB}\n",
        "sys/fs/cgroup/memory.current": "0\n",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    assert (hw.available_ram, hw.ram_reserve) == (GiB, hardware.OS_RESERVE_MIN)


def test_without_a_limit_the_os_reserve_is_unchanged(tmp_path: Path) -> None:
    hw = probe(make_tree(tmp_path, meminfo(64 * GB, 40 * GB)), cache_dir=tmp_path)
    assert hw.host_available_ram is None
    assert hw.ram_reserve == 4 * GB  # 10 %


ram = st.integers(min_value=0, max_value=2**44)


@settings(max_examples=300, deadline=None)
@given(host=ram, headroom=st.one_of(st.none(), ram))
def test_the_default_budget_is_the_smaller_of_the_hosts_and_the_containers(host: int, headroom: int | None) -> None:
    """For any host free RAM and container headroom: the budget (available less the reserve)
    leaves the OS its reserve of the host's free RAM and, under a limit, the container reserve
    of its headroom, and is the largest budget that does both."""
    available = host if headroom is None else min(host, headroom)
    hw = Hardware(system="Linux", machine="x86_64", total_ram=2**45, available_ram=available,
                  memory_limit_source=None if headroom is None else "cgroup v2", physical_cores=4,
                  performance_cores=None, cpu_quota=None, allowed_cpus=None, board=None, board_kind=None, gpus=(),
                  gpu_offload=False, gpu_offload_note=None, cache_dir=Path("/tmp"), free_disk=None,
                  host_available_ram=None if headroom is None else host)
    budget = hw.available_ram - hw.ram_reserve
    os_bound = host - max(int(host * hardware.OS_RESERVE_FRACTION), hardware.OS_RESERVE_MIN)
    limit_bound = os_bound if headroom is None else headroom - hardware.CONTAINER_RESERVE
    assert 0 <= budget <= available
    assert budget == max(0, min(os_bound, limit_bound))


# --- CPU ----------------------------------------------------------------------------


def test_big_little_counts_performance_cores(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path, {**meminfo(8 * GB, 6 * GB), **arm_cpus([1_800_000] * 4 + [2_400_000] * 4)}
    )
    hw = probe(root, cache_dir=tmp_path)
    assert hw.physical_cores == 8
    assert hw.performance_cores == 4
    assert hw.recommended_threads == 4


def test_big_little_by_cpu_capacity_with_unevenly_clocked_big_clusters(tmp_path: Path) -> None:
    # RK3588-like: 4 little cores, then two big clusters clocked a little apart.
    capacities = [414] * 4 + [1024] * 2 + [990] * 2
    root = make_tree(
        tmp_path, {**meminfo(16 * GB, 14 * GB), **arm_cpus(capacities, "cpu_capacity")}
    )
    assert probe(root, cache_dir=tmp_path).performance_cores == 4


def test_hyperthreads_count_once(tmp_path: Path) -> None:
    hw = probe(laptop(tmp_path), cache_dir=tmp_path)
    assert hw.physical_cores == 8
    assert hw.performance_cores is None
    assert hw.recommended_threads == 8


@pytest.mark.parametrize(
    ("cpu_max", "quota", "threads"),
    [
        ("200000 100000\n", 2.0, 2),
        ("150000 100000\n", 1.5, 1),
        ("50000 100000\n", 0.5, 1),
        ("max 100000\n", None, 8),
    ],
)
def test_cgroup_v2_cpu_quota(
    tmp_path: Path, cpu_max: str, quota: float | None, threads: int
) -> None:
    hw = probe(laptop(tmp_path, **{"sys/fs/cgroup/cpu.max": cpu_max}), cache_dir=tmp_path)
    assert hw.cpu_quota == quota
    assert hw.recommended_threads == threads


def test_cgroup_v1_cpu_quota(tmp_path: Path) -> None:
    root = laptop(tmp_path, **{
        "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "300000\n",
        "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    assert (hw.cpu_quota, hw.recommended_threads) == (3.0, 3)


def test_cpu_affinity_caps_threads(tmp_path: Path) -> None:
    root = laptop(tmp_path, **{"proc/self/status": "Name:\tpython\nCpus_allowed_list:\t0-2,5\n"})
    hw = probe(root, cache_dir=tmp_path)
    assert (hw.allowed_cpus, hw.recommended_threads) == (4, 4)


# --- NVIDIA GPUs --------------------------------------------------------------------


def test_laptop_with_nvidia_gpu(tmp_path: Path) -> None:
    root = laptop(
        tmp_path, **{"_fake/nvidia-smi.csv": "NVIDIA GeForce RTX 4060 Laptop GPU, 8192, 7168\n"}
    )
    hw = probe(root, cache_dir=tmp_path)
    assert hw.gpu == Gpu("NVIDIA GeForce RTX 4060 Laptop GPU", "cuda", 8 * GiB, 7 * GiB, False)
    assert not hw.unified_memory
    assert hw.total_ram == 32 * GB  # VRAM is extra, not taken from RAM


def test_nvidia_smi_output_with_several_gpus_and_unknown_memory() -> None:
    text = (
        "Tesla T4, 15360, 15000\nGPU, with comma, 1024, 512\nOrin (nvgpu), [N/A], [N/A]\ngarbage\n"
    )
    gpus = hardware._parse_nvidia_smi(text)
    assert [(g.name, g.total_memory, g.free_memory) for g in gpus] == [
        ("Tesla T4", 15360 * MiB, 15000 * MiB),
        ("GPU, with comma", 1024 * MiB, 512 * MiB),
    ]


needs_posix = pytest.mark.skipif(os.name != "posix", reason="fake nvidia-smi is a shell script")


def _fake_nvidia_smi(folder: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")


@needs_posix
def test_query_nvidia_smi_runs_the_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvidia_smi(tmp_path, 'echo "$1 $2"', monkeypatch)
    assert hardware._query_nvidia_smi() == (
        "--query-gpu=name,memory.total,memory.free --format=csv,noheader,nounits\n"
    )


@needs_posix
@pytest.mark.parametrize("body", ["exec sleep 5", "echo 'NVIDIA-SMI has failed' ; exit 9"])
def test_query_nvidia_smi_that_hangs_or_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str
) -> None:
    _fake_nvidia_smi(tmp_path, body, monkeypatch)
    assert hardware._query_nvidia_smi(timeout=0.3) is None


def test_query_nvidia_smi_without_the_binary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hardware._query_nvidia_smi() is None


# --- llama.cpp GPU offload ------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (types.SimpleNamespace(llama_supports_gpu_offload=lambda: True), (True, None)),
        (
            types.SimpleNamespace(llama_supports_gpu_offload=lambda: False),
            (False, "this llama.cpp build is CPU-only"),
        ),
    ],
)
def test_llama_gpu_offload(
    monkeypatch: pytest.MonkeyPatch, module: object, expected: tuple
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    assert _real_llama_gpu_offload() == expected


def test_llama_gpu_offload_when_llama_cpp_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        sys.modules, "llama_cpp", None
    )  # makes `import llama_cpp` raise ImportError
    supported, note = _real_llama_gpu_offload()
    assert not supported
    assert note is not None and note.startswith("llama_cpp cannot be loaded")


def test_gpu_unused_by_cpu_only_build_is_described(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        hardware, "_llama_gpu_offload", lambda: (False, "this llama.cpp build is CPU-only")
    )
    root = laptop(
        tmp_path, **{"_fake/nvidia-smi.csv": "NVIDIA GeForce RTX 4060 Laptop GPU, 8192, 7168\n"}
    )
    hw = probe(root, cache_dir=tmp_path)
    assert not hw.gpu_offload
    assert "CPU-only" in hw.describe()


# --- disk and summary -----------------------------------------------------------------


def test_free_disk_of_a_cache_dir_not_yet_created(tmp_path: Path) -> None:
    hw = probe(laptop(tmp_path), cache_dir=tmp_path / "not" / "yet" / "there")
    assert hw.cache_dir == tmp_path / "not" / "yet" / "there"
    assert hw.free_disk is not None and hw.free_disk > 0


def test_default_cache_dir_is_huggingface_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert probe(laptop(tmp_path)).cache_dir == tmp_path / "hub"


def test_describe(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        **meminfo(64 * GB, 60 * GB),
        **arm_cpus([2_400_000] * 4),
        "proc/device-tree/model": "Raspberry Pi 5 Model B Rev 1.0\0",
        "sys/fs/cgroup/memory.max": f"{3 * GB}\n",
        "sys/fs/cgroup/memory.current": f"{GB}\n",
    })  # fmt: skip
    hw = probe(root, cache_dir=tmp_path)
    text = hw.describe()
    assert str(hw) == text
    for part in (
        "Raspberry Pi 5",
        "2.0 GB of 3.0 GB RAM",
        "cgroup v2",
        "4 CPU cores",
        "no GPU",
        str(tmp_path),
    ):
        assert part in text
    assert "\n" not in text


def test_hardware_is_frozen(tmp_path: Path) -> None:
    hw = probe(laptop(tmp_path), cache_dir=tmp_path)
    with pytest.raises(AttributeError):
        hw.total_ram = 1  # type: ignore[misc]


# --- parse_size ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (6_000_000_000, 6 * GB),
        (0, 0),
        ("6GB", 6 * GB),
        ("6 GB", 6 * GB),
        ("4gb", 4 * GB),
        ("3.5G", 3_500_000_000),
        ("3.5g", 3_500_000_000),
        ("512MiB", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("1.5Gi", 3 * GiB // 2),
        ("500M", 500 * 10**6),
        ("64k", 64_000),
        ("1TB", 10**12),
        ("1024", 1024),
        ("1024B", 1024),
        (" 7 gb ", 7 * GB),
        (".5GB", GB // 2),
        ("0.1GB", 100_000_000),
    ],
)
def test_parse_size(text: int | str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "bad", ["", "GB", "six GB", "6 XB", "-1GB", "6GBs", "6 G B", "1e9", -1, True, None, 6.0, [6]]
)
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(bad)  # type: ignore[arg-type]


# --- the real machine -----------------------------------------------------------------


def test_real_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("GGUF_MCV_HW_ROOT", raising=False)
    monkeypatch.setattr(hardware, "_llama_gpu_offload", _real_llama_gpu_offload)
    hw = probe(cache_dir=tmp_path)
    assert isinstance(hw, Hardware)
    assert 0 < hw.available_ram <= hw.total_ram
    assert hw.physical_cores >= 1 and hw.recommended_threads >= 1
    assert isinstance(hw.gpu_offload, bool)
    assert hw.free_disk is not None and hw.free_disk > 0
    assert hw.describe()


def test_cpu_flags_read_x86_flags_and_arm_features(tmp_path: Path) -> None:
    from gguf_mcv.hardware import cpu_flags

    x86 = make_tree(tmp_path / "x86", {"proc/cpuinfo": "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n\n"
                                                         "processor\t: 1\nflags\t\t: fpu avx512f avx512_bf16\n"})
    assert cpu_flags(x86) == {"fpu", "avx512f", "avx512_bf16"}
    arm = make_tree(tmp_path / "arm", {"proc/cpuinfo": "processor\t: 0\nFeatures\t: fp asimd bf16\n"})
    assert "bf16" in cpu_flags(arm) and "avx512_bf16" not in cpu_flags(arm)
    assert cpu_flags(make_tree(tmp_path / "none", {"proc/cpuinfo": "garbage\x00\n"})) == frozenset()
    assert cpu_flags(tmp_path / "missing") == frozenset()
