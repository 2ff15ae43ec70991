"""The server's log (``server.logs``): ``gguf-mcv serve`` shows the library's warnings; a
library user's own logging is left as it is."""

from __future__ import annotations

import base64
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import PIL.Image
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
requests = pytest.importorskip("requests")

from gguf_mcv.errors import ConfigError  # noqa: E402  (after the importorskips)
from gguf_mcv.server import logs  # noqa: E402


def test_serve_logs_the_warnings_of_a_served_request(tiny, tmp_path) -> None:
    cache = tmp_path / "cache"  # an image-embedding cache whose index is damaged: warned of when used
    cache.mkdir()
    (cache / "cache.db").write_bytes(b"this is not a SQLite database" * 100)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gguf_mcv", "serve", str(tiny.quants["Q4_K_M"]), "--port",
                             str(port), "--api-key", "", "--cache-dir", str(cache)],
                            env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
        png = io.BytesIO()
        PIL.Image.fromarray(pixels).save(png, format="PNG")
        image = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        body = {"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]}]}
        deadline = time.monotonic() + 90
        while True:
            try:
                r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
                time.sleep(0.3)
        assert r.status_code == 200, r.text  # the memory tier carries on
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    # the damaged index is set aside (gguf_mcv.cache_files) when the worker first opens the cache
    assert "WARNING:  gguf_mcv.bytes_cache: the cache index in" in err and "is damaged" in err, err
    assert "Application startup complete" in err  # uvicorn's own log is still there


def test_log_config_adds_gguf_mcvs_logger_and_leaves_an_applications_handlers_alone() -> None:
    root = logging.getLogger()
    saved = root.handlers[:]
    try:
        root.handlers = []
        config = logs.log_config("warning")
        assert config["loggers"]["gguf_mcv"] == {"handlers": ["gguf_mcv"], "level": logging.WARNING}
        assert config["handlers"]["gguf_mcv"]["stream"] == "ext://sys.stderr"
        assert "uvicorn.error" in config["loggers"]  # uvicorn's own configuration
        root.handlers = [logging.NullHandler()]  # the application configured logging itself
        assert logs.log_config("info")["loggers"]["gguf_mcv"] == {"level": logging.INFO}
    finally:
        root.handlers = saved
    with pytest.raises(ConfigError, match="log level"):
        logs.log_config("loud")


def test_importing_the_library_and_building_an_app_configure_no_logging() -> None:
    code = ("import logging, gguf_mcv, gguf_mcv.server; "
            "print(logging.getLogger().handlers, [type(h).__name__ for h in logging.getLogger('gguf_mcv').handlers])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert done.stdout.strip() == "[] ['NullHandler']", done.stderr
