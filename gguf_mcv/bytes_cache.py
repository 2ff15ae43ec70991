"""A folder of bytes values on disk, shared safely: a diskcache store that never unpickles.

`diskcache <https://grantjenks.com/docs/diskcache/>`_ keeps an SQLite index and one file per
large entry, bounded in bytes with least-recently-used eviction, and safe for several processes
and threads sharing one folder. Here every setting is given, values are bytes and keys plain
values (never a pickle, whatever the folder holds), only files named as diskcache names them
inside the folder are read or deleted, and a damaged index is set aside and started afresh.
The embedding cache's disk tier (:mod:`gguf_mcv.vision.embed_cache`) and the kept chats' store
(:mod:`gguf_mcv.runtime.kv_store`) are such folders.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import Any

from .cache_files import folder_lock, inside, is_regular, open_regular, set_aside

logger = logging.getLogger(__name__)

#: Seconds a disk operation waits for another process's lock before giving up (then: a miss).
DISK_TIMEOUT_S = 5.0

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
