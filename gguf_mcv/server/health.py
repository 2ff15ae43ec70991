"""``GET /health`` (no key needed) and ``GET /metrics`` (Prometheus' text format, or JSON)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from ..runtime import native_check
from ..runtime.memory_store import EVENTS
from . import prometheus
from .bodies import authorize
from .http_errors import HTTPError, error_responses
from .state import state_of

router = APIRouter(responses=error_responses(ollama=False))


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {"status": "ok", "model": state.name, "queue_length": state.gate.waiting,
            "in_flight": state.gate.active, "parallel": state.gate.capacity,
            "native_fallbacks": list(native_check.notices()), **state.worker.to_dict()}


@router.get("/metrics", dependencies=[Depends(authorize)], responses={200: {
    "description": "Prometheus' text format, or the JSON view",
    "content": {prometheus.CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}},
                "application/json": {"schema": {"type": "object"}}}}})
async def metrics(request: Request, format: Annotated[str | None, Query(
        json_schema_extra={"enum": ["prometheus", "json", None]})] = None) -> Response:
    """Prometheus' text format; the JSON view with ``?format=json`` (or ``Accept: application/json``)."""
    state = state_of(request)
    accept = request.headers.get("accept", "")
    if format not in (None, "json", "prometheus"):
        raise HTTPError(400, f"format must be 'prometheus' (the default) or 'json', not {format[:40]!r}.",
                        param="format")
    if format == "json" or (format is None and "application/json" in accept and "text/plain" not in accept):
        snapshot = state.metrics.snapshot(state.gate)
        snapshot["worker_restarts"] = state.worker.restarts
        if state.kept is not None:
            snapshot["kept_chats"] = dict(state.kept.counts)
        if state.kept_in_memory is not None:
            memory = state.kept_in_memory
            snapshot["kept_chats_memory"] = {**{event: memory.counts[event] for event in EVENTS},
                                             "bytes": memory.usage(), "cap_bytes": memory.max_bytes}
        return JSONResponse(snapshot)
    assert state.registry is not None
    return Response(prometheus.exposition(state.registry), media_type=prometheus.CONTENT_TYPE)
