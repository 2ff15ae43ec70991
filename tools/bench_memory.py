"""Calibrate and check the memory model: predicted vs measured peak RSS.

For each quant of a ladder (``synthetic.build`` output: ``ggml-model-<QUANT>.gguf`` +
``mmproj-model-f16.gguf``), each ``n_ctx`` and each vision backend (``--backends``: libmtmd,
ONNX Runtime int8 and fp32; the ONNX graphs are converted first, in this process, so a child
only loads them), a fresh Python process loads the pair with :func:`gguf_mcv.load`, asks one
question about a 1344x1344 image at full detail
(10 slices: 9 + overview = 640 image tokens) and reports its peak RSS: ``VmHWM``, the
same high-water mark as ``getrusage().ru_maxrss`` (file-backed pages included, so
llama.cpp's memory-mapped weights count) but without the parent's own peak, which Linux
carries into a child's ``ru_maxrss`` across fork+exec. The parent prints predicted vs
measured as Markdown::

    python tools/bench_memory.py                        # /tmp/bench (built if missing) + tiny
    python tools/bench_memory.py --ladder /tmp/bench --ctx 2048 8192 --quants Q4_0 Q8_0
    python tools/bench_memory.py --no-bench --ctx 4096 --quants Q4_K_M --backends onnx-int8 onnx-fp32
    python tools/bench_memory.py --json out.json        # every measurement, for --reuse
    python tools/bench_memory.py --reuse out.json       # re-predict without re-measuring

One bench-size run takes 2-7 minutes on 2 cores (10 slices of SigLIP-400M on the CPU);
``--detail low`` (one slice) is for iterating, not for the record.

Target: every prediction within 10 % of the measurement, none under by more than 5 %.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import fresh, images, memory, models, options, record

IMAGE_SIDE = 1344  # 3x3 slices of 448 + overview at full detail
QUESTION = "Describe this image in detail."

# llama.cpp log lines worth keeping (buffer sizes in MiB), parsed in the child
_LOG_SIZES = {
    "mapped": re.compile(r"CPU_Mapped model buffer size =\s*([\d.]+) MiB"),
    "repack": re.compile(r"CPU_REPACK model buffer size =\s*([\d.]+) MiB"),
    "kv": re.compile(r"CPU KV buffer size =\s*([\d.]+) MiB"),
    "text_compute": re.compile(r"sched_reserve:\s+CPU compute buffer size =\s*([\d.]+) MiB"),
    "vision_compute": re.compile(r"reserve_compute_meta:\s+CPU compute buffer size =\s*([\d.]+) MiB"),
}


# --- child: one measurement in a fresh process -----------------------------------------


def one_run(model: str, mmproj: str, image: str, n_ctx: int = 4096, kv_type: str = "f16", detail: str = "high",
            max_tokens: int = 4, backend: str = "llama.cpp") -> dict[str, Any]:
    """Load, ask one question: the peak RSS and what llama.cpp logged (run in a fresh process)."""
    import logging
    import resource

    log_lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log_lines.append(record.getMessage())

    native_log = logging.getLogger("gguf_mcv.llama_log")
    native_log.setLevel(logging.DEBUG)
    native_log.addHandler(Keep())
    native_log.propagate = False

    import gguf_mcv

    stages = {"import": memory.status()}
    start = time.perf_counter()
    model_ = gguf_mcv.load(model_path=model, mmproj_path=mmproj, n_ctx=n_ctx, kv_cache_type=kv_type,
                           vision_backend=backend)
    stages["load"] = memory.status()
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    reply = model_.ask(QUESTION, image, max_tokens=max_tokens, detail=detail)
    ask_s = time.perf_counter() - start
    stages["ask"] = memory.status()
    sizes: dict[str, float] = {}
    for line in log_lines:
        for key, pattern in _LOG_SIZES.items():
            if m := pattern.search(line):
                sizes[key] = max(sizes.get(key, 0.0), float(m.group(1)) * 2**20)
    return {
        # VmHWM, not ru_maxrss: Linux carries the parent's RSS high-water mark across
        # fork+exec into the child's ru_maxrss (exec_mmap -> setmax_mm_hiwater_rss), so a
        # big parent (pytest, this script after reading headers) would show up as the peak.
        "peak_rss": memory.status()["VmHWM"],
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "stages": stages,
        "llama_buffers": sizes,
        "prompt_tokens": reply.usage.prompt_tokens,
        "image_tokens": reply.usage.image_tokens,
        "slices": reply.timings.slices_encoded,
        "backend": model_.info.vision_backend,
        "load_s": round(load_s, 1),
        "ask_s": round(ask_s, 1),
    }


# --- parent: the matrix ------------------------------------------------------------------


def ensure_ladder(path: Path | None, preset: str, quants: list[str]) -> Path:
    """The ladder in ``path`` (built there if files are missing), or a fresh temp one."""
    folder = path or Path(tempfile.gettempdir()) / f"gguf_mcv_bench_{preset}"
    models.build(folder, preset, quants=quants)
    return folder


def measure(model: Path, mmproj: Path, image: Path, n_ctx: int, detail: str, timeout: float,
            backend: str = "llama.cpp") -> dict:
    """One run in a fresh process; its report."""
    run = fresh.call("bench_memory:one_run", {"model": str(model), "mmproj": str(mmproj), "image": str(image),
                                               "n_ctx": n_ctx, "detail": detail, "backend": backend},
                     timeout=timeout)
    if run.returncode != 0 or run.result is None:
        raise RuntimeError(f"child failed ({run.returncode}): {run.stderr_tail[-2000:]}")
    return {**run.result, "peak_tree_rss": run.peak_tree_rss}


def predict(model: Path, mmproj: Path, n_ctx: int, image_tokens: int, backend: str = "llama.cpp") -> dict:
    """The memory model's prediction for one run (headers read from the files)."""
    from gguf_mcv.resolver import estimate_files

    est = estimate_files(model, mmproj, n_ctx=n_ctx, image_tokens=image_tokens,
                                image_pixels=IMAGE_SIDE * IMAGE_SIDE, vision_backend=backend)
    return est.to_dict()


def run_matrix(args: argparse.Namespace, image: Path) -> list[dict]:
    from gguf_mcv.testing import synthetic

    ladders = [("tiny", args.tiny)] if not args.no_tiny else []
    ladders += [("bench", args.ladder)] if not args.no_bench else []
    image_tokens = 640 if args.detail == "high" else 64
    results = []
    for preset, folder in ladders:
        folder = ensure_ladder(folder, preset, args.quants)
        mmproj = folder / synthetic.MMPROJ_NAME
        if any(b != "llama.cpp" for b in args.backends):
            convert(mmproj)
        for n_ctx in args.ctx:
            for quant in args.quants:
                for backend in args.backends:
                    model = folder / synthetic.quant_filename(quant)
                    start = time.perf_counter()
                    got = measure(model, mmproj, image, n_ctx, args.detail, args.timeout, backend)
                    if got["backend"] != backend:
                        raise RuntimeError(f"asked for {backend}, the child loaded {got['backend']}")
                    row = {"ladder": preset, "quant": quant, "model": str(model), "mmproj": str(mmproj),
                           "file_size": model.stat().st_size, "backend": backend,
                           "n_ctx": n_ctx, "measured": got["peak_rss"], "run": got,
                           "predicted": predict(model, mmproj, n_ctx, image_tokens, backend)}
                    results.append(row)
                    print(_line(row, time.perf_counter() - start), file=sys.stderr, flush=True)
    return results


def convert(mmproj: Path) -> None:
    """The mmproj's ONNX graphs in the cache (converted now when missing), so no child converts."""
    from gguf_mcv.runtime.engine import file_identity
    from gguf_mcv.vision import onnx_vision

    print(f"ONNX graphs of {mmproj} ...", file=sys.stderr, flush=True)
    onnx_vision.prepare(mmproj, file_identity(mmproj))


def _error(row: dict) -> float:
    return (row["predicted"]["total"] - row["measured"]) / row["measured"] * 100


def _line(row: dict, seconds: float) -> str:
    backend = row.get("backend", "llama.cpp")
    return (f"{row['ladder']:5s} {row['quant']:7s} {backend:9s} n_ctx {row['n_ctx']:5d}: predicted "
            f"{row['predicted']['total'] / 2**20:8.1f} MiB, measured {row['measured'] / 2**20:8.1f} MiB "
            f"({_error(row):+.1f} %), {seconds:.0f} s")


def markdown(results: list[dict]) -> str:
    """The predicted-vs-measured table, as Markdown."""
    lines = ["| model | quant | vision backend | file | n_ctx | predicted peak | measured peak | error |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['ladder']} | {r['quant']} | {r.get('backend', 'llama.cpp')} | "
                     f"{r['file_size'] / 1e6:.0f} MB | {r['n_ctx']} | "
                     f"{r['predicted']['total'] / 2**20:.1f} MiB | {r['measured'] / 2**20:.1f} MiB | "
                     f"{_error(r):+.1f} % |")
    return "\n".join(lines)


def verdict(results: list[dict]) -> tuple[bool, str]:
    """Within 10 % everywhere and never under by more than 5 %?"""
    errors = [_error(r) for r in results]
    ok = all(abs(e) <= 10 for e in errors) and all(e >= -5 for e in errors)
    return ok, (f"{len(errors)} runs; error from {min(errors):+.1f} % to {max(errors):+.1f} % "
                f"(target: within +-10 %, never below -5 %): {'PASS' if ok else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    from gguf_mcv.testing import synthetic

    p = options.parser(__doc__, ladder=Path("/tmp/bench"), quant=options.OMIT, threads=options.OMIT)
    p.add_argument("--tiny", type=Path, default=None,
                   help="tiny ladder (default: $TMPDIR/gguf_mcv_bench_tiny, built if missing)")
    p.add_argument("--no-tiny", action="store_true")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--quants", nargs="+", default=list(synthetic.LADDER))
    p.add_argument("--backends", nargs="+", default=["llama.cpp", "onnx-int8", "onnx-fp32"],
                   choices=("llama.cpp", "onnx-int8", "onnx-fp32"), help="vision backends to measure")
    p.add_argument("--detail", default="high", choices=("high", "low"),
                   help="high: 10 slices, 640 image tokens (the real check); low: 1 slice, to iterate")
    p.add_argument("--image", type=Path, default=None,
                   help=f"default: a generated {IMAGE_SIDE}x{IMAGE_SIDE} PNG")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--reuse", type=Path, help="re-predict the measurements of an earlier --json")
    args = p.parse_args(argv)
    print("$ python tools/bench_memory.py " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.reuse:
        earlier = json.loads(args.reuse.read_text())["results"]
        results = earlier["rows"] if isinstance(earlier, dict) else earlier  # a record, or the older layout
        for r in results:
            folder = args.ladder if r["ladder"] == "bench" else args.tiny
            model = Path(r.get("model") or folder / synthetic.quant_filename(r["quant"]))
            mmproj = Path(r.get("mmproj") or folder / synthetic.MMPROJ_NAME)
            r["predicted"] = predict(model, mmproj, r["n_ctx"], r["run"]["image_tokens"],
                                     r.get("backend", "llama.cpp"))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            image = args.image or Path(tmp) / "image.png"
            if not args.image:
                image.write_bytes(images.encoded(images.ramps(IMAGE_SIDE, noise_seed=0)))
            results = run_matrix(args, image)
    ok, summary = verdict(results)
    print(markdown(results))
    print(summary)
    record.write(args.json, "bench_memory", {"rows": results, "summary": summary}, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
