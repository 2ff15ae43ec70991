"""The disk store of bytes values: never unpickles, never follows a row out of its folder,
sets a damaged index aside."""

from __future__ import annotations

import pickle
import sqlite3
from pathlib import Path

import pytest

from gguf_mcv import bytes_cache


class _Marker:
    """Unpickling it creates a file: proof that a pickle was run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _store(folder: Path):
    return bytes_cache.open_bytes_cache(folder, 2**24, cull_limit=1)


def _plant_row(folder: Path, key: object, raw: int, mode: int, filename: str | None, value: object) -> None:
    with sqlite3.connect(folder / "cache.db") as con:
        con.execute("INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, "
                    "size, mode, filename, value) VALUES (?, ?, 0, NULL, 0, 0, NULL, 0, ?, ?, ?)",
                    (key, raw, mode, filename, value))


def test_values_come_back_as_the_bytes_stored(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.set("small", b"x" * 10)
    store.set("large", b"y" * 2**16)  # a file of its own
    assert store.get("small") == b"x" * 10 and store.get("large") == b"y" * 2**16
    store.close()
    again = _store(tmp_path)
    assert again.get("large") == b"y" * 2**16
    again.close()


def test_a_planted_pickle_key_or_value_is_never_unpickled(tmp_path: Path) -> None:
    import diskcache

    folder, marker = tmp_path / "c", tmp_path / "ran"
    _store(folder).close()
    _plant_row(folder, pickle.dumps(_Marker(str(marker))), 0, diskcache.core.MODE_RAW, None, b"x")
    _plant_row(folder, "k", 1, diskcache.core.MODE_PICKLE, None, pickle.dumps(_Marker(str(marker))))
    store = _store(folder)
    assert bytes_cache.UNREADABLE_KEY in list(store.iterkeys())
    assert store.get("k") == b""
    assert not marker.exists()
    store.close()


@pytest.mark.parametrize("name", ["../victim", "/etc/passwd", "ab/cd/not-a-diskcache-name.val"])
def test_a_row_naming_a_file_it_did_not_write_is_unsafe(tmp_path: Path, name: str) -> None:
    import diskcache

    folder = tmp_path / "c"
    (tmp_path / "victim").write_bytes(b"secret")
    _store(folder).close()
    _plant_row(folder, "k", 1, diskcache.core.MODE_BINARY, name, None)
    store = _store(folder)
    with pytest.raises(bytes_cache.UnsafeEntry):
        store.get("k")
    store.delete("k")  # removes the row, never the file
    assert (tmp_path / "victim").read_bytes() == b"secret"
    store.close()


def test_a_damaged_index_is_set_aside(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.set("k", b"v")
    store.close()
    (tmp_path / "cache.db").write_bytes(b"this is not a SQLite database" * 100)
    bytes_cache.check_index(tmp_path)
    assert not (tmp_path / "cache.db").exists() and list(tmp_path.glob(".damaged-cache.db-*"))
    fresh = _store(tmp_path)
    assert fresh.get("k") is None
    fresh.close()
