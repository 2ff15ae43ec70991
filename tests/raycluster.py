"""A real local Ray cluster for tests: a head node and one worker node, one CPU each.

``start(request, prefix)`` starts it with Ray's own CLI and stops it when the requesting fixture
ends; (its address, the environment its child processes need). Only this cluster's processes are
stopped (``ray stop`` would stop every Ray cluster on the machine, a user's own or another test
run's): those whose command line names its temporary folder or its address, and their children.
``extra_env`` is added to both nodes' environment (their workers inherit it), ``worker_env`` to the
worker node's only (e.g. ``GGUF_MCV_HW_ROOT``: a smaller board than the head). Where a
node cannot start, ``skip_why`` makes the test skip with Ray's output, otherwise it fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
RAY_CLI = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_cluster(temp: str, address: str) -> None:
    """Stop the processes of the cluster whose temporary folder is ``temp`` and whose head is at
    ``address`` (its port): SIGTERM, then SIGKILL for those still running after 15 s."""
    port = address.rsplit(":", 1)[1]

    def names_it(word: str) -> bool:  # Ray's client server names the head by another of its IPs
        return temp + "/" in word or word.endswith("=" + temp) or (word.startswith("--address=")
                                                                   and word.endswith(":" + port))

    mine = {proc.pid: proc for proc in psutil.process_iter(["cmdline"])
            if proc.pid != os.getpid() and any(map(names_it, proc.info["cmdline"] or []))}
    for proc in list(mine.values()):
        with contextlib.suppress(psutil.NoSuchProcess):
            mine.update((child.pid, child) for child in proc.children(recursive=True))
    for proc in mine.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(list(mine.values()), timeout=15)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=15)


def start(request: pytest.FixtureRequest, prefix: str, *, skip_why: str | None = None,
          extra_env: dict[str, str] | None = None,
          worker_env: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    temp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
           **(extra_env or {})}

    def stop() -> None:
        if "ray" in sys.modules:  # a driver this process connected
            sys.modules["ray"].shutdown()
        stop_cluster(temp, address)
        shutil.rmtree(temp, ignore_errors=True)

    request.addfinalizer(stop)
    address = f"127.0.0.1:{free_port()}"
    node = ["--num-cpus=1", f"--temp-dir={temp}", "--object-store-memory=80000000", "--disable-usage-stats"]
    # every port of its own: another test run's cluster may be up beside it (Ray's defaults are fixed)
    head = ["--head", f"--port={address.rsplit(':', 1)[1]}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}"]
    for args, extra in ((head, {}), ([f"--address={address}", "--node-ip-address=127.0.0.1"], worker_env or {})):
        started = subprocess.run([*RAY_CLI, "start", *args, *node, f"--dashboard-agent-listen-port={free_port()}"],
                                 env={**env, **extra}, capture_output=True,
                                 text=True, timeout=180)
        if started.returncode != 0 and skip_why is not None:
            pytest.skip(skip_why + (started.stdout + started.stderr)[-800:])
        assert started.returncode == 0, started.stdout + started.stderr
    return address, env
