"""An MJPEG-over-HTTP camera stand-in on 127.0.0.1, for tests that read a live stream with OpenCV.

``MjpegServer(frames, fps)`` serves ``/stream.mjpg`` (multipart/x-mixed-replace JPEG parts, as
IP cameras do), cycling through ``frames`` (H×W×3 uint8 RGB arrays, or JPEG bytes as they are)
at ``fps``. ``stop()`` closes the listening socket and every open connection (the camera goes
away); ``start()`` serves again on the same port (it comes back).

Hostile cameras: ``lengths="none"`` sends parts without ``Content-Length`` (some cameras do);
``declare=N`` makes every part declare ``Content-Length: N`` and then sends filler bytes for as
long as the client reads (a part of N bytes that never ends).
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cv2
import numpy as np

BOUNDARY = "frameboundary"


class MjpegServer:
    """A stoppable, restartable MJPEG stream (see the module docstring)."""

    def __init__(self, frames: list[np.ndarray | bytes], fps: float = 20.0, port: int = 0, *,
                 lengths: str = "declared", declare: int | None = None) -> None:
        self.jpegs = [f if isinstance(f, bytes) else cv2.imencode(".jpg", cv2.cvtColor(f, cv2.COLOR_RGB2BGR))[1].tobytes()
                      for f in frames]
        self.fps = fps
        self.port = port
        self.lengths = lengths
        self.declare = declare
        self.authorization: str | None = None  #: the last request's Authorization header
        self.served = 0  #: frames sent so far, over all connections
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._alive = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/stream.mjpg"

    def start(self) -> "MjpegServer":
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                owner.authorization = self.headers.get("Authorization")
                if self.path.partition("?")[0] != "/stream.mjpg":
                    self.send_error(404)
                    return
                with owner._lock:
                    owner._conns.add(self.connection)
                self.send_response(200)
                self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
                self.end_headers()
                i = 0
                try:
                    while owner._alive.is_set():
                        jpeg = owner.jpegs[i % len(owner.jpegs)]
                        if owner.declare is not None:
                            self.wfile.write(f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\n"
                                             f"Content-Length: {owner.declare}\r\n\r\n".encode())
                            filler = b"\0" * 2**20
                            while owner._alive.is_set():  # the part that never ends
                                self.wfile.write(filler)
                        length = "" if owner.lengths == "none" else f"Content-Length: {len(jpeg)}\r\n"
                        self.wfile.write(f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\n{length}\r\n".encode()
                                         + jpeg + b"\r\n")
                        self.wfile.flush()
                        owner.served += 1
                        i += 1
                        time.sleep(1 / owner.fps)
                except OSError:
                    pass
                finally:
                    with owner._lock:
                        owner._conns.discard(self.connection)

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._alive.set()
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection."""
        self._alive.clear()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._conns.clear()

    def __enter__(self) -> "MjpegServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
