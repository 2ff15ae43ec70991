"""The embedding cache: LRU by bytes in memory, optional disk tier that survives the process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gguf_mcv.embed_cache import DISK_SUFFIX, EmbeddingCache


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


def test_disk_tier_survives_a_new_cache_and_is_trimmed(tmp_path: Path) -> None:
    first = EmbeddingCache(disk_dir=tmp_path, max_disk_bytes=10_000)
    first.put("k", arr(100, 3.0))
    second = EmbeddingCache(disk_dir=tmp_path)
    got = second.get("k")
    assert got is not None and got[0] == 3.0
    for i in range(20):
        first.put(f"x{i}", arr(500))
    total = sum(p.stat().st_size for p in tmp_path.glob("*" + DISK_SUFFIX))
    assert total <= 10_000
    assert not list(tmp_path.glob("*.tmp"))


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


def entry_file(folder: Path) -> Path:
    (path,) = folder.glob("*" + DISK_SUFFIX)
    return path


def rewrite(path: Path, *, values: np.ndarray, key: str | None = None) -> None:
    """A well-formed entry at ``path`` holding ``values`` (with a checksum that matches them)."""
    stored_key = key if key is not None else str(np.load(path)["key"])
    digest = hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()
    with path.open("wb") as f:
        np.savez(f, values=values, key=np.array(stored_key), sha256=np.array(digest))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_value_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55  # inside the values: the file still opens
    path.write_bytes(bytes(data))


def as_float64(path: Path) -> None:
    rewrite(path, values=np.load(path)["values"].astype(np.float64))


def shorter(path: Path) -> None:
    rewrite(path, values=np.load(path)["values"][:-7].copy())


def longer(path: Path) -> None:
    rewrite(path, values=np.concatenate([np.load(path)["values"], np.ones(7, np.float32)]))


def two_dimensional(path: Path) -> None:
    rewrite(path, values=np.load(path)["values"].reshape(2, -1))


def other_key(path: Path) -> None:
    rewrite(path, values=np.load(path)["values"], key="someone else's key")


def foreign_file(path: Path) -> None:
    np.save(path.with_suffix(".tmp.npy"), np.ones(10, np.float32))
    path.with_suffix(".tmp.npy").replace(path)


DAMAGE = [truncate, flip_value_byte, as_float64, shorter, longer, two_dimensional, other_key,
          foreign_file]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_damaged_disk_entry_is_a_miss_and_is_replaced(tmp_path: Path, damage) -> None:
    EmbeddingCache(disk_dir=tmp_path).put("k", np.arange(64, dtype=np.float32))
    damage(entry_file(tmp_path))
    cache = EmbeddingCache(disk_dir=tmp_path)
    assert cache.get("k", n_values=64) is None and cache.misses == 1
    assert not list(tmp_path.glob("*" + DISK_SUFFIX))  # removed, to be written again
    cache.put("k", np.arange(64, dtype=np.float32))
    got = EmbeddingCache(disk_dir=tmp_path).get("k", n_values=64)
    assert got is not None and np.array_equal(got, np.arange(64))


def test_expected_length_is_checked_in_memory_too() -> None:
    cache = EmbeddingCache()
    cache.put("k", arr(10))
    assert cache.get("k", n_values=11) is None
    assert cache.get("k") is None  # the wrong-length value is dropped
    cache.put("k", arr(10))
    assert cache.get("k", n_values=10) is not None


def test_oversized_file_is_not_read(tmp_path: Path) -> None:
    EmbeddingCache(disk_dir=tmp_path).put("k", arr(64))
    with entry_file(tmp_path).open("ab") as f:
        f.truncate(10 * 2**30)  # sparse: instant, and reading it would need 10 GiB
    cache = EmbeddingCache(disk_dir=tmp_path, max_disk_bytes=2**30)
    assert cache.get("k") is None and cache.get("k", n_values=64) is None


@pytest.fixture(scope="module")
def cached_model(tiny, tmp_path_factory: pytest.TempPathFactory):
    """A tiny model whose embedding cache has a disk tier of its own."""
    import gguf_mcv

    folder = tmp_path_factory.mktemp("embed_cache")
    cache = EmbeddingCache(disk_dir=folder)
    model = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=1024,
                          n_threads=2, embed_cache=cache)
    yield model, cache, folder
    model.close()


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__ for d in DAMAGE])
def test_damaged_entry_is_encoded_again_and_the_answer_is_unchanged(cached_model, damage) -> None:
    model, cache, folder = cached_model
    for old in folder.glob("*" + DISK_SUFFIX):
        old.unlink()
    image = np.random.default_rng(11).integers(0, 256, (200, 200, 3), dtype=np.uint8)

    def ask() -> tuple[str, int]:
        cache.clear()  # memory tier: only the disk entry can answer
        model.engine.reset()  # KV cache: the image must be evaluated again
        calls = model.engine.encoder_calls
        reply = model.ask("What is this?", image, max_tokens=4, temperature=0.0, seed=1)
        assert model.engine.encoder_calls - calls == reply.timings.slices_encoded
        return str(reply), reply.timings.slices_encoded

    first, encoded = ask()
    assert encoded == 1
    assert ask() == (first, 0)  # the good entry is used
    damage(entry_file(folder))
    assert ask() == (first, 1)  # the damaged one is not: same answer, encoder ran again
    assert ask() == (first, 0)  # and the entry written again is good
