#!/usr/bin/env python3
"""Restart, then ask: what the persistent embedding cache and saved conversations save.

Every measurement is a fresh process (the way a board that rebooted, or a restarted
``gguf-mcv serve``, starts), timed from its start to its answer, plus the time to the
first token that the answer reports:

CPU seconds (user + system) of each process are reported too: on a shared machine they
move much less than wall time when other jobs run.

* ``ask`` about the bundled example image after a first process filled the disk cache
  (``--cache-dir``), vs the same with ``--no-disk-cache``;
* a follow-up question in a two-turn conversation about that image after a restart:
  ``Model.load_chat`` of the saved chat (KV state restored), vs replaying the conversation
  with the embeddings from the disk cache, vs replaying it with nothing cached.

    python tools/bench_restart.py --ladder /tmp/bench --quant Q4_K_M --threads 2 --detail low
    python tools/bench_restart.py --tiny --threads 2          # the tiny test model, seconds
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from bench import fresh, models, options, record


def restarted(mode: str, model: str, mmproj: str, threads: int, cache: str | None, chat: str, detail: str,
              max_tokens: int) -> dict[str, Any]:
    """One step of the module doc in this process (run in a fresh one, as after a restart)."""
    import gguf_mcv
    from gguf_mcv.selftest import EXAMPLE_IMAGE

    embed_cache = gguf_mcv.EmbeddingCache(disk_dir=cache) if cache else gguf_mcv.EmbeddingCache()
    loaded = gguf_mcv.load(model_path=model, mmproj_path=mmproj, n_ctx=4096, n_threads=threads,
                           embed_cache=embed_cache)
    opts: dict[str, Any] = dict(max_tokens=max_tokens, temperature=0)
    if mode == "ask":
        reply = loaded.ask("What is in this picture?", str(EXAMPLE_IMAGE), detail=detail, **opts)
    elif mode == "make_chat":
        talk = loaded.chat()
        talk.send("What is in this picture?", str(EXAMPLE_IMAGE), detail=detail, **opts)
        talk.send("What colours are in it?", **opts)
        assert talk.save(chat), "the KV state was not saved"
        Path(chat + ".json").write_text(json.dumps([{"role": t["role"], "content": t["content"]}
                                                    for t in talk.history]))
        return {}
    elif mode == "load_chat":
        reply = loaded.load_chat(chat).send("Is it a photo?", **opts)
    else:  # replay: the conversation again, as a client re-sending its history would
        history = json.loads(Path(chat + ".json").read_text())
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(EXAMPLE_IMAGE),
                                                                                   "detail": detail}},
                                                 {"type": "text", "text": history[0]["content"]}]}]
        messages += history[1:] + [{"role": "user", "content": "Is it a photo?"}]
        reply = loaded.chat_completion(messages, policy=gguf_mcv.MediaPolicy(allow_files=True), **opts)
    return {"ttft_s": reply.timings.ttft_ms / 1000, "slices_encoded": reply.timings.slices_encoded,
            "evaluated_tokens": reply.usage.evaluated_tokens}


def run(mode: str, files: tuple[Path, Path], args: Any, *, cache: Path | None, chat: Path) -> dict:
    measured = fresh.call("bench_restart:restarted", {
        "mode": mode, "model": str(files[0]), "mmproj": str(files[1]), "threads": args.threads,
        "cache": str(cache) if cache else None, "chat": str(chat), "detail": args.detail,
        "max_tokens": args.max_tokens}, timeout=3600)
    return {"wall_s": measured.wall_s, "cpu_s": measured.cpu_s, **measured.checked()}


def main() -> None:
    parser = options.parser(__doc__)
    parser.add_argument("--ladder", type=Path, help="folder of tools/make_test_model.py --out")
    parser.add_argument("--tiny", action="store_true", help="build and use the tiny test model")
    parser.add_argument("--detail", default="low", choices=("low", "auto", "high"))
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.tiny:
            files = models.pair(work / "tiny", args.quant, "tiny")
        elif args.ladder:
            (mmproj,) = args.ladder.glob("mmproj*.gguf")
            files = (args.ladder / f"ggml-model-{args.quant}.gguf", mmproj)
        else:
            parser.error("give --ladder or --tiny")
        cache, chat = work / "emb", work / "talk.chat"
        rows = []
        first = run("ask", files, args, cache=cache, chat=chat)
        rows.append(("ask, first process (fills the disk cache)", first))
        rows.append(("ask after a restart, disk cache", run("ask", files, args, cache=cache, chat=chat)))
        rows.append(("ask after a restart, --no-disk-cache", run("ask", files, args, cache=None, chat=chat)))
        run("make_chat", files, args, cache=cache, chat=chat)
        rows.append(("follow-up after a restart: load_chat (KV state restored)",
                     run("load_chat", files, args, cache=cache, chat=chat)))
        rows.append(("follow-up after a restart: history replayed, embeddings from the disk cache",
                     run("replay", files, args, cache=cache, chat=chat)))
        rows.append(("follow-up after a restart: history replayed, nothing cached",
                     run("replay", files, args, cache=None, chat=chat)))
    print(f"| case ({'tiny' if args.tiny else args.ladder} {args.quant}, {args.threads} threads, "
          f"detail={args.detail}) | process CPU s | process wall s | time to first token s | slices encoded "
          "| tokens evaluated |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows:
        print(f"| {name} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | {r['ttft_s']:.2f} | {r['slices_encoded']} | "
              f"{r['evaluated_tokens']} |")
    record.write(args.json, "bench_restart", [{"case": name, **r} for name, r in rows], args)


if __name__ == "__main__":
    main()
