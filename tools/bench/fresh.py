"""One measurement in a fresh Python process: nothing imported, cached or allocated by an earlier
measurement is there, and its memory is its own.

:func:`call` runs ``module:function`` of a script in ``tools/`` (imported as a module, so its
``main`` does not run) with JSON keyword arguments, and returns what it returned, with the peak
RSS of the child's process tree and its own ``VmHWM``. :func:`run` does the same for any command
whose last :data:`RESULT` line is the result (:func:`emit` writes one).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .memory import TreeSampler

TOOLS = Path(__file__).resolve().parent.parent
#: The prefix of the line a child prints its result on (any other output is its own).
RESULT = "BENCH-RESULT "


@dataclass(frozen=True)
class Fresh:
    """What a fresh process measured, and what it cost."""

    result: Any  #: the child's result (JSON), None when it gave none
    returncode: int
    wall_s: float  #: from start to exit, imports included
    cpu_s: float  #: user + system CPU seconds of the child and its waited-for children
    peak_tree_rss: int  #: largest sampled RSS of the child and its descendants, bytes
    child_vmhwm: int | None  #: the child's own high-water mark (``VmHWM``), when it reported one
    stderr_tail: str  #: the last 4,000 characters it wrote to stderr

    def checked(self) -> Any:
        """The result; SystemExit with the child's stderr when it failed or gave none."""
        if self.returncode != 0 or self.result is None:
            raise SystemExit(f"the measurement's process failed (exit status {self.returncode}):\n"
                             f"{self.stderr_tail}")
        return self.result


def emit(result: Any) -> None:
    """Print ``result`` as this process's result line (with its ``VmHWM``), for :func:`run`."""
    from .memory import own_peak

    print(RESULT + json.dumps({"result": result, "vmhwm": own_peak()}, default=str), flush=True)


def env_for_child(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with ``tools/`` and the checkout on ``PYTHONPATH`` (the scripts and the
    harness importable in the child), plus ``extra``."""
    path = [str(TOOLS), str(TOOLS.parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), **(extra or {})}


def run(argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float | None = None,
        interval: float = 0.2, preexec_fn: Any = None) -> Fresh:
    """``python *argv`` in a fresh process (``env``: extra variables), sampled every ``interval``
    seconds; its :data:`RESULT` line parsed. A run past ``timeout`` seconds is killed (returncode
    -9, no result)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        began, cpu = time.perf_counter(), _children_cpu()
        proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err, env=env_for_child(env),
                                preexec_fn=preexec_fn)
        sampler = TreeSampler(proc.pid, interval)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            sampler.stop()
        wall, cpu = time.perf_counter() - began, _children_cpu() - cpu
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    payload = None
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT):
            payload = json.loads(line[len(RESULT):])
            break
    return Fresh(result=None if payload is None else payload["result"], returncode=proc.returncode,
                 wall_s=wall, cpu_s=cpu, peak_tree_rss=sampler.peak,
                 child_vmhwm=None if payload is None else payload["vmhwm"], stderr_tail=stderr[-4000:])


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children: on a shared machine it
    moves much less than wall time when other jobs run. (One fresh run at a time: a child
    finishing meanwhile would count too.)"""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def call(target: str, kwargs: dict[str, Any] | None = None, **options: Any) -> Fresh:
    """``module:function(**kwargs)`` in a fresh process (``module`` a script in ``tools/`` or any
    importable module); ``options`` are :func:`run`'s."""
    return run(["-m", "bench.fresh", target, json.dumps(kwargs or {}, default=str)], **options)


def _child(target: str, kwargs_json: str) -> None:
    module, _, function = target.partition(":")
    emit(getattr(importlib.import_module(module), function)(**json.loads(kwargs_json)))


if __name__ == "__main__":
    _child(*sys.argv[1:3])
