#!/usr/bin/env python3
"""Ray's own memory per node: the processes `ray start` leaves on a head node and a worker node.

A local cluster of two nodes (one CPU each, the dashboard off, as the fleet's tests start it),
measured after it has settled (``--settle`` seconds) and before anything is deployed: per node, the
unique memory (USS) of Ray's processes summed, and their RSS summed (shared libraries counted in
each process). The figure for docs/cluster.md's "Ray's own memory per node".

    python tools/bench_ray_memory.py --settle 15
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil
from bench import options, record
from bench.memory import MIB

RAY_CLI = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


def _started(args: list[str], env: dict[str, str]) -> set[int]:
    """The pids of the processes one ``ray start`` left running."""
    before = {p.pid for p in psutil.process_iter()}
    subprocess.run([*RAY_CLI, "start", *args], env=env, capture_output=True, check=True, timeout=180)
    return {p.pid for p in psutil.process_iter()} - before


def _memory(pids: set[int]) -> dict[str, object]:
    uss = rss = 0
    names = []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            info = process.memory_full_info()
            uss, rss = uss + info.uss, rss + info.rss
            names.append(process.name())
        except psutil.Error:  # a short-lived helper, gone
            continue
    return {"uss_mib": round(uss / MIB), "rss_mib": round(rss / MIB), "processes": names}


def main() -> None:
    p = options.parser(__doc__, quant=options.OMIT, threads=options.OMIT)
    p.add_argument("--settle", type=float, default=15.0, help="seconds to wait before measuring (default %(default)s)")
    args = p.parse_args()
    temp = tempfile.mkdtemp(prefix="raym", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = ["--num-cpus=1", f"--temp-dir={temp}", "--object-store-memory=80000000", "--disable-usage-stats"]
    try:
        head = _started(["--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                         *node], env)
        worker = _started([f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1", *node], env) - head
        time.sleep(args.settle)
        results = {"head": _memory(head), "worker": _memory(worker)}
    finally:
        subprocess.run([*RAY_CLI, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    print(record.write(args.json, "bench_ray_memory", results, args)["results"])


if __name__ == "__main__":
    main()
