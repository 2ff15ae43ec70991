"""A cache of vision-encoder outputs, so an image already seen is never encoded again.

Keys are strings built by :func:`cache_key` from the vision backend's name, the
mmproj's identity, the image's content hash and the slice index: another projector
or another backend never reuses an entry. Values are flat float32 arrays (image
tokens × embedding width). The memory tier is an LRU bounded in bytes; the optional
disk tier is a `diskcache <https://grantjenks.com/docs/diskcache/>`_ store (SQLite
index plus one file per entry), bounded in bytes with least-recently-used eviction,
and safe for several processes and threads sharing one folder.

libmtmd reads as many floats as the image needs from whatever buffer it is given,
so a damaged disk entry would silently change the answer or read past the buffer.
Each stored value therefore starts with a header (a magic string, a SHA-256 of its
key and one of its values) and is checked (length, key, checksum, and the length
the caller expects) before use; an entry that fails any check is a miss, removed,
and encoded again. A damaged index is set aside and started afresh (:func:`check_index`);
a disk tier that cannot be opened or written (a full or read-only disk, a lock held too
long) never fails an answer: the problem is logged and the memory tier carries on.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .. import constants
from ..cache_files import folder_lock, inside, is_regular, open_regular, set_aside
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
#: Seconds a disk operation waits for another process's lock before giving up (then: a miss).
DISK_TIMEOUT_S = 5.0


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
    return constants.cache_dir() / "embeddings"


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


#: diskcache's settings, every one given (the folder's own Settings table never chooses them):
#: a rollback journal and no memory-mapped I/O, so a truncated or damaged index file reads as
#: an SQLite error, never as a SIGBUS from a mapping (WAL keeps its index in a mapped ``-shm``).
#: No fsync (synchronous 0): a process killed mid-write is still safe (the journal is on disk),
#: a power loss may damage the index, which the check at opening sets aside, and every value is
#: checksummed; with fsyncs each read (LRU updates its row) cost ~1 ms more.
SQLITE_SETTINGS = {"statistics": 0, "tag_index": 0, "sqlite_auto_vacuum": 1, "sqlite_cache_size": 2**13,
                   "sqlite_journal_mode": "truncate", "sqlite_mmap_size": 0, "sqlite_synchronous": 0,
                   "disk_min_file_size": 2**15, "disk_pickle_protocol": 5}
#: The index and SQLite's files beside it: each must be a regular file (or absent).
INDEX_FILES = ("cache.db", "cache.db-wal", "cache.db-shm", "cache.db-journal")
#: The lock taken while a folder's index is checked (and set aside) before opening.
OPEN_LOCK = ".gguf_mcv-open.lock"
#: The names diskcache gives the files it writes (``Disk.filename``): nothing else is read or deleted.
ENTRY_NAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")


class UnsafeEntry(Exception):
    """An index row that must not be followed: a pickled key or value, or a file name that is
    not one diskcache makes (absolute, ``..``, through a symlink) or not a regular file."""


#: What :func:`bytes_only_disk` gives for a key stored pickled (never unpickled).
UNREADABLE_KEY = type("UnreadableKey", (), {"__repr__": lambda self: "<a pickled key, not read>"})()


def open_bytes_cache(directory: str | os.PathLike, max_bytes: int, *, cull_limit: int) -> Any:
    """A diskcache folder of bytes values (:func:`bytes_only_disk`), bounded to ``max_bytes``
    with least-recently-used eviction, safe for several processes and threads.

    Under the folder's lock the index is checked first (:func:`check_index`): a damaged one
    is set aside, with a warning, and a new one started. diskcache's own errors (sqlite3,
    OSError, its Timeout) and filelock's Timeout are the caller's to handle."""
    import diskcache  # lazy: only caches with a disk tier need it

    folder = Path(os.fspath(directory)).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder / OPEN_LOCK, timeout=DISK_TIMEOUT_S):
        check_index(folder)
        return diskcache.Cache(os.fspath(folder), timeout=DISK_TIMEOUT_S, size_limit=max_bytes,
                               eviction_policy="least-recently-used", cull_limit=cull_limit,
                               disk=bytes_only_disk(), **SQLITE_SETTINGS)


def check_index(folder: Path) -> None:
    """Set aside a damaged diskcache index in ``folder`` (the caller holds :data:`OPEN_LOCK`):
    one of :data:`INDEX_FILES` that is not a regular file, a database SQLite finds damaged,
    or one with settings diskcache did not write. Busy or locked: left, the caller's error."""
    import sqlite3
    from urllib.parse import quote

    db = folder / INDEX_FILES[0]
    odd = [name for name in INDEX_FILES if os.path.lexists(folder / name) and not is_regular(folder / name)]
    why = f"{', '.join(odd)} not a regular file" if odd else ""
    if not why and os.path.lexists(db):
        try:
            con = sqlite3.connect(f"file:{quote(os.fspath(db))}?mode=rw", uri=True, timeout=DISK_TIMEOUT_S,
                                  isolation_level=None)
            try:
                con.execute("PRAGMA mmap_size = 0")
                found = con.execute("PRAGMA quick_check").fetchall()
                if found != [("ok",)]:
                    why = f"SQLite's check: {found[0][0] if found else 'nothing'}"
                elif con.execute("SELECT 1 FROM sqlite_master WHERE name = 'Settings'").fetchall():
                    import diskcache

                    known = {*diskcache.DEFAULT_SETTINGS, *diskcache.core.METADATA}
                    if {k for (k,) in con.execute("SELECT key FROM Settings")} - known:
                        why = "its settings table holds settings diskcache never writes"
            finally:
                con.close()
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise
            why = f"{type(exc).__name__}: {exc}"
        except sqlite3.DatabaseError as exc:  # not a database, malformed
            why = f"{type(exc).__name__}: {exc}"
    if why:
        moved = [p.name for name in INDEX_FILES if (p := set_aside(folder / name, why, warn=False)) is not None]
        logger.warning("the cache index in %s is damaged (%s): set aside as %s (delete those when no longer "
                       "needed); a new index is started", folder, why, ", ".join(moved) or "nothing")


def bytes_only_disk() -> type:
    """A diskcache ``Disk`` that hands back stored bytes as they are and never unpickles,
    keys included: a pickled key lists as :data:`UNREADABLE_KEY`, a value of another kind
    (text, a pickle) reads as an empty entry. Only files named as diskcache names them, in
    the folder, are read (as regular files, never blocking) or deleted; a row naming any
    other reads as :class:`UnsafeEntry`."""
    import diskcache  # lazy: see _open_disk

    class BytesOnlyDisk(diskcache.Disk):
        def get(self, key, raw):
            if raw and isinstance(key, (str, bytes, int, float)):
                return super().get(key, raw)
            return UNREADABLE_KEY

        def fetch(self, mode, filename, value, read):
            if mode == diskcache.core.MODE_RAW:
                return value if isinstance(value, bytes) else b""
            if mode != diskcache.core.MODE_BINARY:
                return b""
            if filename is None:
                return value if isinstance(value, bytes) else b""
            path = self._entry(filename)
            try:
                f = open_regular(path)
            except FileNotFoundError:
                raise  # deleted meanwhile by another process: diskcache's miss
            except OSError as exc:  # not a regular file, a symlink (ELOOP), unreadable
                raise UnsafeEntry(f"{path}: {exc.strerror or exc}") from None
            if read:
                return f
            with f:
                return f.read()

        def filename(self, key=diskcache.core.UNKNOWN, value=diskcache.core.UNKNOWN):
            name, full = super().filename(key, value)
            if inside(self._directory, name) is None:  # a symlinked sub-folder would write elsewhere
                raise OSError(f"{os.path.dirname(full)} leads out of the cache folder")
            return name, full

        def remove(self, file_path):
            try:
                path = self._entry(file_path)
            except UnsafeEntry:
                return  # never a file this cache did not write
            if is_regular(path):
                with contextlib.suppress(OSError):
                    path.unlink()
            for up in (path.parent, path.parent.parent):  # the two levels diskcache makes, no further
                with contextlib.suppress(OSError):
                    up.rmdir()

        def _entry(self, filename: Any) -> Path:
            path = inside(self._directory, filename) if isinstance(filename, str) else None
            if path is None or not ENTRY_NAME.fullmatch(filename):
                raise UnsafeEntry(f"the index names {filename!r}, not a file of this cache")
            return path

    return BytesOnlyDisk


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
