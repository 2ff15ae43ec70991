"""``GET /``: the web page (``page.html``, one static file) for browsers; Ollama's greeting for others.

Ollama clients and scripts probe ``/`` for a plain ``... is running``; a browser asks for
``text/html`` and gets the page. The page needs no key to load (it is static and holds
nothing); it sends the key the user types with each API call. Its headers forbid loading
anything from elsewhere, framing it, and sniffing its type.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse

router = APIRouter()

#: What the page may do: its own inline script and style, calls to this server, media it was given.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data: blob:; media-src 'self' data: blob:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@router.get("/", include_in_schema=False)
async def root(request: Request) -> Response:
    if "text/html" in request.headers.get("accept", ""):
        return HTMLResponse(page(), headers=SECURITY_HEADERS)
    return PlainTextResponse("gguf_mcv is running")


@functools.cache
def page() -> bytes:
    """The page's HTML, read once from the package."""
    return resources.files(__package__).joinpath("page.html").read_bytes()
