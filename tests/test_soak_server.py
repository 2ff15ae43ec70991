"""A short server soak (tools/soak_server.py) on the tiny model: 16 clients, a mixed load for a few
seconds against ``serve --parallel 4``, in child processes (the server's RSS is its own).

Every request is valid, so the tool counts any non-200 (a 503 too), an error inside a stream
and a timeout as errors, and a reset or cut-short stream as a dropped connection; the client
hang-ups it makes on purpose are neither. Its exit status is 1 on any of them, or when the
server's peak RSS (``VmHWM``) passes the plan's prediction for 4 slots.

Camera-sized photos are left out (``--photo-mp 0``): decoding one 12 MP JPEG alone takes
~205 MiB at its peak where the plan's image term says 133 MiB, so with photos the tiny server
goes past the plan (README, "Image questions, memory per N and a mixed load"). The vision
backend is the default (ONNX int8), whose memory the plan counts; here it is converted in the
test's fresh cache, which leaves ~28 MiB more in the server than a cached conversion (peaks of
220-254 MiB measured against the plan's 281).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("psutil")

REPO = Path(__file__).resolve().parent.parent
CLIENTS = 16
SECONDS = 6


@pytest.fixture(scope="module")
def soak(tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("soak_server") / "soak.json"
    cmd = [sys.executable, str(REPO / "tools" / "soak_server.py"), "--model", str(tiny.quants["Q4_K_M"]),
           "--mmproj", str(tiny.mmproj), "--clients", str(CLIENTS), "--seconds", str(SECONDS),
           "--parallel", "4", "--photo-mp", "0", "--max-tokens", "8", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    assert out.exists(), f"the soak did not finish ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())["results"]  # the run's record (tools/bench/record.py)
    report["returncode"], report["log"] = proc.returncode, proc.stdout + proc.stderr[-3000:]
    return report


def test_no_errors_and_no_dropped_connections(soak: dict[str, Any]) -> None:
    assert soak["errors"] == 0 and soak["dropped"] == 0, soak["log"]
    assert soak["health_at_end"]["status"] == "ok" and soak["health_at_end"]["in_flight"] == 0
    assert soak["returncode"] == 0, soak["log"]


def test_the_load_was_mixed_and_ran_in_parallel(soak: dict[str, Any]) -> None:
    kinds = {key.split("|")[0] for key, n in soak["by_kind"].items() if n}
    assert kinds == {"text", "follow_up", "image_new", "image_seen", "video", "ollama_stream", "hang_up"}, kinds
    assert soak["hang_ups"] >= 1 and soak["parallel"] == 4 and soak["answered"] >= CLIENTS // 2
    assert soak["completion_tokens"] > 0 and soak["ttft_p50_ms"] is not None
    clients = {o["began"] for o in soak["outcomes"] if o["began"] < 0.5}
    assert len(clients) >= CLIENTS // 2, "the clients did not start together"


def test_peak_rss_is_inside_the_plan(soak: dict[str, Any]) -> None:
    rss, plan = soak["rss_mib"], soak["plan_mib"]
    assert rss["start"] < rss["peak_vmhwm"], "the RSS samples saw no work"
    assert rss["peak_vmhwm"] <= plan["predicted"], soak["log"]
