"""MJPEG over HTTP (``multipart/x-mixed-replace``, as IP cameras serve it), read here rather than by FFmpeg.

FFmpeg buffers a part as long as its ``Content-Length`` says, whatever that is: one part
declaring 99999999999 bytes took a watcher to 931 MB before it gave up. Here each part's
declared length is checked against :data:`MAX_PART_BYTES` before anything is buffered (a
part without one is read up to that many bytes), and each JPEG's size is read from its
header and checked against :data:`~gguf_mcv.vision.media.MAX_PIXELS` before it is decoded;
either is a :class:`~gguf_mcv.errors.SourceError`. :func:`open_mjpeg` answers None for an
``http(s)://`` URL whose answer is not a multipart stream (HLS, a video file, an error page,
a login OpenCV's FFmpeg may know): that goes on to OpenCV. A ``user:password@`` in the URL is
sent as HTTP Basic authentication.
"""

from __future__ import annotations

import base64
import http.client
import io
import urllib.parse
from typing import Any

import numpy as np
import PIL.Image

from ..errors import SourceError
from ..vision.media import MAX_PIXELS, open_pil

#: The longest part (one JPEG) a stream may declare or send: a 64-megapixel JPEG fits with room to spare.
MAX_PART_BYTES = 64 * 2**20
#: The longest header line, and the most header lines, a part may have.
MAX_HEADER_LINE = 8192
MAX_HEADERS = 64


def open_mjpeg(url: str, name: str, timeout: float) -> "MjpegCapture | None":
    """An :class:`MjpegCapture` reading ``url``, or None when its answer is not an MJPEG stream;
    ``OSError`` (``http.client.HTTPException`` included) when it cannot be reached."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    kind = http.client.HTTPSConnection if parts.scheme.lower() == "https" else http.client.HTTPConnection
    conn = kind(host, parts.port, timeout=timeout)
    headers = {"Accept": "multipart/x-mixed-replace, */*", "User-Agent": "gguf-mcv"}
    if parts.username is not None:
        login = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), headers=headers)
        response = conn.getresponse()
    except (OSError, http.client.HTTPException):
        conn.close()
        raise
    except ValueError as exc:  # a URL http.client refuses (a control character in it)
        conn.close()
        raise OSError(str(exc)) from None
    ctype, params = _content_type(response.getheader("Content-Type", ""))
    boundary = params.get("boundary", "").strip()
    if response.status != 200 or ctype != "multipart/x-mixed-replace" or not boundary:
        conn.close()
        return None
    return MjpegCapture(conn, response, boundary, name)


def _content_type(value: str) -> tuple[str, dict[str, str]]:
    """A Content-Type header's type (lower case) and its parameters (quotes taken off)."""
    kind, *rest = value.split(";")
    params = {}
    for item in rest:
        key, _, val = item.partition("=")
        params[key.strip().lower()] = val.strip().strip('"')
    return kind.strip().lower(), params


class MjpegCapture:
    """One MJPEG connection, read as OpenCV's ``VideoCapture`` is (``read``, ``get``, ``release``)."""

    def __init__(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse, boundary: str,
                 name: str) -> None:
        self.name = name
        self._conn = conn
        self._response = response
        marker = boundary if boundary.startswith("--") else "--" + boundary
        self._markers = (marker.encode("latin-1", "replace"), (marker + "--").encode("latin-1", "replace"))
        self._at_part = False  # the boundary line before the next part has been read already
        self._parts = 0

    def isOpened(self) -> bool:  # noqa: N802 - OpenCV's name
        return self._response is not None

    def get(self, prop: int) -> float:
        """Nothing is known before a part is read (no frame rate, no size): 0, as OpenCV says for unknown."""
        return 0.0

    def set(self, prop: int, value: float) -> bool:
        return False

    def release(self) -> None:
        self._conn.close()

    def read(self) -> tuple[bool, Any]:
        """(True, BGR frame) for the next part, (True, None) for a part that is not a decodable
        JPEG, (False, None) when the connection ended or timed out (reopen it); a part over the
        limits is a :class:`SourceError`."""
        try:
            data = self._next_part()
        except SourceError:
            raise
        except (OSError, http.client.HTTPException, ValueError):  # dropped, timed out: reopened by the caller
            return False, None
        if data is None:
            return False, None
        self._parts += 1
        return True, self._decode(data)

    # -- parts -----------------------------------------------------------------------

    def _line(self, limit: int) -> bytes:
        line = self._response.readline(limit + 1)
        if not line:
            raise EOFError
        return line

    def _next_part(self) -> bytes | None:
        try:
            if not self._at_part:
                self._skip_to_boundary()
            self._at_part = False
            length = self._headers()
            if length is not None:
                data = self._response.read(length)
                return data if len(data) == length else None
            return self._until_boundary()
        except EOFError:
            return None

    def _skip_to_boundary(self) -> None:
        skipped = 0
        while True:
            line = self._line(MAX_HEADER_LINE)
            stripped = line.strip()
            if stripped in self._markers:
                if stripped == self._markers[1]:
                    raise EOFError  # the closing boundary: the stream ended
                return
            skipped += len(line)
            if skipped > MAX_PART_BYTES:
                raise SourceError(f"{self.name} sent {skipped:,} bytes without a part boundary: is it an MJPEG "
                                  "stream?")

    def _headers(self) -> int | None:
        """Read a part's headers; its declared length (checked), or None when it declares none."""
        length = None
        for _ in range(MAX_HEADERS + 1):
            line = self._line(MAX_HEADER_LINE)
            if len(line) > MAX_HEADER_LINE:
                raise SourceError(f"{self.name} sent a part header over {MAX_HEADER_LINE} bytes: is it an MJPEG "
                                  "stream?")
            if not line.strip():
                return length
            key, _, value = line.decode("latin-1").partition(":")
            if key.strip().lower() == "content-length":
                text = value.strip()
                if not text.isdigit() or len(text) > 18:
                    raise SourceError(f"{self.name} declared a part of Content-Length {text[:40]!r}: not a "
                                      "length a camera sends.")
                length = int(text)
                if length > MAX_PART_BYTES:
                    raise SourceError(f"{self.name} declared a part of {length:,} bytes, over the "
                                      f"{MAX_PART_BYTES:,} an MJPEG frame may have: is the camera sending "
                                      "something else?")
        raise SourceError(f"{self.name} sent a part with more than {MAX_HEADERS} header lines: is it an MJPEG "
                          "stream?")

    def _until_boundary(self) -> bytes:
        """A part without a Content-Length: its bytes up to the next boundary (within MAX_PART_BYTES)."""
        data = bytearray()
        while True:
            line = self._response.readline(MAX_PART_BYTES + 1 - len(data))
            if not line:
                raise EOFError
            if line.strip() in self._markers:
                self._at_part = line.strip() == self._markers[0]
                return bytes(data[:-2] if data.endswith(b"\r\n") else data.rstrip(b"\n"))
            data += line
            if len(data) > MAX_PART_BYTES:
                raise SourceError(f"{self.name} sent a part of more than {MAX_PART_BYTES:,} bytes, over what an "
                                  "MJPEG frame may have: is the camera sending something else?")

    def _decode(self, data: bytes) -> np.ndarray | None:
        """The JPEG as a BGR array (OpenCV's order); None if it is not one; SourceError over MAX_PIXELS
        (read from the header, before decoding)."""
        import cv2  # lazy: `import gguf_mcv` does not load OpenCV

        try:
            with open_pil(io.BytesIO(data)) as pil:
                size = "{}×{}".format(*pil.size) if pil.size[0] * pil.size[1] > MAX_PIXELS else None
        except PIL.Image.DecompressionBombError:  # Pillow's own limit, far above ours
            size = "more than 178 million"
        except Exception:  # noqa: BLE001 - Pillow raises many kinds on a damaged header: not a frame
            return None
        if size is not None:
            raise SourceError(f"{self.name} sent a JPEG of {size} pixels (part {self._parts} of this connection), "
                              f"over the {MAX_PIXELS:,}-pixel limit: lower the camera's resolution.")
        return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
