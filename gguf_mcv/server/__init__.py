"""A local HTTP server for one :class:`~gguf_mcv.model.Model`: OpenAI and Ollama clients work as they are.

    from gguf_mcv.server import serve
    serve(model, port=8080)            # http://127.0.0.1:8080/v1 and http://127.0.0.1:8080/api

Routes (``/health`` needs no key, every other route does when a key is set):

* OpenAI: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``
  (SSE when ``stream``; usage always in the last chunk; ``: keep-alive`` comments every
  10 s while an answer waits for the model or its images). Errors are
  ``{"error": {"message", "type", "param", "code"}}``.
* Ollama: ``POST /api/generate``, ``POST /api/chat`` (NDJSON unless ``"stream": false``),
  ``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``GET /api/version``, ``GET /``.
  Errors are ``{"error": "message"}``.
* ``GET /health`` (model name, queue length, answers in flight, ``parallel``: how many run
  at once, and the worker's restarts under ``serve_supervised``) and ``GET /metrics``
  (Prometheus' text format; the JSON view with
  ``?format=json``: counters by method, route and status —
  other methods count as ``other``, unknown paths as ``(unmatched)`` — tokens, vision
  encoding, embedding-cache hits, queue length).
* ``GET /`` in a browser: a page to ask about an image or video and continue the
  conversation (``page``); other clients get Ollama's ``gguf_mcv is running``.

The model answers one request at a time; up to ``max_queue`` more wait, later ones get
``503`` with ``Retry-After`` (Ollama's own answer to a full queue; OpenAI clients retry
it) before their body is read. A request takes its place once its body has arrived: a
body still arriving holds none, and gets ``408`` unless it arrives within
``body_timeout_s``. Each answer runs on its own thread; a client that hangs
up stops its generation.

Security: binds 127.0.0.1 by default, and answers only requests for local ``Host``
names (421 otherwise: DNS rebinding) and from no web page but its own (403 otherwise);
``allowed_hosts`` and ``allowed_origins`` widen that (see ``origins``). Request bodies
must be sent as ``application/json`` (415 otherwise). The API key (``api_key=``, else the environment
variable ``GGUF_MCV_API_KEY``) is accepted as ``Authorization: Bearer <key>``. Request
bodies over ``max_body_bytes`` get 413 as soon as that much has arrived. Images and
videos come inside the request (data: URIs, Ollama's base64); local paths and
``file://`` URLs only with ``allow_local_files``; ``http(s)`` URLs only with
``allow_remote_media``, and then the server fetches them itself (size cap, timeout, at
most 3 redirects) and only from public addresses: every address the host resolves to
is checked and the connection goes to the checked one, so a URL cannot reach loopback,
private or link-local hosts. Other URL schemes get 400 saying what is accepted.

A request's ``model`` may be omitted; if given it must name the served model: its
served name, catalog name or alias, Hub repo, display name or file stem, any case,
with or without an Ollama tag (``:latest`` or the quant, e.g. ``minicpm-v-2.6:q4_k_m``).

Modules: ``app`` (building and serving the app), ``openai_api`` and ``ollama_api`` (the
routes), ``health`` (``/health``, ``/metrics``), ``bodies`` (key, body limit, JSON),
``answering`` (the answer thread, streaming, hang-ups), ``gate`` (the queue),
``state`` (what routes share), ``naming`` (model names), ``metrics`` (counters),
``prometheus`` (the counters in Prometheus' format), ``page`` (the web page),
``http_errors`` (error shapes and handlers), ``origins`` (allowed hosts and origins),
``logs`` (the served app's logging), ``supervisor`` (``serve_supervised``: the model in a
worker process started again when it dies, as ``gguf-mcv serve`` runs it), ``standby`` (the
stand-in holding the port while a failed load waits to be tried again), ``media_urls`` (which media URLs are
accepted), ``remote_media`` (the SSRF-safe fetch), ``malloc`` (returning freed memory).
"""

from __future__ import annotations

from typing import Any

try:  # the server's dependencies are an optional extra: say how to get them
    import fastapi.responses
    import prometheus_client
    import pydantic
    import starlette.exceptions
    import starlette.requests
    import starlette.types
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "gguf_mcv.server needs FastAPI and uvicorn: pip install 'gguf-mcv[server]'"
    ) from exc

from .app import API_KEY_ENV, build_app, check_bind, serve

del fastapi, prometheus_client, pydantic, starlette  # imported above only to check that they are installed

__all__ = ["API_KEY_ENV", "build_app", "check_bind", "serve", "serve_supervised"]


def __getattr__(name: str) -> Any:
    if name == "serve_supervised":  # imported when first asked for: it imports uvicorn's supervisor
        from .supervisor import serve_supervised

        return serve_supervised
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
