"""Assembling the FastAPI app (state, routers, error handlers, counting) and serving it."""

from __future__ import annotations

import ipaddress
import logging
import os

from fastapi import Depends, FastAPI

from .. import __version__
from ..errors import ConfigError
from ..messages import MediaPolicy
from ..model import Model
from . import health, ollama_api, openai_api
from .bodies import authorize
from .gate import Gate
from .http_errors import add_error_handlers
from .malloc import return_large_buffers_to_os
from .metrics import CountRequests, Metrics
from .naming import model_names
from .state import State

log = logging.getLogger("gguf_mcv.server")

API_KEY_ENV = "GGUF_MCV_API_KEY"
DEFAULT_MAX_BODY_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_QUEUE = 8


def build_app(
    model: Model,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int = DEFAULT_MAX_QUEUE,
    allow_local_files: bool = False,
    allow_remote_media: bool = False,
) -> FastAPI:
    """A FastAPI app serving ``model`` over the OpenAI and Ollama APIs (see the module doc).

    ``model_name`` is the name clients see (default: the catalog name, else the model's
    name). ``api_key=None`` reads ``$GGUF_MCV_API_KEY``; ``api_key=""`` means no key.
    ``max_queue`` requests may wait while one is answered.
    """
    if max_queue < 0 or max_body_bytes < 1:
        raise ConfigError("max_queue must be >= 0 and max_body_bytes >= 1.")
    key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
    served, names = model_names(model, model_name)
    state = State(
        model=model, name=served, names=names, api_key=key or None, max_body_bytes=max_body_bytes,
        policy=MediaPolicy(allow_files=allow_local_files, allow_remote=False),
        allow_remote=allow_remote_media, gate=Gate(max_queue), metrics=Metrics(),
    )
    app = FastAPI(title="gguf_mcv", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.gguf = state
    app.include_router(health.router)
    app.include_router(openai_api.router, dependencies=[Depends(authorize)])
    app.include_router(ollama_api.router, dependencies=[Depends(authorize)])
    add_error_handlers(app)
    app.add_middleware(CountRequests, metrics=state.metrics)
    return app


def serve(
    model: Model,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int = DEFAULT_MAX_QUEUE,
    allow_local_files: bool = False,
    allow_remote_media: bool = False,
    log_level: str = "info",
) -> None:
    """Serve ``model`` with uvicorn until interrupted (options as in :func:`build_app`)."""
    import uvicorn

    app = build_app(model, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                    max_queue=max_queue, allow_local_files=allow_local_files,
                    allow_remote_media=allow_remote_media)
    return_large_buffers_to_os()
    if app.state.gguf.api_key is None and not _is_loopback(host):
        log.warning("Serving on %s without an API key: anyone who can reach it can use the model. "
                    "Set %s or pass api_key.", host, API_KEY_ENV)
    # a graceful-shutdown limit: an endless stream must not keep Ctrl-C waiting
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
