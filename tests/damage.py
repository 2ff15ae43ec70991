"""Damage done to a cache file, and a child process that reads the cache afterwards.

Each damage takes the file to harm and a second file of the same folder (for ``swapped``).
The reading runs in a child (:func:`run_child`): a signal or a hang fails the test that
asked, never the test run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def truncated(path: Path, other: Path) -> None:
    os.truncate(path, path.stat().st_size // 3)


def zeroed(path: Path, other: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def directory(path: Path, other: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def symlink(path: Path, other: Path) -> None:
    """A symlink to a copy outside the folder (the copy is intact: following it would be trusting it)."""
    outside = path.parent.parent / f"outside-{path.name}"
    shutil.copyfile(path, outside)
    path.unlink()
    path.symlink_to(outside)


def fifo(path: Path, other: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def unreadable(path: Path, other: Path) -> None:
    """Mode 000: as root (these tests' usual user) still readable, so it may be a hit."""
    path.chmod(0)


def swapped(path: Path, other: Path) -> None:
    tmp = path.with_name(path.name + ".swap")
    os.replace(path, tmp)
    os.replace(other, path)
    os.replace(tmp, other)


DAMAGES = [truncated, zeroed, directory, symlink, fifo, unreadable, swapped]

#: Run first in every child: counts the warnings gguf_mcv logs, prints them as JSON at exit.
PRELUDE = """
import atexit, json, logging, sys
class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING); self.messages = []
    def emit(self, record):
        self.messages.append(record.getMessage())
_count = _Count()
logging.getLogger("gguf_mcv").addHandler(_count)
logging.getLogger("gguf_mcv").setLevel(logging.INFO)
RESULT = {}
atexit.register(lambda: print("RESULT " + json.dumps({**RESULT, "warnings": _count.messages})))
"""


def run_child(code: str, *args: str, timeout: float = 60) -> dict:
    """Run ``code`` (after :data:`PRELUDE`, which it fills ``RESULT`` for) in a child; its
    result, with ``warnings``. A signal, a hang or an exception fails the caller's test."""
    proc = subprocess.run([sys.executable, "-c", PRELUDE + code, *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ)
    assert proc.returncode == 0, f"the child ended with {proc.returncode}:\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][len("RESULT "):])
