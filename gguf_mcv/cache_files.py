"""Reading, setting aside and sweeping files in gguf_mcv's cache folders, damage in mind.

A cache folder can hold anything by the time it is read again: a FIFO (opening it blocks),
a directory or a symlink where a file was, a file truncated or swapped with another. Cache
files are therefore opened only as regular files (never through a symlink, never blocking);
a damaged entry is renamed aside (never deleted: gguf_mcv did not necessarily make what is
there now); and temporary files left by a killed writer are swept under the writer's lock.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: What a set-aside entry's name starts with (hidden; never swept: the user deletes it).
ASIDE_PREFIX = ".damaged-"


class NotRegularFile(OSError):
    """A path is not a regular file (a folder, a FIFO, a device, a symlink); ``mode`` is its
    ``st_mode``, for a caller that says which."""

    def __init__(self, message: str, mode: int = 0) -> None:
        super().__init__(message)
        self.mode = mode


def open_regular(path: str | os.PathLike, *, follow_symlinks: bool = False) -> io.BufferedReader:
    """``path`` opened for binary reading, if it is a regular file (reached without a symlink as
    its last component unless ``follow_symlinks``: then OSError ELOOP); else
    :class:`NotRegularFile`. A FIFO never blocks the opening."""
    nofollow = 0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | nofollow)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{os.fspath(path)} is not a regular file", mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`); OSError when it is
    larger than ``limit`` bytes or cannot be read."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{os.fspath(path)} is larger than {limit} bytes")
    return data


def read_json(path: str | os.PathLike, limit: int) -> Any:
    """The JSON value in the regular file ``path`` (:func:`read_regular`): OSError as there;
    ValueError when it is not UTF-8 JSON, or nests too deep for the parser (a planted
    ``[[[…]]]`` is damage like any other, never a RecursionError for the caller)."""
    data = read_regular(path, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("it nests too deeply to be one of ours") from None


def is_regular(path: str | os.PathLike) -> bool:
    """Whether ``path`` itself (not a symlink's target) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def inside(folder: str | os.PathLike, name: str) -> Path | None:
    """``folder/name`` when ``name`` is a plain relative name that stays in ``folder`` (no
    absolute path, no ``..``, no symlinked folder on the way); else None."""
    if not isinstance(name, str) or not name or "\x00" in name or os.path.isabs(name):
        return None
    parts = Path(name).parts
    if any(p in ("..", ".") for p in parts):
        return None
    path = Path(folder) / name
    root = os.path.realpath(folder)
    parent = os.path.realpath(path.parent)
    if parent != root and not parent.startswith(root + os.sep):
        return None
    return path


def set_aside(path: str | os.PathLike, why: str, *, warn: bool = True) -> Path | None:
    """Rename ``path`` (whatever it is) to a hidden ``.damaged-…`` name beside it, with one
    warning (unless ``warn`` is False: the caller warns); the new path, or None when there
    was nothing to move or it could not be moved (always warned)."""
    path = Path(path)
    aside = path.with_name(f"{ASIDE_PREFIX}{path.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("%s is damaged (%s) and could not be set aside (%s); delete it", path, why, exc)
        return None
    if warn:
        logger.warning("%s is damaged (%s): set aside as %s (delete it when no longer needed)", path, why,
                       aside.name)
    return aside


def remove_entry(path: Path) -> int:
    """Delete a temporary entry (a file or a folder tree) this library wrote; the bytes freed."""
    try:
        info = os.lstat(path)
    except OSError:
        return 0
    if stat.S_ISDIR(info.st_mode):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(path, ignore_errors=True)
        return size
    try:
        path.unlink()
    except OSError:
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0


def sweep(folder: Path, pattern: re.Pattern[str], owned: str, lock_of: str = "{}.lock") -> int:
    """Delete the temporary entries in ``folder`` whose names match ``pattern`` (the group that
    matched names the writer's stem), left by writers that were killed; the bytes freed.

    The caller holds the lock of stem ``owned``: its entries go now. Another stem's entries go
    when its lock (``lock_of``, formatted with the stem) can be taken at once: no writer is
    at work on them.
    """
    from filelock import Timeout

    freed = 0
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return 0
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        if name.startswith(ASIDE_PREFIX):
            continue  # set aside for the user, who deletes it
        stem, path = next(v for v in match.groupdict().values() if v), folder / name
        if stem == owned:
            freed += remove_entry(path)
            continue
        try:
            with folder_lock(folder / lock_of.format(stem), timeout=0):
                freed += remove_entry(path)
        except (Timeout, OSError):
            pass  # a live writer's (or a lock we cannot take): left alone
    if freed:
        logger.info("removed %d bytes of temporary files left by interrupted writers in %s", freed, folder)
    return freed


def folder_lock(path: Path, timeout: float = -1) -> Any:
    """A ``filelock.FileLock`` on ``path``, whatever was planted there: filelock opens its file
    with O_TRUNC, so a symlink (or a folder, a FIFO) in its place is set aside first."""
    from filelock import FileLock

    if os.path.lexists(path) and not is_regular(path):
        set_aside(path, "not a regular file where a lock file belongs")
    return FileLock(str(path), timeout=timeout)


def digest_of(content: dict[str, Any]) -> str:
    """A SHA-256 over a manifest's content (its ``digest`` key left out), in a canonical form."""
    body = {k: v for k, v in content.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(path: Path, content: dict[str, Any]) -> None:
    """Write ``content`` with its :func:`digest_of` to ``path`` atomically (a fresh temporary
    file, never one already there, renamed over it; a folder in the way is set aside)."""
    if path.is_dir() and not path.is_symlink():
        set_aside(path, "a folder where a manifest belongs", warn=False)  # the reader warned
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json.part", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**content, "digest": digest_of(content)}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_manifest(path: Path, version: int, limit: int = 1 << 20) -> dict[str, Any] | None:
    """The content of the manifest at ``path`` when its digest checks out; None when there is
    none or it is of another format ``version``; :class:`DamagedManifest` (saying why) when it
    is unusable."""
    try:
        data = read_json(path, limit)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise DamagedManifest(f"{type(exc).__name__}: {exc}") from None
    if isinstance(data, dict) and data.get("version") != version and isinstance(data.get("version"), int):
        return None  # written by another release: rebuilt, not damaged
    if not isinstance(data, dict) or data.get("digest") != digest_of(data):
        raise DamagedManifest("its content does not match its digest")
    return data


class DamagedManifest(Exception):
    """A cache manifest that cannot be trusted (the message says why)."""
