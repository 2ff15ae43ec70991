"""Measure this machine's speed once, for the speed model, and keep the result.

:func:`rates` returns the :class:`~gguf_mcv.speed.Rates` of this machine: from the
cache file ``<cache_dir>/speed-probe.json`` when it was written on the same machine
(same CPU model and flags, core count, llama-cpp-python and onnxruntime versions),
else by probing (a few seconds) and writing it. With ``probe=False`` or
``GGUF_MCV_NO_PROBE=1`` nothing is measured and :data:`~gguf_mcv.speed.DEFAULT_RATES`
is used. A cache file that cannot be read or does not describe this machine is
probed again and replaced.

What is measured (:func:`measure`):

* memory bandwidth: numpy streaming reads (a dot product of two arrays far larger than
  the CPU caches) on every recommended thread at once;
* llama.cpp's own rates, on a small model pair generated for the purpose
  (:mod:`gguf_mcv.synthetic`, in a temporary folder, deleted after): one 448-pixel slice
  through one SigLIP-400M-sized vision block (libmtmd's F16 matrices), a 280-token prompt
  and 32 decoded tokens through a 2-layer, 1024-wide Q4_K_M text model. Those kernels
  (ggml's quantized dot products, its F16 conversions) run at rates numpy's BLAS says
  nothing about, so they are timed where they run.

Every timing is busy time (:func:`busy_seconds`): CPU seconds per thread, which on an
idle machine is the wall clock and on a shared one leaves out other processes' turns.
"""

from __future__ import annotations

import json
import os
import platform
import stat
import tempfile
import threading
import time
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from . import constants
from .errors import ConfigError, GgufMcvError
from .speed import DEFAULT_RATES, Rates

#: Bumped when what is measured changes: older cache files are then probed again.
PROBE_VERSION = 1
CACHE_NAME = "speed-probe.json"
#: Bytes each thread streams through per bandwidth pass: far beyond any CPU cache.
BANDWIDTH_BYTES = 128 * 2**20
#: A cache file larger than this is not ours (ours is under 2 KB): it is probed again.
MAX_CACHE_BYTES = 64 * 1024


def rates(*, probe: bool | None = None, threads: int | None = None, cache: Path | None = None,
          measure_fn: Callable[[int], Rates] | None = None, refresh: bool = False) -> Rates:
    """This machine's :class:`Rates`: cached, probed (and cached), or the defaults.

    ``probe=None`` probes unless ``GGUF_MCV_NO_PROBE`` is set; ``threads`` defaults to
    the hardware's recommended threads; ``cache`` is the cache file (default
    ``<cache_dir>/speed-probe.json``); ``measure_fn`` replaces :func:`measure` (tests).
    A probe that fails (no room for its model, llama.cpp refusing it) gives the defaults,
    with the failure in ``source``, and is tried again next time. ``refresh`` probes
    again whatever the cache holds (a probe taken while other work held the cores is
    pessimistic: threads that wait for each other spin).
    """
    if probe is None:
        probe = not constants.no_probe()
    if not probe:
        return DEFAULT_RATES
    if threads is None:
        from .hardware import probe as hardware_probe  # the machine layer, cheap

        threads = hardware_probe().recommended_threads
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 4096:
        raise ConfigError(f"threads must be a whole number from 1 to 4096, not {threads!r}.")
    path = cache or constants.cache_dir() / CACHE_NAME
    key = machine_key(threads)
    found = None if refresh else read_cache(path, key)
    if found is not None:
        return found
    try:
        measured = (measure_fn or measure)(threads)
    except (GgufMcvError, OSError, MemoryError) as exc:
        # the plan still works; its table names where the rates came from, and the next
        # call probes again (nothing is cached)
        return replace(DEFAULT_RATES, source=f"defaults (the speed probe failed: {exc})")
    write_cache(path, key, measured)
    return measured


def machine_key(threads: int) -> dict[str, Any]:
    """What must be unchanged for a cached probe to hold: CPU, cores, threads, builds."""
    return {
        "probe_version": PROBE_VERSION,
        "cpu": _cpu_identity(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "machine": platform.machine(),
        "llama_cpp_python": _version("llama_cpp_python"),
        "onnxruntime": _version("onnxruntime"),
    }


def read_cache(path: Path, key: dict[str, Any]) -> Rates | None:
    """The cached rates when ``path`` holds a valid probe for ``key``; None otherwise."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_CACHE_BYTES:
            return None  # a folder, a FIFO (reading it would block) or something huge
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("key") != key:
            return None
        values = data["rates"]
        if not isinstance(values, dict):
            return None
        return Rates(**values)
    except (OSError, ValueError, TypeError, KeyError):
        # unreadable, not JSON, wrong fields or impossible values (ConfigError is a
        # ValueError): a damaged cache is measured again, never trusted
        return None


def write_cache(path: Path, key: dict[str, Any], measured: Rates) -> None:
    """Write the probe atomically (a temporary file renamed over the old one), so a
    reader or a concurrent prober never sees half a file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".speed-probe.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"key": key, "rates": measured.to_dict(), "written": time.time()}, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only cache folder costs a probe next time, nothing else


# --- measurements ----------------------------------------------------------------------


def measure(threads: int) -> Rates:
    """Probe this machine now (a few seconds): bandwidth with numpy, the rest with llama.cpp."""
    start, busy = time.perf_counter(), busy_seconds(threads)
    bandwidth = measure_bandwidth(threads)
    timed = time_llama(threads)
    load = f", load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs" if hasattr(os, "getloadavg") else ""
    return rates_from(bandwidth, timed, threads, f"the probe of {time.strftime('%Y-%m-%d')} "
                      f"({time.perf_counter() - start:.1f} s wall, {busy_seconds(threads) - busy:.1f} s "
                      f"busy, {threads} threads{load})")


def measure_bandwidth(threads: int, nbytes: int = BANDWIDTH_BYTES, repeats: int = 3) -> float:
    """Bytes per second ``threads`` threads read together (numpy dot products, best of
    ``repeats``; timed in :func:`busy_seconds`)."""
    import numpy as np

    n = max(1, nbytes // 8)
    arrays = [(np.ones(n, np.float32), np.ones(n, np.float32)) for _ in range(max(1, threads))]
    best = 0.0
    for _ in range(repeats):
        barrier = threading.Barrier(len(arrays) + 1)

        def work(pair: tuple[Any, Any], start: threading.Barrier) -> None:
            start.wait()
            np.dot(pair[0], pair[1])

        workers = [threading.Thread(target=work, args=(pair, barrier)) for pair in arrays]
        for w in workers:
            w.start()
        barrier.wait()
        t0 = busy_seconds(len(arrays))
        for w in workers:
            w.join()
        elapsed = busy_seconds(len(arrays)) - t0
        best = max(best, len(arrays) * 2 * n * 4 / max(elapsed, 1e-6))
    return best


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (``/proc/cpuinfo``), else what platform says."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"{platform.processor()} {platform.machine()}"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("model name", "flags", "Features", "CPU part", "Hardware"):
            fields.setdefault(name.strip(), value.strip())
    return " | ".join(f"{k}={v}" for k, v in sorted(fields.items())) or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def busy_seconds(threads: int) -> float:
    """Process CPU seconds per thread: the clock every probe timing uses.

    On an idle machine it runs with the wall clock (every thread busy); on a shared one
    it leaves out the time other processes held the cores, so a probe taken while
    something else ran still describes the machine, not that moment.
    """
    return time.process_time() / max(1, threads)


def probe_spec() -> Any:
    """The generated model pair the probe times: a 1024-wide, 2-layer Q4_K_M text model (rows
    that are multiples of 256, as in every real MiniCPM-V, so the K-quant types are used) with
    a small vocabulary, and one SigLIP-400M-sized vision block."""
    from .synthetic import SyntheticSpec

    return SyntheticSpec(n_embd=1024, n_layer=2, n_head=16, n_head_kv=2, n_ff=2816, n_vocab=1024,
                         n_merges=240, v_embd=1152, v_layer=1, v_head=16, v_ff=4304,
                         name="gguf_mcv speed probe")


def time_llama(threads: int, folder: Path | None = None) -> dict[str, float]:
    """Busy seconds (:func:`busy_seconds`) llama.cpp takes, on the probe pair, for one
    448-pixel slice, a 280-token prompt and each of 32 decoded tokens.

    The pair is generated into ``folder`` (default: a temporary folder, deleted after).
    """
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="gguf-mcv-probe-") as tmp:
            return time_llama(threads, Path(tmp))
    import llama_cpp  # lazy: llama.cpp's native library

    from .engine import Engine
    from .synthetic import build

    built = build(folder, probe_spec(), ["Q4_K_M"])
    llama = llama_cpp.Llama(model_path=str(built.quants["Q4_K_M"]), n_ctx=2048, n_batch=512,
                            n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    engine = Engine(llama, built.mmproj, n_threads=threads)
    try:
        out = {"slice_s": _time_slice(engine, threads)}
        out.update(_time_text(engine, threads))
        return out
    finally:
        engine.close()
        llama.close()


def _time_slice(engine: Any, threads: int) -> float:
    """One 448-pixel slice through the encoder, after a small image has warmed it up."""
    import numpy as np

    from .media import Image

    rng = np.random.default_rng(0)
    seconds = 0.0
    for side in (56, 448):
        image = Image(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), f"probe{side}")
        with engine.tokenize(f"{engine.marker}\n", [image]) as prompt:
            start = busy_seconds(threads)
            stats = engine.prefill(prompt)
            seconds = (busy_seconds(threads) - start) / max(1, stats.slices_encoded)
        engine.reset()
    return seconds


def _time_text(engine: Any, threads: int) -> dict[str, float]:
    """A text prompt's prefill, then 32 greedy tokens (the first one not timed)."""
    from .options import Sampling

    words = " ".join(f"w{i % 50}" for i in range(100))
    with engine.tokenize(words) as prompt:
        start = busy_seconds(threads)
        engine.prefill(prompt)
        out = {"prefill_s": busy_seconds(threads) - start, "prefill_tokens": float(prompt.n_pos)}
    steps = engine.generate(Sampling(temperature=0.0), 33)
    next(steps)
    start, n = busy_seconds(threads), 0
    for _ in steps:
        n += 1
    out["token_s"] = (busy_seconds(threads) - start) / max(1, n)
    out["n_past"] = out["prefill_tokens"] + 1 + n / 2
    return out


def rates_from(bandwidth: float, timed: dict[str, float], threads: int, source: str) -> Rates:
    """:class:`Rates` from the bandwidth and :func:`time_llama`'s timings of the probe pair.

    Everything one probe token costs is put on its weights (``matvec``): llama.cpp's
    per-token work grows with the layers, as the weights do.
    """
    from .shapes import TextShape, VisionShape
    from .speed import attention_flops, decode_bytes, text_flops_per_token, vision_flops_per_slice

    spec = probe_spec()
    text = TextShape(n_layers=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head,
                     n_head_kv=spec.n_head_kv, head_dim=spec.head_size, n_vocab=spec.n_vocab,
                     n_ff=spec.n_ff)
    vision = VisionShape(width=spec.v_embd, blocks=spec.v_layer, heads=spec.v_head, ff=spec.v_ff)
    n = timed["prefill_tokens"]
    size = _q4_k_m_bytes(text)
    kv = text.kv_bytes_per_token() * timed["n_past"]
    return Rates(
        bandwidth=bandwidth,
        matvec=(decode_bytes(size, text, "Q4_K_M") + kv) / timed["token_s"],
        prefill_flops=(n * text_flops_per_token(text) + n * attention_flops(text, int(n // 2)))
        / timed["prefill_s"],
        vision_flops=vision_flops_per_slice(vision, spec.n_embd) / timed["slice_s"],
        threads=threads, source=source,
    )


def _q4_k_m_bytes(text: Any) -> int:
    """The probe's Q4_K_M text file, but for its header: layers at Q4_K_M's mix plus embeddings."""
    from .memory import GGML_TYPE_BITS, QUANT_TYPE_MIX, embedding_bytes

    bits = sum(share * GGML_TYPE_BITS[t] for t, share in QUANT_TYPE_MIX["Q4_K_M"].items())
    token_embd, output = embedding_bytes(text, "Q4_K_M")
    layer_params = text_params_per_layer(text)
    return int(layer_params * text.n_layers * bits / 8) + token_embd + output


def text_params_per_layer(text: Any) -> int:
    """Weights of one attention + FFN layer (the matrices; norms and biases are noise)."""
    q, kv = text.n_head * text.head_dim, text.n_head_kv * text.head_dim
    return text.n_embd * (2 * q + 2 * kv) + 3 * text.n_embd * text.ff
