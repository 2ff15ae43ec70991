#!/usr/bin/env python3
"""Decode rate of a streamed answer through ``gguf-mcv serve`` (the model in a worker process
under uvicorn's supervisor) against ``gguf_mcv.server.serve`` in one process (how ``serve``
ran before), each asked the same greedy question several times, alternating.

    python tools/bench_stream.py --rounds 5 --max-tokens 400

Reports each setup's best and median tokens/s, counted by the client from the first streamed
piece to ``[DONE]`` (the tiny generated model unless ``--model`` names one), and tokens per CPU
second the server's processes (the supervisor and its worker, or the one process) spent. On a
shared machine the best and the CPU figure are the fairer ones: other work slows the clock.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests
from bench import options, record
from bench.fresh import env_for_child
from bench.models import model_files
from bench.served import Server, free_port, start_server

IN_PROCESS = """
import sys, gguf_mcv
from gguf_mcv.server import serve
model = gguf_mcv.load(model_path=sys.argv[1], mmproj_path=sys.argv[2], n_ctx=4096, n_threads=int(sys.argv[4]))
serve(model, port=int(sys.argv[3]), api_key="", log_level="warning")
"""


def in_process(model: Path, mmproj: Path, threads: int) -> Server:
    port = free_port()
    env = env_for_child()
    proc = subprocess.Popen([sys.executable, "-c", IN_PROCESS, str(model), str(mmproj), str(port), str(threads)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(proc, f"http://127.0.0.1:{port}", Path(os.devnull))
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if requests.get(server.base + "/health", timeout=2).ok:
                return server
        except requests.RequestException:
            time.sleep(0.3)
    server.stop()
    raise SystemExit("the in-process server did not start")


def cpu_seconds(pid: int) -> float:
    """User and system time of the process and all its children (the supervisor's worker too)."""
    total = 0.0
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


def stream(server: Server, max_tokens: int) -> tuple[float, float]:
    """(tokens/s by the clock, tokens per CPU second of the server's processes) of one streamed answer."""
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    first = None
    tokens = 0
    cpu = cpu_seconds(server.proc.pid)
    with requests.post(server.base + "/v1/chat/completions", json=body, stream=True, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            first = first or time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    wall = time.perf_counter() - first  # the first piece starts the clock
    return (tokens - 1) / wall, tokens / (cpu_seconds(server.proc.pid) - cpu)


def main() -> None:
    ap = options.parser(__doc__, quant=options.OMIT)
    ap.add_argument("--model")
    ap.add_argument("--mmproj")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=400)
    args = ap.parse_args()
    model, mmproj = model_files(args.model, args.mmproj)
    servers = {"one process (before)": in_process(model, mmproj, args.threads),
               "worker under supervisor (serve)": start_server(model, mmproj, ["--api-key", "", "--no-disk-cache",
                                                                               "--threads", str(args.threads)])}
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
    try:
        for server in servers.values():
            stream(server, 16)  # warm up
        for i in range(args.rounds):
            for name, server in list(servers.items())[:: 1 if i % 2 else -1]:  # each goes first half the time
                rates[name].append(stream(server, args.max_tokens))
    finally:
        for server in servers.values():
            server.stop()
    for k, unit in ((0, "tok/s"), (1, "tok per CPU s")):
        for name, values in rates.items():
            column = [v[k] for v in values]
            print(f"{name:<34} best {max(column):8.1f} {unit:<14} median {statistics.median(column):8.1f}")
        for what, pick in (("best", max), ("median", statistics.median)):
            before, after = (pick([v[k] for v in values]) for values in rates.values())
            print(f"  {what} change: {100 * (after - before) / before:+.1f} %")
    record.write(args.json, "bench_stream", {name: [{"tokens_per_s": a, "tokens_per_cpu_s": b} for a, b in values]
                                             for name, values in rates.items()}, args)


if __name__ == "__main__":
    main()
