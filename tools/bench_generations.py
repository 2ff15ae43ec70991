#!/usr/bin/env python3
"""Time one chat on several bench-size generations, side by side (MiniCPM-V 2.6 vs 4.6).

    python tools/make_test_model.py --preset bench --out /tmp/bench --quants Q4_K_M
    python tools/make_test_model.py --preset 4.6-bench --out /tmp/bench46 --quants Q4_K_M
    python tools/bench_generations.py /tmp/bench /tmp/bench46 --threads 2

Each ladder runs in a fresh process (so its peak RSS is its own): load, a first question
about a photo at full detail, a follow-up, the same photo in a new chat, a regenerate of
that chat's last answer, then decode speed. Times are ``reply.timings.ttft_ms`` (to the
first token) except decode; ``slices`` is how many vision slices each step encoded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys
import numpy as np
import gguf_mcv
from gguf_mcv.vision.embed_cache import EmbeddingCache

model_path, mmproj = sys.argv[1], sys.argv[2]
threads, size, max_tokens = (int(a) for a in sys.argv[3:6])
photo = np.random.default_rng(3).integers(0, 256, (size, size, 3), np.uint8)
rows = {}

def timed(name, call):
    reply = call()
    rows[name] = {"ttft_s": round(reply.timings.ttft_ms / 1000, 3),
                  "slices": reply.timings.slices_encoded, "evaluated": reply.usage.evaluated_tokens,
                  "decode_tok_s": round(reply.timings.decode_tokens_per_s, 1)}
    return reply

with gguf_mcv.load(model_path=model_path, mmproj_path=mmproj, n_ctx=4096, n_threads=threads,
                   embed_cache=EmbeddingCache()) as model:
    sampling = dict(temperature=0, max_tokens=max_tokens)
    chat = model.chat()
    timed("first question", lambda: chat.send("Describe the photo.", photo, detail="high", **sampling))
    timed("follow-up", lambda: chat.send("And the colours?", **sampling))
    other = model.chat()
    timed("same photo, new chat", lambda: other.send("What is this?", photo, detail="high", **sampling))
    timed("regenerate", lambda: other.regenerate(max_tokens=max_tokens, temperature=0.7, seed=2))
    timed("decode", lambda: model.chat().send("Tell a long story.", temperature=0, max_tokens=128))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"rows": rows, "peak_mib": int(status["VmHWM"].split()[0]) // 1024,
                  "backend": model.info.vision_backend}))
"""


def run(ladder: Path, quant: str, threads: int, size: int, max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(ladder / f"ggml-model-{quant}.gguf"),
                          str(ladder / "mmproj-model-f16.gguf"), str(threads), str(size), str(max_tokens)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ladders", type=Path, nargs="+", help="folders written by tools/make_test_model.py")
    p.add_argument("--quant", default="Q4_K_M")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--image-size", type=int, default=1344)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    results = {}
    for ladder in args.ladders:
        results[ladder.name] = run(ladder, args.quant, args.threads, args.image_size, args.max_tokens)
        print(f"{ladder.name}: {json.dumps(results[ladder.name])}", file=sys.stderr, flush=True)
    names = list(results)
    print(f"{args.quant}, {args.threads} threads, {args.image_size}² photo at full detail, greedy")
    print("| step | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    steps = list(results[names[0]]["rows"])
    for step in steps:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
