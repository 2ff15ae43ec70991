"""The native check's verdicts: what each kernel path did on this machine and build, kept.

:mod:`gguf_mcv.runtime.native_check` runs the paths in child processes; this module keeps
their outcomes (in memory, and in ``<cache_dir>/native-check/<fingerprint>.json`` as a checked
manifest) and answers from them without running anything, so that the planner can ask too
(:func:`extra_bufts_known_to_crash`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import environment
from .cache_files import DamagedManifest, read_manifest, write_manifest
from .hardware import cpu_identity, dist_version, local_repack_family

#: Bumped when what a path runs changes: older verdicts are then checked again.
CHECK_VERSION = 1
FOLDER = "native-check"
ENV_FAULT = "GGUF_MCV_NATIVE_FAULT"
#: A verdict file larger than this is not ours (ours is under 4 KB): it is checked again.
MAX_VERDICT_BYTES = 256 * 1024


@dataclass(frozen=True)
class Outcome:
    """What one path did in the child: ``ok``, ``error`` (a Python error, not a crash),
    ``crashed`` (killed by a signal or an abnormal exit), ``hung`` (silent for ``limit_s``
    seconds: checked again under a longer limit, see :mod:`gguf_mcv.runtime.native_check`), or
    ``unchecked`` (the check itself could not run: no child could be started, or it failed
    before any path; such an outcome is never kept on disk, so the next process checks again)."""

    status: str
    detail: str = ""
    limit_s: float | None = None

    @property
    def safe(self) -> bool:
        """The path did not take its process down."""
        return self.status in ("ok", "error", "unchecked")

    def to_dict(self) -> dict[str, str | float]:
        found: dict[str, str | float] = {"status": self.status, "detail": self.detail}
        if self.limit_s is not None:
            found["limit_s"] = self.limit_s
        return found


_memo: dict[str, dict[str, Outcome]] = {}
_read_from_disk: set[str] = set()
_lock = threading.Lock()


def verdict_path(key: str) -> Path:
    """Where the verdict for fingerprint ``key`` is kept."""
    return environment.cache_dir() / FOLDER / f"{key}.json"


def kept(key: str) -> dict[str, Outcome]:
    """This process's outcomes for ``key``, read from the kept verdict on first use (call it
    holding ``_lock``; the dict is the memo itself)."""
    known = _memo.setdefault(key, {})
    if key not in _read_from_disk:
        _read_from_disk.add(key)
        known.update(read_verdict(verdict_path(key), key))
    return known


def forget() -> None:
    """Drop what this process remembers (the kept verdict files stay)."""
    with _lock:
        _memo.clear()
        _read_from_disk.clear()


def read_verdict(path: Path, key: str) -> dict[str, Outcome]:
    """The outcomes kept in ``path`` for ``key``; empty when the file is missing, damaged or
    another machine's (a damaged verdict is checked again, never trusted)."""
    try:
        data = read_manifest(path, CHECK_VERSION, MAX_VERDICT_BYTES)
    except DamagedManifest:
        return {}
    if data is None or data.get("key") != key or not isinstance(data.get("paths"), dict):
        return {}
    found = {}
    for name, value in data["paths"].items():
        if (isinstance(name, str) and isinstance(value, dict)
                and value.get("status") in ("ok", "error", "crashed", "hung")
                and isinstance(value.get("detail", ""), str)):
            found[name] = Outcome(value["status"], value.get("detail", ""), _limit(value.get("limit_s")))
    return found


def _limit(value: object) -> float | None:
    """A kept limit when it is one (a positive finite number); None (unknown: checked again) else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        return None
    return float(value)


def write_verdict(path: Path, key: str, known: dict[str, Outcome]) -> None:
    """Keep the outcomes (atomically, with a digest of the content: see :mod:`gguf_mcv.cache_files`)."""
    try:
        write_manifest(path, {"version": CHECK_VERSION, "key": key, "written": time.time(),
                              "paths": {p: o.to_dict() for p, o in sorted(known.items()) if o.status != "unchecked"}})
    except OSError:
        pass  # a read-only cache folder costs a check per process, nothing else


def extra_bufts_known_to_crash() -> bool:
    """Whether a verdict already kept for this machine and build (in memory or on disk) says some
    type crashes with the extra buffer types: loads here then run without them, and without the
    repacked copies they make. Runs no check (the planner asks this, and plans without I/O)."""
    with _lock:
        known = dict(kept(fingerprint()))
    return any(p.startswith("text:") and p.endswith(":extra") and not o.safe for p, o in known.items())



def loads_repack_family(family: str | None = None) -> str:
    """The repack family loads on this machine get: its CPU's (``family``, default
    :func:`gguf_mcv.hardware.local_repack_family`), or ``"none"`` where a kept verdict found the
    extra buffer types crashing, so that loads leave them off (:func:`extra_bufts_known_to_crash`).
    Runs no check."""
    if extra_bufts_known_to_crash():
        return "none"
    return family if family is not None else local_repack_family()

def fingerprint() -> str:
    """A digest of what a verdict depends on: CPU, kernel, Python, builds, native libraries
    (and ``$GGUF_MCV_NATIVE_FAULT``, so simulated faults never mix with real verdicts); worked
    out once per process (and value of that variable)."""
    return _fingerprint(os.environ.get(ENV_FAULT, ""))


@functools.lru_cache(maxsize=8)
def _fingerprint(fault: str) -> str:
    parts = {
        "version": CHECK_VERSION,
        "cpu": cpu_identity(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "python": sys.version,
        "llama_cpp_python": dist_version("llama_cpp_python"),
        "onnxruntime": dist_version("onnxruntime"),
        "libraries": _native_libraries(),
        "fault": fault,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _native_libraries() -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of llama-cpp-python's and onnxruntime's shared libraries:
    a rebuild with other flags keeps the version but changes these."""
    found = []
    for package, sub in (("llama_cpp", "lib"), ("onnxruntime", "capi")):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        folder = Path(next(iter(spec.submodule_search_locations))) / sub
        try:
            entries = sorted(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            if ".so" in entry.name or entry.suffix in (".dylib", ".dll"):
                with contextlib.suppress(OSError):
                    info = entry.stat()
                    found.append((f"{package}/{entry.name}", info.st_size, info.st_mtime_ns))
    return found
