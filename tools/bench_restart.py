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

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
import gguf_mcv
from gguf_mcv.selftest import EXAMPLE_IMAGE
args = json.loads(sys.argv[1])
cache = gguf_mcv.EmbeddingCache(disk_dir=args["cache"]) if args["cache"] else gguf_mcv.EmbeddingCache()
model = gguf_mcv.load(model_path=args["model"], mmproj_path=args["mmproj"], n_ctx=4096,
                      n_threads=args["threads"], embed_cache=cache)
opts = dict(max_tokens=args["max_tokens"], temperature=0)
mode = args["mode"]
if mode == "ask":
    reply = model.ask("What is in this picture?", str(EXAMPLE_IMAGE), detail=args["detail"], **opts)
elif mode == "make_chat":
    chat = model.chat()
    chat.send("What is in this picture?", str(EXAMPLE_IMAGE), detail=args["detail"], **opts)
    chat.send("What colours are in it?", **opts)
    assert chat.save(args["chat"]), "the KV state was not saved"
    json.dump([{"role": t["role"], "content": t["content"]} for t in chat.history], open(args["chat"] + ".json", "w"))
    reply = None
elif mode == "load_chat":
    reply = model.load_chat(args["chat"]).send("Is it a photo?", **opts)
else:  # replay: the conversation again, as a client re-sending its history would
    history = json.load(open(args["chat"] + ".json"))
    first = history[0]["content"]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(EXAMPLE_IMAGE),
                                              "detail": args["detail"]}},
                                             {"type": "text", "text": first}]}]
    messages += history[1:] + [{"role": "user", "content": "Is it a photo?"}]
    reply = model.chat_completion(messages, policy=gguf_mcv.MediaPolicy(allow_files=True), **opts)
out = {} if reply is None else {"ttft_s": reply.timings.ttft_ms / 1000, "slices_encoded": reply.timings.slices_encoded,
                                "evaluated_tokens": reply.usage.evaluated_tokens}
print(json.dumps(out))
"""


def run(mode: str, files: tuple[Path, Path], args, *, cache: Path | None, chat: Path) -> dict:
    spec = {"mode": mode, "model": str(files[0]), "mmproj": str(files[1]), "threads": args.threads,
            "cache": str(cache) if cache else None, "chat": str(chat), "detail": args.detail,
            "max_tokens": args.max_tokens}
    began, cpu = time.perf_counter(), _children_cpu()
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                          env=os.environ, timeout=3600)
    wall, cpu = time.perf_counter() - began, _children_cpu() - cpu
    if done.returncode != 0:
        sys.exit(f"{mode} failed:\n{done.stderr}")
    return {"wall_s": wall, "cpu_s": cpu, **json.loads(done.stdout.strip().splitlines()[-1])}


def _children_cpu() -> float:
    """CPU seconds (user + system) used by finished child processes: less sensitive than wall
    time to other jobs on a shared machine."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ladder", type=Path, help="folder of tools/make_test_model.py --out")
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--tiny", action="store_true", help="build and use the tiny test model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--detail", default="low", choices=("low", "auto", "high"))
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.tiny:
            from gguf_mcv.testing import synthetic

            built = synthetic.build(work / "tiny", quants=[args.quant])
            files = (built.quants[args.quant], built.mmproj)
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


if __name__ == "__main__":
    main()
