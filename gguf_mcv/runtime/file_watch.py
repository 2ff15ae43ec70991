"""The files a loaded model reads its weights from, checked for changes before each answer.

llama.cpp and ONNX Runtime memory-map their weights: a mapped file cut short kills the
process with SIGBUS at its next read of a lost page (Python cannot catch that), and one
overwritten in place is read from its new bytes. So each answer first compares every such
file with what was loaded (:class:`MappedFiles`: one ``os.stat`` per file, microseconds)
and refuses with :class:`~gguf_mcv.errors.ModelFileChangedError` when one changed. A file
replaced by a rename keeps the old version mapped (safe), but it is another file now, so it
is refused too: the model is to be loaded again. What a change *during* an evaluation does
is in docs/reliability.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

from ..errors import ModelFileChangedError


class _Version(NamedTuple):
    """What tells one version of a file from another without reading it (ctime too: ``cp -p``
    and ``touch -r`` set mtime back, never ctime)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int


def _version(path: str) -> _Version | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _Version(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class MappedFiles:
    """The versions of ``paths`` seen now (at load); :meth:`check` says whether they are still there."""

    def __init__(self, paths: Iterable[str | os.PathLike]) -> None:
        self._seen = {p: _version(p) for p in dict.fromkeys(os.fspath(p) for p in paths)}

    @property
    def paths(self) -> tuple[str, ...]:
        """The files watched."""
        return tuple(self._seen)

    def check(self) -> None:
        """Raise :class:`ModelFileChangedError`, naming the file, when one of the files is not
        the version that was loaded (cut, overwritten, replaced, removed)."""
        for path, seen in self._seen.items():
            now = _version(path)
            if now != seen:
                raise ModelFileChangedError(
                    f"{path} {_how(seen, now)} since the model was loaded; its weights are memory-mapped, "
                    f"so answering could crash this process or read the new bytes. Load the model again. "
                    f"To replace a file under a running model, write the new one beside it and rename it "
                    f"over the old (see docs/reliability.md).", path)


def _how(seen: _Version | None, now: _Version | None) -> str:
    if now is None:
        return "is gone (or cannot be read)"
    if seen is None:
        return "appeared"
    if (now.device, now.inode) != (seen.device, seen.inode):
        return "was replaced by another file"
    if now.size != seen.size:
        return f"changed size ({seen.size} -> {now.size} bytes)"
    return "was written to"
