"""Cgroup files (v1 and v2) under a root folder: the cgroups above this process, and the memory
their limits leave.

A memory cgroup is charged for its processes' anonymous memory, the kernel memory they cause and
every file page they read or write, and the file pages stay charged after the process that read
them exits. Most of those file pages are reclaimable: the kernel drops clean, unmapped page cache
before it OOM-kills anyone in the cgroup. So what a limit leaves is the limit less what cannot be
reclaimed: ``usage`` less the clean page cache no live process maps (and, on v2, reclaimable slab).
Mapped file pages (a running model's weights), shmem and tmpfs files, and dirty or writeback
pages stay counted as used.

Every file is read relative to ``root`` (see :mod:`gguf_mcv.hardware`), so a recorded tree of
``proc/self/cgroup`` and ``sys/fs/cgroup/...`` files describes any container.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryLimit", "cgroup_dirs", "key_values", "memory_limit", "read", "read_int", "unreclaimable"]


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest memory limit above this process. Sizes are in bytes."""

    limit: int  #: the smallest limit of any level
    headroom: int  #: the least any limited level leaves: its limit less what it cannot reclaim
    source: str  #: ``"cgroup v2"`` or ``"cgroup v1"``


@dataclass(frozen=True)
class _Layout:
    label: str
    mount: str  #: where the hierarchy is mounted, relative to the root
    controller: str  #: the v1 controller naming the hierarchy in ``/proc/self/cgroup``; "" for v2
    limits: tuple[str, ...]  #: limit files; the smallest binds
    usage: str
    version: int


_LAYOUTS = (
    # memory.high is a limit too: above it the kernel throttles the cgroup's allocations into reclaim.
    _Layout("cgroup v2", "sys/fs/cgroup", "", ("memory.max", "memory.high"), "memory.current", 2),
    _Layout("cgroup v1", "sys/fs/cgroup/memory", "memory", ("memory.limit_in_bytes",), "memory.usage_in_bytes", 1),
)


def read(root: Path, rel: str) -> str | None:
    """The text of ``root/rel``, or None when it is missing or unreadable."""
    try:
        return (root / rel).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def read_int(text: str | None) -> int | None:
    """An integer file's value; None for missing, ``max`` or garbage."""
    try:
        return int((text or "").strip())
    except ValueError:
        return None


def key_values(text: str | None) -> dict[str, int]:
    """``proc/meminfo`` and ``memory.stat`` lines (``Key: 123 kB`` / ``key 123``) as a dict."""
    values = {}
    for line in (text or "").splitlines():
        fields = line.replace(":", " ").split()
        if len(fields) >= 2 and fields[1].isdigit():
            values[fields[0]] = int(fields[1])
    return values


def unreclaimable(version: int, usage: int, stat: dict[str, int]) -> int:
    """What of a cgroup's ``usage`` the kernel cannot reclaim, from its ``memory.stat``.

    Reclaimable: page cache on the file LRU lists that is clean and mapped by no live process,
    and (v2) reclaimable slab. Everything else is used: anonymous memory, shmem and tmpfs (on the
    anon lists), mapped, dirty and writeback file pages, unreclaimable kernel memory, sockets.
    Mapped shmem is counted in both ``file_mapped`` and ``shmem`` and so subtracted from the file
    pages twice: an error that only ever counts more as used. A missing ``memory.stat`` reclaims
    nothing.
    """
    prefix = "total_" if version == 1 else ""  # v1's total_* fields include the child cgroups

    def field(name: str) -> int:
        return stat.get(prefix + name, 0)

    if version == 1:
        mapped, dirty, writeback = field("mapped_file"), field("dirty"), field("writeback")
        lru = field("active_file") + field("inactive_file")
        slab = 0  # v1's memory.stat does not split slab; all of it stays counted
    else:
        mapped, dirty, writeback = field("file_mapped"), field("file_dirty"), field("file_writeback")
        lru = field("active_file") + field("inactive_file")
        if "active_file" not in stat and "inactive_file" not in stat:
            lru = max(0, field("file") - field("shmem"))
        slab = field("slab_reclaimable")
    clean_unmapped = max(0, lru - mapped - dirty - writeback)
    return max(0, usage - clean_unmapped - slab)


def memory_limit(root: Path, host_total: int) -> MemoryLimit | None:
    """The tightest cgroup memory limit above this process and what it leaves, or None.

    Every level counts (a Kubernetes pod's limit binds each container in it), and the headroom
    is the least any limited level leaves: a parent's usage includes its other children. Where a
    container sees only its own v1 cgroup, that cgroup's ``hierarchical_memory_limit`` stands for
    the hidden parents' limit (their other children's usage stays unseen). v2 is read first; v1
    where v2 has no limit.
    """
    for layout in _LAYOUTS:
        limits, headrooms = [], []
        for folder in cgroup_dirs(root, layout.mount, layout.controller):
            stat = key_values(read(root, f"{folder}/memory.stat"))
            values = [read_int(read(root, f"{folder}/{name}")) for name in layout.limits]
            # v1 also says the tightest limit of the levels above, which a container cannot see.
            values.append(stat.get("hierarchical_memory_limit") if layout.version == 1 else None)
            # "max" (v2) reads as None; v1's "unlimited" is a huge page-size-dependent number.
            limit = min((v for v in values if v is not None and v < host_total), default=None)
            if limit is None:
                continue
            usage = read_int(read(root, f"{folder}/{layout.usage}")) or 0
            limits.append(limit)
            headrooms.append(limit - unreclaimable(layout.version, usage, stat))
        if limits:
            return MemoryLimit(min(limits), max(0, min(headrooms)), layout.label)
    return None


def cgroup_dirs(root: Path, mount: str, controller: str) -> list[str]:
    """Cgroup folders above this process under ``mount``: its own first, then each parent.

    ``controller`` names the cgroup v1 hierarchy; "" means cgroup v2. Inside a container the
    process's own folder may not be mounted (its cgroup is the mount's top); missing levels
    are there to be skipped by the caller.
    """
    path = "/"
    for line in (read(root, "proc/self/cgroup") or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, cgroup = rest.partition(":")
        v2_line = hierarchy == "0" and controllers == ""
        if (not controller and v2_line) or (controller and controller in controllers.split(",")):
            path = cgroup.strip()
            break
    parts = [p for p in path.split("/") if p and p != ".."]
    return ["/".join([mount, *parts[:i]]) for i in range(len(parts), -1, -1)]
