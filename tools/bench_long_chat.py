#!/usr/bin/env python3
"""Time a long chat that outgrows its context: drops with a shifted cache vs re-evaluation.

    python tools/bench_long_chat.py --ladder /tmp/bench --quant Q4_K_M --turns 60 --ctx 2048

An image (a new random picture, ``detail="low"``: one slice) every 5 turns, 16-token greedy
answers, one model per mode in this one run. Prints, per mode, the mean time of a turn with
no drop, of a turn where turns were dropped, the encoder calls (images encoded once each,
never again because of a drop) and how often the greedy answer equals the other mode's.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
from bench import options, record


def run(model_path: Path, mmproj: Path, *, turns: int, n_ctx: int, shift: bool, threads: int) -> dict:
    import gguf_mcv

    with gguf_mcv.load(model_path=model_path, mmproj_path=mmproj, n_ctx=n_ctx, n_threads=threads) as model:
        chat = model.chat(context_shift=shift)
        rows = []
        for i in range(turns):
            image = np.random.default_rng(1000 + i).integers(0, 256, (448, 448, 3), np.uint8) if i % 5 == 0 else ()
            start = time.perf_counter()
            reply = chat.send(f"Turn {i}: what do you see now, and what changed?", image, detail="low",
                              max_tokens=16, temperature=0)
            rows.append({"seconds": time.perf_counter() - start, "dropped": reply.dropped_turns,
                         "image": bool(i % 5 == 0), "answer": str(reply),
                         "evaluated": reply.usage.evaluated_tokens})
        return {"rows": rows, "encoder_calls": model.engine.encoder_calls,
                "shifted": model.engine.shifted_positions}


def overflow_turn(model_path: Path, mmproj: Path, *, turns: int, n_ctx: int, threads: int) -> str:
    """The same chat with ``overflow="error"``: the turn whose ContextOverflowError ends it."""
    import gguf_mcv

    with gguf_mcv.load(model_path=model_path, mmproj_path=mmproj, n_ctx=n_ctx, n_threads=threads) as model:
        chat = model.chat(overflow="error")
        for i in range(turns):
            image = np.random.default_rng(1000 + i).integers(0, 256, (448, 448, 3), np.uint8) if i % 5 == 0 else ()
            try:
                chat.send(f"Turn {i}: what do you see now, and what changed?", image, detail="low",
                          max_tokens=16, temperature=0)
            except gguf_mcv.errors.ContextOverflowError as exc:
                return f"overflow=\"error\": ContextOverflowError at turn {i}: {str(exc)[:90]}..."
    return f"overflow=\"error\": all {turns} turns fit (no overflow to report)"


def summary(name: str, result: dict) -> str:
    rows = result["rows"]
    plain = [r["seconds"] for r in rows if not r["dropped"] and not r["image"]]
    dropped = [r["seconds"] for r in rows if r["dropped"] and not r["image"]]
    evaluated = [r["evaluated"] for r in rows if r["dropped"] and not r["image"]]
    mean = lambda xs: f"{statistics.mean(xs):.2f} s" if xs else "-"  # noqa: E731
    return (f"| {name} | {mean(plain)} | {mean(dropped)} ({len(dropped)} turns, "
            f"{statistics.mean(evaluated) if evaluated else 0:.0f} positions evaluated) | "
            f"{sum(r['dropped'] for r in rows)} | {result['encoder_calls']} | {result['shifted']} |")


def main() -> int:
    p = options.parser(__doc__, ladder=Path("/tmp/bench"))
    p.add_argument("--turns", type=int, default=60)
    p.add_argument("--ctx", type=int, default=2048)
    args = p.parse_args()
    model = args.ladder / f"ggml-model-{args.quant}.gguf"
    mmproj = args.ladder / "mmproj-model-f16.gguf"
    results = {mode: run(model, mmproj, turns=args.turns, n_ctx=args.ctx, shift=mode == "shift",
                         threads=args.threads) for mode in ("shift", "re-evaluate")}
    print(f"{args.turns} turns, n_ctx={args.ctx}, {args.quant}, {args.threads} threads")
    print("| mode | turn without a drop (no image) | turn with a drop (no image) | questions dropped | "
          "encoder calls | positions shifted |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, result in results.items():
        print(summary(mode, result))
    pairs = list(zip(results["shift"]["rows"], results["re-evaluate"]["rows"], strict=True))
    same = sum(a["answer"] == b["answer"] for a, b in pairs if a["dropped"] or b["dropped"])
    total = sum(1 for a, b in pairs if a["dropped"] or b["dropped"])
    print(f"greedy answers equal in both modes on turns with a drop: {same} of {total}")
    overflow = overflow_turn(model, mmproj, turns=args.turns, n_ctx=args.ctx, threads=args.threads)
    print(overflow)
    record.write(args.json, "bench_long_chat", {"modes": results, "equal_on_drops": [same, total],
                                                "overflow": overflow}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
