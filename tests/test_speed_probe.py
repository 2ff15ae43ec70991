"""Tests of the machine speed probe: caching, invalidation, damaged and concurrent cache files."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import replace
from pathlib import Path

import damage
import pytest
from damage import run_child  # tests/ is on sys.path

from gguf_mcv.cache_files import digest_of
from gguf_mcv.errors import ConfigError
from gguf_mcv.planning.speed import DEFAULT_RATES, Rates
from gguf_mcv.runtime import speed_probe

FAKE = Rates(bandwidth=12e9, matvec=9e9, prefill_flops=40e9, vision_flops=50e9,
             threads=3, source="fake probe")


class Counter:
    """A stand-in for :func:`speed_probe.measure` that counts its calls."""

    def __init__(self, result: Rates = FAKE) -> None:
        self.calls = 0
        self.result = result

    def __call__(self, threads: int) -> Rates:
        self.calls += 1
        return replace(self.result, threads=threads)


def test_probe_false_and_the_env_var_use_the_defaults(tmp_path: Path, monkeypatch) -> None:
    fake = Counter()
    assert speed_probe.rates(probe=False, cache=tmp_path / "c.json", measure_fn=fake) is DEFAULT_RATES
    monkeypatch.setenv("GGUF_MCV_NO_PROBE", "1")
    assert speed_probe.rates(threads=2, cache=tmp_path / "c.json", measure_fn=fake) is DEFAULT_RATES
    monkeypatch.setenv("GGUF_MCV_NO_PROBE", "0")  # "0" means probe
    assert speed_probe.rates(threads=2, cache=tmp_path / "c.json", measure_fn=fake).source == "fake probe"
    assert fake.calls == 1 and not (tmp_path / "c.json.tmp").exists()


def test_probe_runs_once_then_comes_from_the_cache(tmp_path: Path) -> None:
    cache, fake = tmp_path / "sub" / "speed.json", Counter()
    first = speed_probe.rates(probe=True, threads=3, cache=cache, measure_fn=fake)
    second = speed_probe.rates(probe=True, threads=3, cache=cache, measure_fn=fake)
    assert fake.calls == 1 and first == second == replace(FAKE, threads=3)
    data = json.loads(cache.read_text())
    assert data["key"] == speed_probe.machine_key(3) and data["rates"]["bandwidth"] == 12e9
    assert data["digest"] == digest_of(data)  # written by cache_files.write_manifest
    assert [p.name for p in cache.parent.iterdir()] == ["speed.json"]  # no temporary file left


@pytest.mark.parametrize("change", ["threads", "llama_cpp_python", "onnxruntime", "cpu", "probe_version"])
def test_a_changed_machine_or_build_is_probed_again(tmp_path: Path, monkeypatch, change: str) -> None:
    cache, fake = tmp_path / "speed.json", Counter()
    speed_probe.rates(probe=True, threads=2, cache=cache, measure_fn=fake)
    threads = 2
    if change == "threads":
        threads = 4
    elif change == "cpu":
        monkeypatch.setattr(speed_probe, "cpu_identity", lambda: "another CPU | flags=sse2")
    elif change == "probe_version":
        monkeypatch.setattr(speed_probe, "PROBE_VERSION", speed_probe.PROBE_VERSION + 1)
    else:
        real = speed_probe.dist_version
        monkeypatch.setattr(speed_probe, "dist_version", lambda d: "99.0" if d == change else real(d))
    speed_probe.rates(probe=True, threads=threads, cache=cache, measure_fn=fake)
    assert fake.calls == 2
    speed_probe.rates(probe=True, threads=threads, cache=cache, measure_fn=fake)
    assert fake.calls == 2  # and the new probe was cached


def _valid_file(key: dict) -> dict:
    return {"key": key, "rates": FAKE.to_dict()}


@pytest.mark.parametrize("content", [
    b"", b"\x00\xff\xfe garbage", b'{"key": ', b"[1, 2, 3]", b'"a string"', b"null", b"[" * 100_000 + b"]" * 100_000,
    "json:rates-missing", "json:rates-a-list", "json:negative-bandwidth", "json:nan-bandwidth",
    "json:unknown-field", "json:bandwidth-a-string", "json:bool-threads-ok", "json:digest-mismatch",
])
def test_a_damaged_cache_file_is_probed_again_and_replaced(tmp_path: Path, content) -> None:
    cache, fake = tmp_path / "speed.json", Counter()
    key = speed_probe.machine_key(2)
    if isinstance(content, str):
        data = _valid_file(key)
        kind = content.removeprefix("json:")
        if kind == "rates-missing":
            del data["rates"]
        elif kind == "rates-a-list":
            data["rates"] = [1, 2]
        elif kind == "negative-bandwidth":
            data["rates"]["bandwidth"] = -5
        elif kind == "nan-bandwidth":
            data["rates"]["bandwidth"] = math.nan
        elif kind == "unknown-field":
            data["rates"]["warp_factor"] = 9
        elif kind == "bandwidth-a-string":
            data["rates"]["bandwidth"] = "fast"
        elif kind == "bool-threads-ok":
            data["rates"]["source"] = "cached"  # a valid file (written before files had a digest), for contrast
        elif kind == "digest-mismatch":
            data["rates"]["bandwidth"] = 1e12  # edited after its digest was made
            data["digest"] = digest_of(_valid_file(key))
        content = json.dumps(data).encode()
    cache.write_bytes(content)
    got = speed_probe.rates(probe=True, threads=2, cache=cache, measure_fn=fake)
    if b'"cached"' in content:
        assert fake.calls == 0 and got.source == "cached"
        return
    assert fake.calls == 1 and got.source == "fake probe"
    assert speed_probe.read_cache(cache, key) == got  # replaced by a valid file


def test_a_cache_folder_that_cannot_be_written_still_gives_rates(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    fake = Counter()
    got = speed_probe.rates(probe=True, threads=2, cache=blocker / "speed.json", measure_fn=fake)
    assert got.source == "fake probe" and fake.calls == 1


def test_concurrent_probes_leave_one_valid_file(tmp_path: Path) -> None:
    """Many threads probing and writing at once: every reader sees a whole file or none."""
    cache = tmp_path / "speed.json"
    key = speed_probe.machine_key(2)
    bad_reads: list[str] = []
    stop = threading.Event()

    def writer(i: int) -> None:
        for j in range(20):
            speed_probe.write_cache(cache, key, replace(FAKE, source=f"writer {i}.{j}"))

    def reader() -> None:
        while not stop.is_set():
            if cache.exists():
                text = cache.read_text()
                try:
                    json.loads(text)
                except ValueError:
                    bad_reads.append(text[:40])

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert bad_reads == []
    final = speed_probe.read_cache(cache, key)
    assert final is not None and final.source.startswith("writer ")
    assert [p.name for p in tmp_path.iterdir()] == ["speed.json"]


def test_concurrent_first_probes_all_get_rates(tmp_path: Path) -> None:
    cache, fake, results = tmp_path / "speed.json", Counter(), []
    threads = [threading.Thread(target=lambda: results.append(
        speed_probe.rates(probe=True, threads=2, cache=cache, measure_fn=fake))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and all(r.source == "fake probe" for r in results)
    assert speed_probe.read_cache(cache, speed_probe.machine_key(2)) is not None


def test_bandwidth_is_a_positive_rate() -> None:
    bw = speed_probe.measure_bandwidth(2, nbytes=8 * 2**20, repeats=1)
    assert math.isfinite(bw) and 1e8 < bw < 1e13


def _timed(scale: float = 1.0) -> dict:
    """:func:`speed_probe.time_llama`'s result for made-up timings (``scale`` x slower)."""
    types = {}
    for t, token_s in (("Q4_K", 0.001), ("Q5_1", 0.003)):
        tensors = [["token_embd.weight", t, 500_000], ["blk.0.attn_q.weight", t, 4_000_000],
                   ["blk.1.attn_q.weight", t, 4_000_000], ["output.weight", t, 500_000]]
        types[t] = {"prefill_s": 0.1 * scale, "prefill_tokens": 280.0, "token_s": token_s * scale,
                    "n_past": 297.0, "tensors": tensors}
    return {"slice_s": 0.5 * scale, "types": types, "overhead": {1: 0.0001 * scale, 9: 0.0005 * scale},
            "onnx_slice_s": {"onnx-fp32": 0.2 * scale, "onnx-int8": 0.1 * scale}}


def test_rates_from_timings_scale_inversely_with_time() -> None:
    a = speed_probe.rates_from(1e15, _timed(), 2, "t")
    b = speed_probe.rates_from(1e15, _timed(2.0), 2, "t")
    assert a.vision_flops == pytest.approx(2 * b.vision_flops)
    assert a.prefill_flops == pytest.approx(2 * b.prefill_flops)
    for name in ("matvec_by_type", "prefill_by_type", "vision_by_backend"):
        for k, v in getattr(a, name).items():
            assert v == pytest.approx(2 * getattr(b, name)[k]), (name, k)
    assert a.token_overhead_s == pytest.approx(b.token_overhead_s / 2)
    with pytest.raises(ValueError):  # an infinite timing is an impossible rate, never a silent zero
        speed_probe.rates_from(20e9, {**_timed(), "slice_s": math.inf}, 2, "t")


def test_rates_from_takes_the_fixed_costs_out_of_each_types_rate() -> None:
    r = speed_probe.rates_from(1e15, _timed(), 2, "t")
    assert r.layer_overhead_s == pytest.approx(0.00005) and r.token_overhead_s == pytest.approx(0.00005)
    # 8.5 MB read per token (layers + output, not token_embd) in 1 ms less 0.15 ms of fixed cost
    assert r.matvec_by_type["Q4_K"] == pytest.approx(8_500_000 / 0.00085, rel=1e-3)
    assert r.matvec_by_type["Q5_1"] < r.matvec_by_type["Q4_K"] / 3
    assert r.matvec == r.matvec_by_type["Q4_K"] and r.prefill_flops == r.prefill_by_type["Q4_K"]
    # int8 runs the blocks only; the rest at fp32's rate: so faster than twice fp32 on the blocks
    assert r.vision_by_backend["onnx-int8"] > 2 * r.vision_by_backend["onnx-fp32"]
    no_onnx = speed_probe.rates_from(1e15, {**_timed(), "onnx_slice_s": {}}, 2, "t")
    assert no_onnx.vision_by_backend == {}


def test_a_noisy_overhead_reading_never_gives_a_type_negative_time() -> None:
    timed = _timed()
    timed["overhead"] = {1: 0.01, 9: 0.02}  # more than a whole token: a hiccup
    r = speed_probe.rates_from(1e15, timed, 2, "t")
    assert all(math.isfinite(v) and v > 0 for v in r.matvec_by_type.values())


@pytest.mark.slow
def test_the_real_probe_measures_this_machine(tmp_path: Path) -> None:
    """The whole probe through llama.cpp on its generated pair; the cache then answers."""
    cache = tmp_path / "speed.json"
    got = speed_probe.rates(probe=True, threads=2, cache=cache)
    assert got.source.startswith("the probe of") and got.threads == 2
    for name in ("bandwidth", "matvec", "prefill_flops", "vision_flops"):
        assert 1e8 < getattr(got, name) < 1e14, name
    assert set(got.matvec_by_type) == set(got.prefill_by_type) == set(speed_probe.PROBED_TYPES)
    # finite and positive; on cores other work oversubscribes two threads can spin for a
    # tenth of a second per token (Q4_1 at 1e8 B/s under a load of 10), hence the wide floor
    assert all(1e6 < v < 1e14 for v in got.matvec_by_type.values())
    # what the fixed costs take depends on the load on this machine's cores: only their kind is checked
    for overhead in (got.token_overhead_s, got.layer_overhead_s):
        assert math.isfinite(overhead) and overhead >= 0
    assert set(got.vision_by_backend) == {"onnx-fp32", "onnx-int8"}
    assert speed_probe.rates(probe=True, threads=2, cache=cache, measure_fn=Counter()) == got


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), MemoryError("no room")])
def test_a_failed_probe_gives_labelled_defaults_and_is_retried(tmp_path: Path, error: Exception) -> None:
    cache = tmp_path / "speed.json"

    def broken(threads: int) -> Rates:
        raise error

    got = speed_probe.rates(probe=True, threads=2, cache=cache, measure_fn=broken)
    assert got.bandwidth == DEFAULT_RATES.bandwidth and "the speed probe failed" in got.source
    assert str(error) in got.source and not cache.exists()
    fake = Counter()
    assert speed_probe.rates(probe=True, threads=2, cache=cache, measure_fn=fake).source == "fake probe"
    assert fake.calls == 1


def test_refresh_probes_again_and_replaces_the_cache(tmp_path: Path) -> None:
    cache, fake = tmp_path / "speed.json", Counter()
    speed_probe.rates(probe=True, threads=2, cache=cache, measure_fn=fake)
    newer = Counter(replace(FAKE, bandwidth=99e9, source="newer"))
    assert speed_probe.rates(probe=True, threads=2, cache=cache, measure_fn=newer, refresh=True).source == "newer"
    assert speed_probe.rates(probe=True, threads=2, cache=cache, measure_fn=fake).bandwidth == 99e9
    assert (fake.calls, newer.calls) == (1, 1)


@pytest.mark.parametrize("threads", [0, -2, 10**9, 2.5, "2", True])
def test_impossible_thread_counts_are_refused_before_probing(tmp_path: Path, threads) -> None:
    fake = Counter()
    with pytest.raises(ConfigError, match="threads"):
        speed_probe.rates(probe=True, threads=threads, cache=tmp_path / "s.json", measure_fn=fake)
    assert fake.calls == 0


@pytest.mark.parametrize("kind", ["huge", "folder", "fifo"])
def test_a_cache_path_that_is_not_a_small_file_is_probed_again_without_blocking(tmp_path: Path, kind: str) -> None:
    import os

    cache, fake = tmp_path / "speed.json", Counter()
    if kind == "huge":
        data = _valid_file(speed_probe.machine_key(2))
        data["padding"] = "x" * (speed_probe.MAX_CACHE_BYTES + 1)
        cache.write_text(json.dumps(data))
    elif kind == "folder":
        cache.mkdir()
    else:
        os.mkfifo(cache)  # reading a FIFO with no writer would block forever
    got = speed_probe.rates(probe=True, threads=2, cache=cache, measure_fn=fake)
    assert got.source == "fake probe" and fake.calls == 1
    if kind == "huge":
        assert speed_probe.read_cache(cache, speed_probe.machine_key(2)) == got  # replaced


_PROBE_AFTER_DAMAGE = """
from dataclasses import replace
from pathlib import Path
from gguf_mcv.runtime import speed_probe
from gguf_mcv.planning.speed import Rates
calls = []
def fake(threads):
    calls.append(threads)
    return Rates(bandwidth=12e9, matvec=9e9, prefill_flops=40e9, vision_flops=50e9, threads=threads,
                 source="fake probe")
path = Path(sys.argv[1])
got = speed_probe.rates(probe=True, threads=2, cache=path, measure_fn=fake)
RESULT["hit"] = not calls
RESULT["wrong"] = got.threads != 2
RESULT["after"] = speed_probe.read_cache(path, speed_probe.machine_key(2)) is not None
"""


@pytest.mark.parametrize("damage", damage.DAMAGES, ids=lambda f: f.__name__)
def test_a_damaged_verdict_is_probed_again_with_one_warning_in_a_child(tmp_path: Path, damage) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    path, other = folder / "speed.json", folder / "other.json"
    speed_probe.write_cache(path, speed_probe.machine_key(2), replace(FAKE, threads=2))
    other.write_text(json.dumps({"key": "another cache's file", "paths": {}}))
    damage(path, other)
    result = run_child(_PROBE_AFTER_DAMAGE, str(path))
    assert not result["wrong"] and result["after"], result
    if damage.__name__ == "unreadable":  # root reads a mode-000 file
        assert result["hit"] and not result["warnings"], result
    elif damage.__name__ == "swapped":  # a valid file of another kind: another key, not damage
        assert not result["hit"], result
    else:
        assert not result["hit"] and len(result["warnings"]) == 1, result


def test_the_onnx_int8_rate_is_the_fastest_kernel_this_cpu_class_tries(tiny, tmp_path: Path, monkeypatch) -> None:
    """A conversion keeps the fastest int8 kernel that passes its check, so the probe times every
    kernel of this CPU's class (A B A B) and gives the fastest's time as onnx-int8's."""
    pytest.importorskip("onnxruntime")
    from gguf_mcv.vision import onnx_variants

    monkeypatch.setitem(onnx_variants.CANDIDATES, onnx_variants.cpu_class(), ("u8s8", "nbits8", "u8u8"))
    measured: list[dict[str, float]] = []
    real = onnx_variants.time_alternating

    def spy(runs, rounds=2):
        measured.append(real(runs, rounds))
        return measured[-1]

    monkeypatch.setattr(onnx_variants, "time_alternating", spy)
    times = speed_probe.time_onnx(tiny.mmproj, 2, tmp_path)
    assert set(times) == {"onnx-fp32", "onnx-int8"} and all(t > 0 for t in times.values())
    fp32, int8 = measured
    assert set(int8) == {"u8s8", "nbits8", "u8u8"} and times["onnx-int8"] == min(int8.values())
    assert {p.name for p in tmp_path.glob("probe-int8-*.onnx")} == {f"probe-int8-{k}.onnx" for k in int8}
