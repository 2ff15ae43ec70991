"""Which sites may use the server: the ``Host`` names it answers to, the web pages
(``Origin``) whose requests it takes.

A web page cannot read a local server's answers unless the server says so (CORS), but it
can make the browser send requests, and a page whose own name an attacker points at
127.0.0.1 (DNS rebinding) can read them too. So:

* ``Host``: by default only what a client on this machine sends: an IP address,
  ``localhost`` or ``*.localhost``, this machine's name; others get 421. ``allowed_hosts``
  adds names (``*.example.com`` patterns; ``"*"`` accepts any Host, as a server for the
  network must).
* ``Origin`` (sent by browsers): only the server's own pages (the same host and port) and
  ``allowed_origins`` (``"*"`` for any); others get 403. Allowed origins also get CORS
  headers, so their pages can read the answers.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import ConfigError
from .http_errors import HTTPError, error_response

_HOST_PATTERN = re.compile(r"(\*|(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?)")
_ORIGIN = re.compile(r"(\*|null|[a-z][a-z0-9+.-]*://[^/?#@\s]+)")


def check_allowed(hosts: Sequence[str], origins: Sequence[str]) -> tuple[list[str], list[str]]:
    """``hosts`` and ``origins`` normalized (lower case, no trailing ``/``); :class:`ConfigError` if malformed."""
    hosts = [h.strip().lower() for h in hosts]
    origins = [o.strip().lower().rstrip("/") for o in origins]
    for host in hosts:
        if not _HOST_PATTERN.fullmatch(host):
            raise ConfigError(f"Allowed host {host!r} is not a host name: give a name without scheme or "
                              "port, e.g. myserver.lan, *.example.com, or * for any.")
    for origin in origins:
        if not _ORIGIN.fullmatch(origin):
            raise ConfigError(f"Allowed origin {origin!r} is not an origin: give scheme://host[:port], "
                              "e.g. https://app.example.com, or * for any.")
    return hosts, origins


class CheckSite:
    """ASGI middleware: 421 for a ``Host`` not allowed, 403 for a web page's ``Origin`` not allowed.

    ``allowed_hosts`` and ``allowed_origins`` as :func:`check_allowed` returns them.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str], allowed_origins: Sequence[str]) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = {h for h in allowed_hosts if not h.startswith("*")} | {"localhost", socket.gethostname().lower()}
        self.suffixes = tuple(h[1:] for h in allowed_hosts if h.startswith("*.")) + (".localhost",)
        self.any_origin = "*" in allowed_origins
        self.origins = set(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host", "").lower()
        origin = headers.get("origin")
        error = None
        if not self._host_allowed(host):
            name = _hostname(host)
            error = HTTPError(421, f"This server answers to local names only, not {name!r}: a web page "
                                   "must not reach it through a name of its own. Use 127.0.0.1 or localhost, "
                                   f"or start the server with --allowed-host {name} (allowed_hosts in Python).",
                              code="host_not_allowed")
        elif origin is not None and not self._origin_allowed(origin.lower().rstrip("/"), host):
            error = HTTPError(403, f"Requests from web pages at {origin} are refused: only this server's own "
                                   f"page may call it. To let that site use it, start the server with "
                                   f"--allowed-origin {origin} (allowed_origins in Python).",
                              code="origin_not_allowed")
        if error is None:
            await self.app(scope, receive, send)
        else:
            await error_response(Request(scope), error)(scope, receive, send)

    def _host_allowed(self, host: str) -> bool:
        if self.any_host or not host:  # no Host: HTTP/1.0, never a browser
            return True
        name = _hostname(host)
        if name in self.hosts or name.endswith(self.suffixes):
            return True
        try:  # an IP address cannot be rebound: DNS rebinding needs a name of the attacker's
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def _origin_allowed(self, origin: str, host: str) -> bool:
        if self.any_origin or origin in self.origins:
            return True
        try:
            return urlsplit(origin).netloc == host  # the server's own page
        except ValueError:
            return False


def _hostname(host: str) -> str:
    """``host`` (a Host header's value) without its port and IPv6 brackets."""
    try:
        return urlsplit("//" + host).hostname or host
    except ValueError:
        return host
