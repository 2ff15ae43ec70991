"""The ``gguf-mcv`` command: a thin layer over the library.

Exit codes: 0 ok, 1 a user-facing error (one line on stderr, no traceback unless
``--debug``), 2 bad usage (argparse). Each command imports what it needs when it
runs, so ``gguf-mcv --help`` does not load llama.cpp, huggingface_hub or OpenCV.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from . import constants
from .errors import ConfigError, ContextOverflowError, GgufMcvError, MediaError
from .options import (
    DETAILS,
    KV_CACHE_TYPES,
    VISION_BACKENDS,
    VISION_WEIGHTS,
    check_int,
    check_max_tokens,
    check_number,
    check_sampling,
    check_text,
)
from .units import format_size


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (GgufMcvError, OSError) as exc:
        if args.debug:
            raise
        print(f"gguf-mcv: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gguf-mcv", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(metavar="COMMAND")

    p = sub.add_parser("models", help="list the catalog and what is in the local cache")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_models)

    p = sub.add_parser("plan", help="show which quant fits this machine, how fast it runs, and why")
    p.add_argument("model", help="catalog name, Hub repo id, 'auto', or a local .gguf file")
    p.add_argument("--mmproj", help="vision projector, when MODEL is a local .gguf file "
                                    "(default: the single mmproj*.gguf next to it)")
    p.add_argument("--ram", help="memory budget, e.g. 4GB (default: free RAM minus a reserve)")
    p.add_argument("--ctx", type=int, help=f"context size (default {constants.DEFAULT_N_CTX}, shrunk to at "
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
    _speed_args(p)
    p.add_argument("--no-probe", action="store_true",
                   help="predict speed from default constants instead of measuring this machine once")
    p.add_argument("--reprobe", action="store_true",
                   help="measure this machine again (best when nothing else is running)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_plan)

    p = sub.add_parser("pull", help="download a model and its vision projector")
    p.add_argument("model", help="catalog name or Hub repo id")
    p.add_argument("--quant", help="e.g. Q4_K_M (default: planned from RAM)")
    p.add_argument("--ram", help="memory budget for planning, e.g. 4GB")
    p.add_argument("--ctx", type=int, help=f"context size the plan assumes (default {constants.DEFAULT_N_CTX})")
    p.add_argument("--revision")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _speed_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_pull)

    p = sub.add_parser("ask", help="ask a question about images")
    _model_args(p)
    p.add_argument("args", nargs="+", metavar="IMAGE... PROMPT", help="image files, then the question")
    p.add_argument("--example", action="store_true", help="ask about the bundled example image")
    p.add_argument("--detail", choices=DETAILS, default="auto")
    _answer_args(p)
    _cache_args(p)
    p.set_defaults(func=_ask)

    p = sub.add_parser("video", help="ask a question about a video")
    _model_args(p)
    p.add_argument("video", help="video file, animated GIF or folder of images")
    p.add_argument("prompt")
    p.add_argument("--frames", type=int, help="at most this many frames (default: from the machine)")
    p.add_argument("--fps", type=float, default=1.0, help="frames sampled per second (default 1)")
    p.add_argument("--no-dedupe", action="store_true", help="keep near-duplicate frames")
    p.add_argument("--no-timestamps", action="store_true", help="no frame times in the prompt")
    _answer_args(p)
    _cache_args(p)
    p.set_defaults(func=_video)

    p = sub.add_parser("chat", help="talk about images and videos interactively")
    _model_args(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--quiet", action="store_true", help="no progress line while images are encoded")
    _cache_args(p)
    p.set_defaults(func=_chat)

    p = sub.add_parser("serve", help="serve OpenAI- and Ollama-compatible HTTP APIs")
    _model_args(p)
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
    p.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="also answer requests for this host name (repeatable; *.example.com patterns; "
                        "* for any). Default: local names only on a loopback --host, any name otherwise")
    p.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from this origin (e.g. https://app.example.com; * for any) "
                        "call the API (repeatable; default: only the server's own page)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                   help="a request body must arrive within S seconds, else 408 (default 60)")
    _cache_args(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("bench", help="time a first question, a follow-up and decoding")
    _model_args(p)
    p.add_argument("image", nargs="?", help="image to ask about (default: the bundled example)")
    p.add_argument("--detail", choices=DETAILS, default="auto")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-probe", action="store_true",
                   help="predict from default constants instead of measuring this machine once")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench)

    p = sub.add_parser("batch", help="answer a folder, glob or CSV/JSONL of images and videos into JSONL")
    _model_args(p)
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
    p.set_defaults(func=_batch)

    p = sub.add_parser("watch", help="answer a question about a camera, video file or stream at every tick, "
                                     "one JSON line per answer")
    _model_args(p)
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
    p.set_defaults(func=_watch)

    p = sub.add_parser("selftest", help="check the install offline with a tiny generated model")
    p.set_defaults(func=_selftest)
    return parser


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="catalog name, Hub repo id, or a local .gguf file")
    p.add_argument("--mmproj", help="vision projector, when MODEL is a local .gguf file "
                                    "(default: the single mmproj*.gguf next to it)")
    p.add_argument("--quant", help="quantization, e.g. Q4_K_M (default: planned from RAM)")
    p.add_argument("--ram", help="memory budget for planning, e.g. 4GB")
    p.add_argument("--ctx", type=int, help=f"context size (default {constants.DEFAULT_N_CTX}, shrunk to at "
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
    _speed_args(p)


def _speed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-tokens-per-s", type=float, metavar="N",
                   help="only quants (and, for 'auto', models) predicted to decode at least N tokens/s")
    p.add_argument("--max-first-answer-s", type=float, metavar="S",
                   help="only those predicted to answer a photo's first token within S seconds")


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", help="folder of the image-embedding disk cache "
                                       "(default: $GGUF_MCV_CACHE/embeddings, else ~/.cache/gguf_mcv/embeddings)")
    p.add_argument("--cache-size", default="2GiB", help="size cap of that cache, e.g. 500MB (default 2GiB)")
    p.add_argument("--no-disk-cache", action="store_true", help="keep image embeddings in memory only")


def _answer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="print the answer with usage and timings as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line while images are encoded")


# --- commands ----------------------------------------------------------------------


def _models(args: argparse.Namespace) -> int:
    from .models.catalog import load_catalog  # lazy: per command
    from .models.hub import cached_models  # lazy: per command

    cached = {repo.lower(): (repo, files) for repo, files in cached_models().items()}
    rows: list[dict[str, Any]] = []
    for entry in load_catalog().entries():
        files = cached.pop(entry.repo.lower(), ("", []))[1]
        rows.append({"name": entry.name, "display_name": entry.display_name, "repo": entry.repo,
                     "rank": entry.rank, "thinking": entry.thinking,
                     "quants": {q: f.size for q, f in entry.quants.items()},
                     "cached": [{"file": f, "bytes": n} for f, n in files]})
    others: list[dict[str, Any]] = [{"repo": repo, "cached": [{"file": f, "bytes": n} for f, n in files]}
              for repo, files in cached.values()]
    if args.json:
        print(json.dumps({"catalog": rows, "other_cached": others}, indent=2))
        return 0
    for row in rows:
        print(f"{row['name']:<26} {row['display_name']:<26} {row['repo']}")
        print(f"{'':<26} quants: {', '.join(row['quants'])}")
        for f in row["cached"]:
            print(f"{'':<26} cached: {f['file']} ({format_size(f['bytes'])})")
    for row in others:
        print(f"{'(not in catalog)':<26} {row['repo']}")
        for f in row["cached"]:
            print(f"{'':<26} cached: {f['file']} ({format_size(f['bytes'])})")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .planning.planner import check_request  # lazy: per command
    from .resolver import check_plan, plan, plan_local  # lazy: per command

    limits: dict[str, Any] = dict(detail=args.detail, min_tokens_per_s=args.min_tokens_per_s,
                                  max_first_answer_s=args.max_first_answer_s)
    settings: dict[str, Any] = dict(ram_budget=args.ram, n_ctx=args.ctx, kv_cache_type=args.kv,
                                    vision_backend=args.vision_backend, vision_weights=args.vision_weights, **limits)
    local = _local_files(args)
    # every argument before the machine is probed (the speed probe takes seconds to a minute)
    if local is not None:
        check_request(**settings)
    else:
        check_plan(args.model, quant=args.quant, **settings)
    from .hardware import probe as hardware_probe  # lazy: per command
    from .resolver import machine_rates  # lazy: per command

    hw = hardware_probe()
    rates = machine_rates(hw, False if args.no_probe else None, refresh=args.reprobe)
    if local is not None:
        result = plan_local(*local, hardware=hw, ram_budget=args.ram, n_ctx=args.ctx, kv_cache_type=args.kv,
                            rates=rates, vision_backend=args.vision_backend, vision_weights=args.vision_weights,
                            **limits)
    else:
        result = plan(args.model, ram_budget=args.ram, n_ctx=args.ctx, quant=args.quant,
                      kv_cache_type=args.kv, hardware=hw, rates=rates, vision_backend=args.vision_backend,
                      vision_weights=args.vision_weights, **limits)
    kernels = _native_lines(result, local, args.vision_backend)
    if args.json:
        print(json.dumps({**result.to_dict(), "native_kernels": kernels}, indent=2))
    else:
        print(result.table())
        for line in kernels:
            print(f"Native kernels: {line}")
    return 0


def _native_lines(result: Any, local: tuple[Path, Path] | None, vision_backend: str) -> list[str]:
    """What the native check (gguf_mcv.runtime.native_check) changes for this plan's load, or refuses."""
    from .planning.memory import QUANT_TYPE_MIX, output_type
    from .runtime import native_check  # lazy: per command

    if local is not None:
        types = native_check.weight_types(local[0])
    else:
        types = {*QUANT_TYPE_MIX.get(result.quant.upper(), {result.quant.upper(): 1.0}), output_type(result.quant)}
    try:
        decision = native_check.decide(types, None if result.vision_on_gpu else result.vision_backend,
                                       vision_auto=vision_backend == "auto", what=result.quant)
    except GgufMcvError as exc:
        return [f"refused: {_one_line(exc)}"]
    # the plan itself may have moved the vision backend (announced then, kept in native_check.notices())
    notices = dict.fromkeys([*native_check.notices(), *decision.notices])
    return list(notices) or ["every kernel this load uses ran in the check"]


def _pull(args: argparse.Namespace) -> int:
    from .resolver import pull  # lazy: per command

    files = pull(args.model, quant=args.quant, ram_budget=args.ram, n_ctx=args.ctx,
                 revision=args.revision, progress=False if args.no_progress else None,
                 min_tokens_per_s=args.min_tokens_per_s, max_first_answer_s=args.max_first_answer_s)
    out = {"repo": files.repo, "revision": files.revision, "quant": files.quant,
           "model": str(files.model), "mmproj": str(files.mmproj)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{files.repo} {files.quant}\n  model:  {files.model}\n  mmproj: {files.mmproj}")
    return 0


def _ask(args: argparse.Namespace) -> int:
    from .selftest import EXAMPLE_IMAGE  # lazy: per command

    *images, prompt = args.args
    if args.example:
        images = [str(EXAMPLE_IMAGE), *images]
    with _load(args) as model:
        reply = model.ask(prompt, images, stream=not args.json, detail=args.detail,
                          on_progress=_progress_line(args), **_sampling(args))
        _print_answer(reply, args.json)
    return 0


def _video(args: argparse.Namespace) -> int:
    with _load(args) as model:
        reply = model.ask_video(
            args.prompt, args.video, max_frames=args.frames, fps=args.fps,
            dedupe=not args.no_dedupe, timestamps=not args.no_timestamps, stream=not args.json,
            on_progress=_progress_line(args, "frame"), **_sampling(args))
        _print_answer(reply, args.json)
    return 0


def _chat(args: argparse.Namespace) -> int:
    with _load(args) as model:
        chat = model.chat(system=args.system, overflow="drop_oldest")
        images: list[str] = []
        videos: list[str] = []
        print("Type a question. /image PATH, /video PATH, /again (answer the last question anew), "
              "/save PATH, /load PATH, /reset, /exit.", file=sys.stderr)
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                return 0
            command, _, rest = line.partition(" ")
            if command == "/exit":
                return 0
            if command == "/reset":
                chat.reset()
                images.clear()
                videos.clear()
                print("(conversation cleared)", file=sys.stderr)
            elif command in ("/save", "/load") and rest.strip():
                try:
                    if command == "/save":
                        kept = chat.save(rest.strip())
                        print(f"(saved to {rest.strip()}{'' if kept else '; its turns will be evaluated again'})",
                              file=sys.stderr)
                    else:
                        chat = model.load_chat(rest.strip())
                        print(f"(loaded {len(chat.history) // 2} question(s) from {rest.strip()})", file=sys.stderr)
                except GgufMcvError as exc:
                    print(f"(error: {_one_line(exc)})", file=sys.stderr)
            elif command == "/again":
                try:
                    _print_pieces(chat.regenerate(stream=True, max_tokens=args.max_tokens))
                except ConfigError as exc:
                    print(f"(error: {_one_line(exc)})", file=sys.stderr)
            elif command in ("/image", "/video"):
                if not Path(rest.strip()).exists():
                    print(f"(no such file: {rest.strip()})", file=sys.stderr)
                    continue
                (images if command == "/image" else videos).append(rest.strip())
                print(f"({command[1:]} added to the next question)", file=sys.stderr)
            elif line:
                try:
                    stream = chat.send(line, images, videos=videos, stream=True,
                                       max_tokens=args.max_tokens, on_progress=_progress_line(args))
                    _print_pieces(stream)
                    dropped = stream.reply.dropped_turns if stream.reply is not None else 0
                    if dropped > 0:
                        print(f"(the context was full: the {dropped} oldest question(s) and their "
                              "answers were dropped)", file=sys.stderr)
                except ContextOverflowError as exc:
                    print(f"(this question does not fit in the context even on its own: "
                          f"{_one_line(exc)} The conversation is kept; /reset starts over.)",
                          file=sys.stderr)
                except (MediaError, ConfigError) as exc:
                    print(f"(error: {_one_line(exc)})", file=sys.stderr)
                images.clear()
                videos.clear()


def _print_pieces(stream: Any) -> None:
    for piece in stream:
        print(piece, end="", flush=True)
    print()


def _serve(args: argparse.Namespace) -> int:
    try:
        from .server import check_bind, serve_supervised  # lazy: per command, and an optional extra
        from .server.logs import configure_logging
        from .server.origins import check_allowed
    except ImportError as exc:
        raise ConfigError(f"The server needs its extra: pip install 'gguf-mcv[server]' ({exc}).") from exc
    check_bind(args.host, args.port)  # a bad address or a port in use, before minutes of loading
    from functools import partial  # lazy: per command

    from .units import parse_size  # lazy: per command

    keep_bytes = parse_size(args.keep_chats_size)  # a bad size, before minutes of loading
    check_allowed(args.allowed_host or (), args.allowed_origin)
    if not check_number("--body-timeout", args.body_timeout) > 0:
        raise ConfigError(f"--body-timeout must be more than 0 seconds, not {args.body_timeout:g}.")
    _checked_load_kwargs(args)  # a missing file or a bad setting, before a worker starts
    configure_logging()  # the supervisor's warnings show too (each worker configures its own)
    # the model is loaded (again, if it dies) in the server's worker process: _load travels by name
    serve_supervised(partial(_load, args), host=args.host, port=args.port, api_key=args.api_key,
                     max_queue=args.max_queue, allow_local_files=args.allow_local_files,
                     allow_remote_media=args.allow_remote_media, truncate=args.truncate,
                     keep_chats=args.keep_chats, keep_chats_bytes=keep_bytes,
                     body_timeout_s=args.body_timeout, allowed_hosts=args.allowed_host,
                     allowed_origins=args.allowed_origin)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .selftest import EXAMPLE_IMAGE  # lazy: per command

    image = args.image or str(EXAMPLE_IMAGE)
    with _load(args) as model:
        chat = model.chat()
        first = chat.send("Describe this picture.", image, detail=args.detail,
                          max_tokens=args.max_tokens, temperature=0)
        follow = chat.send("What colours are in it?", max_tokens=args.max_tokens, temperature=0)
        result = {
            "model": model.info.name, "quant": model.info.quant, "vision_backend": model.info.vision_backend,
            "image_tokens": first.usage.image_tokens, "slices_encoded": first.timings.slices_encoded,
            "first_ttft_s": first.timings.ttft_ms / 1000, "encode_s": first.timings.encode_ms / 1000,
            "follow_up_ttft_s": follow.timings.ttft_ms / 1000,
            "decode_tokens_per_s": first.timings.decode_tokens_per_s,
        }
        result.update(_bench_predictions(model.info, first, args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:<22} {value:.3f}" if isinstance(value, float) else f"{key:<22} {value}")
    return 0


def _bench_predictions(info: Any, first: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The speed model's predictions for what ``_bench`` just measured, keyed ``predicted_*``."""
    from .hardware import probe as hardware_probe  # lazy: per command
    from .models.headers import read_projector_header, read_tensors, read_text_header, tensor_list  # lazy
    from .planning import speed  # lazy: per command
    from .resolver import machine_rates  # lazy: per command

    text, projector = read_text_header(info.model_path), read_projector_header(info.mmproj_path)
    weights = speed.weight_profile(text.size, text.shape, info.quant, tensor_list(read_tensors(info.model_path)))
    threads = args.threads or hardware_probe().recommended_threads
    rates = machine_rates(hardware_probe(), False if args.no_probe else None)
    rates = speed.scaled(rates, **{k: threads / rates.threads for k in ("matvec", "prefill_flops", "vision_flops")})
    prompt = first.usage.prompt_tokens
    token = speed.decode_seconds(text.size, text.shape, info.quant, rates, n_past=prompt, weights=weights)
    encode = speed.encode_seconds(projector.shape, text.shape.n_embd, rates, backend=info.vision_backend)
    slices = first.timings.slices_encoded
    prefill = speed.prefill_seconds(prompt, text.shape, rates, weights=weights)
    return {
        "predicted_decode_tokens_per_s": 1 / token,
        "predicted_encode_s": encode * slices,
        "predicted_first_ttft_s": encode * slices + prefill + token,
        "rates_source": rates.source,
    }


def _batch(args: argparse.Namespace) -> int:
    from .jobs import batch  # lazy: per command

    # every argument before the model is loaded (or a cluster joined)
    load_kwargs = _checked_load_kwargs(args)
    schema = batch.load_schema(args.schema) if args.schema else None
    options = batch.check_options({"max_tokens": args.max_tokens, "temperature": args.temperature,
                                   "seed": args.seed, "detail": args.detail, "max_frames": args.frames,
                                   "fps": args.fps})
    batch.check_out(args.out)
    if args.workers is not None:
        check_int("--workers", args.workers, low=1)
    items = batch.collect(args.input, prompts=args.prompt, schema=schema, options=options)
    show = False if args.no_progress else None
    if args.ray:
        from .jobs import batch_ray  # lazy: per command, and an optional extra

        summary = batch_ray.run_items(args.ray, load_kwargs, items, args.out, workers=args.workers,
                                      progress=show)
    else:
        with _load(args) as model:
            summary = batch.run_items(model, items, args.out, progress=show)
    repaired = f"; cut a torn last line ({summary.repaired_bytes} bytes)" if summary.repaired_bytes else ""
    print(f"{summary.answered} answered ({summary.failed} errors), {summary.skipped} already in {args.out}, "
          f"{summary.items_per_s:.2f} items/s{repaired}", file=sys.stderr)
    return 0


def _watch(args: argparse.Namespace) -> int:
    from .watch import watch  # lazy: per command
    from .watch.changes import DEFAULT_THRESHOLD  # lazy: per command
    from .watch.jsonl import LinesFile  # lazy: per command
    from .watch.sources import check_source  # lazy: per command

    schema = None
    if args.schema:
        from .jobs.batch_input import load_schema  # lazy: per command

        schema = load_schema(args.schema)
    from .watch.changes import check_threshold  # lazy: per command
    from .watch.observe import check_every  # lazy: per command
    from .watch.sources import check_give_up  # lazy: per command

    check_source(args.source)  # a missing file, a bad URL or number, before minutes of loading
    check_every(args.every)
    check_give_up(args.give_up)
    if args.threshold is not None:
        check_threshold(args.threshold)
    check_text("--prompt", args.prompt)
    check_max_tokens(args.max_tokens)
    check_sampling(temperature=args.temperature, seed=args.seed)
    _checked_load_kwargs(args)
    out = LinesFile(args.jsonl).open() if args.jsonl else None  # a FIFO or a JPEG refused before loading
    if out is not None and out.repaired_bytes:
        print(f"{args.jsonl}: cut a torn last line ({out.repaired_bytes} bytes)", file=sys.stderr)
    status = None if args.quiet or not sys.stderr.isatty() else _status_line
    lines = 0
    try:
        with _load(args) as model:
            watching = watch(model, args.source, args.prompt, every_s=args.every, schema=schema,
                             only_changes=args.only_changes, answer_unchanged=args.answer_unchanged,
                             threshold=DEFAULT_THRESHOLD if args.threshold is None else args.threshold,
                             detail=args.detail, max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=args.seed, give_up_s=args.give_up)
            try:
                for seen in watching:
                    line = json.dumps(seen.to_dict(), ensure_ascii=False)
                    if out is not None:
                        out.write(line)  # first: every line printed is in the file
                    if status is not None:
                        print("\r\x1b[K", end="", file=sys.stderr)
                    print(line, flush=True)
                    lines += 1
                    if status is not None:
                        status(seen, lines)
            except KeyboardInterrupt:
                if status is not None:
                    print("\r\x1b[K", end="", file=sys.stderr)
                print(f"(stopped after {lines} observation(s))", file=sys.stderr)
                return 130
            finally:
                watching.close()  # releases the camera or stream
    finally:
        if out is not None:
            out.close()
    return 0


def _status_line(seen: Any, lines: int) -> None:
    """One live line on stderr (a terminal) saying what the last tick did."""
    what = "asked" if seen.asked else "unchanged"
    print(f"frame {seen.frame_index} · {seen.changed:.1%} changed · {seen.slices_encoded} encoded / "
          f"{seen.slices_reused} reused · {what} · {seen.latency_s:.2f} s · skipped {seen.frames_skipped} "
          f"frames, {seen.ticks_skipped} ticks · reconnects {seen.reconnects} · {lines} lines",
          end="", file=sys.stderr, flush=True)


def _selftest(args: argparse.Namespace) -> int:
    from . import selftest  # lazy: per command

    print("gguf-mcv selftest")
    return 0 if selftest.run() else 1


# --- helpers -----------------------------------------------------------------------


def _load(args: argparse.Namespace):
    from .loader import load  # lazy: per command

    model = load(**_load_kwargs(args), embed_cache=_embed_cache(args))
    if args.verbose or (getattr(args, "vision_backend", "auto") == "auto" and model.info.vision_backend == "llama.cpp"):
        print(f"vision encoder: {model.info.vision_backend} ({model.info.vision_backend_reason})", file=sys.stderr)
    return model


def _checked_load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`_load_kwargs`, checked as ``load()`` checks them (:func:`gguf_mcv.loader.check_load`),
    for a command that does more before it loads (or loads in another process)."""
    from .loader import check_load  # lazy: per command

    kwargs = _load_kwargs(args)
    check_load(**kwargs)
    return kwargs


def _load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``load()``'s keywords for MODEL and the model options (plain values: they travel to Ray workers)."""
    gpu = args.gpu_layers if args.gpu_layers == "auto" else _int(args.gpu_layers, "--gpu-layers")
    common: dict[str, Any] = dict(n_ctx=args.ctx, n_threads=args.threads, n_gpu_layers=gpu,
                                  vision_gpu=args.vision_gpu, kv_cache_type=args.kv,
                                  vision_backend=getattr(args, "vision_backend", "auto"), verbose=args.verbose,
                                  vision_weights=getattr(args, "vision_weights", None),
                                  min_tokens_per_s=getattr(args, "min_tokens_per_s", None),
                                  max_first_answer_s=getattr(args, "max_first_answer_s", None))
    parallel = getattr(args, "parallel", "1")
    common["parallel"] = parallel if parallel == "auto" else _int(parallel, "--parallel")
    local = _local_files(args)
    if local is not None:
        return dict(model_path=str(local[0].resolve()), mmproj_path=str(local[1].resolve()),
                    ram_budget=args.ram, **common)
    return dict(model=args.model, quant=args.quant, ram_budget=args.ram, **common)


def _local_files(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """(model, mmproj) when MODEL names a local .gguf file (or --mmproj was given), else None."""
    local = Path(args.model)
    if not (args.model.endswith(".gguf") or args.mmproj):
        return None
    if not local.is_file():
        raise ConfigError(f"Model file {local} does not exist.")
    return local, Path(args.mmproj) if args.mmproj else _find_mmproj(local)


def _embed_cache(args: argparse.Namespace):
    """The embedding cache the command's options ask for: a disk tier unless --no-disk-cache
    (None for commands without those options: the model's own, in memory)."""
    from .units import parse_size  # lazy: per command
    from .vision.embed_cache import EmbeddingCache, default_disk_dir  # lazy: per command

    if not hasattr(args, "no_disk_cache"):
        return None
    if args.no_disk_cache:
        if args.cache_dir is not None:
            raise ConfigError("Give --cache-dir or --no-disk-cache, not both.")
        return EmbeddingCache()
    folder = Path(args.cache_dir).expanduser() if args.cache_dir else default_disk_dir()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--cache-dir {folder} is a file, not a folder: name a folder (it is created).")
    return EmbeddingCache(disk_dir=folder, max_disk_bytes=parse_size(args.cache_size))


def _find_mmproj(model: Path) -> Path:
    found = sorted(p for p in model.parent.glob("*.gguf") if "mmproj" in p.name.lower())
    if len(found) != 1:
        raise ConfigError(f"Pass --mmproj: found {len(found)} mmproj files next to {model}.")
    return found[0]


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        out["temperature"] = args.temperature
    if args.seed is not None:
        out["seed"] = args.seed
    return out


def _print_answer(reply_or_stream, as_json: bool) -> None:
    if not as_json:
        for piece in reply_or_stream:
            print(piece, end="", flush=True)
        print()
        return
    reply = reply_or_stream
    out: dict[str, Any] = {"answer": str(reply), "finish_reason": reply.finish_reason,
                           "usage": vars(reply.usage), "timings": vars(reply.timings)}
    if reply.reasoning:
        out["reasoning"] = reply.reasoning
    if reply.video is not None:
        out["video"] = vars(reply.video)
    print(json.dumps(out, indent=2))


def _progress_line(args: argparse.Namespace, unit: str = "image slice"):
    """An ``on_progress`` callback drawing the slices being encoded on stderr (cleared before
    the answer); None when stderr is not a terminal or ``--quiet`` was given."""
    from .progress import encoding  # lazy: per command

    return None if getattr(args, "quiet", False) else encoding(unit)


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} takes an integer or 'auto', not {text!r}.") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
