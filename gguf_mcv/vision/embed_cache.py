"""A cache of vision-encoder outputs, so an image already seen is never encoded again.

Keys are strings built by :func:`cache_key` from the vision backend's name, the
mmproj's identity, the image's content hash and the slice index: another projector
or another backend never reuses an entry. Values are flat float32 arrays (image
tokens × embedding width). The memory tier is an LRU bounded in bytes; the optional
disk tier is a folder of bytes values (:mod:`gguf_mcv.bytes_cache`: SQLite index plus
one file per entry), bounded in bytes with least-recently-used eviction, and safe for
several processes and threads sharing one folder.

libmtmd reads as many floats as the image needs from whatever buffer it is given,
so a damaged disk entry would silently change the answer or read past the buffer.
Each stored value therefore starts with a header (a magic string, a SHA-256 of its
key and one of its values) and is checked (length, key, checksum, and the length
the caller expects) before use; an entry that fails any check is a miss, removed,
and encoded again. A damaged index is set aside and started afresh (:func:`~gguf_mcv.bytes_cache.check_index`);
a disk tier that cannot be opened or written (a full or read-only disk, a lock held too
long) never fails an answer: the problem is logged and the memory tier carries on.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .. import environment
from ..bytes_cache import UnsafeEntry, open_bytes_cache
from ..errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_BYTES = 512 * 2**20
DEFAULT_DISK_BYTES = 2 * 2**30
#: The smallest disk budget accepted: the SQLite index alone takes some tens of KiB.
MIN_DISK_BYTES = 2**20
#: The vision backend every entry was made by unless the engine says otherwise.
DEFAULT_BACKEND = "llama.cpp"
#: First bytes of every stored value (the format's version is in it).
MAGIC = b"GMCVEMB1"
_HEADER_BYTES = len(MAGIC) + 32 + 32  # magic, sha256(key), sha256(values)
_DTYPE = np.dtype("<f4")


class _BadEntry(Exception):
    """A disk entry that must not be used (the message says why)."""


def cache_key(backend: str, projector: str, digest: str, index: int = 0) -> str:
    """The key of slice ``index`` of an image (``digest``) encoded by ``backend`` with ``projector``.

    ``backend`` names the vision encoder's implementation (``"llama.cpp"``, ``"onnx-int8"``…)
    and ``projector`` identifies the mmproj file: embeddings of one never serve the other.
    """
    for name, value in (("backend", backend), ("projector", projector), ("digest", digest)):
        if not isinstance(value, str) or not value or ":" in value:
            raise ConfigError(f"The embedding cache key's {name} must be a non-empty string "
                              f"without ':', not {value!r}.")
    return f"{backend}:{projector}:{digest}:{int(index)}"


def default_disk_dir() -> Path:
    """Where the disk tier lives unless told otherwise: ``<cache_dir>/embeddings``."""
    return environment.cache_dir() / "embeddings"


class EmbeddingCache:
    """LRU of image embeddings by bytes, with an optional on-disk tier (``disk_dir``)."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MEMORY_BYTES,
        *,
        disk_dir: str | os.PathLike | None = None,
        max_disk_bytes: int = DEFAULT_DISK_BYTES,
    ) -> None:
        if isinstance(max_disk_bytes, bool) or not isinstance(max_disk_bytes, int) \
                or max_disk_bytes < MIN_DISK_BYTES:
            raise ConfigError(f"max_disk_bytes must be an integer of at least {MIN_DISK_BYTES} "
                              f"(1 MiB), not {max_disk_bytes!r}.")
        self.max_bytes = max_bytes
        self.disk_dir = Path(disk_dir).expanduser() if disk_dir is not None else None
        self.max_disk_bytes = max_disk_bytes
        self._items: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._disk: Any = None  # the diskcache.Cache, opened on first use
        self._disk_failed = False
        self.hits = 0
        self.misses = 0
        self.disk_hits = 0  #: hits served by the disk tier (a subset of ``hits``)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[str]:
        """The keys held in memory, least recently used first."""
        with self._lock:
            return list(self._items)

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
                self.disk_hits += 1
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

    def discard(self, key: str) -> None:
        """Drop the entry under ``key`` from both tiers (nothing happens when there is none)."""
        with self._lock:
            self._forget(key)
        disk = self._open_disk()
        if disk is None:
            return
        try:
            disk.delete(key)
        except Exception as exc:  # noqa: BLE001 - see _disk_error
            self._disk_error("delete", exc)

    def clear(self) -> None:
        """Drop everything held in memory (the disk tier is kept)."""
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def close(self) -> None:
        """Close the disk tier's files (it is opened again when next needed)."""
        with self._lock:
            disk, self._disk = self._disk, None
        if disk is not None:
            disk.close()

    def disk_usage(self) -> int:
        """Bytes the disk tier takes now (0 without one)."""
        disk = self._open_disk()
        if disk is None:
            return 0
        try:
            return int(disk.volume())
        except Exception as exc:  # noqa: BLE001 - see _disk_error
            self._disk_error("measure", exc)
            return 0

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

    # -- the disk tier ----------------------------------------------------------

    def _open_disk(self):
        if self.disk_dir is None or self._disk_failed:
            return None
        with self._lock:
            if self._disk is None:
                try:
                    self._disk = open_bytes_cache(self.disk_dir, self.max_disk_bytes, cull_limit=16)
                except Exception as exc:  # noqa: BLE001 - see _disk_error
                    self._disk_failed = True
                    logger.warning("not using the embedding disk cache in %s: %s (%s). Delete that "
                                   "folder to start it afresh.", self.disk_dir, exc, type(exc).__name__)
                    return None
            return self._disk

    def _disk_error(self, action: str, exc: BaseException) -> None:
        # diskcache raises sqlite3 errors, its own Timeout and OSError: each means the disk tier
        # cannot help this time, never that the answer should fail (the memory tier has it).
        logger.warning("embedding disk cache in %s: could not %s (%s: %s)", self.disk_dir, action,
                       type(exc).__name__, exc)

    def _read_disk(self, key: str, n_values: int | None) -> np.ndarray | None:
        disk = self._open_disk()
        if disk is None:
            return None
        try:
            try:
                stored = disk.get(key, read=True)
            except UnsafeEntry:
                raise
            except Exception as exc:  # noqa: BLE001 - see _disk_error
                self._disk_error("read", exc)
                return None
            if stored is None:
                return None
            return _decode(_read_limited(stored, n_values, self.max_disk_bytes), key, n_values)
        except (OSError, _BadEntry, UnsafeEntry) as exc:
            logger.warning("ignoring embedding cache entry for %s in %s: %s", key, self.disk_dir, exc)
            try:
                disk.delete(key)  # the caller encodes again and writes a good one
            except Exception as exc2:  # noqa: BLE001 - see _disk_error
                self._disk_error("delete a bad entry", exc2)
            return None

    def _write_disk(self, key: str, value: np.ndarray) -> None:
        disk = self._open_disk()
        if disk is None:
            return
        try:
            disk.set(key, _encode(key, value))
        except Exception as exc:  # noqa: BLE001 - see _disk_error
            self._disk_error("write", exc)


def _checksum(values: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(values).data).digest()


def _encode(key: str, values: np.ndarray) -> bytes:
    """A stored value: magic, SHA-256 of the key, SHA-256 of the values, the float32 values."""
    return b"".join((MAGIC, hashlib.sha256(key.encode()).digest(), _checksum(values),
                     np.ascontiguousarray(values, dtype=_DTYPE).tobytes()))


def _read_limited(stored: Any, n_values: int | None, max_bytes: int) -> bytes:
    """The bytes of a stored value (diskcache gives small ones as bytes, others as a file),
    never reading more than an entry of the expected size could hold."""
    limit = _HEADER_BYTES + (n_values * _DTYPE.itemsize if n_values is not None else max_bytes)
    if isinstance(stored, (bytes, str)):  # a str: a MODE_RAW text value someone else stored
        data = stored if isinstance(stored, bytes) else b""
    else:
        with stored:
            data = stored.read(limit + 1)
    if len(data) > limit:
        raise _BadEntry(f"it is larger ({len(data)}+ bytes) than an entry can be")
    return data


def _decode(data: bytes, key: str, n_values: int | None) -> np.ndarray:
    """The values of a stored entry, checked; :class:`_BadEntry` says what is wrong."""
    if len(data) < _HEADER_BYTES or not data.startswith(MAGIC):
        raise _BadEntry("it is not an embedding entry of this version")
    body = data[_HEADER_BYTES:]
    if len(body) % _DTYPE.itemsize or not body:
        raise _BadEntry(f"its length ({len(data)} bytes) cannot be right")
    values = np.frombuffer(body, dtype=_DTYPE)
    if n_values is not None and values.size != n_values:
        raise _BadEntry(f"it holds {values.size} values, not the {n_values} expected")
    if data[len(MAGIC):len(MAGIC) + 32] != hashlib.sha256(key.encode()).digest():
        raise _BadEntry("it belongs to another key")
    if data[len(MAGIC) + 32:_HEADER_BYTES] != _checksum(values):
        raise _BadEntry("its checksum does not match its values")
    return values  # frombuffer over bytes: already read-only
