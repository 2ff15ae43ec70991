"""Measure this machine's speed once, for the speed model, and keep the result.

:func:`rates` returns the :class:`~gguf_mcv.planning.speed.Rates` of this machine: from the
cache file ``<cache_dir>/speed-probe.json`` when it was written on the same machine
(same CPU model and flags, core count, llama-cpp-python and onnxruntime versions),
else by probing (a few seconds) and writing it. With ``probe=False`` or
``GGUF_MCV_NO_PROBE=1`` nothing is measured and :data:`~gguf_mcv.planning.speed.DEFAULT_RATES`
is used. A cache file that cannot be read or does not describe this machine is
probed again and replaced.

What is measured (:func:`measure`):

* memory bandwidth: numpy streaming reads (a dot product of two arrays far larger than
  the CPU caches) on every recommended thread at once;
* llama.cpp's own rates, on small models generated for the purpose
  (:mod:`gguf_mcv.testing.synthetic`, in a temporary folder, deleted after): for each weight
  type in :data:`PROBED_TYPES` a 2-layer, 1024-wide text model whose matrices are all of
  that type, timed on a ~140-token prompt and 32 greedy tokens (ggml's kernels differ by
  up to 3x per byte between types, and a file mixes several); two narrow models that
  time the fixed cost of a token and of a layer; and one 448-pixel slice through two
  SigLIP-400M-sized vision blocks (libmtmd's F16 matrices) and through one (ONNX Runtime
  fp32, and int8 in each kernel a conversion on this CPU class tries,
  ``gguf_mcv.vision.onnx_variants``: the fastest stands for the one it keeps). Those
  kernels run at rates numpy's BLAS says nothing about, so they are timed where they run.
  The text models' weights are random blocks of the type, written without llama.cpp's
  quantizer (which needs seconds per K-quant model).

Every timing is wall time (:func:`clock`): llama.cpp's worker threads sleep at their
barriers, so CPU seconds per thread undercount a multi-threaded step (with two threads
they gave rates 3-5x too high). A probe taken while other work holds the cores is
therefore pessimistic: ``gguf-mcv plan --reprobe`` measures again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from .. import environment
from ..cache_files import digest_of, read_json, write_manifest
from ..errors import ConfigError, EngineError, GgufMcvError
from ..hardware import cpu_identity, dist_version
from ..planning.speed import DEFAULT_RATES, Rates

logger = logging.getLogger(__name__)

#: Bumped when what is measured changes: older cache files are then probed again.
PROBE_VERSION = 3
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
    ``<cache_dir>/speed-probe.json``); ``measure_fn`` replaces :func:`measure_in_child` (tests).
    A probe that fails (no room for its model, llama.cpp refusing it) gives the defaults,
    with the failure in ``source``, and is tried again next time. ``refresh`` probes
    again whatever the cache holds (a probe taken while other work held the cores is
    pessimistic: threads that wait for each other spin).
    """
    if probe is None:
        probe = not environment.no_probe()
    if not probe:
        return DEFAULT_RATES
    if threads is None:
        from ..hardware import probe as hardware_probe  # the machine layer, cheap

        threads = hardware_probe().recommended_threads
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 4096:
        raise ConfigError(f"threads must be a whole number from 1 to 4096, not {threads!r}.")
    path = cache or environment.cache_dir() / CACHE_NAME
    key = machine_key(threads)
    found = None if refresh else read_cache(path, key)
    if found is not None:
        return found
    try:
        measured = (measure_fn or measure_in_child)(threads)
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
        "cpu": cpu_identity(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "machine": platform.machine(),
        "llama_cpp_python": dist_version("llama_cpp_python"),
        "onnxruntime": dist_version("onnxruntime"),
    }


def read_cache(path: Path, key: dict[str, Any]) -> Rates | None:
    """The cached rates when ``path`` holds a valid probe for ``key``; None otherwise (with one
    warning when the file is there but damaged: it is probed again and replaced)."""
    try:
        data = read_json(path, MAX_CACHE_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # a folder, a FIFO (never read: it would block), huge, not JSON
        logger.warning("the speed probe's verdict %s is unusable (%s): probing again", path, exc)
        return None
    try:
        if not isinstance(data, dict) or data.get("key") != key:
            return None  # another machine's or build's: probed again, not damage
        if "digest" in data and data["digest"] != digest_of(data):  # files from before the digest have none
            raise ValueError("its content does not match its digest")
        values = data["rates"]
        if not isinstance(values, dict):
            raise TypeError("its rates are not a mapping")
        return Rates(**values)
    except (ValueError, TypeError, KeyError) as exc:
        # wrong fields or impossible values (ConfigError is a ValueError): measured again, never trusted
        logger.warning("the speed probe's verdict %s is unusable (%s: %s): probing again", path,
                       type(exc).__name__, exc)
        return None


def write_cache(path: Path, key: dict[str, Any], measured: Rates) -> None:
    """Write the probe atomically, with a digest of its content (:func:`cache_files.write_manifest`),
    so a reader or a concurrent prober never sees half a file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_manifest(path, {"key": key, "rates": measured.to_dict(), "written": time.time()})
    except OSError:
        pass  # a read-only cache folder costs a probe next time, nothing else


# --- measurements ----------------------------------------------------------------------


#: Seconds the probe's process may take before it counts as hung (it takes 5-10 s).
PROBE_TIMEOUT_S = 600.0


def measure_in_child(threads: int, timeout: float = PROBE_TIMEOUT_S) -> Rates:
    """:func:`measure` in a child process: a native kernel that crashes or hangs while it is
    timed kills the child, never the caller (an :class:`EngineError` says how it ended)."""
    from ..children import child_command, child_env, describe_exit

    command = child_command("gguf_mcv.runtime.speed_probe", str(threads))
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout, env=child_env(),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise EngineError(f"the speed probe's process ran past {timeout:.0f} s and was stopped") from None
    lines = done.stdout.decode("utf-8", errors="replace").strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.decode("utf-8", errors="replace").splitlines()[-3:]
        raise EngineError(f"the speed probe's process {describe_exit(done.returncode, tail)}")
    try:
        return Rates(**json.loads(lines[-1]))
    except (ValueError, TypeError) as exc:
        raise EngineError(f"the speed probe's process printed no rates ({exc})") from None


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
    """Bytes per second ``threads`` threads read together (numpy dot products, the median of
    ``repeats``; timed with :func:`clock` from the first thread's start to the last one's end,
    as the threads themselves see it: the main thread, one more than the cores, may be
    scheduled late)."""
    import numpy as np

    n = max(1, nbytes // 8)
    arrays = [(np.ones(n, np.float32), np.ones(n, np.float32)) for _ in range(max(1, threads))]
    rates = []
    for _ in range(repeats):
        barrier = threading.Barrier(len(arrays))
        spans: list[tuple[float, float]] = []

        def work(pair: tuple[Any, Any], start: threading.Barrier, spans: list[tuple[float, float]]) -> None:
            start.wait()
            began = clock()
            np.dot(pair[0], pair[1])
            spans.append((began, clock()))

        workers = [threading.Thread(target=work, args=(pair, barrier, spans)) for pair in arrays]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
        rates.append(len(arrays) * 2 * n * 4 / max(elapsed, 1e-6))
    return statistics.median(rates)


def clock() -> float:
    """The probe's clock: wall seconds (see the module's docstring for why not CPU time)."""
    return time.perf_counter()


def busy_seconds(threads: int) -> float:
    """Process CPU seconds per thread: only reported in the probe's ``source`` line, beside
    the wall time (the two far apart say the machine was busy, or the threads waited)."""
    return time.process_time() / max(1, threads)


def probe_spec() -> Any:
    """The generated models the probe times: 1024 wide with 2 layers (rows that are
    multiples of 256, as in every real MiniCPM-V, so every block type fits), a small
    vocabulary, and one SigLIP-400M-sized vision block."""
    from ..testing.synthetic import SyntheticSpec

    return SyntheticSpec(n_embd=1024, n_layer=2, n_head=16, n_head_kv=2, n_ff=2816, n_vocab=1024,
                         n_merges=32, v_embd=1152, v_layer=1, v_head=16, v_ff=4304,
                         name="gguf_mcv speed probe")


def overhead_spec(n_layer: int) -> Any:
    """A model so narrow that a token's time is llama.cpp's fixed cost: graph, sampling,
    the Python loop, and what each of its ``n_layer`` layers adds."""
    return replace(probe_spec(), n_embd=128, n_head=2, n_head_kv=1, n_ff=256, n_layer=n_layer,
                   v_embd=64, v_head=4, v_ff=128)


#: ggml weight types the probe times, one generated model each: every type llama.cpp's
#: quant mixes use (K-quants, and the legacy types it falls back to for rows that are not
#: multiples of 256), F16, and the i-quants third-party ladders add (IQ3_M and IQ3_XS are
#: mostly IQ3_S). Another type is predicted at Q4_K's rate.
PROBED_TYPES = ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16",
                "IQ3_S", "IQ4_XS")
#: Layer counts of the two overhead models: their difference gives the cost per layer.
OVERHEAD_LAYERS = (1, 9)
#: Greedy tokens timed per model (the first, which finishes the prompt, is not).
TIMED_TOKENS = 32
#: Vision blocks of the tower libmtmd is timed on.
LIBMTMD_BLOCKS = 2
#: Words of each type's prompt: about 140 tokens, one batch through the GEMM path.
PROMPT_WORDS = 50


def time_llama(threads: int, folder: Path | None = None, types: tuple[str, ...] = PROBED_TYPES) -> dict[str, Any]:
    """Seconds (:func:`clock`) llama.cpp takes on generated models.

    Returns ``slice_s`` (one 448-pixel slice through a :data:`LIBMTMD_BLOCKS`-block tower),
    ``onnx_slice_s`` (:func:`time_onnx`), ``overhead`` (``{n_layers: seconds per token}`` of
    the overhead models) and ``types``: per ggml type, a ~140-token prompt's ``prefill_s``, the median ``token_s`` of
    :data:`TIMED_TOKENS` greedy tokens, ``prefill_tokens``, ``n_past`` and the model's
    ``tensors`` (:func:`gguf_mcv.models.headers.tensor_list`). Every model is written in
    milliseconds (:func:`gguf_mcv.testing.synthetic.write_text_model` with ``weight_type``) into
    ``folder`` (default: a temporary folder, deleted after).
    """
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="gguf-mcv-probe-") as tmp:
            return time_llama(threads, Path(tmp), types)
    from ..testing.synthetic import write_mmproj, write_text_model
    from ..vision.mmproj_standin import write_standin

    folder.mkdir(parents=True, exist_ok=True)
    spec = probe_spec()
    mmproj = write_mmproj(folder / "probe-mmproj.gguf", spec)
    # libmtmd is timed on two blocks: with one, the patch embedding and the resampler are a
    # third of the slice, and would be charged at the blocks' rate (+37 % on a 27-block tower)
    tower = write_mmproj(folder / "probe-tower.gguf", replace(spec, v_layer=LIBMTMD_BLOCKS))
    standin = write_standin(mmproj, folder / "probe-standin.gguf")
    out: dict[str, Any] = {"types": {}, "overhead": {}}
    for t in types:
        path = write_text_model(folder / f"probe-{t}.gguf", spec, weight_type=t)
        with open_engine(path, tower if t == "Q4_K" else standin, threads) as engine:
            if t == "Q4_K":
                out["slice_s"] = _time_slice(engine, threads)
            out["types"][t] = {**_time_text(engine, threads, words=PROMPT_WORDS), "tensors": _tensors(path)}
    out["onnx_slice_s"] = time_onnx(mmproj, threads, folder)
    tiny = overhead_spec(1)
    tiny_standin = write_standin(write_mmproj(folder / "overhead-mmproj.gguf", tiny), folder / "overhead-standin.gguf")
    for n_layer in OVERHEAD_LAYERS:
        path = write_text_model(folder / f"overhead-{n_layer}.gguf", overhead_spec(n_layer), weight_type="F16")
        with open_engine(path, tiny_standin, threads) as engine:
            out["overhead"][n_layer] = _time_text(engine, threads, words=10)["token_s"]
    return out


def time_onnx(mmproj: Path, threads: int, folder: Path) -> dict[str, float]:
    """Seconds ONNX Runtime takes for one 448-pixel slice through ``mmproj``'s tower (the
    faster of two, after a small one has warmed the session up), per variant (``{"onnx-fp32": s,
    "onnx-int8": s}``); int8's is the fastest of the kernels a conversion on this CPU class tries
    (``onnx_variants.candidates``, timed in turn A B A B), as the conversion keeps the fastest
    that passes its check. Empty when onnxruntime or onnx cannot be imported (then the libmtmd
    rate stands in)."""
    try:
        import onnx

        from ..vision.onnx_graph import Weights, build_model
        from ..vision.onnx_vision import OnnxEncoder
    except ImportError:
        return {}
    import numpy as np

    from ..vision import onnx_variants
    from .native_check import vision_safe

    weights = Weights(mmproj)
    projector = weights.projector()
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((3, projector.image_size, projector.image_size), np.float32)
    kernels = {"fp32": ("u8s8",), "int8": onnx_variants.candidates(onnx_variants.cpu_class())}
    times = {}
    for variant in ("fp32", "int8"):
        if not vision_safe(f"onnx-{variant}"):
            continue  # its kernels crash here: the loader will not use it either
        runs = {}
        for kernel in kernels[variant]:
            path = folder / f"probe-{variant}-{kernel}.onnx"
            model, _ = build_model(weights, fold=True, int8=variant == "int8", kernel=kernel)
            onnx.save_model(model, str(path))
            encoder = OnnxEncoder(path, projector, n_threads=threads)
            encoder.encode_pixels(rng.standard_normal((3, 112, 112), np.float32))  # warm-up
            runs[kernel] = functools.partial(_slice_seconds, encoder, pixels)
        # the faster of two each, as for libmtmd
        times[f"onnx-{variant}"] = min(onnx_variants.time_alternating(runs, 2).values())
    return times


def _slice_seconds(encoder: Any, pixels: Any) -> float:
    start = clock()
    encoder.encode_pixels(pixels)
    return clock() - start


@contextlib.contextmanager
def open_engine(path: Path, mmproj: Path, threads: int) -> Iterator[Any]:
    """An :class:`~gguf_mcv.runtime.engine.Engine` for ``path`` and ``mmproj`` as the probe measures it
    (the native check's kernels, ``threads`` threads), closed on exit."""
    from .engine import Engine
    from .llama_load import open_llama
    from .native_check import decide, weight_types

    extra = decide(weight_types(path), what="the speed probe's model").extra_bufts
    llama = open_llama(path, extra_bufts=extra, n_ctx=1024, n_batch=512, n_ubatch=512,
                       n_threads=threads, n_threads_batch=threads, verbose=False)
    try:
        engine = Engine(llama, mmproj, n_threads=threads, slice_size=probe_spec().image_size)
        try:
            yield engine
        finally:
            engine.close()
    finally:
        llama.close()


def _tensors(path: Path) -> list[tuple[str, str, int]]:
    from ..models.headers import read_tensors, tensor_list

    return tensor_list(read_tensors(path))


def _time_slice(engine: Any, threads: int) -> float:
    """The faster of two 448-pixel slices through the encoder, after a small image has
    warmed it up (two threads on two cores make single timings wander by a third)."""
    import numpy as np

    from ..vision.media import Image

    rng = np.random.default_rng(0)
    times = []
    for i, side in enumerate((56, 448, 448)):
        image = Image(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), f"probe{i}")
        with engine.tokenize(f"{engine.marker}\n", [image]) as prompt:
            start = clock()
            stats = engine.prefill(prompt)
            times.append((clock() - start) / max(1, stats.slices_encoded))
        engine.reset()
    return min(times[1:])


def _time_text(engine: Any, threads: int, tokens: int = TIMED_TOKENS, words: int = 100) -> dict[str, float]:
    """A prompt of ``words`` words (100: about 280 tokens), then the median time of
    ``tokens`` greedy tokens (the first one, which ends the prompt's evaluation, not timed)."""
    from ..options import GenerationOptions, Sampling

    text = " ".join(f"w{i % 50}" for i in range(words))
    with engine.tokenize(text) as prompt:
        start = clock()
        engine.prefill(prompt)
        out = {"prefill_s": clock() - start, "prefill_tokens": float(prompt.n_pos)}
    steps = engine.generate(GenerationOptions(Sampling(temperature=0.0), tokens + 1))
    next(steps)
    times = []
    while True:
        start = clock()
        try:
            next(steps)
        except StopIteration:
            break
        times.append(clock() - start)
    out["token_s"] = statistics.median(times) if times else float("nan")
    out["n_past"] = out["prefill_tokens"] + 1 + len(times) / 2
    return out


def rates_from(bandwidth: float, timed: dict[str, Any], threads: int, source: str) -> Rates:
    """:class:`Rates` from the bandwidth and :func:`time_llama`'s timings.

    The overhead models give the fixed cost per token and per layer; each type's model,
    less that cost and its KV cache at the bandwidth, gives the type's decode rate; its
    prompt gives the type's prompt rate. Q4_K's rates stand in for types not timed.
    """
    from ..models.shapes import TextShape, VisionShape
    from ..planning.speed import attention_flops, type_bits, vision_flops_per_slice, weight_profile

    spec = probe_spec()
    text = TextShape(n_layers=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head,
                     n_head_kv=spec.n_head_kv, head_dim=spec.head_size, n_vocab=spec.n_vocab,
                     n_ff=spec.n_ff)
    vision = VisionShape(width=spec.v_embd, blocks=spec.v_layer, heads=spec.v_head, ff=spec.v_ff)
    (few, few_s), (many, many_s) = sorted((int(k), float(v)) for k, v in timed["overhead"].items())
    layer_s = max(0.0, (many_s - few_s) / (many - few))
    token_s = max(0.0, few_s - layer_s * few)
    matvec: dict[str, float] = {}
    prefill: dict[str, float] = {}
    for t, m in timed["types"].items():
        profile = weight_profile(0, text, None, [tuple(x) for x in m["tensors"]])
        read = profile.per_token().get(t, 0)
        kv = text.kv_bytes_per_token() * m["n_past"] / bandwidth
        # a noisy overhead reading must not leave the weights no time at all
        weights_s = max(m["token_s"] - token_s - layer_s * spec.n_layer - kv, 0.25 * m["token_s"])
        matvec[t] = read / weights_s
        n = m["prefill_tokens"]
        params = sum(b * 8 / type_bits(typ) for typ, b in profile.layers.items())
        out_params = sum(b * 8 / type_bits(typ) for typ, b in profile.output.items())
        flops = 2 * n * params + 2 * out_params + n * attention_flops(text, int(n // 2))
        prefill[t] = flops / m["prefill_s"]
    generic = "Q4_K" if "Q4_K" in matvec else next(iter(matvec))
    return Rates(
        bandwidth=bandwidth, matvec=matvec[generic], prefill_flops=prefill[generic],
        vision_flops=vision_flops_per_slice(replace(vision, blocks=LIBMTMD_BLOCKS), spec.n_embd) / timed["slice_s"],
        threads=threads, source=source, matvec_by_type=matvec, prefill_by_type=prefill,
        vision_by_backend=_onnx_rates(timed.get("onnx_slice_s") or {}, vision, spec.n_embd),
        token_overhead_s=min(token_s, 0.5), layer_overhead_s=min(layer_s, 0.5),
    )


def _onnx_rates(seconds: dict[str, float], vision: Any, text_width: int) -> dict[str, float]:
    """FLOP/s per ONNX variant: fp32 over the whole slice; int8 over the blocks only, after
    taking out the rest (patch embedding, projector) at fp32's rate -- as
    :func:`gguf_mcv.planning.speed.encode_seconds` predicts it."""
    from ..planning.speed import vision_flops_parts

    if "onnx-fp32" not in seconds:
        return {}
    blocks, rest = vision_flops_parts(vision, text_width)
    fp32 = (blocks + rest) / seconds["onnx-fp32"]
    out = {"onnx-fp32": fp32}
    if "onnx-int8" in seconds:
        # a noisy reading must not leave the blocks no time at all
        out["onnx-int8"] = blocks / max(seconds["onnx-int8"] - rest / fp32, 0.25 * seconds["onnx-int8"])
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m gguf_mcv.runtime.speed_probe THREADS``: probe, print the rates as one JSON line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit() or int(args[0]) < 1:
        print("usage: python -m gguf_mcv.runtime.speed_probe THREADS", file=sys.stderr)
        return 2
    from .native_check import inject_fault

    inject_fault("speed-probe")
    print(json.dumps(measure(int(args[0])).to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
