"""The embedding cache: LRU by bytes in memory, optional disk tier that survives the process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from gguf_mcv.embed_cache import EmbeddingCache


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
    total = sum(p.stat().st_size for p in tmp_path.glob("*.npy"))
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
