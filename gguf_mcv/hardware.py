"""Describe the machine: RAM after container limits, CPU cores, board, GPU, free disk.

Every file the probe reads goes through :func:`gguf_mcv.cgroups.read`, relative to a root folder
(``/`` unless ``GGUF_MCV_HW_ROOT`` or the ``root`` argument says otherwise), so a
fake tree of ``proc/``, ``sys/`` and ``etc/`` files can describe any machine: a
4 GB Raspberry Pi on a 24 GB laptop, in tests or to preview what the planner would
pick. On the real root psutil supplies RAM and core counts; under a fake root they
come from the tree's ``proc/meminfo`` and ``proc/cpuinfo``. Container limits
always come from the cgroup files (:mod:`gguf_mcv.cgroups`).

Two facts are not files on a real machine, so a fake tree spells them out:

* ``_fake/nvidia-smi.csv``: what ``nvidia-smi --query-gpu=name,memory.total,memory.free
  --format=csv,noheader,nounits`` would print (absent: no NVIDIA GPU);
* ``_fake/platform``: ``"<system> <machine>"`` as :mod:`platform` would say, e.g.
  ``Darwin arm64`` (absent: ``Linux unknown``).

Under a fake root the real ``nvidia-smi`` and :mod:`platform` are never consulted,
so the test machine's own GPU cannot leak into a fake one. Whether the installed
llama.cpp can offload to a GPU is a fact about the software, not the machine, and
is always asked of the real ``llama_cpp``.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import psutil

from gguf_mcv import environment
from gguf_mcv.cgroups import cgroup_dirs, key_values, memory_limit
from gguf_mcv.cgroups import read as _read
from gguf_mcv.cgroups import read_int as _int
from gguf_mcv.errors import ConfigError
from gguf_mcv.units import format_size, parse_size

__all__ = ["Gpu", "Hardware", "available_ram", "format_size", "parse_size", "probe"]

#: Files a fake hardware tree uses in place of running ``nvidia-smi`` / asking :mod:`platform`.
FAKE_NVIDIA_SMI = "_fake/nvidia-smi.csv"
FAKE_PLATFORM = "_fake/platform"

_NVIDIA_SMI_ARGS = ("--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits")
_MIB = 2**20

#: Kept back from the host's free RAM by a default budget: max(10 %, 300 MB) -- the OS, page
#: cache and whatever else starts later need room, and predictions are within ~5 %.
OS_RESERVE_FRACTION = 0.10
OS_RESERVE_MIN = 300_000_000
#: Kept back from what a container's memory limit leaves: no OS lives inside the limit, only
#: the kernel memory the run causes beyond its RSS (page tables, thread stacks, slab, sockets)
#: and the ~5 % the memory model misses by (docs/models-and-planning.md, "Where the budget
#: comes from", has the measurements).
CONTAINER_RESERVE = 64 * _MIB


@dataclass(frozen=True)
class Gpu:
    """A GPU llama.cpp could offload to. Memory is in bytes."""

    name: str
    #: The llama.cpp backend it needs: ``"cuda"`` or ``"metal"``.
    backend: str
    total_memory: int
    free_memory: int
    #: Shares system RAM (Jetson, Apple Silicon): its memory *is* the RAM budget, not extra.
    unified: bool

    def describe(self) -> str:
        """``"NVIDIA GeForce RTX 4060 (cuda, 7.2 GB of 8.6 GB free)"``."""
        memory = "shares RAM"
        if not self.unified:
            memory = f"{format_size(self.free_memory)} of {format_size(self.total_memory)} free"
        return f"{self.name} ({self.backend}, {memory})"


@dataclass(frozen=True)
class Hardware:
    """What :func:`probe` found. Sizes are in bytes."""

    system: str  #: ``"Linux"``, ``"Darwin"``, ``"Windows"``
    machine: str  #: ``"x86_64"``, ``"aarch64"``, ``"arm64"``, ...
    total_ram: int  #: physical RAM, lowered to the container's memory limit
    available_ram: int  #: RAM free for a model now: the host's, or less where a cgroup limit leaves less
    memory_limit_source: str | None  #: ``"cgroup v2"``, ``"cgroup v1"`` or None (no limit)
    physical_cores: int
    performance_cores: int | None  #: big cores on big.LITTLE / hybrid CPUs, else None
    cpu_quota: float | None  #: CPUs the cgroup quota allows (``cpu.max``), None if unlimited
    allowed_cpus: int | None  #: logical CPUs in the process's affinity mask, if known
    board: str | None  #: e.g. ``"Raspberry Pi 5 Model B Rev 1.0"``
    board_kind: str | None  #: ``"raspberry-pi"``, ``"jetson"`` or None
    gpus: tuple[Gpu, ...]
    gpu_offload: bool  #: the installed llama.cpp build can offload layers to a GPU
    gpu_offload_note: str | None  #: why it cannot, when it cannot
    cache_dir: Path  #: where models are downloaded
    free_disk: int | None  #: free bytes on cache_dir's file system, None if unknown
    #: The host's (or VM's) free RAM where a cgroup memory limit applies, else None.
    host_available_ram: int | None = None
    #: The CPU's repack family, from its feature flags (a key of
    #: :data:`gguf_mcv.planning.calibration.REPACKED_TYPES`); None: assumed from ``machine``
    #: (:func:`cpu_family`), as for a machine described by hand.
    repack_family: str | None = None

    @property
    def gpu(self) -> Gpu | None:
        """The first GPU, or None."""
        return self.gpus[0] if self.gpus else None

    @property
    def unified_memory(self) -> bool:
        """True when the GPU shares system RAM, so offloading frees no RAM."""
        return any(g.unified for g in self.gpus)

    @property
    def ram_reserve(self) -> int:
        """What a default RAM budget keeps back from ``available_ram``.

        The host's free RAM keeps an OS reserve (:data:`OS_RESERVE_FRACTION`, at least
        :data:`OS_RESERVE_MIN`); what a cgroup limit leaves keeps only :data:`CONTAINER_RESERVE`.
        The budget is the smaller of the two.
        """
        host = self.available_ram if self.host_available_ram is None else self.host_available_ram
        by_host = host - max(int(host * OS_RESERVE_FRACTION), OS_RESERVE_MIN)
        by_limit = by_host if self.host_available_ram is None else self.available_ram - CONTAINER_RESERVE
        return self.available_ram - max(0, min(by_host, by_limit))

    @property
    def recommended_threads(self) -> int:
        """Threads for llama.cpp: performance cores (or all physical cores), within the quota."""
        n = self.performance_cores or self.physical_cores
        if self.cpu_quota is not None:
            # A thread beyond the quota gets throttled mid-matmul and every other thread waits.
            n = min(n, int(self.cpu_quota))
        if self.allowed_cpus is not None:
            n = min(n, self.allowed_cpus)
        return max(1, n)

    def describe(self) -> str:
        """A one-paragraph summary for people."""
        head = f"{self.system} {self.machine} machine"
        if self.board:
            head = f"{self.board} ({self.system} {self.machine})"
        ram = f"{format_size(self.available_ram)} of {format_size(self.total_ram)} RAM available"
        if self.memory_limit_source:
            ram += f" (limited by {self.memory_limit_source})"
        cpu = f"{self.physical_cores} CPU cores"
        if self.performance_cores:
            cpu += f" ({self.performance_cores} performance)"
        if self.cpu_quota is not None:
            cpu += f", CPU quota {self.cpu_quota:g}"
        cpu += f", {self.recommended_threads} threads recommended"
        gpu = "GPU " + ", ".join(g.describe() for g in self.gpus) if self.gpus else "no GPU"
        if self.gpus and not self.gpu_offload:
            gpu += f", unused: {self.gpu_offload_note}"
        disk = "unknown free space"
        if self.free_disk is not None:
            disk = f"{format_size(self.free_disk)} free"
        return f"{head}: {ram}; {cpu}; {gpu}; {disk} for models in {self.cache_dir}."

    __str__ = describe


def probe(root: str | Path | None = None, *, cache_dir: Path | None = None) -> Hardware:
    """Describe this machine, or the fake one whose files lie under ``root``.

    ``root`` defaults to :func:`gguf_mcv.environment.hardware_root` (``$GGUF_MCV_HW_ROOT``
    or ``/``); ``cache_dir`` to huggingface_hub's cache folder.
    """
    root = Path(root) if root is not None else environment.hardware_root()
    real = root.resolve() == Path("/").resolve()
    system, machine = _platform(root, real)
    total, available, limit_source, host_available = _memory(root, real)
    speeds = _core_speeds(root)
    physical = _physical_cores(root, real, speeds)
    performance = _performance_cores(speeds)
    if performance is None and real and system == "Darwin":
        performance = _darwin_performance_cores(physical)
    board, board_kind = _board(root)
    offload, note = _llama_gpu_offload()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
    return Hardware(
        system=system,
        machine=machine,
        total_ram=total,
        available_ram=max(0, available),
        memory_limit_source=limit_source,
        physical_cores=physical,
        performance_cores=performance,
        cpu_quota=_cpu_quota(root),
        allowed_cpus=_allowed_cpus(root),
        board=board,
        board_kind=board_kind,
        gpus=_gpus(root, real, system, machine, board, board_kind, total, available),
        gpu_offload=offload,
        gpu_offload_note=note,
        cache_dir=cache,
        free_disk=_free_disk(cache),
        host_available_ram=host_available,
        repack_family=repack_family(machine, cpu_flags(root)),
    )


def available_ram(root: str | Path | None = None) -> int:
    """RAM free for a model now, as :func:`probe` counts it (``Hardware.available_ram``: the
    host's, or less where a cgroup limit leaves less), without probing the rest of the machine."""
    root = Path(root) if root is not None else environment.hardware_root()
    return max(0, _memory(root, root.resolve() == Path("/").resolve())[1])


# --- reading files ------------------------------------------------------------------


def _cpu_list(text: str | None) -> list[int]:
    """``"0-3,6"`` → ``[0, 1, 2, 3, 6]`` (the kernel's CPU list format)."""
    cpus: list[int] = []
    for part in (text or "").strip().split(","):
        lo, _, hi = part.partition("-")
        if lo.strip().isdigit() and (not hi or hi.strip().isdigit()):
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _platform(root: Path, real: bool) -> tuple[str, str]:
    if real:
        return platform.system(), platform.machine()
    system, _, machine = (_read(root, FAKE_PLATFORM) or "Linux unknown").strip().partition(" ")
    return system, machine.strip() or "unknown"


# --- memory -------------------------------------------------------------------------


def _memory(root: Path, real: bool) -> tuple[int, int, str | None, int | None]:
    """Total and available RAM after container limits, the limit's source and the host's
    available RAM (both None without a limit)."""
    total, available = _host_memory(root, real)
    # psutil reports the host's RAM even inside a container, where the kernel kills the
    # process at the cgroup limit long before host RAM runs out.
    limit = memory_limit(root, total)
    if limit is None:
        return total, available, None, None
    return min(total, limit.limit), min(available, limit.headroom), limit.source, available


def _host_memory(root: Path, real: bool) -> tuple[int, int]:
    """Total and available RAM of the host (or VM), before container limits."""
    if real:
        vm = psutil.virtual_memory()
        return vm.total, vm.available
    info = key_values(_read(root, "proc/meminfo"))
    if "MemTotal" not in info:
        raise ConfigError(
            f"hardware root {root} has no readable proc/meminfo; ${environment.ENV_HW_ROOT} "
            "must name a folder laid out like / (proc/, sys/, etc/)"
        )
    # Kernels before 3.14 lack MemAvailable; free + buffers + page cache is its old estimate.
    fallback = sum(info.get(k, 0) for k in ("MemFree", "Buffers", "Cached"))
    return info["MemTotal"] * 1024, info.get("MemAvailable", fallback) * 1024


# --- CPU ----------------------------------------------------------------------------


def _cpu_quota(root: Path) -> float | None:
    """CPUs the cgroup CPU quota allows (``200000 100000`` → 2.0), or None."""
    quotas = []
    for folder in cgroup_dirs(root, "sys/fs/cgroup", ""):
        quota, _, period = (_read(root, f"{folder}/cpu.max") or "").strip().partition(" ")
        q, p = _int(quota), _int(period)  # quota "max" = no quota
        if q and p and q > 0 and p > 0:
            quotas.append(q / p)
    if not quotas:
        for folder in cgroup_dirs(root, "sys/fs/cgroup/cpu", "cpu"):
            q = _int(_read(root, f"{folder}/cpu.cfs_quota_us"))  # -1 = no quota
            p = _int(_read(root, f"{folder}/cpu.cfs_period_us"))
            if q and p and q > 0 and p > 0:
                quotas.append(q / p)
    return min(quotas, default=None)


def _allowed_cpus(root: Path) -> int | None:
    """Logical CPUs this process may run on (``taskset``, ``docker --cpuset-cpus``)."""
    for line in (_read(root, "proc/self/status") or "").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return len(_cpu_list(line.partition(":")[2])) or None
    return None


def _core_speeds(root: Path) -> dict[str, int]:
    """Each online physical core (keyed by its hyper-thread siblings) → its speed.

    Speed is the scheduler's ``cpu_capacity`` (ARM), else ``cpuinfo_max_freq``; 0 if unknown.
    """
    speeds: dict[str, int] = {}
    for n in _cpu_list(_read(root, "sys/devices/system/cpu/online")):
        folder = f"sys/devices/system/cpu/cpu{n}"
        speed = _int(_read(root, f"{folder}/cpu_capacity")) or _int(
            _read(root, f"{folder}/cpufreq/cpuinfo_max_freq")
        )
        core = (_read(root, f"{folder}/topology/thread_siblings_list") or "").strip() or str(n)
        speeds[core] = max(speed or 0, speeds.get(core, 0))
    return speeds


def _performance_cores(speeds: dict[str, int]) -> int | None:
    """Cores within 20% of the fastest when some are slower (big.LITTLE), else None."""
    known = [s for s in speeds.values() if s > 0]
    if not known:
        return None
    # 20%, not "equal to the fastest": RK3588 clocks its two big clusters a little
    # apart, and x86 favoured cores turbo a few percent above their siblings.
    fast = sum(1 for s in known if s >= 0.8 * max(known))
    return fast if fast < len(known) else None


def _physical_cores(root: Path, real: bool, speeds: dict[str, int]) -> int:
    if real:
        n = psutil.cpu_count(logical=False) or psutil.cpu_count(logical=True)
    else:
        n = _cpuinfo_cores(_read(root, "proc/cpuinfo")) or len(speeds)
    return max(1, n or 1)


def _cpuinfo_cores(text: str | None) -> int:
    """Physical cores in ``/proc/cpuinfo``: distinct (package, core id), else processors.

    ARM's cpuinfo has no ``core id``; its boards have no hyper-threads either.
    """
    blocks = [dict(_cpuinfo_fields(b)) for b in (text or "").split("\n\n")]
    blocks = [b for b in blocks if "processor" in b]
    if blocks and all("core id" in b for b in blocks):
        return len({(b.get("physical id"), b["core id"]) for b in blocks})
    return len(blocks)


def _cpuinfo_fields(block: str) -> list[tuple[str, str]]:
    pairs = (line.partition(":") for line in block.splitlines())
    return [(k.strip(), v.strip()) for k, sep, v in pairs if sep]


def _darwin_performance_cores(physical: int) -> int | None:
    """Apple Silicon's P-cores (``sysctl hw.perflevel0.physicalcpu``), when it also has E-cores."""
    try:
        out = subprocess.run(
            ["sysctl", "-n", "hw.perflevel0.physicalcpu"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    n = _int(out.stdout)
    return n if n and n < physical else None


# --- board and GPU ------------------------------------------------------------------


def _device_tree(root: Path, name: str) -> str:
    """A device-tree property (NUL-terminated strings), or "" without a device tree."""
    text = _read(root, f"proc/device-tree/{name}")
    if text is None:
        text = _read(root, f"sys/firmware/devicetree/base/{name}")
    return text or ""


def _board(root: Path) -> tuple[str | None, str | None]:
    """(board name, kind) from the device tree and the Jetson L4T release file."""
    model = _device_tree(root, "model").strip("\0 \n")
    tegra = _read(root, "etc/nv_tegra_release")
    if tegra is not None or "nvidia,tegra" in _device_tree(root, "compatible") or "Jetson" in model:
        if not model:
            release = re.search(r"R(\d+) \(release\), REVISION: ([\d.]+)", tegra or "")
            model = (
                f"NVIDIA Jetson (L4T R{release[1]}.{release[2]})" if release else "NVIDIA Jetson"
            )
        return model, "jetson"
    if model.startswith("Raspberry Pi"):
        return model, "raspberry-pi"
    return model or None, None


def _gpus(
    root: Path, real: bool, system: str, machine: str,
    board: str | None, board_kind: str | None, total: int, available: int,
) -> tuple[Gpu, ...]:  # fmt: skip
    # Unified-memory GPUs share the RAM budget: their memory is the RAM figures, not extra.
    if board_kind == "jetson":
        return (Gpu(board or "NVIDIA Jetson", "cuda", total, available, unified=True),)
    if system == "Darwin" and machine == "arm64":
        return (Gpu("Apple Silicon GPU", "metal", total, available, unified=True),)
    return _parse_nvidia_smi((_query_nvidia_smi() if real else _read(root, FAKE_NVIDIA_SMI)) or "")


def _query_nvidia_smi(timeout: float = 5.0) -> str | None:
    """``nvidia-smi``'s CSV GPU list, or None without the binary or when it fails or hangs."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, *_NVIDIA_SMI_ARGS], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.SubprocessError):  # a wedged driver can hang it
        return None
    return out.stdout if out.returncode == 0 else None


def _parse_nvidia_smi(text: str) -> tuple[Gpu, ...]:
    """``name, total MiB, free MiB`` lines → GPUs; lines with ``[N/A]`` memory are skipped."""
    gpus = []
    for line in text.splitlines():
        fields = line.rsplit(",", 2)  # GPU names may contain commas; the numbers cannot
        if len(fields) != 3:
            continue
        name, total, free = fields
        try:
            gpus.append(
                Gpu(name.strip(), "cuda", int(float(total)) * _MIB, int(float(free)) * _MIB, False)
            )
        except ValueError:
            continue
    return tuple(gpus)


def _llama_gpu_offload() -> tuple[bool, str | None]:
    """Whether the installed llama.cpp can offload layers to a GPU, and if not, why."""
    try:
        import llama_cpp  # lazily: loading its native library is slow and may fail

        supported = bool(llama_cpp.llama_supports_gpu_offload())
    except Exception as exc:  # not installed, half-installed, or the library fails to load
        return False, f"llama_cpp cannot be loaded ({type(exc).__name__}: {exc})"
    return (True, None) if supported else (False, "this llama.cpp build is CPU-only")


# --- disk ---------------------------------------------------------------------------


def _default_cache_dir() -> Path:
    """huggingface_hub's cache folder (``HF_HUB_CACHE``), looked up at call time, not import."""
    try:
        from huggingface_hub import constants as hf_constants

        return Path(hf_constants.HF_HUB_CACHE)
    except ImportError:
        home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
        return Path(os.environ.get("HF_HUB_CACHE") or Path(home) / "hub")


def _free_disk(folder: Path) -> int | None:
    """Free bytes on the file system that holds (or will hold) ``folder``."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def cpu_flags(root: str | Path | None = None) -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (x86 ``flags``, ARM ``Features``; empty if unknown)."""
    text = _read(Path(root) if root is not None else Path("/"), "proc/cpuinfo") or ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_family(machine: str) -> str:
    """Repack family for an architecture name: x86 assumes AVX2, 64-bit ARM dot products."""
    m = machine.lower()
    if m in ("x86_64", "amd64", "x64"):
        return "x86-avx2"
    if m in ("aarch64", "arm64"):
        return "arm-dotprod"
    return "none"

def local_repack_family(root: str | Path | None = None) -> str:
    """This CPU's repack family, a key of :data:`gguf_mcv.planning.calibration.REPACKED_TYPES`
    (:func:`repack_family` of this machine's architecture and feature flags)."""
    return repack_family(platform.machine(), cpu_flags(root))


def repack_family(machine: str, flags: frozenset[str]) -> str:
    """The repack family of a CPU: from its architecture (:func:`cpu_family`) refined by its
    feature flags (none known: the architecture's assumption)."""
    family = cpu_family(machine)
    if family == "x86-avx2" and flags:
        return "x86-avx512" if "avx512f" in flags else "x86-avx2" if "avx2" in flags else "none"
    if family == "arm-dotprod" and flags and "asimddp" not in flags:
        return "none"
    return family


def cpu_identity() -> str:
    """The CPU's model name and feature flags (``/proc/cpuinfo``), else what platform says: what a
    verdict measured on this CPU (the speed probe's, the native check's) is kept under."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"{platform.processor()} {platform.machine()}"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("model name", "flags", "Features", "CPU part", "Hardware"):
            fields.setdefault(name.strip(), value.strip())
    return " | ".join(f"{k}={v}" for k, v in sorted(fields.items())) or platform.machine()


def dist_version(dist: str) -> str | None:
    """The installed version of the distribution ``dist`` (e.g. ``"llama_cpp_python"``), or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
