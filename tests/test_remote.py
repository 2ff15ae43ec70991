"""The one fetch of an http(s) URL: public addresses only, redirects bounded, bodies capped as they arrive."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gguf_mcv.errors import MediaError
from gguf_mcv.vision import remote


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/ok":
            self._send(200, b"x" * 1000)
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/moved":
            self.send_response(301)
            self.send_header("Location", "/ok")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/unsized":  # no length declared: the cap is found by reading
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"y" * 5000)
            self.close_connection = True
        elif self.path == "/cut":  # declares more than it sends, then hangs up
            self.send_response(200)
            self.send_header("Content-Length", "5000")
            self.end_headers()
            self.wfile.write(b"z" * 10)
            self.close_connection = True
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def public(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "_is_public", lambda ip: True)  # the test server is on loopback


def test_private_addresses_are_refused_before_connecting(server: str) -> None:
    for url in (server + "/ok", "http://10.0.0.1/x.png", "http://169.254.169.254/latest/meta-data/",
                "http://[::1]/x.png", "http://[::ffff:127.0.0.1]/x.png"):
        with pytest.raises(MediaError, match="not a public address"):
            remote.fetch(url, max_bytes=10_000)


@pytest.mark.usefixtures("public")
def test_a_body_is_fetched_and_redirects_followed(server: str, tmp_path: Path) -> None:
    assert remote.fetch(server + "/ok", max_bytes=1000) == b"x" * 1000
    assert remote.fetch(server + "/moved", max_bytes=1000) == b"x" * 1000
    remote.download(server + "/moved", tmp_path / "f", max_bytes=1000)
    assert (tmp_path / "f").read_bytes() == b"x" * 1000


@pytest.mark.usefixtures("public")
@pytest.mark.parametrize(("path", "message"), [
    ("/ok", "larger than 999 bytes"),  # declared too large
    ("/unsized", "larger than 999 bytes"),  # found too large while reading
    ("/loop", "more than 3 redirects"),
    ("/missing", "HTTP 404"),
])
def test_what_cannot_be_fetched_is_a_media_error(server: str, path: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        remote.fetch(server + path, max_bytes=999)


@pytest.mark.usefixtures("public")
def test_a_body_cut_short_is_a_media_error(server: str, tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="ended after 10 of 5,000 bytes"):  # not a short image
        remote.fetch(server + "/cut", max_bytes=10_000)
    with pytest.raises(MediaError, match="ended after 10 of 5,000 bytes"):
        remote.download(server + "/cut", tmp_path / "f", max_bytes=10_000)
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("url", ["ftp://example.com/x.png", "http:///x.png", "http://example.com:99999/x",
                                 "file:///etc/passwd", "http://[::1/x.png"])
def test_urls_that_are_not_http_are_refused(url: str) -> None:
    with pytest.raises(MediaError):
        remote.fetch(url, max_bytes=10)


@pytest.mark.usefixtures("public")
def test_a_server_that_never_answers_times_out() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    try:
        with pytest.raises(MediaError, match="timed out|failed"):
            remote.fetch(f"http://127.0.0.1:{silent.getsockname()[1]}/x", max_bytes=10, timeout=0.5)
    finally:
        silent.close()


@pytest.mark.parametrize("url", ["http://[::1/x.png", "https://[fe80::1/clip.mp4"])
def test_a_malformed_url_is_a_media_error_for_every_caller(url: str) -> None:
    import gguf_mcv

    for call in (lambda: gguf_mcv.load_image(url, allow_remote=True),
                 lambda: gguf_mcv.sample_frames(url, allow_remote=True)):
        with pytest.raises(MediaError, match="Malformed URL"):
            call()
