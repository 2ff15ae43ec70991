#!/usr/bin/env python3
"""Compare gguf_mcv's chat engine with llama-cpp-python's MiniCPMv26ChatHandler, in one run.

Both answer the same questions about the same 1344×1344 image on the same
benchmark-size model (real SigLIP-400M vision shape, Qwen2-0.5B-size text model;
made by tools/make_test_model.py --preset bench), with the same threads and the same
sampling: MiniCPM-V's published settings (temperature 0.7, top_p 0.8, top_k 100,
repeat_penalty 1.05) and a fixed seed. Measured: time to first token of a first question, of a follow-up about
the same image, and of the same image in a new conversation; decode speed; and
gguf_mcv's detail="low" first question. Ratios are gguf_mcv / peer.

    python tools/bench_chat.py --ladder /tmp/bench-visible --quant Q4_K_M --threads 2
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

from bench import images, models, options, record, stats

SAMPLING = dict(temperature=0.7, top_p=0.8, top_k=100, repeat_penalty=1.05, seed=1)
TARGETS = {  # measure: (target ratio, True when the ratio must be at most the target)
    "follow-up TTFT": (0.02, True),
    "same image, new conversation TTFT": (0.05, True),
    "first question TTFT": (1.05, True),
    "decode tokens/s": (0.97, False),
    'detail="low" first question TTFT': (0.15, True),
}


def user(text: str, uri: str | None = None) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": uri}}] if uri else []
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def timed_pieces(start_call) -> tuple[float, int, float, str]:
    """(ttft s, pieces, pieces per second after the first, text) of a streamed answer.

    ``start_call()`` starts the request and returns an iterator of text pieces; the clock
    starts before it, because a chat handler may evaluate the prompt before returning.
    Both engines are measured this way (one piece per generated token).
    """
    start = time.perf_counter()
    first = last = None
    n, text = 0, []
    for piece in start_call():
        if piece:
            now = time.perf_counter()
            first = first or now
            last = now
            n += 1
            text.append(piece)
    end = time.perf_counter()
    ttft = (first or end) - start
    tps = (n - 1) / (last - first) if n > 1 and last > first else 0.0
    return ttft, n, tps, "".join(text)


def openai_pieces(chunks):
    for chunk in chunks:
        yield chunk["choices"][0].get("delta", {}).get("content") or ""


def run_peer(model: Path, mmproj: Path, uri: str, args) -> dict[str, float]:
    from llama_cpp.llama_chat_format import MiniCPMv26ChatHandler

    from gguf_mcv import checked_llama

    llm = checked_llama(str(model), n_ctx=args.ctx, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False,
                chat_handler=MiniCPMv26ChatHandler(clip_model_path=str(mmproj), verbose=False))
    opts = dict(max_tokens=args.max_tokens, stream=True, min_p=0.0, **SAMPLING)

    def ask(messages):
        return timed_pieces(lambda: openai_pieces(llm.create_chat_completion(messages=messages, **opts)))

    messages = [user("Describe this picture.", uri)]
    ttft1, n, tps, text = ask(messages)
    print(f"  peer first question: {ttft1:.1f} s, {n} pieces at {tps:.1f}/s", flush=True)
    messages += [{"role": "assistant", "content": text}, user("What colours are there?")]
    ttft2, *_ = ask(messages)
    print(f"  peer follow-up: {ttft2:.1f} s", flush=True)
    ttft3, *_ = ask([user("How many circles?", uri)])
    print(f"  peer same image, new conversation: {ttft3:.1f} s", flush=True)
    llm.close()
    return {"first": ttft1, "follow": ttft2, "new": ttft3, "tps": tps}


def run_ours(model: Path, mmproj: Path, png: bytes, args) -> dict[str, float]:
    import gguf_mcv

    m = gguf_mcv.load(model_path=model, mmproj_path=mmproj, n_ctx=args.ctx, n_threads=args.threads)
    opts = dict(max_tokens=args.max_tokens, stream=True, **SAMPLING)
    chat = m.chat()
    ttft1, n, tps, _ = timed_pieces(lambda: chat.send("Describe this picture.", png, detail="high", **opts))
    print(f"  gguf_mcv first question: {ttft1:.1f} s, {n} pieces at {tps:.1f}/s", flush=True)
    ttft2, *_ = timed_pieces(lambda: chat.send("What colours are there?", **opts))
    print(f"  gguf_mcv follow-up: {ttft2:.2f} s", flush=True)
    ttft3, *_ = timed_pieces(lambda: m.chat().send("How many circles?", png, detail="high", **opts))
    print(f"  gguf_mcv same image, new conversation: {ttft3:.2f} s", flush=True)
    m.engine.embed_cache.clear()
    ttft4, *_ = timed_pieces(lambda: m.chat().send("Describe this picture.", png, detail="low", **opts))
    print(f"  gguf_mcv detail=low first question: {ttft4:.1f} s", flush=True)
    m.close()
    return {"first": ttft1, "follow": ttft2, "new": ttft3, "tps": tps, "low": ttft4}


MEASURES = [  # (name, peer key, our key, unit)
    ("first question TTFT", "first", "first", "s"),
    ("follow-up TTFT", "follow", "follow", "s"),
    ("same image, new conversation TTFT", "new", "new", "s"),
    ("decode tokens/s", "tps", "tps", "tok/s"),
    ('detail="low" first question TTFT', "first", "low", "s"),
]


def table(peer: list[dict[str, float]], ours: list[dict[str, float]]) -> tuple[str, bool, dict]:
    """The Markdown table (medians over the rounds; the ratio is the median of each round's), whether
    every target was met, and the ratios by measure."""
    lines = ["| measure | MiniCPMv26ChatHandler | gguf_mcv | ratio (range) | target | met |",
             "| --- | ---: | ---: | ---: | --- | --- |"]
    all_met, ratios = True, {}
    for name, pk, ok, unit in MEASURES:
        p = statistics.median(r[pk] for r in peer)
        o = statistics.median(r[ok] for r in ours)
        r = stats.ratio([x[ok] for x in ours], [x[pk] for x in peer])
        ratios[name] = r
        ratio = r["median"] if r["median"] is not None else float("inf")
        target, at_most = TARGETS[name]
        met = ratio <= target if at_most else ratio >= target
        all_met &= met
        spread = f" ({r['min']:.3f}–{r['max']:.3f})" if r["n"] > 1 else ""
        lines.append(f"| {name} | {p:.2f} {unit} | {o:.2f} {unit} | {ratio:.3f}×{spread} | "
                     f"{'≤' if at_most else '≥'} {target}× | {'yes' if met else 'NO'} |")
    return "\n".join(lines), all_met, ratios


def main() -> int:
    parser = options.parser(__doc__, ladder=Path("/tmp/bench-visible"))
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=1344)
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds, peer then ours (default 1)")
    args = parser.parse_args()

    model, mmproj = models.pair(args.ladder, args.quant, "bench", visible_padding=True)
    png = images.encoded(images.shapes(args.image_size))
    uri = images.data_uri(png)
    print(f"bench model {model.name} + {mmproj.name}, {args.threads} threads, "
          f"{args.image_size}×{args.image_size} image, {args.max_tokens} tokens, {args.rounds} round(s)", flush=True)

    def peer() -> dict[str, float]:
        gc.collect()
        return run_peer(model, mmproj, uri, args)

    def ours() -> dict[str, float]:
        gc.collect()
        return run_ours(model, mmproj, png, args)

    samples = stats.alternate({"peer": peer, "gguf_mcv": ours}, args.rounds)
    text, ok, ratios = table(samples["peer"], samples["gguf_mcv"])
    print()
    print(text)
    record.write(args.json, "bench_chat", {**samples, "ratios": ratios, "targets_met": ok}, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
