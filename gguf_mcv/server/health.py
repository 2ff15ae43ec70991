"""``GET /health`` (no key needed) and ``GET /metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from .bodies import authorize
from .state import state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {"status": "ok", "model": state.name, "queue_length": state.gate.waiting,
            "in_flight": state.gate.active}


@router.get("/metrics", dependencies=[Depends(authorize)])
async def metrics(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return state.metrics.snapshot(state.gate)
