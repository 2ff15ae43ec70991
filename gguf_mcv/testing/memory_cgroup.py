"""Real memory cgroups for tests and benchmarks: make one with a limit, run processes in it, read
what the kernel charged and killed, remove it.

cgroup v2 where its memory controller is enabled for children of ``/sys/fs/cgroup``, else the
cgroup v1 memory hierarchy at ``/sys/fs/cgroup/memory``. Making one needs root;
:meth:`MemoryCgroup.make` raises :class:`OSError` saying why when it cannot.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Sequence

__all__ = ["MemoryCgroup"]

V2_MOUNT = Path("/sys/fs/cgroup")
V1_MOUNT = Path("/sys/fs/cgroup/memory")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class MemoryCgroup:
    """A memory cgroup of its own, limited to ``limit`` bytes (``None``: no limit of its own)."""

    def __init__(self, folder: Path, version: int, limit: int | None) -> None:
        self.folder, self.version, self.limit = folder, version, limit

    @classmethod
    def make(cls, limit: int | None, parent: MemoryCgroup | None = None, prefix: str = "gguf_mcv") -> MemoryCgroup:
        """A new cgroup under ``parent`` (else the hierarchy's top) limited to ``limit`` bytes, with
        no swap to spill into; OSError saying why when none can be made here."""
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        if parent is not None:
            if parent.version == 2:  # children of a v2 cgroup get the controller only when asked
                (parent.folder / "cgroup.subtree_control").write_text("+memory")
            return cls._create(parent.folder / name, parent.version, limit)
        why = []
        if "memory" in _read(V2_MOUNT / "cgroup.controllers").split():
            if "memory" in _read(V2_MOUNT / "cgroup.subtree_control").split():
                return cls._create(V2_MOUNT / name, 2, limit)
            why.append("cgroup v2 is mounted but its memory controller is not enabled for children "
                       "(echo +memory > /sys/fs/cgroup/cgroup.subtree_control)")
        if (V1_MOUNT / "memory.limit_in_bytes").exists():
            return cls._create(V1_MOUNT / name, 1, limit)
        why.append("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
        raise OSError("; ".join(why))

    @classmethod
    def _create(cls, folder: Path, version: int, limit: int | None) -> MemoryCgroup:
        folder.mkdir()  # PermissionError when not root
        group = cls(folder, version, limit)
        try:
            if limit is not None:
                group._write("memory.max" if version == 2 else "memory.limit_in_bytes", str(limit))
                # no swap to spill into either, where the kernel accounts it
                swap, value = ("memory.swap.max", "0") if version == 2 else ("memory.memsw.limit_in_bytes", str(limit))
                if (folder / swap).exists():
                    group._write(swap, value)
        except OSError:
            folder.rmdir()
            raise
        return group

    def _write(self, name: str, value: str) -> None:
        (self.folder / name).write_text(value)

    def join(self) -> None:
        """Move the calling process into the cgroup (a child's ``preexec_fn``)."""
        self._write("cgroup.procs", str(os.getpid()))

    def pids(self) -> list[int]:
        """The processes in the cgroup now."""
        return [int(p) for p in _read(self.folder / "cgroup.procs").split()]

    def stat(self) -> dict[str, int]:
        """``memory.stat`` as a dict."""
        out = {}
        for line in _read(self.folder / "memory.stat").splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
        return out

    def peak(self) -> int | None:
        """The cgroup's peak usage in bytes, page cache included."""
        text = _read(self.folder / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"))
        return int(text) if text.strip().isdigit() else None

    def kernel_peak(self) -> int | None:
        """The peak of kernel memory charged to the cgroup (v1's ``memory.kmem.max_usage_in_bytes``;
        None where the kernel keeps no such figure)."""
        text = _read(self.folder / "memory.kmem.max_usage_in_bytes")
        return int(text) if self.version == 1 and text.strip().isdigit() else None

    def oom_kills(self) -> int | None:
        """Processes the kernel OOM-killed in the cgroup (None where the kernel does not say)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in _read(self.folder / name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    def remove(self, children: Sequence[MemoryCgroup] = ()) -> None:
        """Remove the cgroup (after ``children``): its processes are moved to the caller's own
        cgroup first, and killed if they cannot be moved. Never raises; warns when a folder stays."""
        for group in [*children, self]:
            group._empty()
            for _ in range(50):  # an exiting process can take a moment to leave
                try:
                    group.folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    group._empty()
                    time.sleep(0.1)
            else:
                print(f"warning: could not remove the cgroup {group.folder}")

    def _empty(self) -> None:
        home = _own_cgroup(self.version)
        for pid in self.pids():
            try:
                (home / "cgroup.procs").write_text(str(pid))
            except OSError:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _own_cgroup(version: int) -> Path:
    """The folder of the calling process's own memory cgroup."""
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (version == 2 and hierarchy == "0" and not controllers) or (
                version == 1 and "memory" in controllers.split(",")):
            folder = (V2_MOUNT if version == 2 else V1_MOUNT) / path.strip().lstrip("/")
            if (folder / "cgroup.procs").exists():
                return folder
    return V2_MOUNT if version == 2 else V1_MOUNT
