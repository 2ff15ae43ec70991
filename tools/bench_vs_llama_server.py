#!/usr/bin/env python3
"""Our server against llama.cpp's own ``llama-server``, built from the llama.cpp that
llama-cpp-python vendors (``tools/build_llama_server.sh``), through the real ``openai`` client.

Both serve the same GGUF pair with the same slots and threads, greedy. Each round starts each
server fresh and runs the same steps against it, in alternating order (A B, then B A, ...), so
the machine's drift falls on both alike. Reported per step: the median and spread (min..max)
of the wall time over rounds for each server, and their ratio (ours / llama-server's).

Steps, each with images never seen before in that server's life unless the step says so:

- ``first_full``: the first question about a photo (``--photo-side``²), full detail (ours:
  ``detail: high``; llama-server always slices in full);
- ``first_default`` (ours only): the same with another photo at our default detail;
- ``follow_up``: a second turn in the first conversation;
- ``new_chat_same_image``: the first photo again, at the start of a new chat;
- ``four_images``: four clients at once, each with another photo;
- ``later_same_image``: the first photo again in a new chat, after the four;
- ``text_one`` / ``text_four``: ``--text-tokens`` tokens of text for one client, for four at once;
  also as completion tokens per second (``*_tok_per_s``, whose ratio is ours / theirs too: above
  1 is faster), since greedy answers of random weights may end early, at other lengths per server.

    tools/build_llama_server.sh /tmp/llama-server
    python tools/bench_vs_llama_server.py --ladder /tmp/ev/b26 --llama-server \\
        /tmp/llama-server/build/bin/llama-server --threads 2 --parallel 4 --rounds 4 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
from bench import images, options, record, stats
from bench.served import free_port, start_server

STEPS = ("first_full", "first_default", "follow_up", "new_chat_same_image", "four_images",
         "later_same_image", "text_one", "text_four", "text_one_tok_per_s", "text_four_tok_per_s")
GREEDY: dict[str, Any] = dict(temperature=0, seed=0)


class Peer:
    """A running ``llama-server`` child on a free loopback port."""

    def __init__(self, binary: Path, model: Path, mmproj: Path, *, threads: int, parallel: int, n_ctx: int) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="llama_server_", suffix=".log")[1])
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(binary), "-m", str(model), "--mmproj", str(mmproj), "-t", str(threads), "-np", str(parallel),
                 "-c", str(n_ctx * parallel), "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if requests.get(f"{self.base}/health", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"llama-server did not start:\n{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def image_part(jpeg: bytes, detail: str | None) -> dict[str, Any]:
    url: dict[str, Any] = {"url": images.data_uri(jpeg, "image/jpeg")}
    if detail:
        url["detail"] = detail
    return {"type": "image_url", "image_url": url}


def timed(fn: Callable[[], Any]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def at_once(calls: list[Callable[[], Any]]) -> float:
    """Wall time of ``calls`` run together, each on its own thread."""
    errors: list[BaseException] = []

    def run(call: Callable[[], Any]) -> None:
        try:
            call()
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - began


def one_round(base: str, ours: bool, args: argparse.Namespace, round_no: int) -> dict[str, float]:
    """Every step against the server at ``base``; {step: seconds}."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=3600, max_retries=0)
    name = client.models.list().data[0].id  # ours refuses another model's name
    side = args.photo_side
    photos = [images.photo_bytes(1000 * round_no + i, side, side) for i in range(6)]

    tokens: dict[str, int] = {}  # completion tokens of the text steps (random weights may stop early)

    def ask(messages: list[dict[str, Any]], max_tokens: int = args.image_tokens, step: str = "") -> str:
        out = client.chat.completions.create(model=name, messages=messages, max_tokens=max_tokens, **GREEDY)
        if step and out.usage is not None:
            tokens[step] = tokens.get(step, 0) + out.usage.completion_tokens
        return out.choices[0].message.content or ""

    def question(photo: bytes, text: str, detail: str | None) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [image_part(photo, detail), {"type": "text", "text": text}]}]

    full = "high" if ours else None
    times: dict[str, float] = {}
    first = question(photos[0], "What is in this picture?", full)
    answer: list[str] = []
    times["first_full"] = timed(lambda: answer.append(ask(first)))
    if ours:
        times["first_default"] = timed(lambda: ask(question(photos[1], "What is in this picture?", None)))
    follow = first + [{"role": "assistant", "content": answer[0]}, {"role": "user", "content": "And the colours?"}]
    times["follow_up"] = timed(lambda: ask(follow))
    times["new_chat_same_image"] = timed(lambda: ask(question(photos[0], "Describe it briefly.", full)))
    times["four_images"] = at_once([lambda p=p: ask(question(p, "What is in this picture?", full))
                                    for p in photos[2:6]])
    times["later_same_image"] = timed(lambda: ask(question(photos[0], "What stands out?", full)))
    text = [{"role": "user", "content": f"Round {round_no}: write a long story about a lighthouse."}]
    times["text_one"] = timed(lambda: ask(text, args.text_tokens, "text_one"))
    times["text_four"] = at_once([lambda i=i: ask([{"role": "user", "content": f"Story {round_no}.{i} please."}],
                                                 args.text_tokens, "text_four") for i in range(4)])
    for step, n in tokens.items():  # the text rows as rates too: the two servers' answers may differ in length
        times[f"{step}_tok_per_s"] = n / times[step]
    return times


def summary(samples: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for step in STEPS:
        row: dict[str, Any] = {}
        for name, rounds in samples.items():
            values = [r[step] for r in rounds if step in r]
            if values:
                row[name] = {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}
        if "ours" in row and "llama-server" in row:
            row["ratio"] = row["ours"]["median_s"] / row["llama-server"]["median_s"]
        rows[step] = row
    return rows


def cell(row: dict[str, Any], name: str) -> str:
    """One server's median and (min-max) for a summary row."""
    r = row.get(name)
    return f"{r['median_s']:.2f} ({r['min_s']:.1f}-{r['max_s']:.1f})" if r else "-"


def main() -> None:
    ap = options.parser(__doc__, ladder=None)
    ap.add_argument("--llama-server", type=Path, required=True, help="the binary tools/build_llama_server.sh built")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096, help="positions per slot")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--photo-side", type=int, default=1344)
    ap.add_argument("--image-tokens", type=int, default=16)
    ap.add_argument("--text-tokens", type=int, default=128)
    args = ap.parse_args()
    model = next(args.ladder.glob(f"*{args.quant}*.gguf"))
    mmproj = next(args.ladder.glob("mmproj*.gguf"))
    counter = {"ours": 0, "llama-server": 0}

    def ours() -> dict[str, float]:
        # its own embedding cache: the disk cache outlives a server, and an earlier run's photos
        # (the same seeds) would make its first questions cached ones
        with tempfile.TemporaryDirectory(prefix="bench_vs_ls_") as cache:
            server = start_server(model, mmproj, ["--threads", str(args.threads), "--parallel", str(args.parallel),
                                                  "--ctx", str(args.ctx), "--cache-dir", cache])
            try:
                return one_round(server.base, True, args, _next(counter, "ours"))
            finally:
                server.stop()

    def theirs() -> dict[str, float]:
        peer = Peer(args.llama_server, model, mmproj, threads=args.threads, parallel=args.parallel, n_ctx=args.ctx)
        try:
            return one_round(peer.base, False, args, _next(counter, "llama-server"))
        finally:
            peer.stop()

    def said(i: int, name: str, r: dict[str, float]) -> None:
        shown = (f"{k} {v:.2f}" + ("" if k.endswith("_per_s") else "s") for k, v in r.items())
        print(f"round {i} {name}: " + ", ".join(shown), flush=True)

    samples = stats.alternate({"ours": ours, "llama-server": theirs}, args.rounds, said, swap=True)
    rows = summary(samples)
    print(f"{'step':22} {'ours (s)':>14} {'llama-server (s)':>18} {'ratio':>7}")
    for step, row in rows.items():
        ratio = f"{row['ratio']:.2f}" if "ratio" in row else "-"
        print(f"{step:22} {cell(row, 'ours'):>14} {cell(row, 'llama-server'):>18} {ratio:>7}")
    record.write(args.json, "bench_vs_llama_server", {"rounds": samples, "summary": rows}, args)


def _next(counter: dict[str, int], name: str) -> int:
    """The round number of ``name``'s next round (its photos' seeds: each round its own)."""
    counter[name] += 1
    return counter[name] - 1


if __name__ == "__main__":
    main()
