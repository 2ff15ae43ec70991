"""Memory figures: this process's own (``/proc/self/status``) and the peak RSS of a process tree,
sampled while it runs."""

from __future__ import annotations

import threading
import time

import psutil

MIB = 2**20

#: The ``/proc/<pid>/status`` fields read, in bytes: resident now, its high-water mark, and the
#: anonymous and file-backed shares (llama.cpp's memory-mapped weights are file-backed).
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def status(pid: int | str = "self") -> dict[str, int]:
    """:data:`FIELDS` of a process in bytes (Linux; empty elsewhere or when it is gone).

    ``VmHWM`` is the same high-water mark as ``getrusage().ru_maxrss``, but without the parent's
    own peak, which Linux carries into a child's ``ru_maxrss`` across fork+exec."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in FIELDS:
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def own_peak() -> int:
    """This process's peak RSS in bytes (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    peak = status().get("VmHWM")
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


def tree_rss(proc: psutil.Process, pss: bool = False) -> int:
    """Resident bytes of ``proc`` and all its descendants now (those gone meanwhile count 0); with
    ``pss``, their proportional share instead (a page two processes share counts half in each, so
    a forked child does not count its parent's pages twice: what a memory cgroup charges)."""
    total = 0
    try:
        members = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for member in members:
        try:
            total += member.memory_full_info().pss if pss else member.memory_info().rss
        except psutil.Error:
            pass
    return total


class TreeSampler:
    """Samples the RSS of a process and its descendants every ``interval`` seconds on a thread,
    until stopped.

    ``peak`` is the largest sample of the whole tree (of PSS with ``pss``: see :func:`tree_rss`);
    :meth:`high_water` the kernel's own peak of the root process (``VmHWM``), which also sees what
    happened between samples.
    """

    def __init__(self, pid: int, interval: float = 0.2, *, pss: bool = False) -> None:
        self.proc = psutil.Process(pid)
        self.interval, self.pss = interval, pss
        self.samples: list[tuple[float, int]] = []
        self._began = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._sample()
        self._thread.start()

    def _sample(self) -> None:
        if not self.proc.is_running():
            self._stop.set()
            return
        self.samples.append((time.perf_counter() - self._began, tree_rss(self.proc, self.pss)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> None:
        if not self._stop.is_set():
            self._sample()
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        """The largest sample of the tree's RSS (0 before any)."""
        return max((rss for _, rss in self.samples), default=0)

    def high_water(self) -> int | None:
        """The root process's ``VmHWM`` so far (Linux; None when unknown or gone)."""
        return status(self.proc.pid).get("VmHWM")
