"""Fetching an http(s) image or video: the one place gguf_mcv reads a URL, for every caller.

Only public addresses are fetched (no SSRF): every address the host resolves to must be
public, the connection goes to the checked address (no second DNS answer), and each redirect
(at most :data:`MAX_REDIRECTS`) is checked the same way. A body is read up to its cap and
refused past it, before more arrives. To use media from a private address (a camera on the
LAN, localhost), read it yourself and pass the bytes or a file.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from ..errors import MediaError

#: Connect and per-read timeout, seconds.
REMOTE_TIMEOUT_S = 20.0
MAX_REDIRECTS = 3
_CHUNK = 1 << 20


def url_scheme(url: str) -> str:
    """The lower-cased scheme of ``url``; MediaError when it cannot be parsed (an unclosed IPv6 bracket)."""
    try:
        return urllib.parse.urlsplit(url).scheme.lower()
    except ValueError as exc:
        raise MediaError(f"Malformed URL {url[:200]}: {exc}. Check its host part.") from None


def is_remote(url: str) -> bool:
    """Whether ``url`` is an http(s) URL (one :func:`fetch` reads); MediaError when malformed."""
    return url_scheme(url) in ("http", "https")


def fetch(url: str, *, max_bytes: int, timeout: float = REMOTE_TIMEOUT_S) -> bytes:
    """The body of ``url`` (a public http(s) address), at most ``max_bytes``; MediaError otherwise."""
    return b"".join(_body(url, max_bytes, timeout))


def download(url: str, path: Path, *, max_bytes: int, timeout: float = REMOTE_TIMEOUT_S) -> None:
    """Write the body of ``url`` to ``path`` as it arrives (at most ``max_bytes``); MediaError otherwise,
    and then no file is left at ``path``."""
    try:
        with path.open("wb") as out:
            for chunk in _body(url, max_bytes, timeout):
                out.write(chunk)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _body(url: str, max_bytes: int, timeout: float) -> Iterator[bytes]:
    """The body of ``url`` in chunks, after the redirects, the address checks and the size checks."""
    from .. import __version__  # here: the package is still importing this module when it sets it

    first = url
    for _ in range(MAX_REDIRECTS + 1):
        if not is_remote(url):
            raise MediaError(f"Only http(s) media URLs can be fetched, not {url[:200]}.")
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError:
            raise MediaError(f"Bad port in media URL {url[:200]}.") from None
        if not parts.hostname:
            raise MediaError(f"Only http(s) media URLs can be fetched, not {url[:200]}.")
        conn = _connect(parts, _public_address(parts.hostname, port, url), port, timeout)
        try:
            conn.request("GET", urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")),
                         headers={"User-Agent": f"gguf_mcv/{__version__}", "Accept": "image/*, video/*"})
            resp = conn.getresponse()
            location = resp.getheader("location")
            if resp.status in (301, 302, 303, 307, 308) and location:
                url = urllib.parse.urljoin(url, location)
                continue
            if resp.status != 200:
                raise MediaError(f"Fetching {url[:200]} failed: HTTP {resp.status}.")
            yield from _capped(resp, max_bytes, url)
            return
        except (OSError, http.client.HTTPException) as exc:  # timeouts, resets, TLS, bad HTTP
            raise MediaError(f"Fetching {url[:200]} failed: {exc}.") from exc
        finally:
            conn.close()
    raise MediaError(f"Fetching {first[:200]}: more than {MAX_REDIRECTS} redirects.")


def _public_address(host: str, port: int, url: str) -> str:
    """An address of ``host`` after checking that all of them are public."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise MediaError(f"Cannot resolve the host of {url[:200]}: {exc}.") from exc
    for info in infos:
        if not _is_public(ipaddress.ip_address(info[4][0])):
            raise MediaError(f"Refusing to fetch {url[:200]}: {host} is not a public address ({info[4][0]}). "
                             "Media from a private address: read it yourself and pass the bytes or a file.")
    return str(infos[0][4][0])


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _connect(parts: urllib.parse.SplitResult, address: str, port: int,
             timeout: float) -> http.client.HTTPConnection:
    """A connection to ``address`` speaking HTTP(S) for ``parts.hostname`` (TLS checks that name)."""
    host = parts.hostname or ""
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
        if parts.scheme.lower() == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
    except OSError as exc:
        raise MediaError(f"Cannot connect to {host}: {exc}.") from exc
    cls = http.client.HTTPSConnection if parts.scheme.lower() == "https" else http.client.HTTPConnection
    conn = cls(host, port, timeout=timeout)
    conn.sock = sock  # already connected: http.client will not resolve the name again
    return conn


def _capped(resp: http.client.HTTPResponse, max_bytes: int, url: str) -> Iterator[bytes]:
    declared = resp.getheader("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise MediaError(f"{url[:200]} is larger than {max_bytes:,} bytes.")
    read = 0
    while chunk := resp.read(min(_CHUNK, max_bytes + 1 - read)):
        read += len(chunk)
        if read > max_bytes:
            raise MediaError(f"{url[:200]} is larger than {max_bytes:,} bytes.")
        yield chunk
    if declared.isdigit() and read < int(declared):  # http.client returns a short body without a word
        raise MediaError(f"Fetching {url[:200]} failed: the connection ended after {read:,} of "
                         f"{int(declared):,} bytes. Try again.")
