"""Request bodies (``server.bodies``, ``server.gate``): JSON only, a deadline, slow bodies hold no
place in the queue, the bodies being read share a byte budget. Raw sockets play the slow clients."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

pytest.importorskip("fastapi")
requests = pytest.importorskip("requests")

from test_server import Running  # noqa: E402

import gguf_mcv  # noqa: E402  (after the importorskips)
from gguf_mcv import server  # noqa: E402

JSON_ROUTES = ["/v1/chat/completions", "/api/generate", "/api/chat", "/api/show"]


@pytest.fixture(scope="module")
def model(tiny) -> Iterator[gguf_mcv.Model]:
    m = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=1024, n_threads=2)
    yield m
    m.close()


@pytest.fixture(scope="module")
def srv(model) -> Iterator[Running]:
    """No key, two places in the queue (one answering, one waiting), 4 KiB bodies."""
    running = Running(server.build_app(model, api_key="", max_queue=1, max_body_bytes=4096))
    yield running
    running.stop()


@contextmanager
def slow_body(running: Running, path: str = "/v1/chat/completions", length: int = 1000,
              first: bytes = b"{") -> Iterator[socket.socket]:
    """A POST whose headers and ``first`` body bytes were sent; the rest comes as the test sends it."""
    host, port = running.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {length}\r\n\r\n".encode() + first)
        yield sock
    finally:
        sock.close()


def response_of(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response on ``sock`` (read until the server closes it)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def hello(running: Running) -> requests.Response:
    return requests.post(running.url + "/v1/chat/completions", timeout=60,
                         json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_json_routes_refuse_bodies_not_sent_as_json(srv: Running, path: str, content_type: str | None) -> None:
    # what a web page can send anywhere without a CORS preflight (or, from a Blob, with no type)
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", "stream": False,
                       "max_tokens": 2, "options": {"num_predict": 2}})
    headers = {"Content-Type": content_type} if content_type else {}
    r = requests.post(srv.url + path, data=body.encode(), headers=headers, timeout=30)
    assert r.status_code == 415, r.text
    message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["error"]
    assert "Content-Type: application/json" in message
    assert requests.post(srv.url + path, data=body.encode(), headers={"Content-Type": "application/json"},
                         timeout=60).status_code == 200


def test_slow_bodies_do_not_lock_others_out(srv: Running) -> None:
    # more slow clients than the queue has places, each sending a byte now and then
    with ExitStack() as stack:
        slow = [stack.enter_context(slow_body(srv)) for _ in range(4)]
        time.sleep(0.3)  # their headers have been read: they are reading their bodies
        for _ in range(2):
            for sock in slow:
                sock.sendall(b" ")
            r = hello(srv)
            assert r.status_code == 200, r.text
            # the answer's place is given back just after its response is sent: wait for it
            deadline = time.monotonic() + 60
            while True:
                health = requests.get(srv.url + "/health", timeout=30).json()
                if health["queue_length"] == 0 and health["in_flight"] == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert health["queue_length"] == 0 and health["in_flight"] == 0, health


def test_a_body_that_does_not_arrive_in_time_gets_408(model) -> None:
    running = Running(server.build_app(model, api_key="", body_timeout_s=1.5))
    try:
        began = time.monotonic()
        with slow_body(running, "/api/chat") as sock:
            for _ in range(4):  # a byte every 0.5 s: never stalled, never done
                time.sleep(0.5)
                try:
                    sock.sendall(b" ")
                except OSError:  # refused and closed already
                    break
            status, error = response_of(sock)
        assert status == 408 and "did not arrive within 1.5 s" in error["error"]
        assert time.monotonic() - began < 60  # refused, not left waiting (generous: a loaded machine)
        assert hello(running).status_code == 200
    finally:
        running.stop()


def test_the_bodies_being_read_share_a_byte_budget(model) -> None:
    # max_queue 0, one slot, 2 KiB bodies: the bodies being read may hold 2 KiB in all
    running = Running(server.build_app(model, api_key="", max_queue=0, max_body_bytes=2048))
    try:
        with slow_body(running, length=2000, first=b"{" + b" " * 1499):  # 1.5 KiB arrived, stalled
            time.sleep(0.3)
            body = json.dumps({"messages": [{"role": "user", "content": "x" * 900}], "max_tokens": 2})
            r = requests.post(running.url + "/v1/chat/completions", data=body, timeout=30,
                              headers={"Content-Type": "application/json"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
            assert int(r.headers["Retry-After"]) >= 1
            assert hello(running).status_code == 200  # a small body fits beside it
        time.sleep(0.3)  # the stalled client is gone: its bytes are released
        r = requests.post(running.url + "/v1/chat/completions", data=body, timeout=60,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
    finally:
        running.stop()
