#!/usr/bin/env python3
"""The fleet on Ray Serve: follow-ups with our conversation router against Serve's default router.

A local two-node Ray cluster (one CPU each) runs two replicas of a generated model with one thread
each; four clients at once each hold a three-turn image conversation (a distinct picture, streamed
OpenAI requests, greedy). Per router, over the follow-ups (turns 2 and 3): how many were answered
by a replica other than the one that answered the first turn, the image slices encoded in the whole
run (``/metrics``: a moved follow-up encodes its picture again; the first turns encode one each),
the prompt positions evaluated (``prompt_tokens - cached_tokens``; with one slot per replica a
conversation's KV is overwritten by the others', so a follow-up evaluates its prompt again but
takes the picture's embeddings from the replica's cache), and time to first token (from sending
to the first streamed event), p50 and max. The two routers run A B A B.

    python tools/bench_fleet.py --ladder /tmp/tiny --preset tiny --rounds 2

``--throughput`` instead sets the fleet (two replicas, one thread each) against one single
``gguf-mcv serve`` with two threads and ``--parallel 2``, A B then B A: the aggregate decode rate of
four text clients at once (all completion tokens / wall time from the first request to the last
answer's end) and one request's overhead (the median of ``--overhead-requests`` one-token
requests, one after another: what Serve's front and router add to the single server's path).

    python tools/bench_fleet.py --ladder /tmp/ev/b26 --preset bench --throughput --rounds 2
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests
from bench import images, models, options, record
from bench.stats import percentile

REPLICA_HEADER = "x-gguf-mcv-replica"
CONVERSATIONS = 4
TURNS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_cluster(temp: str) -> tuple[str, dict[str, str]]:
    """A head node and a worker node on this machine, one CPU each; (address, the env used)."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([checkout, *filter(None, [os.environ.get("PYTHONPATH")])])}
    address = f"127.0.0.1:{_free_port()}"
    node = ["--num-cpus=1", f"--temp-dir={temp}", "--object-store-memory=80000000", "--disable-usage-stats"]
    for args in (["--head", f"--port={address.rsplit(':', 1)[1]}", "--node-ip-address=127.0.0.1",
                  "--include-dashboard=false"], [f"--address={address}", "--node-ip-address=127.0.0.1"]):
        subprocess.run([*_ray_cli(), "start", *args, *node], env=env, capture_output=True, check=True, timeout=180)
    return address, env


def _ray_cli() -> list[str]:
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


def turn(url: str, messages: list, max_tokens: int) -> dict[str, Any]:
    """One streamed turn: its replica, time to first token, usage and answer."""
    began = time.perf_counter()
    first = None
    pieces, usage = [], None
    with requests.post(url + "/v1/chat/completions", stream=True, timeout=600, json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as answered:
        answered.raise_for_status()
        for line in answered.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            first = first or time.perf_counter()
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            pieces += [c["delta"].get("content") or "" for c in event.get("choices", [])]
        replica = answered.headers.get(REPLICA_HEADER, "single")
    assert first is not None and usage is not None
    return {"replica": replica, "ttft_s": first - began, "answer": "".join(pieces),
            "completion_tokens": usage["completion_tokens"], "wall_s": time.perf_counter() - began,
            "evaluated": usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]}


def conversation(url: str, seed: int, side: int, max_tokens: int) -> list[dict[str, Any]]:
    messages: list = [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": images.data_uri(images.png_bytes(seed, side))}}]}]
    turns = []
    for i in range(TURNS):
        turns.append(turn(url, messages, max_tokens))
        messages += [{"role": "assistant", "content": turns[-1]["answer"]}, {"role": "user", "content": f"And {i}?"}]
    return turns


def _slices(url: str) -> dict[str, float]:
    """Image slices encoded and taken from the embedding cache, summed over the replicas (``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"encoded": 0.0, "cache": 0.0}
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=60).text):
        for sample in family.samples:
            if sample.name == "gguf_mcv_vision_slices_total":
                out[sample.labels["source"]] += sample.value
    return out


@contextlib.contextmanager
def fleet(address: str, load: dict[str, Any], affinity: bool = True) -> Iterator[str]:
    """Two replicas deployed on the cluster at ``address`` for the block; their URL."""
    from ray import serve

    from gguf_mcv.fleet.run import APP_NAME, deploy

    url = deploy(address, load, replicas=2, port=_free_port(), app_kwargs={"api_key": ""}, affinity=affinity)
    try:
        yield url
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()  # the next deploy starts its proxy on its own port


def measure(address: str, load: dict[str, Any], affinity: bool, seed: int, side: int, max_tokens: int
            ) -> dict[str, Any]:
    with fleet(address, load, affinity) as url:
        with ThreadPoolExecutor(CONVERSATIONS) as pool:
            done = list(pool.map(lambda c: conversation(url, seed + c, side, max_tokens), range(CONVERSATIONS)))
        time.sleep(2)  # the replicas' reports, which /metrics shows, come every second
        slices = _slices(url)
    follow = [t for turns in done for t in turns[1:]]
    moved = sum(t["replica"] != turns[0]["replica"] for turns in done for t in turns[1:])
    ttft = [t["ttft_s"] for t in follow]
    return {"follow_ups": len(follow), "moved": moved, "slices_encoded": slices["encoded"],
            "slices_from_cache": slices["cache"],
            "evaluated_mean": sum(t["evaluated"] for t in follow) / len(follow),
            "first_turn_evaluated_mean": sum(turns[0]["evaluated"] for turns in done) / len(done),
            "ttft_p50_s": percentile(ttft, 50), "ttft_max_s": max(ttft),
            "replicas_used": len({t["replica"] for turns in done for t in turns})}


def throughput(url: str, seed: int, max_tokens: int, overhead_requests: int) -> dict[str, Any]:
    """The decode rate of four text clients at once, and the median one-token request, at ``url``."""
    import statistics

    def story(i: int) -> dict[str, Any]:
        return turn(url, [{"role": "user", "content": f"Story {seed}.{i}: a long tale of a lighthouse."}], max_tokens)

    began = time.perf_counter()
    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        done = list(pool.map(story, range(CONVERSATIONS)))
    wall = time.perf_counter() - began
    tokens = sum(t["completion_tokens"] for t in done)
    one = [turn(url, [{"role": "user", "content": f"Hi {seed}.{i}"}], 1)["wall_s"] for i in range(overhead_requests)]
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "one_request_s": statistics.median(one),
            "replicas_used": len({t["replica"] for t in done})}


def fleet_throughput(address: str, load: dict[str, Any], seed: int, args: Any) -> dict[str, Any]:
    with fleet(address, load) as url:
        return throughput(url, seed, args.text_tokens, args.overhead_requests)


def single_throughput(model: Any, mmproj: Any, seed: int, args: Any) -> dict[str, Any]:
    from bench.served import start_server

    server = start_server(model, mmproj, ["--threads", "2", "--parallel", "2", "--ctx", "4096"])
    try:
        return throughput(server.base, seed, args.text_tokens, args.overhead_requests)
    finally:
        server.stop()


def main() -> None:
    p = options.parser(__doc__, ladder=None, threads=1)
    p.add_argument("--preset", default="tiny", help="tools/make_test_model.py preset (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="A B rounds (default %(default)s)")
    p.add_argument("--image-side", type=int, default=448, help="picture side in pixels (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--throughput", action="store_true", help="the fleet's decode rate and per-request overhead "
                   "against one single server with --parallel 2 (see above)")
    p.add_argument("--text-tokens", type=int, default=128, help="--throughput: tokens per text answer at most")
    p.add_argument("--overhead-requests", type=int, default=8, help="--throughput: one-token requests timed")
    args = p.parse_args()
    model, mmproj = models.pair(args.ladder, args.quant, args.preset)
    load = dict(model_path=str(model), mmproj_path=str(mmproj), n_ctx=4096, n_threads=args.threads)
    temp = tempfile.mkdtemp(prefix="rayb", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    address, env = start_cluster(temp)
    import ray

    ray.init(address=address, log_to_driver=False)
    names = ("fleet", "single --parallel 2") if args.throughput else ("conversation", "serve-default")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        for r in range(args.rounds):
            if args.throughput:
                for name in names if r % 2 == 0 else names[::-1]:  # A B, then B A
                    results[name].append(fleet_throughput(address, load, r, args) if name == "fleet"
                                         else single_throughput(model, mmproj, r, args))
                    print(name, results[name][-1], file=sys.stderr)
                continue
            for name, affinity in (("conversation", True), ("serve-default", False)):
                # a fresh picture per round and router: nothing cached from before
                results[name].append(measure(address, load, affinity, 1000 * (r + 1) + 100 * affinity,
                                             args.image_side, args.max_tokens))
                print(name, results[name][-1], file=sys.stderr)
    finally:
        ray.shutdown()
        subprocess.run([*_ray_cli(), "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    rec = record.write(args.json, "bench_fleet", results, args)
    print(json.dumps(rec["results"], indent=2))


if __name__ == "__main__":
    main()
