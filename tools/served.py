"""Helpers the server tools share (tools/load_server.py, tools/soak_server.py,
tools/bench_parallel.py): a ``gguf-mcv serve`` child process on a free port, its resident
memory sampled while it works, and the plan's prediction of that memory.

Not a tool itself; the tools import it from their own folder.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import psutil
import requests

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_files(model: str | None, mmproj: str | None) -> tuple[Path, Path]:
    """(model, mmproj): the given local files (mmproj default: the one mmproj*.gguf beside the
    model), else the tiny generated Q4_K_M model (built once, in the temp folder)."""
    if model:
        path = Path(model)
        if mmproj:
            return path, Path(mmproj)
        found = sorted(path.parent.glob("mmproj*.gguf"))
        if len(found) != 1:
            raise SystemExit(f"name the projector with --mmproj ({len(found)} mmproj*.gguf beside {path})")
        return path, found[0]
    sys.path.insert(0, str(REPO))
    from gguf_mcv.testing import synthetic

    built = synthetic.build(Path(tempfile.gettempdir()) / "gguf_mcv_load_model", quants=["Q4_K_M"])
    return Path(built.quants["Q4_K_M"]), Path(built.mmproj)


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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
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


class RssSampler:
    """Samples a process's resident memory every ``interval`` seconds on a thread, until stopped.

    ``peak`` is the largest sample; :meth:`high_water` the kernel's own peak (``VmHWM``), which
    also sees what happened between samples.
    """

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._began = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._sample()
        self._thread.start()

    def _sample(self) -> None:
        try:
            self.samples.append((time.perf_counter() - self._began, self.proc.memory_info().rss))
        except psutil.Error:  # the process is gone: nothing more to sample
            self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> None:
        self._sample()
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max(rss for _, rss in self.samples)

    def high_water(self) -> int | None:
        """``VmHWM`` from /proc (Linux): the process's peak RSS so far; None elsewhere."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None


def planned_peak(model: Path, mmproj: Path, *, n_ctx: int, parallel: int, kv_cache_type: str = "f16",
                 vision_backend: str = "auto") -> dict[str, int]:
    """The plan's peak RSS for ``parallel`` slots of ``n_ctx`` positions: its memory row for these
    files (``plan_local``, the same options as the server) plus ``slot_bytes`` per slot beyond the
    first, as ``parallel="auto"`` counts them (``memory.slot_bytes``)."""
    sys.path.insert(0, str(REPO))
    from gguf_mcv.resolver import plan_local

    plan = plan_local(model, mmproj, n_ctx=n_ctx, kv_cache_type=kv_cache_type, vision_backend=vision_backend)
    one = plan.estimate.total
    return {"one_slot": one, "slot_bytes": plan.slot_bytes, "predicted": one + (parallel - 1) * plan.slot_bytes,
            "auto_slots": plan.slots}


def png_bytes(seed: int, side: int = 96) -> bytes:
    """A PNG of random pixels (a new seed, a new image: nothing cached can answer for it)."""
    arr = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def photo_bytes(seed: int, width: int = 4032, height: int = 3024) -> bytes:
    """A camera-sized JPEG (12 MP by default): smooth colour waves plus some noise, a few MB."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (height // 64 + 1, width // 64 + 1, 3), dtype=np.uint8)
    image = PIL.Image.fromarray(small).resize((width, height), PIL.Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def gif_bytes(seed: int, frames: int = 3, side: int = 64) -> bytes:
    """A short animated GIF (one frame a second): a video the server samples into frames."""
    rng = np.random.default_rng(seed)
    images = [PIL.Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(frames)]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=1000, loop=0)
    return buf.getvalue()


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


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
