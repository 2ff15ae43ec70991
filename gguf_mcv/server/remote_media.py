"""Fetching http(s) images and videos for a request, only from public addresses (no SSRF)."""

from __future__ import annotations

import base64
import http.client
import ipaddress
import socket
import ssl
import urllib.parse
from typing import Any

from .. import __version__
from ..errors import MediaError
from .media_urls import part_url

#: Connect and per-read timeout when fetching a remote image or video.
REMOTE_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3


def fetch_remote_media(messages: list[dict[str, Any]], max_bytes: int) -> list[dict[str, Any]]:
    """``messages`` with each http(s) image or video URL replaced by a data: URI of its bytes."""
    def part(p: Any) -> Any:
        url = part_url(p)
        if url is None or urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
            return p
        data = "data:;base64," + base64.b64encode(_fetch_public(url, max_bytes=max_bytes)).decode()
        kind = p["type"]
        value = p[kind]
        return {**p, kind: {**value, "url": data} if isinstance(value, dict) else data}

    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list)
            else m for m in messages]


def _fetch_public(url: str, *, max_bytes: int, timeout: float = REMOTE_TIMEOUT_S) -> bytes:
    """GET ``url``, but only from public addresses; :class:`MediaError` for anything else.

    Every address the host resolves to must be public, and the connection goes to the
    checked address (no second DNS answer). Redirects are followed (at most
    :data:`MAX_REDIRECTS`), each checked the same way.
    """
    for _ in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError:
            raise MediaError(f"Bad port in media URL {url[:200]}.") from None
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
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
            return _read_capped(resp, max_bytes, url)
        except (OSError, http.client.HTTPException) as exc:  # timeouts, resets, TLS, bad HTTP
            raise MediaError(f"Fetching {url[:200]} failed: {exc}.") from exc
        finally:
            conn.close()
    raise MediaError(f"Fetching {url[:200]}: more than {MAX_REDIRECTS} redirects.")


def _public_address(host: str, port: int, url: str) -> str:
    """An address of ``host`` after checking that all of them are public."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise MediaError(f"Cannot resolve the host of {url[:200]}: {exc}.") from exc
    for info in infos:
        if not _is_public(ipaddress.ip_address(info[4][0])):
            raise MediaError(f"Refusing to fetch {url[:200]}: {host} is not a public address "
                             f"({info[4][0]}).")
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


def _read_capped(resp: http.client.HTTPResponse, max_bytes: int, url: str) -> bytes:
    declared = resp.getheader("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise MediaError(f"{url[:200]} is larger than {max_bytes} bytes.")
    data = resp.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise MediaError(f"{url[:200]} is larger than {max_bytes} bytes.")
    return data
