"""What a benchmark's JSON says about where and how it ran: the command, the date, the commit and
the machine, around the results. ``gguf-mcv bench --json`` and every script under ``tools/``
write this record, so docs/benchmarks.md can say which run gave each row.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from ..hardware import cpu_flags, dist_version

__all__ = ["command", "commit", "cpu_class", "machine", "record"]

#: The record's layout; raised when a field changes meaning.
RECORD_VERSION = 1


def cpu_class(flags: frozenset[str] | None = None) -> str:
    """``avx512-amx``, ``avx512``, ``avx2``, ``arm-dotprod`` or the architecture's name: the CPU
    class a benchmark's figures hold for (the int8 kernels, and llama.cpp's, differ by class)."""
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return "avx512-amx" if "amx_tile" in flags else "avx512"
    if "avx2" in flags:
        return "avx2"
    if "asimddp" in flags:
        return "arm-dotprod"
    return platform.machine() or "unknown"


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("model name", "Model", "Hardware"):
            return value.strip()
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine a run is on: CPU model and class, cores, RAM, OS, Python and the versions of the
    libraries whose speed is measured."""
    import psutil  # lazy: only benchmarks ask

    return {
        "cpu": _cpu_model(),
        "cpu_class": cpu_class(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_bytes": psutil.virtual_memory().total,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": {dist: dist_version(dist) for dist in
                     ("gguf_mcv", "llama_cpp_python", "onnxruntime", "numpy")},
    }


def commit(folder: Path | None = None) -> str | None:
    """The git commit of the checkout holding ``folder`` (default: this package), with ``-dirty``
    when files differ from it; None outside a checkout or without git."""
    where = folder or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def command(argv: Sequence[str]) -> str:
    """``argv`` as a shell line to run again: ``python tools/x.py ...`` for a script (its path from
    the current folder), the program's name for a command such as ``gguf-mcv``."""
    if not argv:
        return ""
    head = Path(argv[0])
    shown = ["python", os.path.relpath(head)] if head.suffix == ".py" else [head.name]
    return shlex.join([*shown, *argv[1:]])


def record(benchmark: str, results: Any, *, settings: dict[str, Any] | None = None,
           argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The JSON record of one benchmark run: its name, command line, UTC date, commit and machine,
    the settings it ran with and its results."""
    return {
        "record_version": RECORD_VERSION,
        "benchmark": benchmark,
        "command": command(sys.argv if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "settings": settings or {},
        "results": results,
    }
