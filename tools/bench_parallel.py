#!/usr/bin/env python3
"""Parallel slots: aggregate decode rate and time to first token with 1, 2, 4, 8 concurrent
text clients, against the same model with parallel=1 and against llama.cpp's raw bound.

Each client asks its own short text question (greedy, a fixed number of tokens) from its own
thread, all at once. Aggregate rate = all clients' completion tokens / wall time from the
first request to the last answer's end (short prompts: prefill is a small share). Time to
first token is the client's, from its request to its first generated token, queueing included.
The raw bound is llama.cpp alone, in the same run: the time of one ``llama_decode`` of a batch
of N tokens (one per sequence, each after the same prompt) against one of 1 token; N tokens
in t(N) instead of N × t(1) is the most batching can gain, ``bound(N) = N·t(1)/t(N)``.

    python tools/bench_parallel.py --ladder /tmp/bench --quant Q4_K_M --threads 2

With ``--images`` it measures image questions through the server instead: a fresh
``gguf-mcv serve`` per slot count (``--parallel 1``, then each N of ``--image-clients``),
clients asking about distinct never-seen images at once (one streamed OpenAI request each,
``--image-side`` pixels, one slice), so every answer needs the vision encoder, which runs one
slice at a time. Reported per client count: answers/s (answers / wall time from the first
request to the last answer) and TTFT p50/p95 (from sending to the first streamed event) with
``--parallel 1`` and ``--parallel N``; and per server its peak RSS (``VmHWM``, sampled every
0.5 s too) beside the plan's prediction (``plan_local()``'s memory row plus ``slot_bytes`` per
slot beyond the first).

    python tools/bench_parallel.py --ladder /tmp/bench --quant Q4_K_M --threads 2 --images
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests
from bench import images, options, record
from bench.memory import MIB, TreeSampler
from bench.served import planned_peak, read_stream, start_server
from bench.stats import percentile

import gguf_mcv

GREEDY = dict(temperature=0, repeat_penalty=1.0)


def clients(model: gguf_mcv.Model, n: int, max_tokens: int) -> tuple[float, list[float], int]:
    """(aggregate tok/s, each client's time to first token in ms, tokens) for ``n`` clients at once."""
    ttft: list[float] = [0.0] * n
    tokens: list[int] = [0] * n
    go = threading.Barrier(n + 1)

    def client(i: int) -> None:
        go.wait()
        began = time.perf_counter()
        reply = model.ask(f"Client {i} asks: tell me about the number {i * 37 + 11}.",
                          max_tokens=max_tokens, **GREEDY)
        ended = time.perf_counter()
        tokens[i] = reply.usage.completion_tokens
        # the first token came (total - ttft) before the end; random weights' text often reaches
        # the client only at the end (incomplete UTF-8 is held back), so the first piece would not do
        first_token = ended - (reply.timings.total_ms - reply.timings.ttft_ms) / 1000.0
        ttft[i] = (first_token - began) * 1000.0

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    return sum(tokens) / wall, ttft, sum(tokens)


def raw_bound(model: gguf_mcv.Model, sizes: list[int], prompt_tokens: int = 48, reps: int = 24) -> dict[int, float]:
    """Seconds per ``llama_decode`` of a batch of n tokens (n sequences), for each n in ``sizes``,
    on ``model``'s own context. Only before the model answered anything: the slots must be
    empty and idle (the memory is cleared afterwards, and nothing else touches the context)."""
    assert model.scheduler is not None and not any(model.scheduler.slot_units()), "a fresh model"
    engine = model.engine
    lc, ctx = engine._lc, engine.llama.ctx
    mem = lc.llama_get_memory(ctx)
    n_max = max(sizes)
    batch = lc.llama_batch_init(max(prompt_tokens, n_max), 0, 1)
    try:
        def decode(entries: list[tuple[int, int, int]]) -> None:
            for i, (token, pos, seq) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, True
                batch.seq_id[i][0] = seq
            batch.n_tokens = len(entries)
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        prompt = [(100 + k) % engine.llama.n_vocab() for k in range(prompt_tokens)]
        out: dict[int, float] = {}
        for n in sizes:
            lc.llama_memory_clear(mem, True)
            for seq in range(n):  # each sequence holds the prompt (as the clients' do)
                decode([(t, p, seq) for p, t in enumerate(prompt)])
            times = []
            for r in range(reps):
                began = time.perf_counter()
                decode([(7 + seq, prompt_tokens + r, seq) for seq in range(n)])
                times.append(time.perf_counter() - began)
            out[n] = statistics.median(times)
        lc.llama_memory_clear(mem, True)
        return out
    finally:
        lc.llama_batch_free(batch)


def image_round(base: str, name: str, n: int, seed: int, side: int, max_tokens: int) -> tuple[float, list[float]]:
    """``n`` clients at once, each asking about its own new image; (answers/s, each TTFT in ms)."""
    pictures = [images.png_bytes(seed + i, side) for i in range(n)]
    ttft: list[float] = [0.0] * n
    failures: list[str] = []
    go = threading.Barrier(n + 1)

    def client(i: int) -> None:
        url = images.data_uri(pictures[i])
        body = {"model": name, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": f"Client {i}: what is it?"}]}]}
        with requests.Session() as session:
            go.wait()
            status, reply = read_stream(session, f"{base}/v1/chat/completions", body, sse=True)
        if status != 200 or reply is None or reply[2] is None:
            failures.append(f"client {i}: status {status}")
            return
        ttft[i] = reply[2] * 1000.0

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    if failures:
        raise SystemExit("image questions failed: " + "; ".join(failures))
    return n / wall, ttft


def bench_images(args: argparse.Namespace, model: Path, mmproj: Path) -> dict[str, Any]:
    """Image questions against a fresh server per slot count; the tables (see the module doc)."""
    sizes = [int(n) for n in args.image_clients.split(",")]
    rows: dict[tuple[int, int], tuple[float, list[float]]] = {}  # (slots, clients) -> result
    memory: list[tuple[int, int, dict[str, int]]] = []
    seed = 1000
    for slots in [1] + [n for n in sizes if n > 1]:
        extra = ["--parallel", str(slots), "--ctx", str(args.n_ctx), "--threads", str(args.threads),
                 "--max-queue", str(max(sizes)), "--cache-dir", tempfile.mkdtemp(prefix="gguf_mcv_bench_")]
        server = start_server(model, mmproj, extra)
        rss = TreeSampler(server.model_pid, interval=0.5)
        try:
            image_round(server.base, server.name, 1, 1, args.image_side, 2)  # warm-up: first encode, buffers
            for n in sizes if slots == 1 else [slots]:
                rows[(slots, n)] = image_round(server.base, server.name, n, seed, args.image_side, args.max_tokens)
                seed += n
            peak = rss.high_water() or rss.peak
        finally:
            rss.stop()
            server.stop()
        memory.append((slots, peak, planned_peak(model, mmproj, n_ctx=args.n_ctx, parallel=slots)))
    print(f"model {model.name}, {args.threads} threads, {args.max_tokens} tokens per answer, distinct "
          f"{args.image_side}x{args.image_side} images (one slice each), n_ctx {args.n_ctx} per slot")
    print("| clients | parallel=1 answers/s | parallel=N answers/s | gain | TTFT p50 / p95 (parallel=1) | "
          "TTFT p50 / p95 (parallel=N) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        one, par = rows[(1, n)], rows[(n, n)]
        print(f"| {n} | {one[0]:.3f} | {par[0]:.3f} | {par[0] / one[0]:.2f}× | {_pct(one[1], 50):.0f} / "
              f"{_pct(one[1], 95):.0f} ms | {_pct(par[1], 50):.0f} / {_pct(par[1], 95):.0f} ms |")
    print("\n| --parallel | peak RSS (VmHWM) | plan's prediction | measured / predicted |")
    print("| ---: | ---: | ---: | ---: |")
    for slots, peak, plan in memory:
        print(f"| {slots} | {peak / MIB:.0f} MiB | {plan['predicted'] / MIB:.0f} MiB "
              f"({plan['one_slot'] / MIB:.0f} + {slots - 1} × {plan['slot_bytes'] / MIB:.1f}) | "
              f"{peak / plan['predicted']:.2f} |")
    return {"rows": [{"slots": slots, "clients": n, "answers_per_s": r[0], "ttft_ms": r[1]}
                     for (slots, n), r in rows.items()],
            "memory": [{"parallel": slots, "peak_bytes": peak, **plan} for slots, peak, plan in memory]}


def main() -> None:
    ap = options.parser(__doc__, ladder=None)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n-ctx", type=int, default=1024, help="positions per slot")
    ap.add_argument("--images", action="store_true", help="image questions through the server instead")
    ap.add_argument("--image-clients", default="1,2,4", help="client (and slot) counts with --images")
    ap.add_argument("--image-side", type=int, default=448, help="side of each image with --images (default 448)")
    args = ap.parse_args()
    ladder = Path(args.ladder)
    if args.images:
        found = bench_images(args, ladder / f"ggml-model-{args.quant}.gguf", ladder / "mmproj-model-f16.gguf")
        record.write(args.json, "bench_parallel --images", found, args)
        return
    files = dict(model_path=ladder / f"ggml-model-{args.quant}.gguf", mmproj_path=ladder / "mmproj-model-f16.gguf",
                 n_ctx=args.n_ctx, n_threads=args.threads)
    sizes = [int(n) for n in args.clients.split(",")]
    rows = []
    with gguf_mcv.load(**files, parallel=max(sizes)) as par:
        bound_s = raw_bound(par, sorted(set(sizes) | {1}))  # first: the slots are still empty
        par.ask("Warm up.", max_tokens=4, **GREEDY)
        for n in sizes:
            rows.append(("parallel", n, *clients(par, n, args.max_tokens)))
    with gguf_mcv.load(**files) as one:
        one.ask("Warm up.", max_tokens=4, **GREEDY)
        for n in sizes:
            rows.append(("serial", n, *clients(one, n, args.max_tokens)))
    single = next(r[2] for r in rows if r[0] == "serial" and r[1] == 1)
    print(f"model {files['model_path'].name}, {args.threads} threads, {args.max_tokens} tokens per answer, "
          f"n_ctx {args.n_ctx} per slot")
    print(f"raw llama_decode: 1 token {bound_s[1] * 1000:.2f} ms; " + "; ".join(
        f"{n} tokens {bound_s[n] * 1000:.2f} ms" for n in sizes if n > 1))
    print("| clients | parallel=1 tok/s | parallel=N tok/s | gain | raw bound | gain / bound | "
          "TTFT p50 / p95 (parallel=1) | TTFT p50 / p95 (parallel=N) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        s = next(r for r in rows if r[0] == "serial" and r[1] == n)
        p = next(r for r in rows if r[0] == "parallel" and r[1] == n)
        bound = n * bound_s[1] / bound_s[n]
        gain = p[2] / single
        print(f"| {n} | {s[2]:.1f} | {p[2]:.1f} | {gain:.2f}× | {bound:.2f}× | {gain / bound:.2f} | "
              f"{_pct(s[3], 50):.0f} / {_pct(s[3], 95):.0f} ms | {_pct(p[3], 50):.0f} / {_pct(p[3], 95):.0f} ms |")
    record.write(args.json, "bench_parallel", {
        "raw_decode_s": bound_s,
        "rows": [{"mode": mode, "clients": n, "tokens_per_s": rate, "ttft_ms": ttft, "tokens": tokens}
                 for mode, n, rate, ttft, tokens in rows]}, args)


def _pct(values: list[float], q: int) -> float:
    return percentile(values, q) or 0.0


if __name__ == "__main__":
    main()
