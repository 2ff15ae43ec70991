#!/usr/bin/env python3
"""Items per second for N images × 2 prompts: a plain loop over Model.ask, gguf_mcv.jobs.batch, and the
Ray job on a 2-node local cluster (1 CPU and 1 thread per worker), with what each costs per item.

Each way starts from a freshly loaded model (an empty embedding cache) and asks the same
greedy questions. "Overhead/item" is the time per item not spent inside the answers
(wall time × workers − the rows' ``timings.total_ms``, over the items): image decoding,
the results file, and for Ray joining the cluster, starting the workers, loading a model
in each and moving rows. The Ray cluster itself is started before the clock and stopped
after.

    python tools/bench_batch.py --ladder /tmp/tiny --images 50
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import images, options, record
from bench.fresh import env_for_child
from bench.served import free_port

import gguf_mcv
from gguf_mcv.jobs import batch, batch_ray

PROMPTS = ["What is in this picture?", "Which colours dominate?"]


def load(args: argparse.Namespace) -> gguf_mcv.Model:
    return gguf_mcv.load(**load_kwargs(args))


def load_kwargs(args: argparse.Namespace) -> dict:
    ladder = Path(args.ladder)
    return {"model_path": str(ladder / f"ggml-model-{args.quant}.gguf"),
            "mmproj_path": str(ladder / "mmproj-model-f16.gguf"), "n_ctx": 4096, "n_threads": args.threads}


def plain_loop(args: argparse.Namespace, images: list[Path]) -> dict:
    with load(args) as model:
        started = time.monotonic()
        answer_ms = slices = n = 0
        for image in images:
            for prompt in PROMPTS:
                reply = model.ask(prompt, str(image), max_tokens=args.max_tokens, temperature=0.0)
                answer_ms += reply.timings.total_ms
                slices += reply.timings.slices_encoded
                n += 1
        wall = time.monotonic() - started
    return {"items": n, "wall_s": wall, "answer_ms": answer_ms, "slices_encoded": slices, "workers": 1}


def from_rows(out: Path, wall: float, workers: int) -> dict:
    rows = [json.loads(line) for line in out.read_bytes().splitlines()]
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]][:3]
    return {"items": len(rows), "wall_s": wall, "answer_ms": sum(r["timings"]["total_ms"] for r in rows),
            "slices_encoded": sum(r["timings"]["slices_encoded"] for r in rows), "workers": workers}


def with_batch(args: argparse.Namespace, folder: Path, work: Path) -> dict:
    out = work / "batch.jsonl"
    with load(args) as model:
        started = time.monotonic()
        batch.run(model, folder, out, prompts=PROMPTS, options={"max_tokens": args.max_tokens,
                                                                "temperature": 0.0}, progress=False)
        wall = time.monotonic() - started
    return from_rows(out, wall, 1)


def with_ray(args: argparse.Namespace, folder: Path, work: Path) -> dict:
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray_cli = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]
    env = env_for_child({"RAY_USAGE_STATS_ENABLED": "0"})
    port = free_port()
    address = f"127.0.0.1:{port}"
    node = ["--num-cpus=1", f"--temp-dir={temp}", "--object-store-memory=80000000", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1"]
    try:
        for extra in (["--head", f"--port={port}", "--include-dashboard=false"], [f"--address={address}"]):
            subprocess.run([*ray_cli, "start", *extra, *node], env=env, check=True, capture_output=True)
        items = batch.collect(folder, prompts=PROMPTS, options={"max_tokens": args.max_tokens, "temperature": 0.0})
        out = work / "ray.jsonl"
        arrivals: list[float] = []
        write = batch_ray.ResultsFile.write

        def timed(self, row):  # when each row reaches the driver's file
            write(self, row)
            arrivals.append(time.monotonic())

        batch_ray.ResultsFile.write = timed  # type: ignore[method-assign]
        started = time.monotonic()
        batch_ray.run_items(address, load_kwargs(args), items, out, workers=2, progress=False)
        wall = time.monotonic() - started
        batch_ray.ResultsFile.write = write  # type: ignore[method-assign]
        result = from_rows(out, wall, 2)
        result["first_row_s"] = arrivals[0] - started
        return result
    finally:
        subprocess.run([*ray_cli, "stop", "--force"], env=env, capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)


def main() -> None:
    ap = options.parser(__doc__, ladder=None, threads=1)
    ap.add_argument("--images", type=int, default=50)
    ap.add_argument("--size", type=int, default=448, help="image side in pixels (448: one slice)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray job")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_batch"))
    try:
        folder = work / "images"
        folder.mkdir()
        files = images.write_pngs(folder, args.images, args.size)
        results = {"plain loop over Model.ask": plain_loop(args, files)}
        print("plain loop:", results["plain loop over Model.ask"], flush=True)
        results["gguf_mcv.jobs.batch"] = with_batch(args, folder, work)
        print("batch:", results["gguf_mcv.jobs.batch"], flush=True)
        if not args.no_ray:
            results["Ray, 2 local nodes"] = with_ray(args, folder, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.images} images ({args.size}×{args.size}) × {len(PROMPTS)} prompts, {args.quant}, "
          f"{args.threads} thread(s) per model, max_tokens {args.max_tokens}, greedy")
    print("| way | items | wall s | items/s | encoder passes | overhead/item ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        overhead = (r["wall_s"] * 1000 * r["workers"] - r["answer_ms"]) / r["items"]
        print(f"| {name} | {r['items']} | {r['wall_s']:.1f} | {r['items'] / r['wall_s']:.2f} | "
              f"{r['slices_encoded']} | {overhead:.0f} |")
    for name, r in results.items():
        if "first_row_s" in r:
            print(f"{name}: first row after {r['first_row_s']:.1f} s (joining the cluster, starting the workers, "
                  "loading a model in each)")
    record.write(args.json, "bench_batch", results, args)


if __name__ == "__main__":
    main()
