"""The embedding cache: LRU by bytes in memory, optional disk tier that survives the process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import damage as damage_mod  # tests/ is on sys.path
import numpy as np
import pytest
from damage import fifo

from gguf_mcv import bytes_cache
from gguf_mcv.errors import ConfigError
from gguf_mcv.vision import embed_cache
from gguf_mcv.vision.embed_cache import EmbeddingCache, cache_key


def arr(n: int, value: float = 1.0) -> np.ndarray:
    return np.full(n, value, dtype=np.float32)


def test_lru_evicts_by_bytes() -> None:
    cache = EmbeddingCache(max_bytes=3 * 400)
    for key in "abc":
        cache.put(key, arr(100))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("d", arr(100))
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 3
    assert cache.nbytes == 1200
    cache.put("huge", arr(10_000))  # larger than the whole budget: not kept
    assert cache.get("huge") is None


def test_values_are_read_only_copies() -> None:
    cache = EmbeddingCache()
    source = arr(10)
    cache.put("k", source)
    source[:] = 5
    got = cache.get("k")
    assert got is not None and got[0] == 1.0 and not got.flags.writeable


def test_disk_tier_survives_a_new_cache_and_is_trimmed_least_recently_used_first(tmp_path: Path) -> None:
    limit = 2 * 2**20
    first = EmbeddingCache(disk_dir=tmp_path, max_disk_bytes=limit)
    first.put("k", arr(100, 3.0))
    second = EmbeddingCache(disk_dir=tmp_path)
    got = second.get("k")
    assert got is not None and got[0] == 3.0 and second.disk_hits == 1
    for i in range(60):  # 60 x 100 KB: three times the budget
        first.put(f"x{i}", arr(25_000))
        assert EmbeddingCache(disk_dir=tmp_path).get("x0") is not None  # kept in use: not evicted
    assert first.disk_usage() <= limit + 200_000  # diskcache culls after the write that passes it
    fresh = EmbeddingCache(disk_dir=tmp_path)
    assert fresh.get("x0") is not None and fresh.get("x1") is None and fresh.get("x59") is not None
    first.close()
    assert first.get("x59") is not None  # memory tier; the disk tier reopens when needed


def test_discard_drops_an_entry_from_both_tiers(tmp_path: Path) -> None:
    cache = EmbeddingCache(disk_dir=tmp_path)
    cache.put("a", np.ones(8, np.float32))
    cache.put("b", np.ones(8, np.float32))
    cache.discard("a")
    cache.discard("never stored")  # nothing to drop: no error
    assert cache.get("a") is None and len(cache) == 1 and cache.nbytes == 32
    assert EmbeddingCache(disk_dir=tmp_path).get("a") is None  # gone from the disk too
    assert EmbeddingCache(disk_dir=tmp_path).get("b") is not None


def test_keys_name_backend_and_projector() -> None:
    keys = {cache_key("llama.cpp", "p1", "d"), cache_key("onnx-int8", "p1", "d"),
            cache_key("llama.cpp", "p2", "d"), cache_key("llama.cpp", "p1", "d", 1)}
    assert len(keys) == 4
    for bad in ("", "a:b", None, 3):
        with pytest.raises(ConfigError, match="backend"):
            cache_key(bad, "p", "d")  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -1, 1000, 1.5, "2GB", True])
def test_a_disk_budget_that_cannot_work_is_refused(tmp_path: Path, size) -> None:
    with pytest.raises(ConfigError, match="max_disk_bytes"):
        EmbeddingCache(disk_dir=tmp_path, max_disk_bytes=size)


def test_the_default_disk_folder_is_in_the_gguf_mcv_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    assert embed_cache.default_disk_dir() == tmp_path / "embeddings"


def test_unwritable_disk_tier_does_not_fail_the_put(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = EmbeddingCache(disk_dir=blocker / "sub")
    cache.put("k", arr(4))
    assert cache.get("k") is not None


def test_same_image_in_a_new_process_skips_the_encoder(tiny, tmp_path: Path) -> None:
    script = (
        "import sys, numpy as np, gguf_mcv\n"
        "cache = gguf_mcv.EmbeddingCache(disk_dir=sys.argv[3])\n"
        "m = gguf_mcv.load(model_path=sys.argv[1], mmproj_path=sys.argv[2], n_ctx=1024, embed_cache=cache)\n"
        "img = np.random.default_rng(7).integers(0, 256, (300, 300, 3), dtype=np.uint8)\n"
        "print(m.ask('?', img, max_tokens=1).timings.slices_encoded)\n"
    )
    args = [sys.executable, "-c", script, str(tiny.quants["Q4_K_M"]), str(tiny.mmproj), str(tmp_path)]
    runs = [subprocess.run(args, capture_output=True, text=True, timeout=120, env=os.environ)
            for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["1", "0"], runs[0].stderr + runs[1].stderr


# --- damaged disk entries: every one is a miss, never a wrong or short buffer ------------------

N = 10_000  # 40 KB of values: stored by diskcache as a file of its own
VALUES = np.arange(N, dtype=np.float32)


def stored_file(folder: Path) -> Path:
    import diskcache

    with diskcache.Cache(str(folder)) as dc:
        handle = dc.get("k", read=True)
    assert not isinstance(handle, bytes), "expected a value stored as a file"
    handle.close()
    return Path(handle.name)


def overwrite(folder: Path, data: bytes) -> None:
    stored_file(folder).write_bytes(data)


def truncate(folder: Path) -> None:
    path = stored_file(folder)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_value_byte(folder: Path) -> None:
    path = stored_file(folder)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))


def flip_magic(folder: Path) -> None:
    path = stored_file(folder)
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))


def shorter(folder: Path) -> None:
    overwrite(folder, embed_cache._encode("k", VALUES[:-7]))


def longer(folder: Path) -> None:
    overwrite(folder, embed_cache._encode("k", np.concatenate([VALUES, np.ones(7, np.float32)])))


def odd_length(folder: Path) -> None:
    overwrite(folder, embed_cache._encode("k", VALUES)[:-1])


def other_key(folder: Path) -> None:
    overwrite(folder, embed_cache._encode("someone else's key", VALUES))


def foreign_npy(folder: Path) -> None:
    path = stored_file(folder)
    with path.open("wb") as f:
        np.save(f, VALUES)


def huge(folder: Path) -> None:
    overwrite(folder, embed_cache._encode("k", VALUES) + bytes(50 * 2**20))


def empty(folder: Path) -> None:
    overwrite(folder, b"")


def deleted(folder: Path) -> None:
    stored_file(folder).unlink()


def inline_garbage(folder: Path) -> None:
    import diskcache

    with diskcache.Cache(str(folder)) as dc:
        dc.set("k", b"short garbage stored inside the SQLite index")


def pickled_object(folder: Path) -> None:
    import diskcache

    with diskcache.Cache(str(folder)) as dc:
        dc.set("k", {"not": "bytes"})  # diskcache pickles it: not our kind of value


DAMAGE = [truncate, flip_value_byte, flip_magic, shorter, longer, odd_length, other_key, foreign_npy,
          huge, empty, deleted, inline_garbage, pickled_object]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_damaged_disk_entry_is_a_miss_and_is_replaced(tmp_path: Path, damage, caplog) -> None:
    writer = EmbeddingCache(disk_dir=tmp_path)
    writer.put("k", VALUES)
    writer.close()
    damage(tmp_path)
    cache = EmbeddingCache(disk_dir=tmp_path)
    assert cache.get("k", n_values=N) is None and cache.misses == 1
    cache.put("k", VALUES)
    got = EmbeddingCache(disk_dir=tmp_path).get("k", n_values=N)
    assert got is not None and np.array_equal(got, VALUES)


def test_an_entry_without_an_expected_length_is_still_bounded(tmp_path: Path) -> None:
    cache = EmbeddingCache(disk_dir=tmp_path, max_disk_bytes=2**20)
    cache.put("k", VALUES)
    huge(tmp_path)
    assert EmbeddingCache(disk_dir=tmp_path, max_disk_bytes=2**20).get("k") is None


def test_a_damaged_index_is_set_aside_with_one_warning_and_started_afresh(tmp_path: Path, caplog) -> None:
    EmbeddingCache(disk_dir=tmp_path).put("k", VALUES)
    (tmp_path / "cache.db").write_bytes(b"this is not a SQLite database" * 100)
    cache = EmbeddingCache(disk_dir=tmp_path)
    with caplog.at_level("WARNING"):
        assert cache.get("k", n_values=N) is None
        cache.put("k", VALUES)
    assert len(caplog.records) == 1 and str(tmp_path) in caplog.text and "set aside" in caplog.text
    assert [p.name for p in tmp_path.glob(".damaged-cache.db-*")]  # kept for the user, not deleted
    cache.close()
    got = EmbeddingCache(disk_dir=tmp_path).get("k", n_values=N)  # the new index works
    assert got is not None and np.array_equal(got, VALUES)


def test_a_disk_folder_that_is_a_file_does_not_fail_the_put(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = EmbeddingCache(disk_dir=blocker)
    cache.put("k", arr(4))
    assert cache.get("k") is not None and cache.disk_usage() == 0


_WRITER = """
import sys, numpy as np
from gguf_mcv.vision.embed_cache import EmbeddingCache
cache = EmbeddingCache(max_bytes=0, disk_dir=sys.argv[1], max_disk_bytes=2**21)
me = int(sys.argv[2])
for i in range(120):
    key = f"k{i % 40}"  # both processes write and read the same 40 keys
    cache.put(key, np.full(10_000, i % 40, np.float32))
    got = cache.get(f"k{(i * 7) % 40}", n_values=10_000)
    assert got is None or (got == (i * 7) % 40).all(), "a value under another key"
print("ok", cache.hits)
"""


def test_two_processes_writing_at_once(tmp_path: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=os.environ) for n in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0 and out.startswith("ok"), err
        assert "Traceback" not in err and "ignoring" not in err, err  # no entry ever read damaged
    cache = EmbeddingCache(disk_dir=tmp_path, max_disk_bytes=2**21)
    assert cache.disk_usage() <= 2**21 + 20 * 40_072
    found = [k for k in range(40) if cache.get(f"k{k}", n_values=10_000) is not None]
    assert found and all((cache.get(f"k{k}") == k).all() for k in found)


def test_expected_length_is_checked_in_memory_too() -> None:
    cache = EmbeddingCache()
    cache.put("k", arr(10))
    assert cache.get("k", n_values=11) is None
    assert cache.get("k") is None  # the wrong-length value is dropped
    cache.put("k", arr(10))
    assert cache.get("k", n_values=10) is not None


def test_threads_sharing_one_cache_with_a_disk_tier(tmp_path: Path) -> None:
    import threading

    cache = EmbeddingCache(max_bytes=200_000, disk_dir=tmp_path, max_disk_bytes=2**21)
    errors: list[BaseException] = []

    def work(me: int) -> None:
        try:
            for i in range(60):
                k = (i * (me + 1)) % 25
                cache.put(f"k{k}", np.full(10_000, k, np.float32))
                got = cache.get(f"k{(k + 3) % 25}", n_values=10_000)
                assert got is None or (got == (k + 3) % 25).all()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert cache.nbytes <= 200_000 and cache.hits > 0


def test_a_retuned_projector_of_the_same_size_never_gets_the_originals_embeddings(tiny, retuned_mmproj: Path,
                                                                                  tmp_path: Path) -> None:
    """Its slices are encoded again: neither the memory tier nor the disk tier serves the
    original's entries, and its embeddings differ from them."""
    import gguf_mcv

    x, y = (np.random.default_rng(seed).integers(0, 256, (300, 300, 3), dtype=np.uint8) for seed in (21, 22))
    first = EmbeddingCache(disk_dir=tmp_path)

    def ask(mmproj: Path, cache: EmbeddingCache, *images: np.ndarray) -> tuple[list[int], dict]:
        with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=mmproj, n_ctx=1024, n_threads=2,
                           vision_backend="llama.cpp", embed_cache=cache) as model:
            encoded = [model.ask("?", rgb, max_tokens=1).timings.slices_encoded for rgb in images]
            tag = f"llama.cpp:{model.engine.mmproj_id}:"
        return encoded, {k[len(tag):]: cache.get(k) for k in list(cache._items) if k.startswith(tag)}

    encoded, original = ask(tiny.mmproj, first, x, y)
    assert encoded == [1, 1] and len(original) == 2
    encoded, retuned = ask(retuned_mmproj, first, x)  # memory (and disk) hold the original's x
    assert encoded == [1] and len(retuned) == 1
    [(slice_x, values)] = retuned.items()
    assert not np.allclose(values, original[slice_x], atol=1e-4)
    fresh = EmbeddingCache(disk_dir=tmp_path)  # only the disk holds the original's y
    encoded, _ = ask(retuned_mmproj, fresh, y)
    assert encoded == [1] and fresh.disk_hits == 0


# --- a damaged folder: never a signal, a hang, a wrong value or a file deleted elsewhere --------

_READ_AFTER_DAMAGE = """
import numpy as np
from gguf_mcv.vision.embed_cache import EmbeddingCache
N = 10_000
good = np.arange(N, dtype=np.float32)
cache = EmbeddingCache(disk_dir=sys.argv[1])
got = cache.get("k", n_values=N)
RESULT["hit"] = got is not None and bool(np.array_equal(got, good))
RESULT["wrong"] = got is not None and not RESULT["hit"]
cache.put("k", good)
cache.close()
got = EmbeddingCache(disk_dir=sys.argv[1]).get("k", n_values=N)
RESULT["after"] = got is not None and bool(np.array_equal(got, good))
"""


def _two_entries(folder: Path) -> tuple[Path, Path]:
    cache = EmbeddingCache(disk_dir=folder)
    cache.put("k", VALUES)
    cache.put("k2", VALUES + 1)
    disk = cache._open_disk()
    files = [Path(folder, disk._sql("SELECT filename FROM Cache WHERE key = ?", (k,)).fetchone()[0])
             for k in ("k", "k2")]
    cache.close()
    return files[0], files[1]


@pytest.mark.parametrize("target", ["index", "entry"])
@pytest.mark.parametrize("damage", damage_mod.DAMAGES, ids=lambda f: f.__name__)
def test_a_damaged_folder_is_a_miss_with_one_warning_in_a_child(tmp_path: Path, damage, target) -> None:
    folder = tmp_path / "cache"
    entry, other = _two_entries(folder)
    harmed = folder / "cache.db" if target == "index" else entry
    damage(harmed, entry if target == "index" else other)
    result = damage_mod.run_child(_READ_AFTER_DAMAGE, str(folder))
    assert not result["wrong"] and result["after"], result
    assert len(result["warnings"]) == (0 if result["hit"] else 1), result
    if damage.__name__ != "unreadable":  # root reads a mode-000 file: a hit there is right
        assert not result["hit"], result
    outside = tmp_path / f"outside-{harmed.name}"
    assert not outside.exists() or outside.stat().st_size > 0  # a symlink's target is left alone


def test_a_live_reader_survives_its_index_being_truncated(tmp_path: Path) -> None:
    # WAL's -shm (and mmap of cache.db) turned truncation into SIGBUS; with a rollback journal
    # and no mmap it is an SQLite error: a miss for the reader, its memory tier unharmed
    code = """
import os, numpy as np
from gguf_mcv.vision.embed_cache import EmbeddingCache
cache = EmbeddingCache(max_bytes=0, disk_dir=sys.argv[1])
for i in range(50):
    cache.put(f"k{i}", np.full(1000, i, np.float32))
for name in os.listdir(sys.argv[1]):
    if name.startswith("cache.db") and os.path.getsize(os.path.join(sys.argv[1], name)):
        os.truncate(os.path.join(sys.argv[1], name), os.path.getsize(os.path.join(sys.argv[1], name)) // 3)
RESULT["hits"] = sum(cache.get(f"k{i}", n_values=1000) is not None for i in range(50))
cache.put("new", np.ones(10, np.float32))
"""
    assert damage_mod.run_child(code, str(tmp_path))["hits"] < 50
    result = damage_mod.run_child(_READ_AFTER_DAMAGE, str(tmp_path))  # the next process: set aside
    assert not result["wrong"] and result["after"]


def test_an_old_wal_folder_with_a_truncated_shm_opens(tmp_path: Path) -> None:
    import diskcache

    with diskcache.Cache(str(tmp_path)) as old:  # diskcache's defaults: WAL, mmap
        assert old._sql("PRAGMA journal_mode").fetchone()[0] == "wal"
    EmbeddingCache(disk_dir=tmp_path).put("k", VALUES)
    for name in ("cache.db-shm", "cache.db-wal"):
        if (tmp_path / name).exists():
            os.truncate(tmp_path / name, (tmp_path / name).stat().st_size // 3)
    result = damage_mod.run_child(_READ_AFTER_DAMAGE, str(tmp_path))
    assert not result["wrong"] and result["after"]
    assert not (tmp_path / "cache.db-shm").exists()  # no longer in WAL mode


def _plant_row(folder: Path, key: object, raw: int, mode: int, filename: str | None, value: object) -> None:
    import sqlite3

    EmbeddingCache(disk_dir=folder).put("first", VALUES)  # the index exists, with our settings
    with sqlite3.connect(folder / "cache.db") as con:
        con.execute("INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, "
                    "size, mode, filename, value) VALUES (?, ?, 0, NULL, 0, 0, NULL, 0, ?, ?, ?)",
                    (key, raw, mode, filename, value))


class _Marker:
    """Unpickling it creates a file: proof that a pickle was run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_planted_pickle_key_or_value_is_never_unpickled(tmp_path: Path) -> None:
    import pickle

    import diskcache

    marker = tmp_path / "ran"
    _plant_row(tmp_path / "c", pickle.dumps(_Marker(str(marker))), 0, diskcache.core.MODE_RAW, None, b"x")
    _plant_row(tmp_path / "c", "k", 1, diskcache.core.MODE_PICKLE, None, pickle.dumps(_Marker(str(marker))))
    disk = bytes_cache.open_bytes_cache(tmp_path / "c", 2**24, cull_limit=1)
    keys = list(disk.iterkeys())
    assert bytes_cache.UNREADABLE_KEY in keys and "first" in keys
    assert disk.get("k") == b""
    assert EmbeddingCache(disk_dir=tmp_path / "c").get("k") is None
    assert not marker.exists()


@pytest.mark.parametrize("name", ["{outside}", "../victim", "ab/../../victim", "00/00/link.val",
                                  "00/00/0000000000000000000000000000.val"])
def test_a_planted_row_never_reads_or_deletes_a_file_outside_the_folder(tmp_path: Path, name: str, caplog) -> None:
    import diskcache

    folder = tmp_path / "c"
    victim = tmp_path / "victim"
    victim.write_bytes(embed_cache._encode("k", VALUES))  # a valid entry: reading it would be a hit
    if name.startswith("00/00/"):  # a sub-folder that is a symlink out of the folder
        (folder / "00").mkdir(parents=True)
        (folder / "00" / "00").symlink_to(tmp_path)
        (tmp_path / "link.val").symlink_to(victim)
        (tmp_path / "0000000000000000000000000000.val").symlink_to(victim)
    _plant_row(folder, "k", 1, diskcache.core.MODE_BINARY, name.format(outside=victim), None)
    cache = EmbeddingCache(disk_dir=folder)
    with caplog.at_level("WARNING"):
        assert cache.get("k", n_values=N) is None
    assert "not a file of this cache" in caplog.text or "leads out" in caplog.text or "Too many" in caplog.text
    cache.put("k", VALUES)  # the row is replaced; diskcache "removes" the old file
    cache._open_disk().cull()
    assert victim.read_bytes() == embed_cache._encode("k", VALUES)


def test_a_fifo_for_an_entry_never_blocks(tmp_path: Path) -> None:
    entry, _ = _two_entries(tmp_path / "c")
    fifo(entry, entry)
    result = damage_mod.run_child(_READ_AFTER_DAMAGE, str(tmp_path / "c"), timeout=30)
    assert not result["hit"] and result["after"] and len(result["warnings"]) == 1


@pytest.mark.parametrize("name", ["cache.db-journal", "cache.db-wal", "cache.db-shm"])
@pytest.mark.parametrize("kind", [fifo, damage_mod.directory, damage_mod.symlink], ids=lambda f: f.__name__)
def test_something_odd_beside_the_index_is_set_aside(tmp_path: Path, name: str, kind) -> None:
    folder = tmp_path / "cache"
    _two_entries(folder)
    (folder / name).write_bytes(b"")
    kind(folder / name, folder / name)
    result = damage_mod.run_child(_READ_AFTER_DAMAGE, str(folder))
    assert result["after"] and not result["wrong"] and len(result["warnings"]) == 1, result
