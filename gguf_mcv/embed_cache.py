"""A cache of vision-encoder outputs, so an image already seen is never encoded again.

Keys are strings the engine builds from the mmproj's identity, the image's
content hash, the preprocessing settings and the slice index. Values are flat
float32 arrays (image tokens × embedding width). The memory tier is an LRU bounded
in bytes; the optional disk tier keeps one ``.npz`` file per entry in a folder
(written to a temporary name, then renamed, so a crash never leaves a half file
under a real key) and is trimmed oldest-first to its own byte bound.

libmtmd reads as many floats as the image needs from whatever buffer it is given,
so a damaged disk entry would silently change the answer or read past the buffer.
Each file therefore holds its key and a SHA-256 of its values, and is checked
(file size, dtype, shape, key, checksum, and the length the caller expects) before
use; an entry that fails any check is a miss, removed, and encoded again.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_BYTES = 512 * 2**20
DEFAULT_DISK_BYTES = 2 * 2**30
#: Suffix of disk entries (``.npy`` files of older versions carry no checksum and are ignored).
DISK_SUFFIX = ".npz"
#: Bytes an entry file may hold besides its values (zip and ``.npy`` headers, key, checksum).
_ENTRY_OVERHEAD_BYTES = 64 * 2**10
_DTYPE = np.dtype("<f4")


class _BadEntry(Exception):
    """A disk entry that must not be used (the message says why)."""


class EmbeddingCache:
    """LRU of image embeddings by bytes, with an optional on-disk tier."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MEMORY_BYTES,
        *,
        disk_dir: str | os.PathLike | None = None,
        max_disk_bytes: int = DEFAULT_DISK_BYTES,
    ) -> None:
        self.max_bytes = max_bytes
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.max_disk_bytes = max_disk_bytes
        self._items: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes held in memory."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str, n_values: int | None = None) -> np.ndarray | None:
        """The embeddings stored under ``key``, or None.

        ``n_values``: how many floats the caller will read; an entry of another length
        is a miss (and is dropped), never a buffer too short for the reader.
        """
        with self._lock:
            value = self._items.get(key)
            if value is not None and n_values is not None and value.size != n_values:
                self._forget(key)
                value = None
            if value is not None:
                self._items.move_to_end(key)
        if value is None:
            value = self._read_disk(key, n_values)
            if value is not None:
                self._remember(key, value)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, key: str, value: np.ndarray) -> None:
        """Store ``value`` (copied to a flat, read-only float32 array) under ``key``."""
        value = np.array(value, dtype=_DTYPE, copy=True).reshape(-1)
        value.setflags(write=False)
        self._remember(key, value)
        self._write_disk(key, value)

    def clear(self) -> None:
        """Drop everything held in memory (the disk tier is kept)."""
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def _forget(self, key: str) -> None:
        """Drop ``key`` from the memory tier; the caller holds the lock."""
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes

    def _remember(self, key: str, value: np.ndarray) -> None:
        if value.nbytes > self.max_bytes:
            return
        with self._lock:
            self._forget(key)
            self._items[key] = value
            self._bytes += value.nbytes
            while self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.nbytes

    def _path(self, key: str) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / (hashlib.sha256(key.encode()).hexdigest() + DISK_SUFFIX)

    def _read_disk(self, key: str, n_values: int | None) -> np.ndarray | None:
        if self.disk_dir is None:
            return None
        path = self._path(key)
        try:
            value = _load_entry(path, key, n_values, self.max_disk_bytes)
        except FileNotFoundError:
            return None
        except (OSError, _BadEntry) as exc:
            logger.warning("ignoring embedding cache entry %s: %s", path, exc)
            path.unlink(missing_ok=True)  # the caller encodes again and writes a good one
            return None
        try:
            os.utime(path)  # mark as recently used for trimming
        except OSError:
            pass
        return value

    def _write_disk(self, key: str, value: np.ndarray) -> None:
        if self.disk_dir is None:
            return
        tmp = None
        try:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.disk_dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, values=value, key=np.array(key), sha256=np.array(_checksum(value)))
            os.replace(tmp, self._path(key))
        except OSError as exc:
            # A full or read-only disk must not fail the answer: the memory tier has it.
            logger.warning("could not write embedding cache file in %s: %s", self.disk_dir, exc)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return
        self._trim_disk()

    def _trim_disk(self) -> None:
        assert self.disk_dir is not None
        files = []
        for path in self.disk_dir.glob("*" + DISK_SUFFIX):
            try:
                stat = path.stat()
            except OSError:
                continue  # removed meanwhile by another process
            files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_disk_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


def _checksum(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).data).hexdigest()


def _load_entry(path: Path, key: str, n_values: int | None, max_bytes: int) -> np.ndarray:
    """The values of the entry file at ``path``, checked; :class:`_BadEntry` says what is wrong."""
    size = path.stat().st_size
    low, high = 0, max_bytes + _ENTRY_OVERHEAD_BYTES
    if n_values is not None:
        low, high = n_values * _DTYPE.itemsize, n_values * _DTYPE.itemsize + _ENTRY_OVERHEAD_BYTES
    if not low < size <= high:
        raise _BadEntry(f"its size ({size} bytes) cannot be right")
    try:
        with np.load(path, allow_pickle=False) as entry:
            values, stored_key, stored_sum = entry["values"], entry["key"], entry["sha256"]
    except Exception as exc:  # noqa: BLE001
        # np.load and zipfile raise many kinds of exception on a truncated, overwritten or
        # foreign file (BadZipFile, ValueError, EOFError, KeyError, NotImplementedError...):
        # each one means this entry is unusable, never that the answer should fail.
        raise _BadEntry(f"unreadable ({type(exc).__name__}: {exc})") from exc
    if values.dtype != _DTYPE or values.ndim != 1:
        raise _BadEntry(f"it holds {values.dtype} values of shape {values.shape}, not flat float32")
    if n_values is not None and values.size != n_values:
        raise _BadEntry(f"it holds {values.size} values, not the {n_values} expected")
    if stored_key.shape != () or str(stored_key) != key:
        raise _BadEntry("it belongs to another key")
    if stored_sum.shape != () or str(stored_sum) != _checksum(values):
        raise _BadEntry("its checksum does not match its values")
    values.setflags(write=False)
    return values
