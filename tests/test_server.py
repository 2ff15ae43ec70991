"""The HTTP server, driven by the real OpenAI and Ollama clients and plain requests, on the tiny model.

Random weights give gibberish: the tests check behaviour (answers, usage, status codes,
queueing, cancellation), never wording. To make queueing deterministic a test holds the
model itself (a library stream that has yielded its first piece holds the model's lock),
so requests pile up behind it.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import io
import json
import logging
import random
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import PIL.Image
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
requests = pytest.importorskip("requests")

import gguf_mcv  # noqa: E402  (after the importorskips)
from gguf_mcv import server
from gguf_mcv.runtime import native_check  # noqa: E402
from gguf_mcv.server import answering, naming  # noqa: E402
from gguf_mcv.server.app import HTTP_PARSER  # noqa: E402
from gguf_mcv.vision import remote  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Running:
    """A uvicorn server for ``app`` on a free localhost port, in a background thread
    (``lifespan="on"`` runs the app's startup and shutdown too)."""

    def __init__(self, app: Any, lifespan: str = "off") -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan,
                                                    http=HTTP_PARSER))  # as serve() runs it
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def model(tiny) -> Iterator[gguf_mcv.Model]:
    m = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096, n_threads=2)
    yield m
    m.close()


@pytest.fixture(scope="module")
def srv(model) -> Iterator[Running]:
    """The main server: API key set, defaults otherwise."""
    running = Running(server.build_app(model, api_key=KEY))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def small(model) -> Iterator[Running]:
    """A second server on the same model: no key, a queue of 1, a 64 KiB body limit, remote media on."""
    running = Running(server.build_app(model, api_key="", max_queue=1, max_body_bytes=64 * 1024,
                                       allow_remote_media=True))
    yield running
    running.stop()


def png(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image_message(url: str, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def oai(running: Running, key: str = KEY) -> Any:
    return openai.OpenAI(base_url=running.url + "/v1", api_key=key, max_retries=0, timeout=60)


def oll(running: Running, headers: dict[str, str] | None = AUTH) -> Any:
    return ollama.Client(host=running.url, headers=headers, timeout=60)


def served(running: Running) -> str:
    return requests.get(running.url + "/health", timeout=60).json()["model"]


def metrics(running: Running, headers: dict[str, str] = AUTH) -> dict[str, Any]:
    return requests.get(running.url + "/metrics?format=json", headers=headers, timeout=60).json()


@contextmanager
def holding(model: gguf_mcv.Model) -> Iterator[None]:
    """Keep the model busy: a stream holds its lock from its first piece until closed."""
    stream = model.ask("Say many things.", stream=True, max_tokens=4000, temperature=0)
    next(stream)
    try:
        yield
    finally:
        stream.close()


def queue(url: str) -> tuple[int, int]:
    """(waiting, answering) as /health reports them.

    Waiting alone is not enough to wait on: a request just admitted counts as waiting
    until it takes its turn, so one request can look like one answering and one waiting.
    """
    health = requests.get(url + "/health", timeout=30).json()
    return health["queue_length"], health["in_flight"]


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


# -- OpenAI -------------------------------------------------------------------------------------


def test_openai_lists_the_model_and_answers_about_an_image(srv: Running) -> None:
    client = oai(srv)
    name = served(srv)
    assert [m.id for m in client.models.list().data] == [name]
    assert client.models.retrieve(name).id == name
    r = client.chat.completions.create(model=name, messages=image_message(data_uri(png(1))),
                                       max_tokens=8, seed=1)
    assert r.model == name and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 64  # one 64-token image slice plus the text
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_openai_streaming_gives_the_same_answer_with_usage(srv: Running) -> None:
    client = oai(srv)
    kwargs = dict(model=served(srv), messages=image_message(data_uri(png(2))), max_tokens=12,
                  temperature=0, stop=["\n\n\n"])
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_openai_video_url_part(srv: Running) -> None:
    frames = [PIL.Image.fromarray(np.full((48, 64, 3), 60 * i, np.uint8)) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=1000, loop=0)
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": data_uri(buf.getvalue(), "image/gif")}},
        {"type": "text", "text": "What happens?"}]}]
    r = oai(srv).chat.completions.create(model=served(srv), messages=messages, max_tokens=4)
    assert r.usage.prompt_tokens > 2 * 64  # several frames, 64 tokens each


# -- Ollama ---------------------------------------------------------------------------------------


def test_ollama_client_generate_with_images(srv: Running) -> None:
    client = oll(srv)
    name = served(srv)
    r = client.generate(model=name, prompt="Describe it.", images=[png(3)],
                        options={"num_predict": 8, "seed": 2, "temperature": 0.5})
    assert r.done and r.done_reason in ("stop", "length")
    assert isinstance(r.response, str)
    assert r.prompt_eval_count > 64 and 1 <= r.eval_count <= 8
    assert r.total_duration >= r.eval_duration > 0

    parts = list(client.generate(model=name, prompt="Describe it.", images=[b64(png(3))], stream=True,
                                 options={"num_predict": 8, "temperature": 0}))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count >= 1 and parts[-1].prompt_eval_count > 64
    assert all(p.model == name for p in parts)


def test_ollama_client_chat_with_images(srv: Running) -> None:
    client = oll(srv)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is this?", "images": [b64(png(4))]}]
    r = client.chat(model=served(srv), messages=messages, options={"num_predict": 6})
    assert r.message.role == "assistant" and isinstance(r.message.content, str)
    assert r.done and r.prompt_eval_count > 64 and 1 <= r.eval_count <= 6

    parts = list(client.chat(model=served(srv), messages=messages, stream=True,
                             options={"num_predict": 6}))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count >= 1


def test_ollama_list_show_ps_and_version(srv: Running) -> None:
    client = oll(srv)
    name = served(srv)
    listed = client.list().models
    assert len(listed) == 1 and listed[0].model == f"{name}:latest"
    assert listed[0].size > 0 and listed[0].details.format == "gguf"
    assert listed[0].details.quantization_level == "Q4_K_M"
    shown = client.show(listed[0].model)  # the listed name is accepted back
    assert "vision" in shown.capabilities and shown.modelinfo["minicpmv.context_length"] == 4096
    assert client.ps().models[0].context_length == 4096
    assert requests.get(srv.url + "/api/version", headers=AUTH, timeout=60).json()["version"]


def test_requests_scripts_the_ollama_way(srv: Running) -> None:
    url = srv.url + "/api/generate"
    body = {"model": served(srv), "prompt": "What is this?", "images": [b64(png(5))],
            "options": {"num_predict": 5}}
    r = requests.post(url, json={**body, "stream": False}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["done"] is True and isinstance(r.json()["response"], str)

    # streaming is the default (curl --json sends this content type)
    sent = {**AUTH, "Content-Type": "application/json; charset=utf-8"}
    r = requests.post(url, data=json.dumps(body), headers=sent, stream=True, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] >= 1
    assert all(line["done"] is False and isinstance(line["response"], str) for line in lines[:-1])

    # an empty prompt only "loads" the model, as in Ollama
    r = requests.post(url, json={"model": served(srv)}, headers=AUTH, timeout=60)
    assert r.json()["done_reason"] == "load"


# -- queueing and concurrency ------------------------------------------------------------------------


def test_eight_concurrent_clients_are_queued_and_all_answered(srv: Running, model) -> None:
    client = oai(srv)
    name = served(srv)

    def ask(i: int) -> Any:
        return client.chat.completions.create(model=name, messages=image_message(data_uri(png(10 + i))),
                                              max_tokens=4, seed=i)

    with ThreadPoolExecutor(8) as pool:
        with holding(model):
            futures = [pool.submit(ask, i) for i in range(8)]
            wait_for(lambda: queue(srv.url) == (7, 1))
            health = requests.get(srv.url + "/health", timeout=30)  # answered: the event loop is free
            assert health.json() == {
                "status": "ok", "model": name, "queue_length": 7, "in_flight": 1, "parallel": 1,
                "native_fallbacks": list(native_check.notices()), "worker_restarts": 0,
                "last_worker_restart": None, "last_worker_exit": None, "last_load_error": None,
                "next_load_retry": None}  # in-process: no worker to restart
        replies = [f.result(timeout=60) for f in futures]
    assert all(r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 64 for r in replies)


def test_a_full_queue_answers_503_with_retry_after(small: Running, model) -> None:
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}

    def post() -> requests.Response:
        return requests.post(small.url + "/v1/chat/completions", json=body, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        with holding(model):
            futures: list[Future] = [pool.submit(post) for _ in range(8)]
            wait_for(lambda: sum(f.done() for f in futures) == 6)  # one answering, one waiting
        responses = [f.result(timeout=60) for f in futures]
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200] + [503] * 6
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "server_busy"
    assert requests.get(small.url + "/health", timeout=30).json()["queue_length"] == 0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_requests_queued_when_the_server_stops_get_a_503_in_their_api_shape(model) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn.Config(server.build_app(model, api_key=""), log_level="info",
                                       timeout_graceful_shutdown=1, http=HTTP_PARSER))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    records = _Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    try:
        thread.start()
        wait_for(lambda: uv.started, timeout=60)
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
        with ThreadPoolExecutor(3) as pool, holding(model):
            posts = [pool.submit(requests.post, url + path, json={**body, "stream": False}, timeout=120)
                     for path in ("/v1/chat/completions", "/api/chat", "/v1/chat/completions")]
            wait_for(lambda: queue(url) == (2, 1), timeout=60)
            uv.should_exit = True  # as SIGTERM does; the answers cannot finish: the model is held
            responses = [f.result(timeout=120) for f in posts]
        thread.join(60)
    finally:
        uv.should_exit = True
        thread.join(60)
        logging.getLogger("uvicorn.error").removeHandler(records)
    assert [r.status_code for r in responses] == [503, 503, 503]
    assert all(int(r.headers["Retry-After"]) >= 1 for r in responses)
    assert responses[0].json()["error"]["code"] == "server_stopping"  # OpenAI's shape
    assert isinstance(responses[1].json()["error"], str)  # Ollama's
    assert not [r for r in records.records if r.exc_info], [r.getMessage() for r in records.records]


def start_upload(running: Running, path: str, headers: dict[str, str],
                 first: bytes) -> http.client.HTTPConnection:
    """A POST whose client has sent its headers and the ``first`` bytes of its body, and no more yet."""
    host, port = running.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)  # generous: a loaded machine
    conn.putrequest("POST", path)
    for name, value in headers.items():
        conn.putheader(name, value)
    conn.endheaders(first)
    return conn


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/generate"])
def test_a_full_queue_refuses_a_body_before_reading_it(small: Running, model, path: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}

    def post() -> requests.Response:
        return requests.post(small.url + "/v1/chat/completions", json=body, timeout=60)

    with ThreadPoolExecutor(2) as pool:
        with holding(model):
            futures = [pool.submit(post) for _ in range(2)]  # one answering, one waiting: full
            wait_for(lambda: queue(small.url) == (1, 1))  # not one admitted, not yet answering
            # a large upload has begun: the server answers it now, without waiting for the rest
            conn = start_upload(small, path, {"Content-Type": "application/json",
                                              "Content-Length": str(60 * 1024)}, b"{" + b" " * 1023)
            try:
                refused = conn.getresponse()
                assert refused.status == 503 and int(refused.getheader("Retry-After")) >= 1
                error = json.loads(refused.read())["error"]
            finally:
                conn.close()
        assert [f.result(timeout=60).status_code for f in futures] == [200, 200]
    if path.startswith("/v1/"):  # each API's own error shape
        assert error["code"] == "server_busy"
    else:
        assert isinstance(error, str)
    assert requests.get(small.url + "/health", timeout=30).json()["queue_length"] == 0


def test_a_body_is_refused_as_soon_as_it_passes_the_limit(small: Running) -> None:
    # chunked, no Content-Length: 80 KiB sent, the end never comes; the 64 KiB limit is passed
    conn = start_upload(small, "/api/chat", {"Transfer-Encoding": "chunked", "Content-Type": "application/json"},
                        b"".join(b"%x\r\n%s\r\n" % (8192, b" " * 8192) for _ in range(10)))
    try:
        refused = conn.getresponse()
        assert refused.status == 413 and isinstance(json.loads(refused.read())["error"], str)
    finally:
        conn.close()
    assert requests.get(small.url + "/health", timeout=30).json()["queue_length"] == 0


def seconds(fn: Any) -> float:
    began = time.monotonic()
    fn()
    return time.monotonic() - began


def test_a_hung_up_stream_frees_the_model(srv: Running) -> None:
    before = metrics(srv)["cancelled"]
    idle = seconds(lambda: requests.get(srv.url + "/health", timeout=30))  # baselines, this run, this machine
    short = seconds(lambda: oai(srv).chat.completions.create(model=served(srv), max_tokens=3,
                                                             messages=[{"role": "user", "content": "Hi"}]))
    body = {"model": served(srv), "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 4000, "temperature": 0, "stream": True}
    with requests.Session() as session:
        r = session.post(srv.url + "/v1/chat/completions", json=body, headers=AUTH, stream=True, timeout=60)
        lines = r.iter_lines()
        assert next(lines).startswith(b"data: ")
        began = time.monotonic()
        health = requests.get(srv.url + "/health", timeout=30).json()
        # answered while generating, not after the 4000 tokens
        assert time.monotonic() - began < 1.0 + 20 * idle and health["in_flight"] == 1
        r.close()  # hang up mid-stream
    wait_for(lambda: requests.get(srv.url + "/health", timeout=30).json()["in_flight"] == 0)
    began = time.monotonic()
    reply = oai(srv).chat.completions.create(model=served(srv), max_tokens=3,
                                             messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.completion_tokens >= 1
    assert time.monotonic() - began < 2.0 + 10 * short  # the stream stopped: the model was free at once
    assert metrics(srv)["cancelled"] == before + 1


def test_a_stream_that_has_not_started_sends_keep_alive_comments(srv: Running, model,
                                                                  monkeypatch) -> None:
    monkeypatch.setattr(answering, "KEEPALIVE_S", 0.2)
    body = {"model": served(srv), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "stream": True}
    with holding(model):  # the answer cannot start
        r = requests.post(srv.url + "/v1/chat/completions", json=body, headers=AUTH, stream=True,
                          timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = (line for line in r.iter_lines() if line)
        assert next(lines) == next(lines) == b": keep-alive"
    events = list(lines)
    assert events[-1] == b"data: [DONE]"
    answer = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1] if e.startswith(b"data: ")]
    assert answer[-1]["usage"]["completion_tokens"] >= 1

    with ThreadPoolExecutor(1) as pool, holding(model):  # the OpenAI client skips the comments
        chunks = pool.submit(lambda: list(oai(srv).chat.completions.create(**body)))
        time.sleep(0.5)
    assert chunks.result(timeout=60)[-1].usage.completion_tokens >= 1
    wait_for(lambda: requests.get(srv.url + "/health", timeout=30).json()["in_flight"] == 0)


def test_a_stream_given_up_before_it_started_frees_its_place(srv: Running, model,
                                                             monkeypatch) -> None:
    monkeypatch.setattr(answering, "KEEPALIVE_S", 0.2)
    body = {"model": served(srv), "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with holding(model):
        r = requests.post(srv.url + "/v1/chat/completions", json=body, headers=AUTH, stream=True,
                          timeout=30)
        assert next(r.iter_lines()) == b": keep-alive"
        r.close()  # hang up while the answer waits for the model
        wait_for(lambda: requests.get(srv.url + "/health", timeout=30).json()["queue_length"] == 0)
    wait_for(lambda: requests.get(srv.url + "/health", timeout=30).json()["in_flight"] == 0)
    reply = oai(srv).chat.completions.create(model=served(srv), max_tokens=2,
                                             messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.completion_tokens >= 1


def test_a_client_that_gives_up_while_queued_costs_no_answer(srv: Running, model) -> None:
    before = metrics(srv)
    with holding(model), pytest.raises(requests.Timeout):
        requests.post(srv.url + "/api/generate", json={"prompt": "Hi", "options": {"num_predict": 50}},
                      headers=AUTH, timeout=0.5)
    wait_for(lambda: metrics(srv)["cancelled"] == before["cancelled"] + 1)
    after = metrics(srv)
    assert after["answers"] == before["answers"]  # stopped before its first piece went anywhere
    assert after["requests"]["POST /api/generate"].get("499", 0) == \
        before["requests"].get("POST /api/generate", {}).get("499", 0) + 1


# -- refusals ------------------------------------------------------------------------------------------


def test_bad_images_get_400(srv: Running) -> None:
    client = oai(srv)
    corrupt_png = png(6)[:40] + b"\x00" * 100
    for url in ("data:image/png;base64,@@not-base64@@", data_uri(corrupt_png)):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=served(srv), messages=image_message(url),
                                               max_tokens=3, stream=stream)
            assert err.value.body["type"] == "invalid_request_error"

    r = requests.post(srv.url + "/api/generate", headers=AUTH, timeout=30,
                      json={"prompt": "What?", "images": ["not base64!"], "stream": False})
    assert r.status_code == 400 and "base64" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as err:
        oll(srv).chat(model=served(srv), messages=[{"role": "user", "content": "?", "images": [corrupt_png]}])
    assert err.value.status_code == 400


@pytest.mark.parametrize("setting,value", [("temperature", 7.0), ("top_p", 0.0), ("top_k", 2.5),
                                           ("repeat_penalty", -1.0)])
def test_both_apis_refuse_sampling_values_as_the_library_does(srv: Running, setting: str, value: float) -> None:
    """One check for every edge: gguf_mcv.options.Sampling (the OpenAI route allowed temperature <= 2
    and the Ollama route any temperature before)."""
    with pytest.raises(gguf_mcv.ConfigError, match=setting):
        gguf_mcv.Sampling().with_overrides(**{setting: value})
    r = requests.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], setting: value, "max_tokens": 1})
    assert r.status_code == 400 and setting in r.json()["error"]["message"]
    r = requests.post(srv.url + "/api/generate", headers=AUTH, timeout=30,
                      json={"prompt": "hi", "stream": False, "options": {setting: value, "num_predict": 1}})
    assert r.status_code == 400 and setting in r.json()["error"]


def test_oversize_bodies_get_413(small: Running) -> None:
    big = {"prompt": "x" * (100 * 1024), "stream": False}
    r = requests.post(small.url + "/api/generate", json=big, timeout=30)
    assert r.status_code == 413 and isinstance(r.json()["error"], str)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the server must count
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    r = requests.post(small.url + "/v1/chat/completions", data=chunked(), timeout=30,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unsupported_media_url_schemes_get_400_saying_what_is_allowed(srv: Running) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            oai(srv).chat.completions.create(model=served(srv), max_tokens=2, stream=stream,
                                             messages=image_message("ftp://example.com/cat.png"))
        assert err.value.body["code"] == "invalid_image"
        message = err.value.message
        assert "'ftp'" in message and "data: URIs" in message
        assert "--allow-remote-media" in message and "--allow-local-files" in message
    r = requests.post(srv.url + "/api/chat", headers=AUTH, timeout=60, json={"stream": False, "messages": [
        {"role": "user", "content": "?", "images": ["ftp://example.com/cat.png"]}]})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)  # Ollama's shape


def test_wrong_or_missing_key_gets_401_but_health_does_not_need_one(srv: Running) -> None:
    with pytest.raises(openai.AuthenticationError):
        oai(srv, key="wrong").models.list()
    with pytest.raises(ollama.ResponseError) as err:
        oll(srv, headers=None).list()
    assert err.value.status_code == 401
    r = requests.post(srv.url + "/api/generate", json={"prompt": "hi"}, timeout=60)
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    r = requests.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(srv.url + "/metrics", timeout=60).status_code == 401
    assert requests.get(srv.url + "/health", timeout=60).json()["status"] == "ok"


def test_local_files_are_refused(srv: Running, tmp_path) -> None:
    picture = tmp_path / "picture.png"
    picture.write_bytes(png(7))
    for url in ("file:///etc/passwd", "/etc/passwd", str(picture), picture.as_uri()):
        with pytest.raises(openai.BadRequestError) as err:
            oai(srv).chat.completions.create(model=served(srv), messages=image_message(url), max_tokens=2)
        assert "not allowed" in err.value.message and "root:" not in err.value.message


def test_remote_urls_refused_unless_enabled_and_never_to_private_hosts(srv: Running, small: Running) -> None:
    with pytest.raises(openai.BadRequestError, match="not allowed"):
        oai(srv).chat.completions.create(model=served(srv), max_tokens=2,
                                         messages=image_message("https://example.com/cat.png"))
    port = small.url.rsplit(":", 1)[1]
    for url in (f"http://127.0.0.1:{port}/health", f"http://localhost:{port}/health",
                "http://169.254.169.254/latest/meta-data/", "http://[::1]/x.png", "http://10.0.0.1/x.png"):
        with pytest.raises(openai.BadRequestError, match="not a public address"):
            oai(small, key="none").chat.completions.create(model=served(small), max_tokens=2,
                                                           messages=image_message(url))


class _Files(http.server.BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.send_header("Content-Length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def log_message(self, *args: Any) -> None:
        pass


def test_remote_images_are_fetched_with_a_size_cap(small: Running, monkeypatch) -> None:
    # the test's file server is on loopback, so treat every address as public here
    monkeypatch.setattr(remote, "_is_public", lambda ip: True)
    _Files.files = {"/cat.png": png(8), "/huge.png": png(9, (400, 400))}  # the second is > 64 KiB
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    try:
        client = oai(small, key="none")
        for path in ("/cat.png", "/moved"):
            r = client.chat.completions.create(model=served(small), max_tokens=2,
                                               messages=image_message(base + path))
            assert r.usage.prompt_tokens > 64
        with pytest.raises(openai.BadRequestError, match="larger than"):
            client.chat.completions.create(model=served(small), max_tokens=2,
                                           messages=image_message(base + "/huge.png"))
        with pytest.raises(openai.BadRequestError, match="HTTP 404"):
            client.chat.completions.create(model=served(small), max_tokens=2,
                                           messages=image_message(base + "/missing.png"))
    finally:
        files.shutdown()
        files.server_close()


def test_listings_name_files_without_revealing_where_they_are(srv: Running, tiny) -> None:
    shown = requests.post(srv.url + "/api/show", headers=AUTH, json={"model": served(srv)}, timeout=60)
    assert shown.status_code == 200
    info = shown.json()["model_info"]
    assert info["general.file"] == tiny.quants["Q4_K_M"].name
    assert info["general.mmproj"] == tiny.mmproj.name
    folders = {str(tiny.quants["Q4_K_M"].parent), str(tiny.mmproj.parent)}
    listings = [shown] + [requests.get(srv.url + path, headers=AUTH, timeout=60)
                          for path in ("/api/tags", "/api/ps", "/v1/models", "/health", "/metrics")]
    for listing in listings:
        assert not any(folder in listing.text for folder in folders), listing.url


def test_model_names(srv: Running) -> None:
    name = served(srv)
    with pytest.raises(openai.NotFoundError):
        oai(srv).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ollama.ResponseError) as err:
        oll(srv).generate(model="llava:latest", prompt="hi")
    assert err.value.status_code == 404
    for alias in (name.upper(), f"{name}:latest", f"{name}:q4_k_m", f"{name}.gguf"):
        r = oll(srv).generate(model=alias, prompt="hi", options={"num_predict": 2})
        assert r.done and r.model == alias
    r = requests.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=30,  # model may be omitted
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == name


def test_invalid_requests_get_400_in_each_shape(srv: Running) -> None:
    r = requests.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = requests.post(srv.url + "/v1/chat/completions", headers={**AUTH, "Content-Type": "application/json"},
                      timeout=60, data=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = requests.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = requests.post(srv.url + "/api/chat", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "robot", "content": "hi"}], "stream": False})
    assert r.status_code == 400 and "role" in r.json()["error"]
    r = requests.get(srv.url + "/v1/nothing-here", headers=AUTH, timeout=60)
    assert r.status_code == 404 and "message" in r.json()["error"]


def test_metrics_count_requests_and_the_server_is_still_healthy(srv: Running) -> None:
    before = metrics(srv)
    requests.get(srv.url + "/v1/models", timeout=60)  # no key: 401
    oai(srv).chat.completions.create(model=served(srv), max_tokens=2,
                                     messages=image_message(data_uri(png(99))))  # an image not seen before
    requests.post(srv.url + "/api/chat", headers=AUTH, json={"messages": [{"role": "x"}]}, timeout=60)
    wait_for(lambda: metrics(srv)["in_flight"] == 0)  # the answer's thread ends just after its response
    after = metrics(srv)

    def count(m: dict[str, Any], route: str, status: int) -> int:
        return m["requests"].get(route, {}).get(str(status), 0)

    assert count(after, "GET /v1/models", 401) == count(before, "GET /v1/models", 401) + 1
    chats = "POST /v1/chat/completions"
    assert count(after, chats, 200) == count(before, chats, 200) + 1
    assert count(after, "POST /api/chat", 400) == count(before, "POST /api/chat", 400) + 1
    assert count(after, "GET /metrics", 200) >= 1
    assert after["answers"] == before["answers"] + 1
    assert after["prompt_tokens"] - before["prompt_tokens"] > 64
    assert after["image_tokens"] - before["image_tokens"] == 64
    assert after["completion_tokens"] > before["completion_tokens"]
    assert after["encode_ms_total"] > before["encode_ms_total"]
    assert after["queue_length"] == 0 and after["in_flight"] == 0
    assert requests.get(srv.url + "/health", timeout=60).json()["status"] == "ok"


def test_metrics_stay_small_whatever_methods_and_paths_clients_invent(srv: Running) -> None:
    rng = random.Random(0)

    def invented(k: int) -> str:
        return "".join(rng.choices(string.ascii_uppercase, k=k))

    with requests.Session() as session:  # no key: refused requests are counted too
        for i in range(1000):
            path = "/v1/models" if i % 4 == 0 else f"/{invented(6).lower()}/{i}"
            method = "GET" if i % 5 == 0 else invented(8)
            assert session.request(method, srv.url + path, timeout=60).status_code in (401, 404, 405)
    counted = metrics(srv)["requests"]
    assert len(counted) <= 20 and len(json.dumps(counted)) < 2000, sorted(counted)
    assert sum(counted["other (unmatched)"].values()) >= 600  # neither method nor path known


COMPLETED = ("gguf_mcv_answers_total", (("outcome", "completed"),))


def scrape(running: Running) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` parsed by prometheus_client's own parser: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = requests.get(running.url + "/metrics", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_prometheus_metrics_parse_and_count_requests_tokens_encoding_and_cache(srv: Running) -> None:
    before = scrape(srv)
    image = image_message(data_uri(png(123)))
    # a new image, then the same one after another system prompt (so not from the KV cache):
    # encoded once, then from the embedding cache
    for system in ([], [{"role": "system", "content": "Be brief."}]):
        oai(srv).chat.completions.create(model=served(srv), max_tokens=2, messages=system + image)
    requests.get(srv.url + "/v1/models", timeout=60)  # no key: 401
    wait_for(lambda: scrape(srv)[COMPLETED] == before.get(COMPLETED, 0) + 2)  # counted as answers end
    after = scrape(srv)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    chats = dict(method="POST", route="/v1/chat/completions")
    assert delta("gguf_mcv_http_requests_total", **chats, status="200") == 2
    assert delta("gguf_mcv_http_requests_total", method="GET", route="/v1/models", status="401") == 1
    assert delta("gguf_mcv_answers_total", outcome="completed") == 2
    assert delta("gguf_mcv_tokens_total", kind="image") == 128
    assert delta("gguf_mcv_tokens_total", kind="completion") > 0
    assert delta("gguf_mcv_vision_slices_total", source="encoded") == 1
    assert delta("gguf_mcv_vision_slices_total", source="cache") == 1
    assert delta("gguf_mcv_vision_encode_seconds_total") > 0
    assert delta("gguf_mcv_embedding_cache_lookups_total", result="hit") >= 1
    assert delta("gguf_mcv_embedding_cache_lookups_total", result="miss") >= 1
    assert after[("gguf_mcv_queue_length", ())] == 0 and after[("gguf_mcv_active_slots", ())] == 0
    assert after[("gguf_mcv_max_queue", ())] == 8


def test_metrics_views_and_their_errors(srv: Running) -> None:
    as_json = requests.get(srv.url + "/metrics", headers={**AUTH, "Accept": "application/json"}, timeout=60)
    assert as_json.headers["content-type"] == "application/json" and "requests" in as_json.json()
    assert requests.get(srv.url + "/metrics?format=prometheus", headers=AUTH, timeout=60).text.startswith("#")
    bad = requests.get(srv.url + "/metrics?format=xml", headers=AUTH, timeout=60)
    assert bad.status_code == 400 and "format" in bad.text
    assert requests.get(srv.url + "/metrics", timeout=60).status_code == 401  # the key is needed


def test_each_app_has_its_own_registry(model) -> None:
    from prometheus_client import REGISTRY

    apps = [server.build_app(model, api_key="") for _ in range(2)]  # the global registry would refuse this
    registries = {id(app.state.gguf.registry) for app in apps}
    assert len(registries) == 2 and all(app.state.gguf.registry is not REGISTRY for app in apps)
    assert not any(name.startswith("gguf_mcv") for name in REGISTRY._names_to_collectors)


def test_metrics_of_a_closed_model_still_scrape(tiny) -> None:
    m = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=512, n_threads=1)
    running = Running(server.build_app(m, api_key=KEY))
    try:
        m.close()
        scraped = scrape(running)
        assert ("gguf_mcv_queue_length", ()) in scraped
        assert not any(name.startswith("gguf_mcv_embedding_cache") for name, _ in scraped)
    finally:
        running.stop()


def test_a_restarted_server_answers_a_known_image_without_encoding_it(tiny, tmp_path) -> None:
    image = image_message(data_uri(png(321, (600, 500))))  # overview + slices
    encoded = []
    for _ in range(2):  # the second server is a new model with a new cache object: only the disk is shared
        m = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096, n_threads=2,
                          embed_cache=gguf_mcv.EmbeddingCache(disk_dir=tmp_path / "emb"))
        running = Running(server.build_app(m, api_key=KEY))
        try:
            oai(running).chat.completions.create(model=served(running), max_tokens=2, messages=image)
            wait_for(lambda r=running: scrape(r)[COMPLETED] == 1)  # counted as the answer's thread ends
            scraped = scrape(running)
        finally:
            running.stop()
            m.close()
        encoded.append((scraped[("gguf_mcv_vision_slices_total", (("source", "encoded"),))],
                        scraped[("gguf_mcv_vision_slices_total", (("source", "cache"),))],
                        scraped[("gguf_mcv_embedding_cache_lookups_total", (("result", "hit_disk"),))]))
    first, second = encoded
    assert first[0] > 1 and first[1] == 0  # several slices encoded the first time
    assert second == (0, first[0], first[0])  # none after the restart: all from the disk tier


def test_the_memory_of_large_bodies_goes_back_to_the_os(tiny) -> None:
    """``gguf-mcv serve`` keeps no memory for large bodies it is done with (glibc kept 70-80 MiB)."""
    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gguf_mcv", "serve", str(tiny.quants["Q4_K_M"]),
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is None and _answers(url + "/health"), timeout=60)
        image = "data:image/png;base64," + "A" * (5 * 2**20)
        body = json.dumps({"model": "another-model", "messages": [  # read, parsed, then 404
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]})
        # the worker process answers (gguf_mcv/server/supervisor.py): its memory is the one to watch
        (worker,) = [p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        before = worker.memory_info().rss
        with ThreadPoolExecutor(8) as pool:
            for _ in range(3):
                posts = [pool.submit(requests.post, url + "/v1/chat/completions", data=body, timeout=60,
                                     headers={"Content-Type": "application/json"}) for _ in range(8)]
                assert [f.result().status_code for f in posts] == [404] * 8
        grown = worker.memory_info().rss - before
        assert grown < 40 * 2**20, f"{grown / 2**20:.0f} MiB more after 24 bodies of 5 MiB"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).ok
    except requests.RequestException:
        return False


# -- smaller pieces ----------------------------------------------------------------------------------


def test_api_key_from_the_environment(model, monkeypatch) -> None:
    monkeypatch.setenv(server.API_KEY_ENV, "from-env")
    running = Running(server.build_app(model))
    try:
        assert requests.get(running.url + "/v1/models", timeout=60).status_code == 401
        key = {"Authorization": "Bearer from-env"}
        assert requests.get(running.url + "/v1/models", headers=key, timeout=60).status_code == 200
    finally:
        running.stop()


def test_serve_binds_loopback_and_warns_when_exposed_without_a_key(model, monkeypatch, caplog) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(kw))
    monkeypatch.delenv(server.API_KEY_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="gguf_mcv.server"):
        server.serve(model, port=9999)
        assert calls[-1]["host"] == "127.0.0.1" and calls[-1]["port"] == 9999
        assert calls[-1]["http"] == "h11"  # whatever parsers are installed (httptools refuses odd methods)
        assert "without an API key" not in caplog.text
        server.serve(model, host="0.0.0.0")
    assert "without an API key" in caplog.text


def test_serve_refuses_a_bad_port_and_a_server_that_could_not_start(model, monkeypatch) -> None:
    from gguf_mcv.errors import ConfigError

    def cannot_bind(app: Any, **kw: Any) -> None:
        raise SystemExit(3)  # what uvicorn does when it cannot bind

    monkeypatch.setattr(uvicorn, "run", cannot_bind)
    with pytest.raises(ConfigError, match="65535"):
        server.serve(model, port=99999)
    with pytest.raises(ConfigError, match="could not start"):
        server.serve(model, port=9999)


def _reply(text: str) -> gguf_mcv.Reply:
    timings = gguf_mcv.Timings(0, 0, 0, 0, 0, 0, 0, 0)
    return gguf_mcv.Reply(text, usage=gguf_mcv.Usage(3, 0, 0, 0), timings=timings, finish_reason="stop")


def test_priming_keeps_every_piece_the_reply_and_closing() -> None:
    closed: list[bool] = []

    def pieces(texts: list[str]):
        try:
            yield from texts
            return _reply("".join(texts))
        finally:
            closed.append(True)

    empty = answering.primed(gguf_mcv.Stream(pieces([])))
    assert list(empty) == [] and empty.reply == ""
    primed = answering.primed(gguf_mcv.Stream(pieces(["a", "b", "c"])))
    assert list(primed) == ["a", "b", "c"] and primed.reply == "abc"
    closed.clear()
    primed = answering.primed(gguf_mcv.Stream(pieces(["a", "b"])))
    assert next(primed) == "a"
    primed.close()  # closing the primed stream closes the model's stream (and frees the model)
    assert closed == [True]


def test_names_a_catalog_model_answers_to(tmp_path) -> None:
    from types import SimpleNamespace

    from gguf_mcv.model import ModelInfo

    info = ModelInfo(name="MiniCPM-V 2.6", model_path=str(tmp_path / "ggml-model-Q4_K_M.gguf"),
                     mmproj_path=str(tmp_path / "mmproj-model-f16.gguf"), quant="Q4_K_M",
                     repo="openbmb/MiniCPM-V-2_6-gguf", template_origin="gguf", can_think=False,
                     thinking_default=False, n_ctx=4096, slice_size=448)
    served, names = naming.model_names(SimpleNamespace(info=info), None)
    assert served == "minicpm-v-2.6"
    for name in ("minicpm-v-2.6", "MiniCPM-V 2.6", "openbmb/MiniCPM-V-2_6-gguf", "minicpm-v:8b", "minicpm-v",
                 "minicpm-v:latest", "ggml-model-Q4_K_M", "minicpm-v-2.6:Q4_K_M"):
        assert naming.normal_name(name) in names, name
    for name in ("minicpm-v:2b", "minicpm-v-4.5", "llava"):
        assert naming.normal_name(name) not in names, name
    assert naming.model_names(SimpleNamespace(info=info), "my-vlm")[0] == "my-vlm"


class _Scripted:
    """A stand-in Model whose answers follow the question: "late" fails after a piece, "crash" at once."""

    kept_in_memory = None  # build_app looks whether a RAM store is attached (none is asked for here)

    def __init__(self, info: Any) -> None:
        self.info = info

    def chat_completion(self, messages: list[dict[str, Any]], **options: Any) -> gguf_mcv.Stream:
        question = messages[-1]["content"]
        if question == "crash":
            raise RuntimeError("a bug")
        if question == "slow bad image":
            time.sleep(0.5)
            raise gguf_mcv.MediaError("a bad image")

        def pieces():
            yield "one "
            if question == "late":
                raise gguf_mcv.EngineError("llama_decode failed")
            return _reply("one ")

        return gguf_mcv.Stream(pieces())


def test_errors_after_the_stream_started_arrive_in_the_stream(model, caplog, monkeypatch) -> None:
    monkeypatch.setattr(answering, "KEEPALIVE_S", 0.2)
    running = Running(server.build_app(_Scripted(model.info), api_key=""))
    try:
        client = oai(running, key="none")
        for question, error in (("late", "llama_decode failed"), ("slow bad image", "a bad image")):
            with pytest.raises(openai.APIError, match=error):  # the second after keep-alives
                for _ in client.chat.completions.create(model=served(running), stream=True,
                                                        messages=[{"role": "user", "content": question}]):
                    pass
        with pytest.raises(ollama.ResponseError, match="llama_decode failed"):
            for _ in oll(running, headers=None).chat(messages=[{"role": "user", "content": "late"}],
                                                     model=served(running), stream=True):
                pass
        with caplog.at_level(logging.ERROR, logger="gguf_mcv.server"):
            crash = {"messages": [{"role": "user", "content": "crash"}]}
            r = requests.post(running.url + "/api/chat", json=crash, timeout=60)
        assert r.status_code == 500 and "a bug" in r.json()["error"]
        assert "a bug" in caplog.text  # real faults are logged
        r = requests.post(running.url + "/api/generate", json={"prompt": "fine", "stream": False}, timeout=60)
        assert r.json()["response"] == "one " and r.json()["eval_count"] == 0
        assert metrics(running, headers={})["failed"] == 4
    finally:
        running.stop()


# -- structured output ----------------------------------------------------------------------------

from typing import Literal, Optional  # noqa: E402  (this section's own imports, kept with it)

import pydantic  # noqa: E402


class Reading(pydantic.BaseModel):
    """A meter reading: strings bounded by an ASCII pattern so random weights end them soon."""

    reading: float = pydantic.Field(ge=0, le=50)
    unit: Literal["kWh", "m3"]
    digits: list[int] = pydantic.Field(max_length=3)
    note: Optional[str] = pydantic.Field(default=None, pattern=r"^[a-z]{0,5}$")


def test_openai_parse_helper_returns_the_pydantic_object(srv: Running) -> None:
    client = oai(srv)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed in range(4):
        r = parse(model=served(srv), messages=image_message(data_uri(png(9)), "Read the meter."),
                  response_format=Reading, max_tokens=200, seed=seed)
        assert isinstance(r.choices[0].message.parsed, Reading)


def test_openai_json_schema_and_json_object_streaming_and_not(srv: Running) -> None:
    client = oai(srv)
    schema = {"name": "reading", "strict": True, "schema": Reading.model_json_schema()}
    for response_format in ({"type": "json_schema", "json_schema": schema}, {"type": "json_object"}):
        kwargs = dict(model=served(srv), messages=[{"role": "user", "content": "JSON."}], max_tokens=300,
                      seed=5, response_format=response_format)
        whole = client.chat.completions.create(**kwargs)
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        if response_format["type"] == "json_schema":
            Reading.model_validate_json(text)
        elif whole.choices[0].finish_reason == "stop":  # any object: free strings may run long
            assert isinstance(json.loads(text), dict)


def test_ollama_format_schema_and_json(srv: Running) -> None:
    client = oll(srv)
    messages = [{"role": "user", "content": "Read the meter.", "images": [b64(png(10))]}]
    for seed in range(3):
        r = client.chat(model=served(srv), messages=messages, format=Reading.model_json_schema(),
                        options={"num_predict": 200, "seed": seed})
        Reading.model_validate_json(r.message.content)
        parts = list(client.chat(model=served(srv), messages=messages, format=Reading.model_json_schema(),
                                 stream=True, options={"num_predict": 200, "seed": seed}))
        Reading.model_validate_json("".join(p.message.content for p in parts))
    g = client.generate(model=served(srv), prompt="Any JSON.", format="json",
                        options={"num_predict": 300, "seed": 1})
    assert g.done_reason == "length" or isinstance(json.loads(g.response), dict)


def test_invalid_schemas_and_formats_get_a_clean_400(srv: Running) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "strnig"}}}
    with pytest.raises(openai.BadRequestError, match=r"properties\.a\.type"):
        oai(srv).chat.completions.create(model=served(srv), messages=[{"role": "user", "content": "?"}],
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": bad}})
    for response_format in ({"type": "json_schema"}, {"type": "yaml"}):
        r = requests.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "response_format": response_format})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    with pytest.raises(ollama.ResponseError) as err:
        oll(srv).chat(model=served(srv), messages=[{"role": "user", "content": "?"}], format=bad)
    assert err.value.status_code == 400 and "properties.a.type" in str(err.value)
    r = requests.post(srv.url + "/api/generate", headers=AUTH, timeout=60,
                      json={"prompt": "hi", "format": "yaml", "stream": False})
    assert r.status_code == 400
    assert oai(srv).chat.completions.create(model=served(srv), max_tokens=2,
                                            messages=[{"role": "user", "content": "?"}]).choices  # still fine


# -- tool calling ---------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
                   "required": ["city"]}}}


def test_openai_tool_round_trip(srv: Running) -> None:
    client = oai(srv)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=served(srv), messages=messages, tools=[WEATHER_TOOL],
                                       tool_choice="required", max_tokens=100, seed=1)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    chunks = list(client.chat.completions.create(model=served(srv), messages=messages, tools=[WEATHER_TOOL],
                                                 tool_choice="required", max_tokens=100, seed=1, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert streamed[0].function.name == "get_weather"
    assert streamed[0].function.arguments == call.function.arguments
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model=served(srv), messages=messages, tools=[WEATHER_TOOL],
                                            tool_choice="none", max_tokens=6, seed=2)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=served(srv), messages=messages, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "rm"}})


def test_ollama_tool_round_trip(srv: Running) -> None:
    client = oll(srv)
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat(model=served(srv), messages=messages, tools=[WEATHER_TOOL],
                    options={"num_predict": 100, "seed": 1})
    assert r.done
    calls = r.message.tool_calls or []  # "auto": random weights rarely open a call, but any call is valid
    assert all(c.function.name == "get_weather" and "city" in c.function.arguments for c in calls)
    fake = {"function": {"name": "get_weather", "arguments": {"city": "paris"}}}
    messages += [{"role": "assistant", "content": "", "tool_calls": [fake]},
                 {"role": "tool", "content": '{"temperature": 21}'}]
    answer = client.chat(model=served(srv), messages=messages, tools=[WEATHER_TOOL],
                         options={"num_predict": 6, "seed": 2})
    assert answer.done and isinstance(answer.message.content, str)
    parts = list(client.chat(model=served(srv), messages=messages, tools=[WEATHER_TOOL], stream=True,
                             options={"num_predict": 6, "seed": 2}))
    assert parts[-1].done


def long_history(turns: int = 12, words: int = 400) -> list[dict[str, Any]]:
    """A conversation far longer than the test model's 4096-token context, ending in a question."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        history.append({"role": "user", "content": f"question {i}: " + "tell me more " * (words // 3)})
        history.append({"role": "assistant", "content": f"answer {i}: " + "there is more " * (words // 3)})
    return history + [{"role": "user", "content": "And finally?"}]


def test_truncate_drops_oldest_turns_and_says_so_without_it_the_request_is_refused(srv: Running, model) -> None:
    body = {"messages": long_history(), "max_tokens": 4, "temperature": 0}
    refused = requests.post(f"{srv.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert refused.status_code == 400 and "n_ctx" in refused.text
    assert "X-Gguf-Mcv-Dropped-Turns" not in refused.headers

    running = Running(server.build_app(model, api_key="", truncate=True))
    try:
        answered = requests.post(f"{running.url}/v1/chat/completions", json=body, timeout=120)
        assert answered.status_code == 200, answered.text
        dropped = answered.json()["usage"]["dropped_turns"]
        assert 0 < dropped < 12 and answered.headers["X-Gguf-Mcv-Dropped-Turns"] == str(dropped)
        assert answered.json()["usage"]["prompt_tokens"] <= 4096

        chunks = list(oai(running).chat.completions.create(model=served(running), stream=True, **body))
        assert chunks[-1].usage.model_extra["dropped_turns"] == dropped

        ollama_body = {"model": served(running), "messages": body["messages"], "stream": False,
                       "options": {"num_predict": 4, "temperature": 0}}
        ollama = requests.post(f"{running.url}/api/chat", json=ollama_body, timeout=120)
        assert ollama.status_code == 200 and ollama.json()["dropped_turns"] == dropped
        assert ollama.headers["X-Gguf-Mcv-Dropped-Turns"] == str(dropped)

        short = requests.post(f"{running.url}/v1/chat/completions", timeout=60,
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert "dropped_turns" not in short.json()["usage"]
        assert "X-Gguf-Mcv-Dropped-Turns" not in short.headers
    finally:
        running.stop()


def test_bad_schemas_and_tools_get_their_400_without_waiting_for_the_model(srv: Running, model) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^a|$"}}}}}
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
    with holding(model):  # every slot is taken: a request that waited would time out
        for extra in ({"response_format": bad_schema}, {"tools": bad_tool},
                      {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": "x"}}):
            r = requests.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                              json={"messages": [{"role": "user", "content": "?"}], **extra})
            assert r.status_code == 400, r.text
        r = requests.post(srv.url + "/api/chat", headers=AUTH, timeout=60,
                          json={"messages": [{"role": "user", "content": "?"}], "stream": False,
                                "format": {"type": "string", "pattern": "^a|$"}})
        assert r.status_code == 400 and "pattern" in r.text
