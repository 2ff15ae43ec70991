"""A ``gguf-mcv serve`` child process on a free port, streamed requests to it, and the plan's
prediction of its memory (the server benchmarks and soaks: load_server, soak_server,
bench_parallel --images, bench_stream, bench_vs_llama_server)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from .fresh import env_for_child


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running ``gguf-mcv serve`` child process."""

    proc: subprocess.Popen
    base: str
    log: Path
    health: dict[str, Any] = field(default_factory=dict)  #: /health once it answered

    @property
    def name(self) -> str:
        return str(self.health["model"])

    @property
    def parallel(self) -> int:
        """The slots it loaded (``--parallel auto`` resolved); 1 for a server that does not say."""
        return int(self.health.get("parallel", 1))

    @property
    def model_pid(self) -> int:
        """The process holding the model, whose memory to sample: ``serve``'s worker (the
        supervisor's child that runs multiprocessing's ``spawn_main``), else the server itself."""
        try:
            for child in psutil.Process(self.proc.pid).children():
                if "spawn_main" in " ".join(child.cmdline()):
                    return child.pid
        except psutil.Error:
            pass
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> int | None:
        """Terminate it (SIGTERM, then SIGKILL after 30 s); its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode


def start_server(model: Path, mmproj: Path, extra: list[str], *, log: Path | None = None,
                 timeout: float = 300) -> Server:
    """``gguf-mcv serve model --mmproj mmproj *extra`` on a free localhost port, once /health answers.

    Its output goes to ``log`` (default: a temporary file). SystemExit, with the log's tail,
    if it exits or does not answer within ``timeout`` seconds.
    """
    port = free_port()
    log = log or Path(tempfile.mkstemp(prefix="gguf_mcv_serve_", suffix=".log")[1])
    env = env_for_child()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gguf_mcv", "serve", str(model), "--mmproj", str(mmproj),
                                 "--port", str(port), *extra], stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            r = requests.get(f"{server.base}/health", timeout=2)
            if r.ok:
                server.health = r.json()
                return server
        except requests.RequestException:
            pass
        time.sleep(0.3)
    server.stop()
    raise SystemExit(f"the server did not start (exit status {proc.returncode}):\n{server.log_tail()}")


def planned_peak(model: Path, mmproj: Path, *, n_ctx: int, parallel: int, kv_cache_type: str = "f16",
                 vision_backend: str = "auto") -> dict[str, int]:
    """The plan's peak RSS for ``parallel`` slots of ``n_ctx`` positions: its memory row for these
    files (``plan_local``, the same options as the server) plus ``slot_bytes`` per slot beyond the
    first, as ``parallel="auto"`` counts them (``memory.slot_bytes``)."""
    from gguf_mcv.resolver import plan_local

    plan = plan_local(model, mmproj, n_ctx=n_ctx, kv_cache_type=kv_cache_type, vision_backend=vision_backend)
    one = plan.estimate.total
    return {"one_slot": one, "slot_bytes": plan.slot_bytes, "predicted": one + (parallel - 1) * plan.slot_bytes,
            "auto_slots": plan.slots}


class Dropped(Exception):
    """The connection ended without the answer's end."""


class StreamError(Exception):
    """The server reported an error inside a started stream."""


def read_stream(session: requests.Session, url: str, body: dict[str, Any], *, sse: bool, hang_up: bool = False,
                timeout: float = 600) -> tuple[int, tuple[str, int, float | None] | None]:
    """POST a streamed request (OpenAI SSE if ``sse``, else Ollama NDJSON); (status, (text,
    completion tokens, seconds to the first event)) — or, with ``hang_up``, close the connection
    after the first event: (200, None). :class:`Dropped` if the stream stops without its end,
    :class:`StreamError` if the server reports an error in it."""
    began = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    tokens, ended = 0, False
    with session.post(url, json=body, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            return r.status_code, None
        for line in r.iter_lines():
            if not line or line.startswith(b":"):  # SSE separators and keep-alive comments
                continue
            payload = line[len(b"data: "):] if sse else line
            if sse and payload == b"[DONE]":
                ended = True
                break
            event = json.loads(payload)
            if "error" in event:
                raise StreamError(str(event["error"])[:200])
            if ttft is None:
                ttft = time.perf_counter() - began
            if hang_up:
                r.close()  # the intended hang-up: the server must stop this answer
                return 200, None
            if sse:
                if event.get("choices"):
                    text.append(event["choices"][0]["delta"].get("content") or "")
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            else:
                text.append(event.get("response", ""))
                if event.get("done"):
                    tokens, ended = event.get("eval_count", 0), True
                    break
    if not ended:
        raise Dropped("the stream ended without its end")
    return 200, ("".join(text), tokens, ttft)
