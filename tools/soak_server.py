#!/usr/bin/env python3
"""Soak the server with parallel slots: many clients, a mixed valid load, for a fixed time.

Starts ``gguf-mcv serve --parallel N`` (``auto`` or a number) as a child process on a
model (the tiny generated one unless told otherwise), then ``--clients`` client threads
send requests for ``--seconds``, each picking one of these at random (client n starts with the
n-th, so that the first wave has every kind):

* ``text``: a new OpenAI question, not streamed;
* ``follow_up``: the next turn of the client's own conversation (its first turn has an
  image from a shared pool), the history sent again, as OpenAI clients do (KV reuse);
* ``image_new``: an OpenAI question about a never-seen image (a data: URL), streamed;
* ``image_seen``: an Ollama ``/api/chat`` question about an image from the shared pool
  (embedding cache, prefix copies between slots), not streamed;
* ``photo``: an OpenAI question about a camera-sized JPEG (``--photo-mp``, 12 MP; two of
  them, so the second time it comes from the embedding cache but is still decoded), not streamed;
* ``video``: an OpenAI ``video_url`` part, a short animated GIF (a few frames);
* ``ollama_stream``: an Ollama ``/api/generate`` NDJSON stream, half of them with a pool image;
* ``hang_up``: a stream (OpenAI SSE or Ollama NDJSON) the client closes after its first
  event: an intended hang-up, not a dropped connection.

Every request is valid, so every answer must be a 200 that ends properly. Counted as
**errors**: any other status (a 503 ``server_busy`` too: for the user it is a refused
request — the queue is sized so that all clients are admitted, ``--max-queue`` defaults to
the client count), an error inside a stream, a timeout. Counted as **dropped
connections**: a connection reset or closed by the server, a stream that stops without its
end (``[DONE]``, ``"done": true``). The server's RSS is sampled every 0.5 s (psutil) and its
peak (the kernel's ``VmHWM``, which also sees between samples) is compared with the plan's
prediction for this model, ``n_ctx`` and slot count: ``plan_local()``'s memory row plus
``slot_bytes`` per slot beyond the first, as ``parallel="auto"`` counts them.

Reported: requests by kind and outcome, TTFT p50/p95 (streamed requests: from sending to
the first event carrying the answer), aggregate completion tokens/s, RSS over time.
Exit status 1 on any error, dropped connection, RSS over the plan, or an unhealthy server.

    python tools/soak_server.py --clients 16 --seconds 60 --parallel 4
    python tools/soak_server.py --parallel auto --photo-mp 0      # small images only
    python tools/soak_server.py --model /tmp/bench/ggml-model-Q4_K_M.gguf --parallel auto \\
        --ctx 2048 --threads 2 --image-side 448 --json soak.json
"""

from __future__ import annotations

import argparse
import base64
import collections
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import requests
from bench import options, record
from bench.images import data_uri, gif_bytes, photo_bytes, png_bytes
from bench.memory import MIB, TreeSampler
from bench.models import model_files
from bench.served import Dropped, StreamError, planned_peak, read_stream, start_server
from bench.stats import percentile

#: request kinds and their weights in the mix
KINDS = {"text": 3, "follow_up": 3, "image_new": 1, "image_seen": 2, "photo": 1, "video": 1,
         "ollama_stream": 2, "hang_up": 2}
POOL = 6  #: images shared by all clients
TURNS = 4  #: a conversation starts again after this many questions
TIMEOUT_S = 600.0  #: a request not answered within this is an error


@dataclass
class Outcome:
    """One request: what was sent, what came back."""

    kind: str
    route: str
    stream: bool
    result: str  #: "ok", "hang_up", "error:<what>" or "dropped:<what>"
    status: int | None
    began: float  #: seconds since the load began
    seconds: float
    ttft: float | None = None  #: streamed only: seconds to the first event carrying the answer
    tokens: int = 0  #: completion tokens of a finished answer


class Client:
    """One client thread's state: its random choices, its conversation, its session."""

    def __init__(self, n: int, base: str, name: str, args: argparse.Namespace, pool: list[bytes],
                 photos: list[bytes]) -> None:
        self.n, self.base, self.name, self.args, self.pool, self.photos = n, base, name, args, pool, photos
        self.rng = random.Random(args.seed * 1000 + n)
        self.session = requests.Session()
        self.conversation: list[dict[str, Any]] = []
        self.new_images = 0
        self.route = "?"  #: the route of the request in progress

    # -- the kinds ---------------------------------------------------------------------------------

    def image_part(self, raw: bytes, mime: str = "image/png", detail: str = "low") -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": data_uri(raw, mime), "detail": detail}}

    def pool_image(self) -> bytes:
        return self.pool[self.rng.randrange(len(self.pool))]

    def new_image(self) -> bytes:
        self.new_images += 1
        return png_bytes(10_000 + self.n * 10_000 + self.new_images, self.args.image_side)

    def openai(self, messages: list[dict[str, Any]], stream: bool, hang_up: bool = False) -> tuple[int, Any]:
        self.route = "openai"
        body = {"model": self.name, "messages": messages, "max_tokens": self.args.max_tokens, "stream": stream}
        if not stream:
            r = self.session.post(f"{self.base}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
            if r.status_code != 200:
                return r.status_code, None
            reply = r.json()
            return 200, (reply["choices"][0]["message"]["content"] or "", reply["usage"]["completion_tokens"], None)
        return self.read_stream(f"{self.base}/v1/chat/completions", body, sse=True, hang_up=hang_up)

    def ollama_generate(self, prompt: str, images: list[bytes], hang_up: bool = False) -> tuple[int, Any]:
        self.route = "ollama"
        body = {"model": self.name, "prompt": prompt, "stream": True,
                "images": [base64.b64encode(i).decode() for i in images],
                "options": {"num_predict": self.args.max_tokens}}
        return self.read_stream(f"{self.base}/api/generate", body, sse=False, hang_up=hang_up)

    def read_stream(self, url: str, body: dict[str, Any], sse: bool, hang_up: bool) -> tuple[int, Any]:
        return read_stream(self.session, url, body, sse=sse, hang_up=hang_up, timeout=TIMEOUT_S)

    def send(self, kind: str) -> tuple[str, bool, int, Any]:
        """(route, streamed, status, (text, tokens, ttft) or None) for one request of ``kind``."""
        question = f"Client {self.n}: question {self.rng.randrange(10**6)}?"
        if kind == "text":
            return ("openai", False, *self.openai([{"role": "user", "content": question}], stream=False))
        if kind == "follow_up":
            if len(self.conversation) >= 2 * TURNS - 1 or not self.conversation:
                first = [self.image_part(self.pool_image()), {"type": "text", "text": question}]
                self.conversation = [{"role": "system", "content": "You answer briefly."},
                                     {"role": "user", "content": first}]
            else:
                self.conversation.append({"role": "user", "content": question})
            status, reply = self.openai(self.conversation, stream=False)
            if reply is not None:
                self.conversation.append({"role": "assistant", "content": reply[0]})
            else:
                self.conversation = []
            return "openai", False, status, reply
        if kind == "image_new":
            content = [self.image_part(self.new_image()), {"type": "text", "text": question}]
            return ("openai", True, *self.openai([{"role": "user", "content": content}], stream=True))
        if kind == "image_seen":
            self.route = "ollama"
            body = {"model": self.name, "stream": False, "options": {"num_predict": self.args.max_tokens},
                    "messages": [{"role": "user", "content": question,
                                  "images": [base64.b64encode(self.pool_image()).decode()]}]}
            r = self.session.post(f"{self.base}/api/chat", json=body, timeout=TIMEOUT_S)
            if r.status_code != 200:
                return "ollama", False, r.status_code, None
            reply = r.json()
            if not reply.get("done"):
                raise Dropped("an Ollama answer without done")
            return "ollama", False, 200, (reply["message"]["content"], reply.get("eval_count", 0), None)
        if kind == "photo":
            photo = self.photos[self.rng.randrange(len(self.photos))]
            content = [self.image_part(photo, "image/jpeg", self.args.photo_detail), {"type": "text", "text": question}]
            return ("openai", False, *self.openai([{"role": "user", "content": content}], stream=False))
        if kind == "video":
            video = gif_bytes(self.rng.randrange(4), frames=self.args.video_frames, side=64)
            content = [{"type": "video_url", "video_url": {"url": data_uri(video, "image/gif")}},
                       {"type": "text", "text": question}]
            return ("openai", False, *self.openai([{"role": "user", "content": content}], stream=False))
        if kind == "ollama_stream":
            images = [self.pool_image()] if self.rng.random() < 0.5 else []
            return ("ollama", True, *self.ollama_generate(question, images))
        # hang_up
        if self.rng.random() < 0.5:
            content = [self.image_part(self.pool_image()), {"type": "text", "text": question}]
            return ("openai", True, *self.openai([{"role": "user", "content": content}], stream=True, hang_up=True))
        return ("ollama", True, *self.ollama_generate(question, [], hang_up=True))

    def one(self, kind: str, t0: float) -> Outcome:
        began = time.perf_counter()
        stream, status, reply, result = kind in ("image_new", "ollama_stream", "hang_up"), None, None, "ok"
        self.route = "?"
        try:
            _, stream, status, reply = self.send(kind)
            if status != 200:
                result = f"error:status {status}"
            elif kind == "hang_up":
                result = "hang_up"
        except Dropped as exc:
            result = f"dropped:{exc}"
        except StreamError as exc:
            result, status = f"error:in stream: {exc}", 200
        except requests.Timeout:
            result = "error:timeout"
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
            result = f"dropped:{type(exc).__name__}"
        except (ValueError, KeyError, TypeError) as exc:  # a malformed answer
            result = f"error:malformed answer: {type(exc).__name__}"
        text, tokens, ttft = reply if reply is not None else ("", 0, None)
        return Outcome(kind, self.route, stream, result, status, began - t0, time.perf_counter() - began,
                       ttft, tokens if result == "ok" else 0)


def run_load(base: str, name: str, args: argparse.Namespace) -> tuple[list[Outcome], float]:
    """Every client's outcomes, and the wall time from the first request to the last answer."""
    pool = [png_bytes(seed, args.image_side) for seed in range(POOL)]
    side = (args.photo_mp * 1e6 / 12) ** 0.5  # 4:3
    photos = [photo_bytes(seed, round(4 * side), round(3 * side)) for seed in range(2)] if args.photo_mp else []
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    stop_at = t0 + args.seconds
    kinds = [k for k in (args.only.split(",") if args.only else KINDS) if photos or k != "photo"]
    weights = [KINDS[k] for k in kinds]

    def client(n: int) -> None:
        c = Client(n, base, name, args, pool, photos)
        with c.session:
            kind = kinds[n % len(kinds)]  # the first wave covers every kind
            while time.perf_counter() < stop_at:
                outcome = c.one(kind, t0)
                kind = c.rng.choices(kinds, weights)[0]
                with lock:
                    outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(n,), name=f"client-{n}") for n in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, time.perf_counter() - t0


def summarize(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    by = collections.Counter(f"{o.kind}|{o.route}|{o.result}" for o in outcomes)
    ttfts = [o.ttft for o in outcomes if o.ttft is not None and o.result == "ok"]
    tokens = sum(o.tokens for o in outcomes)
    errors = [o for o in outcomes if o.result.startswith("error")]
    dropped = [o for o in outcomes if o.result.startswith("dropped")]
    p50, p95 = percentile(ttfts, 50), percentile(ttfts, 95)
    return {
        "requests": len(outcomes), "answered": sum(o.result == "ok" for o in outcomes),
        "hang_ups": sum(o.result == "hang_up" for o in outcomes), "errors": len(errors), "dropped": len(dropped),
        "by_kind": dict(sorted(by.items())), "completion_tokens": tokens, "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_p50_ms": None if p50 is None else round(p50 * 1000),
        "ttft_p95_ms": None if p95 is None else round(p95 * 1000),
        "first_errors": sorted({o.result for o in errors + dropped})[:10],
    }


def _settled_health(base: str, wait_s: float = 15.0) -> dict:
    """/health once no request is in flight (a dropped stream ends on the server a moment after
    its client let go), or as it is after ``wait_s`` (a request that never ends shows there)."""
    deadline = time.monotonic() + wait_s
    while True:
        health = requests.get(f"{base}/health", timeout=30).json()
        if health.get("in_flight") == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def main() -> int:
    ap = options.parser(__doc__, quant=options.OMIT, threads=None)
    ap.add_argument("--model", help="a local .gguf (default: the tiny generated model)")
    ap.add_argument("--mmproj", help="its projector (default: the one mmproj*.gguf beside it)")
    ap.add_argument("--parallel", default="4", help="auto or N (default 4)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-queue", type=int, help="the server's --max-queue (default: --clients, all admitted)")
    ap.add_argument("--ctx", type=int, default=2048, help="positions per slot (default 2048)")
    ap.add_argument("--vision-backend", default="auto", help="the server's (and the plan's) vision backend")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    ap.add_argument("--image-side", type=int, default=96, help="side of the images in pixels (default 96)")
    ap.add_argument("--video-frames", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", metavar="KIND,...", help="send only these kinds (e.g. photo)")
    ap.add_argument("--photo-mp", type=float, default=12, help="megapixels of the photos (default 12; 0: none)")
    ap.add_argument("--photo-detail", default="auto", choices=("auto", "low", "high"))
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for gguf-mcv serve (repeatable), e.g. --serve-arg=--truncate")
    args = ap.parse_args()
    unknown = set(args.only.split(",")) - set(KINDS) if args.only else set()
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}: choose from {', '.join(KINDS)}")

    model, mmproj = model_files(args.model, args.mmproj)
    cache = tempfile.mkdtemp(prefix="gguf_mcv_soak_cache_")  # a fresh disk cache: nothing known before
    extra = ["--parallel", args.parallel, "--ctx", str(args.ctx), "--max-queue", str(args.max_queue or args.clients),
             "--cache-dir", cache, "--vision-backend", args.vision_backend,
             *(["--threads", str(args.threads)] if args.threads else []), *args.serve_arg]
    server = start_server(model, mmproj, extra)
    rss = TreeSampler(server.model_pid, interval=0.5)
    try:
        at_start = rss.samples[0][1]
        outcomes, wall = run_load(server.base, server.name, args)
        health = _settled_health(server.base)
        metrics_ok = requests.get(f"{server.base}/metrics", timeout=30).ok
        rss.stop()
        high_water = rss.high_water() or rss.peak
    finally:
        rss.stop()
        status = server.stop()
    plan = planned_peak(model, mmproj, n_ctx=args.ctx, parallel=server.parallel, vision_backend=args.vision_backend)
    summary = summarize(outcomes, wall)
    over_plan = high_water > plan["predicted"]
    report = {
        "model": model.name, "parallel": server.parallel, "parallel_asked": args.parallel, "clients": args.clients,
        "seconds": args.seconds, "n_ctx": args.ctx, **summary,
        "rss_mib": {"start": round(at_start / MIB, 1), "peak_sampled": round(rss.peak / MIB, 1),
                    "peak_vmhwm": round(high_water / MIB, 1), "end": round(rss.samples[-1][1] / MIB, 1)},
        "plan_mib": {k: round(v / MIB, 1) for k, v in plan.items() if k != "auto_slots"},
        "plan_auto_slots": plan["auto_slots"], "rss_over_plan": over_plan,
        "health_at_end": health, "metrics_ok": metrics_ok, "server_exit_status": status,
    }
    print_report(report)
    record.write(args.json, "soak_server", {**report, "rss_samples": rss.samples,
                                            "outcomes": [asdict(o) for o in outcomes]}, args)
    failed = summary["errors"] or summary["dropped"] or over_plan or health.get("status") != "ok" or not metrics_ok
    if failed:
        print(f"FAILED. The server's log ends:\n{server.log_tail()}", file=sys.stderr)
    return 1 if failed else 0


def print_report(r: dict[str, Any]) -> None:
    print(f"{r['clients']} clients for {r['seconds']:.0f} s, {r['model']}, --parallel {r['parallel_asked']} "
          f"({r['parallel']} slots), n_ctx {r['n_ctx']} per slot")
    print("| kind | route | outcome | count |\n| --- | --- | --- | ---: |")
    for key, n in r["by_kind"].items():
        print("| " + " | ".join(key.split("|")) + f" | {n} |")
    print(f"\nrequests {r['requests']}: answered {r['answered']}, intended hang-ups {r['hang_ups']}, "
          f"errors {r['errors']}, dropped connections {r['dropped']}")
    print(f"completion tokens {r['completion_tokens']} in {r['wall_s']} s: {r['tokens_per_s']} tok/s aggregate; "
          f"TTFT (streamed) p50 {r['ttft_p50_ms']} ms, p95 {r['ttft_p95_ms']} ms")
    m, p = r["rss_mib"], r["plan_mib"]
    print(f"server RSS: start {m['start']} MiB, peak {m['peak_vmhwm']} MiB (sampled {m['peak_sampled']}), "
          f"end {m['end']} MiB; the plan predicts {p['predicted']} MiB ({p['one_slot']} + "
          f"{r['parallel'] - 1} × {p['slot_bytes']}){' — OVER THE PLAN' if r['rss_over_plan'] else ''}")
    if r["first_errors"]:
        print("errors and drops: " + "; ".join(r["first_errors"]))
    print(f"/health at the end: {r['health_at_end']}")


if __name__ == "__main__":
    sys.exit(main())
