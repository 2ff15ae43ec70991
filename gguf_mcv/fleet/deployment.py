"""The Serve application: a front (the HTTP ingress) and the model replicas behind it.

The front reads a request's body, computes its routing key (:mod:`.keys`) and forwards the
request whole to a replica through a handle routed by :class:`~gguf_mcv.fleet.router.ConversationRouter`;
each replica answers it with the single server's own app (:func:`gguf_mcv.server.build_app`),
so the routes, limits, checks and error shapes are the single server's.
"""

# no "from __future__ import annotations": Serve's ingress hands FastAPI the route's signature as it is,
# and a string annotation of Request there is not resolved (422 "query: request missing")
import json
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from ..server.app import DEFAULT_MAX_BODY_BYTES, build_app
from ..server.http_errors import HTTPError, error_response, openai_error
from ..server.prometheus import CONTENT_TYPE, exposition
from .asgi import answer
from .keys import route_key
from .metrics import merged
from .policy import DEFAULT_IMBALANCE
from .quant import GIVEN, local_reason
from .registry import keep_reporting, registry
from .router import ROUTER_PATH

log = logging.getLogger("gguf_mcv.fleet")

REPLICA_HEADER = "x-gguf-mcv-replica"
_TRIES = 3  # a request no replica started is sent again: Serve routes it to a live one
_HOP_BY_HOP = {"connection", "transfer-encoding", "keep-alive"}

front_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


class Replica:
    """One loaded model answering forwarded requests with the single server's app."""

    def __init__(self, load_kwargs: dict[str, Any], app_kwargs: dict[str, Any]) -> None:
        from ..loader import load  # lazy: the replica's process loads llama.cpp, the front's never does

        self.model = load(**load_kwargs)
        self.app = build_app(self.model, **app_kwargs)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.registry = keep_reporting(self.info)

    async def __call__(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        async def report() -> None:  # this answer counted in /health before the client sees its end
            await self.registry.report.remote(self.info())

        async for piece in answer(self.app, request, [(REPLICA_HEADER, self.name)], before_end=report):
            yield piece

    def info(self) -> dict[str, Any]:
        """Where this replica runs and what it holds (the fleet's ``/health`` lists these)."""
        state = self.app.state.gguf
        return {"replica": self.name, "node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
                "pid": os.getpid(), "quant": self.model.info.quant, "slots": state.gate.capacity,
                "in_flight": state.gate.active, "queue_length": state.gate.waiting,
                "answers": state.metrics.answers, "prompt_tokens": state.metrics.prompt_tokens,
                "cached_tokens": state.metrics.cached_tokens,
                "exposition": exposition(state.registry).decode() if state.registry is not None else ""}


# before the ingress class: serve.ingress serializes it as it is decorated
async def _rest(pieces: Any, content_type: str) -> AsyncIterator[bytes]:
    """The body's chunks; a replica lost mid-answer ends a stream with an error event, never a hang."""
    try:
        async for chunk in pieces:
            yield chunk
    except Exception as exc:
        log.warning("A replica stopped mid-answer: %s", exc)
        lost = HTTPError(503, "The replica answering this stopped mid-answer (it is being restarted); "
                              "send the request again.", code="replica_lost")
        if content_type.startswith("text/event-stream"):
            yield f"data: {json.dumps(openai_error(lost))}\n\n".encode()
        elif "ndjson" in content_type:
            yield (json.dumps({"error": lost.message}) + "\n").encode()


@serve.ingress(front_app)
class Front:
    """The HTTP ingress: each request to the replica that holds its conversation."""

    def __init__(self, replica: DeploymentHandle, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 quant: tuple[str | None, str] = (None, "")) -> None:
        self.replica = replica
        self.max_body_bytes = max_body_bytes
        self.quant = quant  # the one every replica loads, and why
        self.registry = registry()

    @front_app.get("/health", include_in_schema=False)
    async def health(self, request: Request) -> Response:
        """A replica's own ``/health``, with every replica listed and the restarts counted."""
        answered = await self.forward(request, "health")
        if answered.status_code != 200 or not isinstance(answered, StreamingResponse):
            return answered
        body = b"".join([chunk async for chunk in answered.body_iterator])  # type: ignore[misc]
        listing = await self.registry.listing.remote()
        for replica in [*listing["replicas"], *listing["lost"]]:
            replica.pop("exposition", None)  # /metrics shows those
        health = {**json.loads(body), **listing, "quant": self.quant[0], "quant_reason": self.quant[1]}
        health["worker_restarts"] = health["restarts"]
        return JSONResponse(health, headers={REPLICA_HEADER: answered.headers.get(REPLICA_HEADER, "")})

    @front_app.get("/metrics", include_in_schema=False)
    async def metrics(self, request: Request) -> Response:
        """Every replica's families with a ``replica`` label (the JSON view: the answering replica's)."""
        answered = await self.forward(request, "metrics")
        if answered.status_code != 200 or not answered.headers.get("content-type", "").startswith("text/plain"):
            return answered
        async for _ in answered.body_iterator:  # type: ignore[attr-defined]
            pass  # the answering replica's own, in the listing too
        listing = await self.registry.listing.remote()
        texts = {r["replica"]: r.get("exposition", "") for r in listing["replicas"]}
        return Response(merged(texts), media_type=CONTENT_TYPE,
                        headers={REPLICA_HEADER: answered.headers.get(REPLICA_HEADER, "")})

    @front_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"],
                         include_in_schema=False)
    async def forward(self, request: Request, path: str) -> Response:
        body = bytearray()
        declared = request.headers.get("content-length", "")
        # over the limit: the replica answers 413 as the single server does, from what it is sent
        if not (declared.isdigit() and int(declared) > self.max_body_bytes):
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.max_body_bytes:
                    break
        forwarded = {"method": request.method, "path": request.url.path, "query": request.url.query,
                     "headers": list(request.headers.items()), "body": bytes(body),
                     "client": (request.client.host, request.client.port) if request.client else None,
                     "route": route_key(request.url.path, bytes(body))}
        for attempt in range(1, _TRIES + 1):
            pieces: Any = self.replica.options(stream=True).remote(forwarded)  # a DeploymentResponseGenerator
            try:
                start = await pieces.__anext__()
                break
            except Exception as exc:  # noqa: BLE001 - the replica died before answering: nothing was done
                log.warning("A replica failed before answering %s (try %d): %s", request.url.path, attempt, exc)
        else:
            return error_response(request, HTTPError(
                503, "The replicas answering this request stopped; send it again.", headers={"Retry-After": "1"}))
        headers = {k: v for k, v in start["headers"] if k.lower() not in _HOP_BY_HOP}
        return StreamingResponse(_rest(pieces, headers.get("content-type", "")), status_code=start["status"],
                                 headers=headers)


def application(load_kwargs: dict[str, Any], *, replicas: int = 1, app_kwargs: dict[str, Any] | None = None,
                imbalance: int = DEFAULT_IMBALANCE, spread: bool = True, num_cpus: float | None = None,
                affinity: bool = True, quant_reason: str | None = None) -> serve.Application:
    """The fleet as a Serve application (bind it yourself, or run it with :func:`~.serve_on_ray`).

    ``load_kwargs`` are :func:`gguf_mcv.load`'s keywords for every replica; ``app_kwargs``
    :func:`gguf_mcv.server.build_app`'s. ``spread``: one replica per node while nodes last.
    ``affinity=False`` routes with Serve's default router instead (for comparison). ``quant_reason``
    is why every replica loads ``load_kwargs["quant"]`` (``/health`` says both; :func:`~.run.deploy`
    chooses the quant and passes it; None: given, or each replica's own plan when there is none).
    """
    app_kwargs = dict(app_kwargs or {})
    threads = load_kwargs.get("n_threads") or 1
    parallel = load_kwargs.get("parallel") if isinstance(load_kwargs.get("parallel"), int) else 1
    queue = app_kwargs.get("max_queue", 8)
    options: dict[str, Any] = dict(
        name="gguf_mcv_replica", num_replicas=replicas,
        # Serve queues in front of the replicas; each takes what its slots and queue would
        max_ongoing_requests=parallel + queue,
        ray_actor_options={"num_cpus": threads if num_cpus is None else num_cpus},
        request_router_config=RequestRouterConfig(request_router_class=ROUTER_PATH,  # type: ignore[arg-type]
                                                  request_router_kwargs={"imbalance": imbalance})
        if affinity else RequestRouterConfig(),
        health_check_period_s=2, health_check_timeout_s=30)
    if spread:
        options["max_replicas_per_node"] = 1
    model = serve.deployment(**options)(Replica).bind(load_kwargs, app_kwargs)
    front = serve.deployment(name="gguf_mcv_front", ray_actor_options={"num_cpus": 0})(Front)
    quant, local = load_kwargs.get("quant"), load_kwargs.get("model_path")
    if local:
        quant, quant_reason = local_reason(load_kwargs)
    elif quant_reason is None:
        quant_reason = GIVEN if quant else "planned by each replica on its own node"
    return front.bind(model, app_kwargs.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES), (quant, quant_reason))
