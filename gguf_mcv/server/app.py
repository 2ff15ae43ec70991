"""Assembling the FastAPI app (state, routers, error handlers, counting) and serving it."""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..errors import ConfigError
from ..hardware import available_ram
from ..model import Model
from ..prompt.messages import MediaPolicy
from ..runtime.kv_store import DEFAULT_MAX_BYTES as DEFAULT_KEEP_CHATS_BYTES
from ..runtime.kv_store import KVStore
from ..runtime.memory_store import MemoryKVStore, resolve_cap
from . import health, ollama_api, openai_api, page
from .bodies import authorize
from .gate import Gate
from .http_errors import AnswerWhenStopping, add_error_handlers
from .logs import configure_logging
from .malloc import return_large_buffers_to_os
from .metrics import CountRequests, Metrics
from .naming import model_names
from .origins import CheckSite, check_allowed
from .prometheus import registry_for
from .state import DROPPED_TURNS_HEADER, State

log = logging.getLogger("gguf_mcv.server")

API_KEY_ENV = "GGUF_MCV_API_KEY"
DEFAULT_MAX_BODY_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_QUEUE = 8
DEFAULT_BODY_TIMEOUT_S = 60.0


#: uvicorn's HTTP parser, named rather than left to what is installed: with httptools (uvicorn[standard],
#: which ray[serve] pulls in) a request whose method llhttp does not know gets a bare 400 before the app
#: sees it, so the same server answered 405 or 400 depending on other packages.
HTTP_PARSER = "h11"


def build_app(
    model: Model,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int = DEFAULT_MAX_QUEUE,
    allow_local_files: bool = False,
    allow_remote_media: bool = False,
    truncate: bool = False,
    keep_chats: str | os.PathLike | None = None,
    keep_chats_bytes: int = DEFAULT_KEEP_CHATS_BYTES,
    keep_chats_memory: int | str | None = None,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    """A FastAPI app serving ``model`` over the OpenAI and Ollama APIs (see the module doc).

    ``model_name`` is the name clients see (default: the catalog name, else the model's
    name). ``api_key=None`` reads ``$GGUF_MCV_API_KEY``; ``api_key=""`` means no key.
    ``max_queue`` requests may wait while one is answered (or, with a model loaded with
    ``parallel=N``, while N are). With ``truncate`` a request
    whose history does not fit loses its oldest turns, whole, as :class:`~gguf_mcv.Chat` does
    (reported in ``usage.dropped_turns`` and the ``X-Gguf-Mcv-Dropped-Turns`` header);
    without it such a request is refused with a 400. With ``keep_chats`` (a folder, capped at
    ``keep_chats_bytes``) a conversation's KV state is kept there when another one is about to
    overwrite it, and when the server stops, and restored when its next request comes (see
    :meth:`gguf_mcv.Model.keep_chats`). With ``keep_chats_memory`` (bytes, or ``"auto"``: a
    quarter of the RAM free once the model is loaded, at most 2 GiB) such states are kept in
    RAM too, and looked for there first (:meth:`gguf_mcv.Model.keep_chats_in_memory`; a model
    that already has a store in RAM keeps it). Off here by default; :func:`serve` and
    ``gguf-mcv serve`` default to ``"auto"``.

    A request body must be JSON (else 415) and must have arrived within ``body_timeout_s``
    (else 408); a body still arriving holds no place in the queue, and the bodies being
    read share ``(max_queue + parallel) * max_body_bytes`` (503 beyond). With
    ``allowed_hosts=None`` the app answers only requests whose ``Host`` is an IP address,
    ``localhost`` or this machine's name (421 otherwise), as a server for this machine
    should: a web page cannot reach it through a name of its own (DNS rebinding). Names in
    ``allowed_hosts`` (``*.example.com`` patterns, ``"*"`` for any) are answered too.
    Requests from web pages (``Origin``) are refused (403) unless from the server's own
    page or one of ``allowed_origins`` (``"*"`` for any), which also get CORS headers.
    See :mod:`gguf_mcv.server.origins`.
    """
    if max_queue < 0 or max_body_bytes < 1 or not body_timeout_s > 0:
        raise ConfigError("max_queue must be >= 0, max_body_bytes >= 1 and body_timeout_s > 0.")
    hosts, origins = check_allowed(allowed_hosts or (), allowed_origins)
    memory_bytes = resolve_cap(keep_chats_memory, available_ram)
    store = model.keep_chats(keep_chats, max_bytes=keep_chats_bytes) if keep_chats is not None else None
    in_memory = model.kept_in_memory
    if in_memory is None:
        in_memory = _keep_in_memory(model, memory_bytes, keep_chats_memory)
    key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
    served, names = model_names(model, model_name)
    state = State(
        model=model, name=served, names=names, api_key=key or None, max_body_bytes=max_body_bytes,
        policy=MediaPolicy(allow_files=allow_local_files, allow_remote=False),
        allow_remote=allow_remote_media, metrics=Metrics(), truncate=truncate, kept=store, kept_in_memory=in_memory,
        gate=Gate(max_queue, capacity=model.info.parallel,
                  body_budget=(max_queue + model.info.parallel) * max_body_bytes),
        body_timeout_s=body_timeout_s,
    )
    state.registry = registry_for(state)
    app = FastAPI(title="gguf_mcv", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=_keeping(model, store))
    app.state.gguf = state
    app.include_router(health.router)
    app.include_router(page.router)  # no key: the page is static; it sends the key the user types
    app.include_router(openai_api.router, dependencies=[Depends(authorize)])
    app.include_router(ollama_api.router, dependencies=[Depends(authorize)])
    add_error_handlers(app)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"],
                           expose_headers=["Retry-After", DROPPED_TURNS_HEADER])
    app.add_middleware(CheckSite, allowed_hosts=hosts, allowed_origins=origins)
    app.add_middleware(AnswerWhenStopping)
    app.add_middleware(CountRequests, metrics=state.metrics)  # the outermost: refusals are counted too
    return app


def _keep_in_memory(model: Model, cap: int, asked: int | str | None) -> MemoryKVStore | None:
    """The RAM store of ``cap`` bytes for ``model`` (None for 0), the choice logged."""
    if cap:
        log.info("Keeping up to %.0f MiB of idle conversations' KV states in RAM (keep_chats_memory=%s).",
                 cap / 2**20, asked)
        return model.keep_chats_in_memory(cap)
    if asked == "auto":
        log.info("Not keeping idle conversations in RAM: too little is free for keep_chats_memory='auto'.")
    return None


def _keeping(model: Model, store: KVStore | None):
    """The app's lifespan: as the server stops, idle conversations go to ``store`` (if any)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if store is not None and not await run_in_threadpool(model.keep_idle):
            log.warning("Not every idle conversation was kept in %s before the server stopped.", store.directory)

    return lifespan


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
    truncate: bool = False,
    keep_chats: str | os.PathLike | None = None,
    keep_chats_bytes: int = DEFAULT_KEEP_CHATS_BYTES,
    keep_chats_memory: int | str | None = "auto",
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    log_level: str = "info",
) -> None:
    """Serve ``model`` with uvicorn until interrupted (options as in :func:`build_app`, but
    ``keep_chats_memory`` is ``"auto"`` unless told otherwise).

    Bound to a loopback address the server answers local names only (see
    :func:`build_app`); bound to another address (``0.0.0.0``: every one) it is for the
    network and answers any ``Host`` unless ``allowed_hosts`` is given. Logs, uvicorn's and
    the ``gguf_mcv`` logger's at ``log_level`` and above, go to stderr (see
    :mod:`gguf_mcv.server.logs`). :class:`ConfigError` if the port is out of range or the
    server cannot start.
    """
    import uvicorn

    _check_port(port)
    logging_config = configure_logging(log_level)  # first: what building the app logs shows too
    if allowed_hosts is None and not is_loopback(host):
        allowed_hosts = ["*"]
    app = build_app(model, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                    max_queue=max_queue, allow_local_files=allow_local_files,
                    allow_remote_media=allow_remote_media, truncate=truncate, keep_chats=keep_chats,
                    keep_chats_bytes=keep_chats_bytes, keep_chats_memory=keep_chats_memory,
                    body_timeout_s=body_timeout_s, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins)
    return_large_buffers_to_os()
    if app.state.gguf.api_key is None and not is_loopback(host):
        log.warning("Serving on %s without an API key: anyone who can reach it can use the model. "
                    "Set %s or pass api_key.", host, API_KEY_ENV)
    try:  # a graceful-shutdown limit: an endless stream must not keep Ctrl-C waiting
        uvicorn.run(app, host=host, port=port, log_level=log_level, log_config=logging_config,
                    timeout_graceful_shutdown=5, http=HTTP_PARSER)
    except SystemExit as exc:  # uvicorn exits when it cannot start, having logged why
        if exc.code:
            raise ConfigError(f"The server could not start on {host}:{port} (see the log above).") from None
        raise


def check_bind(host: str, port: int) -> None:
    """Raise :class:`ConfigError` unless a server could listen on ``host``:``port`` now.

    Checks what uvicorn will do (resolve ``host``, bind each of its addresses), so a
    command can refuse a bad address or a port in use before it loads a model.
    """
    addresses = addresses_to_bind(host, port)
    errors = [error for error in map(_try_bind, addresses) if error is not None]
    # as asyncio does, an address family this machine lacks is skipped if another one binds
    serious = [e for e in errors if e.errno != errno.EADDRNOTAVAIL]
    if serious or len(errors) == len(addresses):
        raise ConfigError(bind_failure(host, port, (serious or errors)[0]))


def _check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise ConfigError(f"Port {port} is out of range: use a port from 1 to 65535.")


def addresses_to_bind(host: str, port: int) -> list[tuple]:
    """``socket.getaddrinfo``'s addresses a server on ``host``:``port`` binds; :class:`ConfigError`
    for a port out of range or a host that does not resolve."""
    _check_port(port)
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"Cannot serve on host {host!r}: {exc.strerror}. Use an address of this "
                          "machine, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (all).") from None


def _try_bind(address: tuple) -> OSError | None:
    """Bind a socket as asyncio's server would (reusing the address, IPv6 only on IPv6); the error."""
    family, kind, proto, _, sockaddr = address
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
    except OSError as exc:
        return exc
    return None


def bind_failure(host: str, port: int, error: OSError) -> str:
    """What to tell the user when ``host:port`` could not be bound (in use, not allowed, no such address)."""
    if error.errno == errno.EADDRINUSE:
        return f"Port {port} on {host} is already in use: stop what uses it or pass another --port."
    if error.errno == errno.EACCES:
        return f"Not allowed to listen on port {port}: ports below 1024 need privileges; use another --port."
    if error.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine: use one of its addresses, or 0.0.0.0 for all."
    return f"Cannot listen on {host}:{port}: {error.strerror or error}."


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or "localhost") is reachable only from this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
