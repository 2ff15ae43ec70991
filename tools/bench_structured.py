#!/usr/bin/env python3
"""What a JSON-schema grammar costs: decode tokens/s and time to first token, constrained vs not.

The same text question (no image) is asked with and without a nested schema, with
MiniCPM-V's published sampling, several seeds each; the prompt is in the KV cache after
the first call, so time to first token is mostly the grammar's setup (conversion,
llama.cpp's parse) and the first constrained sampling step.

    python tools/bench_structured.py --ladder /tmp/tiny --quant Q4_K_M --threads 2

``--utf8-mask`` instead measures what the UTF-8 mask under a grammar costs
(:mod:`gguf_mcv.output.utf8mask`): the nested schema with the mask and without it, seed by seed
in turn, in the same run, and the one-time table for the vocabulary.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench import options, record

import gguf_mcv

SAMPLING = dict(temperature=0.7, top_p=0.8, top_k=100, repeat_penalty=1.05)
NESTED = {
    "type": "object",
    "properties": {
        "shop": {"type": "string"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number"}}, "required": ["name", "qty", "price"]}},
        "paid": {"enum": ["cash", "card"]},
        "total": {"type": "number", "minimum": 0, "maximum": 500},
    },
    "required": ["shop", "items", "paid", "total"],
}


def measure(model: gguf_mcv.Model, schema: dict | None, runs: int, max_tokens: int) -> tuple[float, float, float]:
    """Median decode tok/s, median time to first token (ms), mean generated tokens."""
    speeds, ttfts, tokens = [], [], []
    model.ask("Read the receipt as JSON.", schema=schema, max_tokens=4, seed=0, **SAMPLING)  # warm the cache
    for seed in range(runs):
        reply = model.ask("Read the receipt as JSON.", schema=schema, max_tokens=max_tokens, seed=seed,
                          **SAMPLING)
        if reply.usage.completion_tokens >= 8:
            speeds.append(reply.timings.decode_tokens_per_s)
        ttfts.append(reply.timings.ttft_ms)
        tokens.append(reply.usage.completion_tokens)
    return statistics.median(speeds), statistics.median(ttfts), statistics.mean(tokens)


def mask_cost(model: gguf_mcv.Model, runs: int, max_tokens: int) -> dict[str, list[float]]:
    """Decode tokens/s of the nested schema with and without the UTF-8 mask, interleaved."""
    engine = model.engine
    start = time.perf_counter()
    engine.sampler.utf8_table()
    print(f"UTF-8 table for {engine.llama.n_vocab()} tokens: {time.perf_counter() - start:.2f} s (once)")
    table, refused = engine.sampler._utf8, engine.sampler._utf8_refused
    assert table is not None and refused is not None
    off_table, off_refused = table * 0, refused & False  # every token allowed, every state ACCEPT
    speeds: dict[str, list[float]] = {"with mask": [], "without": []}
    model.ask("Read the receipt as JSON.", schema=NESTED, max_tokens=4, seed=0, **SAMPLING)  # warm the cache
    for seed in range(runs):
        for name, tables in (("with mask", (table, refused)), ("without", (off_table, off_refused))):
            engine.sampler._utf8, engine.sampler._utf8_refused = tables
            reply = model.ask("Read the receipt as JSON.", schema=NESTED, max_tokens=max_tokens, seed=seed,
                              **SAMPLING)
            speeds[name].append(reply.timings.decode_tokens_per_s)
    engine.sampler._utf8, engine.sampler._utf8_refused = table, refused
    on, off = statistics.median(speeds["with mask"]), statistics.median(speeds["without"])
    print("| decode tokens/s, nested schema | with UTF-8 mask | without | cost |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| median of {runs} | {on:.1f} | {off:.1f} | {100 * (1 - on / off):+.1f} % |")
    mean_on, mean_off = statistics.mean(speeds["with mask"]), statistics.mean(speeds["without"])
    print(f"| mean of {runs} | {mean_on:.1f} | {mean_off:.1f} | {100 * (1 - mean_on / mean_off):+.1f} % |")
    return speeds


def main() -> None:
    ap = options.parser(__doc__, ladder=None)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--utf8-mask", action="store_true", help="measure the UTF-8 mask's cost instead")
    args = ap.parse_args()
    ladder = Path(args.ladder)
    model = gguf_mcv.load(model_path=ladder / f"ggml-model-{args.quant}.gguf",
                          mmproj_path=ladder / "mmproj-model-f16.gguf", n_ctx=2048, n_threads=args.threads)
    with model:
        print(f"{ladder.name} {args.quant}: n_vocab {model.engine.llama.n_vocab()}, {args.threads} threads")
        if args.utf8_mask:
            record.write(args.json, "bench_structured --utf8-mask", mask_cost(model, args.runs, args.max_tokens), args)
            return
        free = measure(model, None, args.runs, args.max_tokens)
        constrained = measure(model, NESTED, args.runs, args.max_tokens)
    print("| measure | unconstrained | nested schema | ratio |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| decode tokens/s | {free[0]:.1f} | {constrained[0]:.1f} | {constrained[0] / free[0]:.2f}× |")
    print(f"| time to first token (prompt cached) | {free[1]:.1f} ms | {constrained[1]:.1f} ms | "
          f"+{constrained[1] - free[1]:.1f} ms |")
    print(f"| tokens per answer (mean) | {free[2]:.0f} | {constrained[2]:.0f} | |")
    names = ("decode_tok_s", "ttft_ms", "tokens")
    record.write(args.json, "bench_structured", {"unconstrained": dict(zip(names, free, strict=True)),
                                                 "nested_schema": dict(zip(names, constrained, strict=True))}, args)


if __name__ == "__main__":
    main()
