#!/usr/bin/env python3
"""Time one chat on several bench-size generations, side by side (MiniCPM-V 2.6 vs 4.6).

    python tools/make_test_model.py --preset bench --out /tmp/bench --quants Q4_K_M
    python tools/make_test_model.py --preset 4.6-bench --out /tmp/bench46 --quants Q4_K_M
    python tools/bench_generations.py /tmp/bench /tmp/bench46 --threads 2

Each ladder runs in a fresh process (so its peak RSS is its own): load, a first question
about a photo at full detail, a follow-up, the same photo in a new chat, a regenerate of
that chat's last answer, then decode speed. Times are ``reply.timings.ttft_ms`` (to the
first token) except decode; ``slices`` is how many vision slices each step encoded.
With ``--rounds N`` the ladders take turns N times (A B A B) and each cell is the median.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from bench import fresh, options, record, stats
from bench.memory import MIB


def one_chat(model_path: str, mmproj: str, threads: int, size: int, max_tokens: int) -> dict[str, Any]:
    """The chat of the module doc, in this process; its rows and vision encoder."""
    import numpy as np

    import gguf_mcv
    from gguf_mcv.vision.embed_cache import EmbeddingCache

    photo = np.random.default_rng(3).integers(0, 256, (size, size, 3), np.uint8)
    rows: dict[str, dict[str, Any]] = {}

    def timed(name: str, call: Any) -> None:
        reply = call()
        rows[name] = {"ttft_s": round(reply.timings.ttft_ms / 1000, 3),
                      "slices": reply.timings.slices_encoded, "evaluated": reply.usage.evaluated_tokens,
                      "decode_tok_s": round(reply.timings.decode_tokens_per_s, 1)}

    with gguf_mcv.load(model_path=model_path, mmproj_path=mmproj, n_ctx=4096, n_threads=threads,
                       embed_cache=EmbeddingCache()) as model:
        sampling: dict[str, Any] = dict(temperature=0, max_tokens=max_tokens)
        chat = model.chat()
        timed("first question", lambda: chat.send("Describe the photo.", photo, detail="high", **sampling))
        timed("follow-up", lambda: chat.send("And the colours?", **sampling))
        other = model.chat()
        timed("same photo, new chat", lambda: other.send("What is this?", photo, detail="high", **sampling))
        timed("regenerate", lambda: other.regenerate(max_tokens=max_tokens, temperature=0.7, seed=2))
        timed("decode", lambda: model.chat().send("Tell a long story.", temperature=0, max_tokens=128))
        return {"rows": rows, "backend": model.info.vision_backend}


def measure(ladder: Path, args: Any) -> dict[str, Any]:
    run = fresh.call("bench_generations:one_chat", {
        "model_path": str(ladder / f"ggml-model-{args.quant}.gguf"), "mmproj": str(ladder / "mmproj-model-f16.gguf"),
        "threads": args.threads, "size": args.image_size, "max_tokens": args.max_tokens})
    return {**run.checked(), "peak_mib": run.child_vmhwm // MIB, "peak_tree_mib": run.peak_tree_rss // MIB}


def medians(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One result of the rounds' medians, cell by cell."""
    first = samples[0]
    rows = {step: {k: statistics.median(s["rows"][step][k] for s in samples) for k in first["rows"][step]}
            for step in first["rows"]}
    return {"rows": rows, "backend": first["backend"],
            "peak_mib": statistics.median(s["peak_mib"] for s in samples)}


def main() -> int:
    p = options.parser(__doc__)
    p.add_argument("ladders", type=Path, nargs="+", help="folders written by tools/make_test_model.py")
    p.add_argument("--image-size", type=int, default=1344)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds over the ladders (default 1)")
    args = p.parse_args()
    runs = {ladder.name: (lambda ladder=ladder: measure(ladder, args)) for ladder in args.ladders}
    samples = stats.alternate(runs, args.rounds, on_sample=lambda i, name, r: print(
        f"round {i + 1}, {name}: {r}", file=sys.stderr, flush=True))
    results = {name: medians(s) for name, s in samples.items()}
    names = list(results)
    print(f"{args.quant}, {args.threads} threads, {args.image_size}² photo at full detail, greedy, "
          f"{args.rounds} round(s)")
    print("| step | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for step in results[names[0]]["rows"]:
        cells = []
        for name in names:
            row = results[name]["rows"][step]
            if step == "decode":
                cells.append(f"{row['decode_tok_s']} tok/s")
            else:
                first = results[name]["rows"]["first question"]["ttft_s"]
                share = f" ({row['ttft_s'] / first:.3f}×)" if step != "first question" else ""
                cells.append(f"{row['ttft_s']:.2f} s{share}, {row['slices']} slices, {row['evaluated']} evaluated")
        print(f"| {step} | " + " | ".join(cells) + " |")
    print("| peak RSS | " + " | ".join(f"{results[n]['peak_mib']} MiB" for n in names) + " |")
    print("| vision encoder | " + " | ".join(results[n]["backend"] for n in names) + " |")
    record.write(args.json, "bench_generations", {"samples": samples, "medians": results}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
