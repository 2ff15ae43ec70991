#!/usr/bin/env python3
"""Load the server with hostile traffic and report what held.

Starts ``gguf-mcv serve`` on a free port (the tiny generated model unless told
otherwise), then N client threads hammer it for a fixed time with a mix of valid
OpenAI and Ollama image questions, streaming requests whose clients hang up after
the first chunk, bad base64 images, corrupt PNGs and oversize bodies. Reports every
outcome by kind and status, the server's resident memory over time, and /health at
the end.

    python tools/load_server.py --clients 16 --seconds 60

With ``--flood N`` it sends N requests at once instead, each with one large image
(``--flood-mib``, 19.5 MiB of JSON by default), and reports their statuses and the
server's resident memory before, at its peak and 10 s after: a full queue must refuse
bodies unread, and the memory of those it took must come back.

    python tools/load_server.py --flood 80
"""

from __future__ import annotations

import base64
import collections
import json
import random
import sys
import threading
import time

import psutil
import requests
from bench import images, options, record
from bench.models import model_files
from bench.served import start_server

KINDS = ("openai", "ollama", "stream_hangup", "bad_base64", "corrupt_png", "oversize")


def png_b64(seed: int, size: int = 96) -> str:
    return base64.b64encode(images.png_bytes(seed, size)).decode()


def request(kind: str, base: str, name: str, rng: random.Random, session: requests.Session) -> str:
    """Send one request of ``kind`` for model ``name``; return an outcome like '200' or 'error:...'."""
    image = png_b64(rng.randrange(20))  # a pool of 20: the embedding cache gets hits too
    chat = {"model": name, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
        {"type": "text", "text": "What is it?"}]}]}
    try:
        if kind == "openai":
            r = session.post(f"{base}/v1/chat/completions", json=chat, timeout=120)
        elif kind == "ollama":
            r = session.post(f"{base}/api/generate", json={
                "model": name, "prompt": "What is it?", "images": [image], "stream": False,
                "options": {"num_predict": 8}}, timeout=120)
        elif kind == "stream_hangup":
            with session.post(f"{base}/v1/chat/completions", json={**chat, "stream": True,
                              "max_tokens": 200}, stream=True, timeout=120) as r:
                if r.status_code == 200:
                    next(r.iter_lines(), None)  # one chunk, then hang up
            return f"{r.status_code}"
        elif kind == "bad_base64":
            bad = {**chat, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-base64@@"}}]}]}
            r = session.post(f"{base}/v1/chat/completions", json=bad, timeout=120)
        elif kind == "corrupt_png":
            r = session.post(f"{base}/api/generate", json={
                "model": name, "prompt": "?", "images": [image[: len(image) // 2 // 4 * 4]],
                "stream": False}, timeout=120)
        else:  # oversize
            r = session.post(f"{base}/v1/chat/completions", data=b"x" * (21 * 2**20),
                             headers={"Content-Type": "application/json"}, timeout=120)
        return str(r.status_code)
    except requests.RequestException as exc:
        return f"error:{type(exc).__name__}"


def flood_body(name: str, mib: float) -> bytes:
    """A chat request whose one image (random pixels, so PNG cannot shrink it) makes ~``mib`` MiB."""
    side = int((mib * 2**20 * 3 / 4 / 3) ** 0.5)  # base64 grows by 4/3; ~3 bytes per noisy pixel
    url = images.data_uri(images.png_bytes(0, side))
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    return json.dumps({"model": name, "max_tokens": 4,
                       "messages": [{"role": "user", "content": content}]}).encode()


def flood(base: str, name: str, proc: psutil.Process, clients: int, mib: float) -> dict:
    """``clients`` concurrent large requests; their statuses and the server's RSS (MiB) over time."""
    body = flood_body(name, mib)
    statuses: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    samples = [proc.memory_info().rss]

    def send() -> None:
        try:
            r = requests.post(f"{base}/v1/chat/completions", data=body, timeout=600,
                              headers={"Content-Type": "application/json"})
            outcome = str(r.status_code)
        except requests.RequestException as exc:
            outcome = f"error:{type(exc).__name__}"
        with lock:
            statuses[outcome] += 1

    threads = [threading.Thread(target=send) for _ in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        samples.append(proc.memory_info().rss)
        time.sleep(0.1)
    time.sleep(10)
    mib_of = [n / 2**20 for n in samples]
    return {"clients": clients, "body_mib": round(len(body) / 2**20, 1), "statuses": dict(statuses),
            "rss_mib": {"before": round(mib_of[0]), "peak": round(max(mib_of)),
                        "10 s after": round(proc.memory_info().rss / 2**20)}}


def main() -> int:
    parser = options.parser(__doc__, quant=options.OMIT, threads=options.OMIT)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-queue", type=int, default=8)
    parser.add_argument("--model", help="a local .gguf (default: the tiny generated model)")
    parser.add_argument("--mmproj")
    parser.add_argument("--flood", type=int, metavar="N", help="send N large requests at once instead")
    parser.add_argument("--flood-mib", type=float, default=19.5, help="size of each (default 19.5)")
    args = parser.parse_args()

    server = start_server(*model_files(args.model, args.mmproj),
                          ["--ctx", "4096", "--max-queue", str(args.max_queue)])
    base, name, proc = server.base, server.name, psutil.Process(server.model_pid)
    if args.flood:
        try:
            report = flood(base, name, proc, args.flood, args.flood_mib)
            report["health"] = requests.get(f"{base}/health", timeout=10).json()
        finally:
            server.stop()
        print(json.dumps(report, indent=2))
        record.write(args.json, "load_server --flood", report, args)
        return 0 if report["health"].get("status") == "ok" else 1
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    lock = threading.Lock()
    stop_at = time.time() + args.seconds

    def client(n: int) -> None:
        rng = random.Random(n)
        with requests.Session() as session:
            while time.time() < stop_at:
                kind = rng.choice(KINDS)
                outcome = request(kind, base, name, rng, session)
                with lock:
                    counts[(kind, outcome)] += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
    rss = [(0.0, proc.memory_info().rss)]
    start = time.time()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(5)
        rss.append((time.time() - start, proc.memory_info().rss))
    for t in threads:
        t.join()
    health = requests.get(f"{base}/health", timeout=10).json()
    metrics = requests.get(f"{base}/metrics", params={"format": "json"}, timeout=10).json()
    server.stop()

    print(f"{args.clients} clients for {args.seconds:.0f} s against {base}")
    print("| request kind | outcome | count |\n| --- | --- | ---: |")
    for (kind, outcome), n in sorted(counts.items()):
        print(f"| {kind} | {outcome} | {n} |")
    total = sum(counts.values())
    failures = sum(n for (k, o), n in counts.items() if o.startswith("error") or o == "500")
    mb = [r / 2**20 for _, r in rss]
    print(f"\nrequests: {total}; transport errors or 500s: {failures}")
    print(f"server RSS: start {mb[0]:.0f} MB, after 10 s {mb[min(2, len(mb) - 1)]:.0f} MB, "
          f"end {mb[-1]:.0f} MB, max {max(mb):.0f} MB")
    print(f"/health at the end: {health}")
    record.write(args.json, "load_server", {"counts": {f"{k}|{o}": n for (k, o), n in counts.items()},
                                            "rss": rss, "health": health, "metrics": metrics}, args)
    return 0 if health.get("status") == "ok" and failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
