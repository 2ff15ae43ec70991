"""gguf_mcv.watch.webhook: events POSTed to a real receiver on loopback, in order and once; a
receiver that hangs, fails, redirects or vanishes never blocks a tick and loses no count."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.watch.webhook import WebhookSink


class Receiver:
    """An HTTP receiver on a loopback port; ``answer(n)`` picks what the n-th POST gets."""

    def __init__(self, answer: Callable[[int], Any] = lambda n: 200) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.arrived: list[float] = []  #: when each accepted body arrived (time.time())
        self.headers: list[dict[str, str]] = []
        self.answer = answer
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                n = len(receiver.headers)
                receiver.headers.append(dict(self.headers))
                body = self.rfile.read(int(self.headers["Content-Length"]))
                what = receiver.answer(n)
                if what == "hang":
                    receiver.release.wait(30)
                    return
                if isinstance(what, tuple):  # (status, Location)
                    self.send_response(what[0])
                    self.send_header("Location", what[1])
                    self.end_headers()
                    return
                if what == 200:
                    receiver.bodies.append(json.loads(body))
                    receiver.arrived.append(time.time())
                self.send_response(what)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(answer: Callable[[int], Any] = lambda n: 200) -> Receiver:
        made.append(Receiver(answer))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_every_event_arrives_once_in_order(receiver) -> None:
    r = receiver()
    sink = WebhookSink(r.url)
    for i in range(20):
        sink.send({"event": "started", "frame": i})
    counts = sink.close(timeout_s=30)
    assert [b["frame"] for b in r.bodies] == list(range(20))
    assert counts.sent == 20 and counts.dropped == counts.failed == 0
    assert r.headers[0]["Content-Type"] == "application/json"


def test_a_receiver_that_fails_at_first_gets_the_event_after_a_retry(receiver) -> None:
    r = receiver(lambda n: 500 if n < 2 else 200)
    sink = WebhookSink(r.url, first_backoff_s=0.01)
    sink.send({"frame": 1})
    counts = sink.close(timeout_s=30)
    assert [b["frame"] for b in r.bodies] == [1] and counts.sent == 1 and len(r.headers) == 3


def test_a_hanging_receiver_never_blocks_send_and_a_full_queue_drops_the_oldest(receiver) -> None:
    r = receiver(lambda n: "hang")
    sink = WebhookSink(r.url, queue_size=3, timeout_s=60, retries=0)
    for i in range(50):
        sink.send({"frame": i})
    # every send returned while the receiver holds at most the first request: sends only queue
    assert len(r.headers) <= 1 and sink.pending() <= 3 + 1
    r.release.set()
    counts = sink.close(timeout_s=30)
    assert counts.sent == 0 and counts.dropped + counts.failed + sink.pending() >= 47
    assert counts.dropped >= 46


def test_a_redirect_is_not_followed(receiver) -> None:
    elsewhere = receiver()
    r = receiver(lambda n: (307, elsewhere.url))
    sink = WebhookSink(r.url, first_backoff_s=0.01)
    sink.send({"frame": 1})
    counts = sink.close(timeout_s=30)
    assert counts.failed == 1 and counts.sent == 0 and "redirect" in (counts.last_error or "")
    assert elsewhere.headers == []


def test_a_receiver_that_vanished_is_tried_again_then_given_up(receiver) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    sink = WebhookSink(f"http://127.0.0.1:{port}/gone", retries=2, first_backoff_s=0.01, timeout_s=2)
    sink.send({"frame": 1})
    counts = sink.close(timeout_s=30)
    assert counts.failed == 1 and counts.sent == 0 and "Connection" in (counts.last_error or "")


def test_credentials_in_the_url_are_sent_as_basic_auth_and_never_shown(receiver, caplog) -> None:
    r = receiver(lambda n: 401)
    url = r.url.replace("http://", "http://alice:s3cret@") + "?token=abc"
    sink = WebhookSink(url, retries=0)
    sink.send({"frame": 1})
    with caplog.at_level("WARNING", logger="gguf_mcv.watch"):
        counts = sink.close(timeout_s=30)
    assert counts.failed == 1 and r.headers[0]["Authorization"].startswith("Basic ")
    assert "s3cret" not in sink.shown and "abc" not in sink.shown
    assert "s3cret" not in caplog.text and "abc" not in caplog.text and "given up" in caplog.text


@pytest.mark.parametrize("url", ["", "ftp://host/x", "http://", "http://host:99999/", "file:///etc/passwd", 3])
def test_bad_urls_are_refused(url: Any) -> None:
    with pytest.raises(ConfigError, match="webhook"):
        WebhookSink(url)


def test_sends_from_many_threads_are_all_counted(receiver) -> None:
    r = receiver()
    sink = WebhookSink(r.url, queue_size=1000)
    threads = [threading.Thread(target=lambda k=k: [sink.send({"t": k, "i": i}) for i in range(25)]) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = sink.close(timeout_s=60)
    assert counts.sent == 200 and len(r.bodies) == 200
    for k in range(8):  # each thread's events in its own order
        assert [b["i"] for b in r.bodies if b["t"] == k] == list(range(25))
