"""Running this package's own code in a child Python, and saying how such a child ended.

Native experiments (the kernel check, the speed probe) and the ONNX conversion run in a child
so that a crash, an OOM kill or their memory stays out of the caller's process.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Iterable


def child_env() -> dict[str, str]:
    """This process's environment, with this copy of gguf_mcv first on the import path (a child
    started with :func:`child_command` runs the same code as its parent)."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def child_command(module: str, *args: str) -> list[str]:
    """The command that runs ``module``'s ``main()`` in a child Python (``-c``, not ``-m``:
    ``-m`` would run a second copy of a module the package has already imported)."""
    return [sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main())", *args]


def describe_exit(returncode: int, stderr_tail: Iterable[str] = ()) -> str:
    """How a child process ended, in words: "killed by SIGILL (its last line)", "exited with status 3"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        what = f"killed by {name}"
    else:
        what = f"exited with status {returncode}"
    said = [line.strip() for line in stderr_tail if line.strip()]
    return f"{what}" + (f" ({said[-1][:200]})" if said else "")
