"""The stand-in a supervised server runs while its model cannot be loaded again: it holds the
port and says why, until the supervisor tries the load once more (see ``supervisor``).

``GET /health`` answers 503 with ``status: "retrying"``, the worker's restarts, the last load
error and the next try's time; every other request gets a 503 with ``Retry-After`` in the
shape of the API it was for (``http_errors``). The ``Host`` and ``Origin`` checks are the
served app's (``origins``).
"""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from .http_errors import HTTPError, error_response
from .origins import CheckSite, check_allowed
from .state import WorkerInfo


def standby_app(info: WorkerInfo, options: dict[str, Any]) -> FastAPI:
    """The stand-in app: ``info`` on ``/health`` (503), a 503 for everything else.

    ``options`` are :func:`~gguf_mcv.server.build_app`'s (only the allowed hosts and
    origins are used)."""
    hosts, origins = check_allowed(options.get("allowed_hosts") or (), options.get("allowed_origins") or ())
    app = FastAPI(title="gguf_mcv", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "retrying", "model": None, **info.to_dict()}, status_code=503,
                            headers=_retry_after(info))

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def unavailable(request: Request) -> Response:
        return error_response(request, HTTPError(
            503, f"The model is not loaded: loading it failed ({info.last_load_error}); it is tried again "
                 f"at {time.strftime('%H:%M:%S', time.localtime(info.next_load_retry or time.time()))}.",
            code="model_not_loaded", headers=_retry_after(info)))

    app.add_middleware(CheckSite, allowed_hosts=hosts, allowed_origins=origins)
    return app


def _retry_after(info: WorkerInfo) -> dict[str, str]:
    wait = (info.next_load_retry or time.time()) - time.time()
    return {"Retry-After": str(max(1, math.ceil(wait)))}
