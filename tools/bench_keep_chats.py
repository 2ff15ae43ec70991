"""Time a follow-up after a restart with and without kept conversations (``serve --keep-chats``).

    python tools/bench_keep_chats.py --ladder /tmp/bench --quant Q4_K_M --threads 2

A conversation (a 1344×1344 photo at detail "high", then a few text turns) is answered, the
model is "restarted" (its idle state kept as a server does when it stops, the model closed
and loaded again), and the next question is timed: with ``keep_chats`` (the state comes back
from disk), and without (the conversation is evaluated again; the image embeddings come from
the disk embedding cache, as ``serve`` has it by default — filled by the first mode, so
the photo is encoded once — or are encoded again with ``--no-embed-cache``). Prints one
JSON object per mode.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from bench import images, options, record

import gguf_mcv
from gguf_mcv.vision.embed_cache import EmbeddingCache

GREEDY = dict(temperature=0, repeat_penalty=1.0)


def main(argv: list[str] | None = None) -> int:
    ap = options.parser(__doc__, ladder=None)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=4, help="text turns after the photo (default 4)")
    ap.add_argument("--no-embed-cache", action="store_true", help="no disk embedding cache in either mode")
    args = ap.parse_args(argv)
    kw = dict(model_path=args.ladder / f"ggml-model-{args.quant}.gguf",
              mmproj_path=args.ladder / "mmproj-model-f16.gguf", n_ctx=args.n_ctx, n_threads=args.threads)
    embeddings = tempfile.TemporaryDirectory()  # shared by both modes: the photo is encoded once

    def cache() -> EmbeddingCache:
        return EmbeddingCache() if args.no_embed_cache else EmbeddingCache(disk_dir=Path(embeddings.name))

    photo = images.data_uri(images.encoded(images.ramps(1344)))
    rows = []
    for keep in (False, True):
        with tempfile.TemporaryDirectory() as tmp:

            with gguf_mcv.load(**kw, embed_cache=cache()) as model:
                store = model.keep_chats(Path(tmp) / "kept") if keep else None
                messages: list[dict] = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": [
                    {"type": "text", "text": "Describe this photo."},
                    {"type": "image_url", "image_url": {"url": photo, "detail": "high"}}]}]
                for i in range(args.turns + 1):
                    answer = model.chat_completion(messages, max_tokens=16, **GREEDY)
                    messages += [{"role": "assistant", "content": str(answer)},
                                 {"role": "user", "content": f"Tell me more about part {i} of it."}]
                began = time.perf_counter()
                if store is not None:
                    assert model.keep_idle(120)
                saved_s = time.perf_counter() - began
                disk = store.disk_usage() if store is not None else 0
            began = time.perf_counter()
            with gguf_mcv.load(**kw, embed_cache=cache()) as model:
                loaded_s = time.perf_counter() - began
                if keep:
                    model.keep_chats(Path(tmp) / "kept")
                cpu = time.process_time()
                reply = model.chat_completion(messages, max_tokens=8, **GREEDY)
                cpu = time.process_time() - cpu
            t = reply.timings
            rows.append({
                "mode": "keep_chats" if keep else "without", "prompt_positions": reply.usage.prompt_tokens,
                "evaluated": reply.usage.prompt_tokens - reply.usage.cached_tokens,
                "slices_encoded": t.slices_encoded, "slices_from_cache": t.slices_from_cache,
                "ttft_s": round(t.ttft_ms / 1000, 3), "answer_cpu_s": round(cpu, 3), "load_s": round(loaded_s, 3),
                "keep_idle_s": round(saved_s, 3), "kept_bytes": disk,
            })
            print(json.dumps(rows[-1]), flush=True)
    embeddings.cleanup()
    record.write(args.json, "bench_keep_chats", rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
