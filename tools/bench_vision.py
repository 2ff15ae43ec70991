#!/usr/bin/env python3
"""Vision encoder backends: per-slice time, one-time conversion, fidelity and peak RSS.

On a generated model (``tools/make_test_model.py --preset bench``: the real SigLIP-400M
tower, 1152 wide, 27 blocks), each backend in a fresh process of its own:

* ``convert``: the ONNX conversion (fp32 graph, int8 quantization, self-validation) into an
  empty cache folder, timed;
* ``llama.cpp`` (libmtmd, the F16 mmproj as it is), ``llama.cpp-bf16`` (libmtmd with the
  BF16 copy of ``gguf_mcv.vision.mmproj_bf16``, made during its load: ``load_s`` includes it),
  ``onnx-fp32`` and ``onnx-int8``: one
  ``detail="low"`` question per fresh random image (one 448-px slice each), ``--runs`` times
  after one warm-up image; the median ``reply.timings.encode_ms``; the embeddings of a fixed
  image for the cosine against libmtmd's; peak RSS (``VmHWM``) of the process.

    python tools/bench_vision.py --ladder /tmp/bench-onnx --threads 2 --runs 3

``--first-run`` instead runs ``onnx-int8`` twice in fresh processes sharing an empty cache
folder: the first converts during its load (a user's first question), the second loads the
conversion from the cache; each one's peak RSS, load time and encode times, the int8 vs fp32
cosine and the converted files' sizes.

    python tools/bench_vision.py --ladder /tmp/bench-onnx --quant Q4_0 --first-run

``--variants`` times the int8 graph's candidates in one process, one alternating run (A B A B,
``--runs`` rounds, one fresh random 448-px slice per round, the same for every candidate): each
int8 kernel (``gguf_mcv.vision.onnx_variants``) with the loader's session options, and u8s8
with other session options (spinning on; basic graph optimizations only); the median of each,
its ratio to libmtmd's F16 slice and its cosine to u8s8. libmtmd takes its turn in every round
too (a fresh process: a warm-up image, then one timed slice), so the ratios come from one
alternating run.

    python tools/bench_vision.py --ladder /tmp/bench-onnx --variants --runs 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench import fresh, memory, options, record

BACKENDS = ("llama.cpp", "llama.cpp-bf16", "onnx-fp32", "onnx-int8")


def worker(name: str, ladder: str, quant: str, threads: int, runs: int, embeddings: str) -> dict[str, Any]:
    """One backend, or the conversion (``name`` "convert"), in this process (run in a fresh one)."""
    folder = Path(ladder)
    mmproj = folder / "mmproj-model-f16.gguf"
    if name == "convert":
        from gguf_mcv.runtime.engine import file_identity
        from gguf_mcv.vision.onnx_vision import prepare

        start = time.perf_counter()
        converted = prepare(mmproj, file_identity(mmproj))
        return {"convert_s": time.perf_counter() - start, "int8_cosine": converted.int8_cosine,
                "peak_rss": memory.own_peak()}
    import gguf_mcv
    from gguf_mcv.vision.embed_cache import EmbeddingCache

    tree = memory.TreeSampler(os.getpid(), 0.02, pss=True)  # what a memory cgroup counts
    cache = EmbeddingCache()
    start = time.perf_counter()
    backend = name.removesuffix("-bf16")
    precision = "bf16" if name.endswith("-bf16") else "as-is" if backend == "llama.cpp" else "auto"
    model = gguf_mcv.load(model_path=folder / f"ggml-model-{quant}.gguf", mmproj_path=mmproj, n_ctx=2048,
                          n_threads=threads, vision_backend=backend, mmproj_precision=precision,
                          embed_cache=cache)
    load_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    fixed = rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)
    model.ask("x", fixed, max_tokens=1, detail="low")  # warm-up, and the fixed image's embeddings
    (key,) = cache.keys()
    np.save(embeddings, cache.get(key))
    times = []
    for _ in range(runs):
        reply = model.ask("x", rng.integers(0, 256, (448, 448, 3), dtype=np.uint8), max_tokens=1, detail="low")
        times.append(reply.timings.encode_ms)
    info = model.info
    model.close()
    import resource  # the largest child's peak: the converting child's on a first run

    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"backend": info.vision_backend, "reason": info.vision_backend_reason, "load_s": load_s,
            "encode_ms": times, "median_ms": statistics.median(times), "peak_rss": memory.own_peak(),
            "children_peak_rss": children, "tree_peak_rss": _stopped(tree)}


def _stopped(sampler: memory.TreeSampler) -> int:
    sampler.stop()
    return sampler.peak


def run(name: str, args: argparse.Namespace, env: dict, embeddings: Path) -> dict:
    """:func:`worker` in a fresh process, with ``env``'s variables."""
    return fresh.call("bench_vision:worker", {
        "name": name, "ladder": str(args.ladder), "quant": args.quant, "threads": args.threads, "runs": args.runs,
        "embeddings": str(embeddings)}, env=env, timeout=3600).checked()


def first_run(args: argparse.Namespace) -> None:
    """onnx-int8 with an empty cache (the conversion in its load), then from the cache."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GGUF_MCV_CACHE": tmp}
        runs = {name: run("onnx-int8", args, env, Path(tmp) / f"{name}.npy") for name in ("first", "cached")}
        manifest = next((Path(tmp) / "onnx").glob("*.json"))
        saved = json.loads(manifest.read_text())
    for name, r in runs.items():
        print(f"{name}: peak RSS {r['peak_rss'] / 2**20:.0f} MiB (largest child "
              f"{r['children_peak_rss'] / 2**20:.0f} MiB, process and children together "
              f"{r['tree_peak_rss'] / 2**20:.0f} MiB), load {r['load_s']:.1f} s, "
              f"{r['median_ms']:.0f} ms per slice {r['encode_ms']}; {r['reason']}")
    sizes = {name: size for name, (size, _) in saved["files"].items()}
    print(f"int8 vs fp32 cosine {saved['int8_cosine']:.5f}; files: " +
          ", ".join(f"{name.split('-')[-1]} {size / 2**20:.1f} MiB" for name, size in sorted(sizes.items())))
    found = {"runs": runs, "files": sizes, "int8_cosine": saved["int8_cosine"]}
    print(json.dumps(found))
    record.write(args.json, "bench_vision --first-run", found, args)


def variants(args: argparse.Namespace) -> None:
    """The int8 candidates side by side (see the module's docstring)."""
    import onnx
    import onnxruntime as ort

    from gguf_mcv.vision.onnx_graph import INT8_KERNELS, Weights, build_model, graph_inputs
    from gguf_mcv.vision.onnx_variants import cpu_class
    from gguf_mcv.vision.onnx_vision import int8_scope, token_cosines

    one_slice = argparse.Namespace(**{**vars(args), "runs": 1})
    with tempfile.TemporaryDirectory() as tmp:
        weights = Weights(Path(args.ladder) / "mmproj-model-f16.gguf")
        p = weights.projector()
        sessions = {}
        for kernel in INT8_KERNELS:
            path = Path(tmp) / f"int8-{kernel}.onnx"
            model, _ = build_model(weights, fold=True, int8=True, int8_scope=int8_scope(p.projector_type),
                                   kernel=kernel, external=path.with_name(path.name + ".data"))
            onnx.save_model(model, str(path))
            del model
            settings = {kernel: {}} if kernel != "u8s8" else {
                "u8s8": {}, "u8s8 spinning": {"spin": "1"}, "u8s8 basic-opt": {"level": "basic"}}
            for name, opt in settings.items():
                so = ort.SessionOptions()
                so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if opt.get("level")
                                               else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
                so.intra_op_num_threads, so.inter_op_num_threads = args.threads, 1
                so.add_session_config_entry("session.intra_op.allow_spinning", opt.get("spin", "0"))
                sessions[name] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        side = p.image_size // p.patch_size
        rng = np.random.default_rng(0)
        times: dict[str, list[float]] = {"libmtmd F16": [], **{name: [] for name in sessions}}
        outs: dict[str, np.ndarray] = {}
        for name, session in sessions.items():  # warm-up, and each one's embeddings of one slice
            feeds = {"pixels": rng.standard_normal((1, 3, p.image_size, p.image_size), np.float32).clip(-1, 1),
                     **graph_inputs(p, side, side)}
            outs[name] = session.run(["embeddings"], {**feeds, "pixels": np.zeros_like(feeds["pixels"]) + 0.1})[0]
        for _ in range(args.runs):
            libmtmd = run("llama.cpp", one_slice, {"GGUF_MCV_CACHE": tmp}, Path(tmp) / "ref.npy")
            times["libmtmd F16"].append(libmtmd["median_ms"] / 1000)
            feeds = {"pixels": rng.uniform(-1, 1, (1, 3, p.image_size, p.image_size)).astype(np.float32),
                     **graph_inputs(p, side, side)}
            for name, session in sessions.items():
                start = time.perf_counter()
                session.run(["embeddings"], feeds)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["libmtmd F16"])
    print(f"CPU class {cpu_class()}, {args.threads} threads, libmtmd F16 {base:.3f} s per slice (median)")
    print("\n| int8 variant | s per 448-px slice (median) | vs libmtmd F16 | cosine vs u8s8 |")
    print("| --- | ---: | ---: | ---: |")
    for name, ts in times.items():
        if name not in outs:
            continue
        cos = float(token_cosines(outs["u8s8"][0], outs[name][0]).mean())
        print(f"| {name} | {statistics.median(ts):.3f} | {statistics.median(ts) / base:.2f}x | {cos:.5f} |")
    found = {"cpu_class": cpu_class(), "libmtmd_s": base, "times": times}
    print(json.dumps(found))
    record.write(args.json, "bench_vision --variants", found, args)


def main() -> None:
    ap = options.parser(__doc__, ladder=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of "
                    f"{', '.join(BACKENDS)} (llama.cpp is always run: the reference)")
    ap.add_argument("--first-run", action="store_true", help="onnx-int8 converting, then from the cache")
    ap.add_argument("--variants", action="store_true", help="the int8 kernels and session options, A B A B")
    args = ap.parse_args()
    if args.variants:
        variants(args)
        return
    if args.first_run:
        first_run(args)
        return
    from gguf_mcv.vision.onnx_vision import token_cosines

    backends = ["llama.cpp"] + [b for b in BACKENDS[1:] if b in args.backends.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GGUF_MCV_CACHE": tmp}
        results = {}
        if any(b.startswith("onnx") for b in backends):
            results["convert"] = run("convert", args, env, Path(tmp) / "none.npy")
            print(f"conversion: {results['convert']['convert_s']:.1f} s, int8 vs fp32 cosine "
                  f"{results['convert']['int8_cosine']:.5f}, peak RSS "
                  f"{results['convert']['peak_rss'] / 2**20:.0f} MiB", flush=True)
        embeddings = {}
        for name in backends:
            path = Path(tmp) / f"{name}.npy"
            results[name] = run(name, args, env, path)
            embeddings[name] = np.load(path)
            print(f"{name}: {results[name]['median_ms']:.0f} ms per slice {results[name]['encode_ms']}, "
                  f"peak RSS {results[name]['peak_rss'] / 2**20:.0f} MiB, load {results[name]['load_s']:.1f} s",
                  flush=True)
    ref = embeddings["llama.cpp"].reshape(64, -1)
    base = results["llama.cpp"]["median_ms"]
    print("\n| backend | ms per 448-px slice | vs llama.cpp | per-token cosine vs libmtmd (min / mean) | peak RSS |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in backends:
        cos = token_cosines(ref, embeddings[name].reshape(64, -1))
        r = results[name]
        print(f"| {name} | {r['median_ms']:.0f} | {r['median_ms'] / base:.2f}x | {cos.min():.5f} / {cos.mean():.5f} "
              f"| {r['peak_rss'] / 2**20:.0f} MiB |")
    print(json.dumps(results))
    record.write(args.json, "bench_vision", results, args)


if __name__ == "__main__":
    main()
