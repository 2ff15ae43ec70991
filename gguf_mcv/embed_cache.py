"""A cache of vision-encoder outputs, so an image already seen is never encoded again.

Keys are strings the engine builds from the mmproj's identity, the image's
content hash, the preprocessing settings and the slice index. Values are float32
arrays (image tokens × embedding width). The memory tier is an LRU bounded in
bytes; the optional disk tier keeps ``.npy`` files in a folder (written to a
temporary name, then renamed, so a crash never leaves a half file under a real
key) and is trimmed oldest-first to its own byte bound.
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

    def get(self, key: str) -> np.ndarray | None:
        """The embeddings stored under ``key``, or None."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
        if value is None:
            value = self._read_disk(key)
            if value is not None:
                self._remember(key, value)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, key: str, value: np.ndarray) -> None:
        """Store ``value`` (copied to a read-only float32 array) under ``key``."""
        value = np.array(value, dtype=np.float32, copy=True)
        value.setflags(write=False)
        self._remember(key, value)
        self._write_disk(key, value)

    def clear(self) -> None:
        """Drop everything held in memory (the disk tier is kept)."""
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def _remember(self, key: str, value: np.ndarray) -> None:
        if value.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[key] = value
            self._bytes += value.nbytes
            while self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.nbytes

    def _path(self, key: str) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / (hashlib.sha256(key.encode()).hexdigest() + ".npy")

    def _read_disk(self, key: str) -> np.ndarray | None:
        if self.disk_dir is None:
            return None
        path = self._path(key)
        try:
            value = np.load(path, allow_pickle=False)
            os.utime(path)  # mark as recently used for trimming
        except (OSError, ValueError):
            return None  # absent or unreadable: the caller encodes again
        value.setflags(write=False)
        return value

    def _write_disk(self, key: str, value: np.ndarray) -> None:
        if self.disk_dir is None:
            return
        tmp = None
        try:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.disk_dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                np.save(f, value, allow_pickle=False)
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
        files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.disk_dir.glob("*.npy")]
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_disk_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
