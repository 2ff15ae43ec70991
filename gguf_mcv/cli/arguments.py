"""The command line's parser: every command, its flags and the flag groups they share."""

from __future__ import annotations

import argparse

from .. import environment
from ..options import (
    DETAILS,
    KV_CACHE_TYPES,
    VISION_BACKENDS,
    VISION_WEIGHTS,
)
from .ask import run_ask, run_video
from .batch import run_batch
from .bench import run_bench
from .catalog import run_models, run_plan, run_pull
from .chat import run_chat
from .selftest import run_selftest
from .serve import run_serve
from .watch import run_watch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gguf-mcv",
                                     description="Run MiniCPM-V vision-language models on a small machine.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(metavar="COMMAND")

    p = sub.add_parser("models", help="list the catalog and what is in the local cache")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_models)

    p = sub.add_parser("plan", help="show which quant fits this machine, how fast it runs, and why")
    p.add_argument("model", help="catalog name, Hub repo id, 'auto', or a local .gguf file")
    p.add_argument("--mmproj", help="vision projector, when MODEL is a local .gguf file "
                                    "(default: the single mmproj*.gguf next to it)")
    p.add_argument("--ram", help="memory budget, e.g. 4GB (default: free RAM minus a reserve)")
    p.add_argument("--ctx", type=int, help=f"context size (default {environment.DEFAULT_N_CTX}, shrunk to at "
                                             "least 2048 when nothing fits with it)")
    p.add_argument("--kv", choices=KV_CACHE_TYPES,
                   help="KV cache type (default f16, q8_0 when nothing fits with f16)")
    p.add_argument("--quant", help="evaluate this quant only")
    p.add_argument("--detail", choices=DETAILS, default="auto",
                   help="image detail the first-answer prediction assumes (default auto)")
    p.add_argument("--vision-backend", choices=VISION_BACKENDS, default="auto",
                   help="the vision encoder whose memory the plan counts (default auto, as load)")
    p.add_argument("--vision-weights", choices=VISION_WEIGHTS,
                   help="where an ONNX encoder keeps its weights (default: packed, mapped from their file "
                        "when nothing fits otherwise)")
    speed_args(p)
    p.add_argument("--no-probe", action="store_true",
                   help="predict speed from default constants instead of measuring this machine once")
    p.add_argument("--reprobe", action="store_true",
                   help="measure this machine again (best when nothing else is running)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_plan)

    p = sub.add_parser("pull", help="download a model and its vision projector")
    p.add_argument("model", help="catalog name or Hub repo id")
    p.add_argument("--quant", help="e.g. Q4_K_M (default: planned from RAM)")
    p.add_argument("--ram", help="memory budget for planning, e.g. 4GB")
    p.add_argument("--ctx", type=int, help=f"context size the plan assumes (default {environment.DEFAULT_N_CTX})")
    p.add_argument("--revision")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    speed_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_pull)

    p = sub.add_parser("ask", help="ask a question about images")
    model_args(p)
    p.add_argument("args", nargs="+", metavar="IMAGE... PROMPT", help="image files, then the question")
    p.add_argument("--example", action="store_true", help="ask about the bundled example image")
    p.add_argument("--detail", choices=DETAILS, default="auto")
    answer_args(p)
    cache_args(p)
    p.set_defaults(func=run_ask)

    p = sub.add_parser("video", help="ask a question about a video")
    model_args(p)
    p.add_argument("video", help="video file, animated GIF or folder of images")
    p.add_argument("prompt")
    p.add_argument("--frames", type=int, help="at most this many frames (default: from the machine)")
    p.add_argument("--fps", type=float, default=1.0, help="frames sampled per second (default 1)")
    p.add_argument("--no-dedupe", action="store_true", help="keep near-duplicate frames")
    p.add_argument("--no-timestamps", action="store_true", help="no frame times in the prompt")
    answer_args(p)
    cache_args(p)
    p.set_defaults(func=run_video)

    p = sub.add_parser("chat", help="talk about images and videos interactively")
    model_args(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--quiet", action="store_true", help="no progress line while images are encoded")
    cache_args(p)
    p.set_defaults(func=run_chat)

    p = sub.add_parser("serve", help="serve OpenAI- and Ollama-compatible HTTP APIs")
    model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="require this key (default: $GGUF_MCV_API_KEY, else none)")
    p.add_argument("--max-queue", type=int, default=8, help="requests allowed to wait (default 8)")
    p.add_argument("--parallel", default="1", metavar="auto|N",
                   help="answer N requests at once in one context (default 1; auto: as many as "
                        "the RAM budget holds, at most 8)")
    p.add_argument("--allow-local-files", action="store_true", help="let requests name local files")
    p.add_argument("--allow-remote-media", action="store_true", help="let requests name http(s) URLs")
    p.add_argument("--truncate", action="store_true",
                   help="drop a request's oldest turns when its history does not fit (default: refuse it)")
    p.add_argument("--keep-chats", metavar="DIR",
                   help="keep idle conversations' KV state in DIR (when another one takes their place, and "
                        "when the server stops), so their next request, even after a restart, is not evaluated again")
    p.add_argument("--keep-chats-size", default="4GiB", help="size cap of --keep-chats, e.g. 10GB (default 4GiB)")
    p.add_argument("--keep-chats-memory", default="auto", metavar="auto|off|SIZE",
                   help="keep idle conversations' KV state in RAM too, up to SIZE (e.g. 512MiB), so a conversation "
                        "whose slot another one took is not evaluated again (default auto: a quarter of the RAM "
                        "free once the model is loaded, at most 2GiB)")
    p.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="also answer requests for this host name (repeatable; *.example.com patterns; "
                        "* for any). Default: local names only on a loopback --host, any name otherwise")
    p.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from this origin (e.g. https://app.example.com; * for any) "
                        "call the API (repeatable; default: only the server's own page)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                   help="a request body must arrive within S seconds, else 408 (default 60)")
    p.add_argument("--ray", metavar="ADDRESS", help="serve on this Ray cluster with Ray Serve (e.g. 10.0.0.5:6379 "
                   "or 'auto'; --host/--port are then the head node's); needs pip install 'gguf-mcv[cluster]' "
                   "and the files visible on every node")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="with --ray: model copies, one per node (default 1)")
    cache_args(p)
    p.set_defaults(func=run_serve)

    p = sub.add_parser("bench", help="time a first question, a follow-up and decoding")
    model_args(p)
    p.add_argument("image", nargs="?", help="image to ask about (default: the bundled example)")
    p.add_argument("--detail", choices=DETAILS, default="auto")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-probe", action="store_true",
                   help="predict from default constants instead of measuring this machine once")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_bench)

    p = sub.add_parser("batch", help="answer a folder, glob or CSV/JSONL of images and videos into JSONL")
    model_args(p)
    p.add_argument("input", help="folder, glob ('photos/*.jpg'), image or video, or a .csv/.jsonl of rows")
    p.add_argument("--prompt", action="append", default=[], help="question for every file (repeatable; "
                   "rows with a prompt column use theirs)")
    p.add_argument("--out", required=True, help="results file (JSONL); a rerun skips what it holds")
    p.add_argument("--schema", help="JSON schema file: answers are JSON, 'parsed' holds the value")
    p.add_argument("--detail", choices=DETAILS, help="image detail (default auto)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--frames", type=int, help="videos: at most this many frames")
    p.add_argument("--fps", type=float, help="videos: frames sampled per second (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--ray", metavar="ADDRESS", help="run on this Ray cluster (e.g. 10.0.0.5:6379 or 'auto'); "
                   "needs pip install 'gguf-mcv[ray]' and the files visible on every node")
    p.add_argument("--workers", type=int, help="with --ray: model copies (default: one per node)")
    p.set_defaults(func=run_batch)

    p = sub.add_parser("watch", help="answer a question about a camera, video file or stream at every tick, "
                                     "one JSON line per answer")
    model_args(p)
    p.add_argument("source", help="camera index (0), device (/dev/video0), video file, or rtsp:// / http(s):// URL")
    p.add_argument("--prompt", required=True, help="the question asked at every tick")
    p.add_argument("--every", type=float, default=2.0, metavar="S", help="seconds between ticks (default 2)")
    p.add_argument("--schema", help="JSON schema file: answers are JSON, 'parsed' holds the value")
    p.add_argument("--only-changes", action="store_true",
                   help="print a line only when the answer (with --schema, the parsed value) changes")
    p.add_argument("--answer-unchanged", action="store_true",
                   help="ask again when nothing in the picture changed (default: repeat the last answer)")
    p.add_argument("--threshold", type=float, help="fraction of a slice that must change for it to be "
                   "encoded again (default 0.002)")
    p.add_argument("--detail", choices=DETAILS, default="auto")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--seed", type=int)
    p.add_argument("--give-up", type=float, default=30.0, metavar="S",
                   help="stop when the source gives no frame for S seconds, reconnecting meanwhile (default 30)")
    p.add_argument("--jsonl", metavar="OUT", help="also append each line to this file")
    p.add_argument("--quiet", action="store_true", help="no live status line")
    p.add_argument("--region", metavar="X,Y,W,H", help="ask about this rectangle of each frame only: pixels, or "
                   "fractions of the frame such as 0.5,0,0.5,1 (the right half)")
    p.add_argument("--zone", action="append", metavar="NAME=X,Y,W,H[:QUESTION]",
                   help="a named region with its own question (default --prompt) and events; repeat for several "
                        "zones of one source (not with --region)")
    events = p.add_argument_group("events (docs/watch.md)")
    events.add_argument("--event-on", metavar="FIELD|answer",
                        help="follow the answer ('answer') or a field of the parsed answer (with --schema): a new "
                             "value that holds is an event (started, changed or ended)")
    events.add_argument("--hold", type=int, default=1, metavar="N",
                        help="ticks a new value must hold before it is an event (default 1)")
    events.add_argument("--cooldown", type=float, default=0.0, metavar="S",
                        help="seconds after an event before the next one (default 0)")
    events.add_argument("--snapshots", metavar="DIR", help="write each event's frame here as a JPEG (oldest "
                                                           "removed beyond 200 files or 200 MiB)")
    events.add_argument("--webhook", metavar="URL", help="POST each event as JSON to this http(s) URL")
    events.add_argument("--mqtt", metavar="mqtt://HOST[:PORT]/TOPIC",
                        help="publish each event on TOPIC/event and the value, retained, on TOPIC/state "
                             "(TOPIC/ZONE/... for zones); mqtts:// for TLS")
    events.add_argument("--mqtt-discovery", nargs="?", const="homeassistant", metavar="PREFIX",
                        help="announce each value to Home Assistant's MQTT discovery (prefix default homeassistant)")
    p.set_defaults(func=run_watch)

    p = sub.add_parser("selftest", help="check the install offline with a tiny generated model")
    p.set_defaults(func=run_selftest)
    return parser


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="catalog name, Hub repo id, or a local .gguf file")
    p.add_argument("--mmproj", help="vision projector, when MODEL is a local .gguf file "
                                    "(default: the single mmproj*.gguf next to it)")
    p.add_argument("--quant", help="quantization, e.g. Q4_K_M (default: planned from RAM)")
    p.add_argument("--ram", help="memory budget for planning, e.g. 4GB")
    p.add_argument("--ctx", type=int, help=f"context size (default {environment.DEFAULT_N_CTX}, shrunk to at "
                                             "least 2048 when nothing fits with it)")
    p.add_argument("--threads", type=int, help="CPU threads (default: performance cores)")
    p.add_argument("--gpu-layers", default="0", help="layers to offload to a GPU: N, -1 (all) or auto")
    p.add_argument("--vision-gpu", action="store_true", help="run the vision encoder on the GPU")
    p.add_argument("--vision-backend", choices=VISION_BACKENDS, default="auto",
                   help="who runs the vision encoder (default auto: ONNX Runtime int8 on a CPU)")
    p.add_argument("--vision-weights", choices=VISION_WEIGHTS,
                   help="where an ONNX encoder keeps its weights: packed in memory, or read from their "
                        "mapped file (slower; for small budgets). Default: packed unless nothing fits")
    p.add_argument("--kv", choices=KV_CACHE_TYPES,
                   help="KV cache type (default f16, q8_0 when nothing fits with f16)")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's logs")
    speed_args(p)


def speed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-tokens-per-s", type=float, metavar="N",
                   help="only quants (and, for 'auto', models) predicted to decode at least N tokens/s")
    p.add_argument("--max-first-answer-s", type=float, metavar="S",
                   help="only those predicted to answer a photo's first token within S seconds")


def cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", help="folder of the image-embedding disk cache "
                                       "(default: $GGUF_MCV_CACHE/embeddings, else ~/.cache/gguf_mcv/embeddings)")
    p.add_argument("--cache-size", default="2GiB", help="size cap of that cache, e.g. 500MB (default 2GiB)")
    p.add_argument("--no-disk-cache", action="store_true", help="keep image embeddings in memory only")


def answer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="print the answer with usage and timings as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line while images are encoded")
