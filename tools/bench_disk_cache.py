"""What the disk caches' SQLite settings cost: per-entry write and read times of a diskcache
folder opened as gguf_mcv opens it (rollback journal, no mmap, no fsync) against diskcache's
defaults (WAL with a memory-mapped -shm, 64 MiB mmap, fsync at checkpoints), and the check
made before each opening (``PRAGMA quick_check``) on an index of many entries.

    python tools/bench_disk_cache.py [--rows 50000]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
from bench import options, record

from gguf_mcv import bytes_cache
from gguf_mcv.vision import embed_cache

SETTINGS = {
    "before (WAL, mmap, fsync)": dict(bytes_cache.SQLITE_SETTINGS, sqlite_journal_mode="wal",
                                       sqlite_mmap_size=2**26, sqlite_synchronous=1),
    "rollback journal, fsync": dict(bytes_cache.SQLITE_SETTINGS, sqlite_synchronous=1),
    "now (rollback journal, no mmap, no fsync)": bytes_cache.SQLITE_SETTINGS,
}


def per_entry(settings: dict, n: int, floats: int, repeats: int = 3) -> tuple[float, float]:
    """Best-of-``repeats`` seconds per ``set`` and per ``get`` of ``n`` entries of ``floats`` float32."""
    import diskcache

    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            cache = diskcache.Cache(folder, timeout=5, size_limit=2**31, eviction_policy="least-recently-used",
                                    cull_limit=16, disk=bytes_cache.bytes_only_disk(), **settings)
            values = [embed_cache._encode(f"k{i}", np.random.rand(floats).astype(np.float32)) for i in range(n)]
            start = time.perf_counter()
            for i, v in enumerate(values):
                cache.set(f"k{i}", v)
            wrote = (time.perf_counter() - start) / n
            start = time.perf_counter()
            for i in range(n):
                got = cache.get(f"k{i}", read=True)
                got if isinstance(got, bytes) else got.read()
            read = (time.perf_counter() - start) / n
            cache.close()
        best = (min(best[0], wrote), min(best[1], read))
    return best


def main() -> None:
    parser = options.parser(__doc__, quant=options.OMIT, threads=options.OMIT)
    parser.add_argument("--rows", type=int, default=50_000, help="entries in the index whose check is timed")
    args = parser.parse_args()
    results: dict = {"per_entry": []}
    for floats, n in ((1024, 400), (64 * 1152, 200)):  # inline in the index; a file of its own
        for name, settings in SETTINGS.items():
            wrote, read = per_entry(settings, n, floats)
            results["per_entry"].append({"entry_bytes": floats * 4, "settings": name, "set_s": wrote, "get_s": read})
            print(f"{floats * 4:>7} B entries, {name:42}: set {wrote * 1e3:6.3f} ms, get {read * 1e3:6.3f} ms")
    with tempfile.TemporaryDirectory() as folder:
        cache = bytes_cache.open_bytes_cache(folder, 2**31, cull_limit=16)
        with cache.transact():
            for i in range(args.rows):
                cache.set(f"k{i}", b"x" * 100)
        cache.close()
        start = time.perf_counter()
        bytes_cache.check_index(Path(folder))
        checked = time.perf_counter() - start
        size = (Path(folder) / "cache.db").stat().st_size
        print(f"check before opening, {args.rows} entries ({size / 2**20:.1f} MiB index): {checked * 1e3:.1f} ms")
    results["check_index"] = {"rows": args.rows, "index_bytes": size, "seconds": checked}
    record.write(args.json, "bench_disk_cache", results, args)


if __name__ == "__main__":
    main()
