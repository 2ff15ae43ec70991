"""What the routes share (the model, settings, queue, counters) and helpers over the model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from prometheus_client import CollectorRegistry

from ..model import Model
from ..prompt.messages import MediaPolicy
from ..prompt.tool_calls import toolbox
from ..reply import Reply
from ..runtime.generation import Stream
from ..runtime.kv_store import KVStore
from ..runtime.memory_store import MemoryKVStore
from .gate import Gate
from .http_errors import HTTPError
from .metrics import Metrics
from .naming import normal_name

DROPPED_TURNS_HEADER = "X-Gguf-Mcv-Dropped-Turns"


@dataclass(frozen=True)
class WorkerInfo:
    """What a supervised server's worker process knows of the ones before it (``serve_supervised``)."""

    restarts: int = 0  #: workers started again after the first one died
    last_restart: float | None = None  #: when the last one was started (Unix time)
    last_exit: str | None = None  #: how the worker before this one ended, e.g. "killed by SIGSEGV"
    last_load_error: str | None = None  #: why the last load that failed (after one had served) failed
    next_load_retry: float | None = None  #: while the model cannot be loaded: when it is tried again (Unix time)

    def to_dict(self) -> dict[str, Any]:
        return {"worker_restarts": self.restarts, "last_worker_restart": self.last_restart,
                "last_worker_exit": self.last_exit, "last_load_error": self.last_load_error,
                "next_load_retry": self.next_load_retry}


@dataclass
class State:
    """What the routes share: the model, settings, the queue and the counters."""

    model: Model
    name: str
    names: frozenset[str]
    api_key: str | None
    max_body_bytes: int
    policy: MediaPolicy
    allow_remote: bool
    gate: Gate
    metrics: Metrics
    #: drop a request's oldest turns (whole) when it does not fit, instead of refusing it
    truncate: bool = False
    registry: CollectorRegistry | None = None  #: this app's Prometheus registry (see ``prometheus``)
    kept: KVStore | None = None  #: where idle conversations' KV states go (``keep_chats``)
    kept_in_memory: MemoryKVStore | None = None  #: and in RAM (``keep_chats_memory``)
    body_timeout_s: float = 60.0  #: a request body must have arrived within this long (else 408)
    worker: WorkerInfo = field(default_factory=WorkerInfo)  #: restarts of a supervised server's worker

    def check_model(self, requested: str | None) -> str:
        """The name to echo for ``requested``; 404 if it names another model."""
        if not requested:
            return self.name
        if normal_name(requested) not in self.names:
            raise HTTPError(404, f"Model {requested!r} not found: this server runs {self.name!r}.",
                            code="model_not_found", param="model")
        return requested


def state_of(request: Request) -> State:
    """The server's :class:`State`, from the app that got ``request``."""
    return request.app.state.gguf


def model_stream(state: State, messages: list[dict[str, Any]], options: dict[str, Any]) -> Stream:
    """Start answering ``messages`` (on the answer's thread) under the server's media policy."""
    return state.model.chat_completion(messages, stream=True, policy=state.policy,
                                       truncate=state.truncate, **options)


def check_output(model: Model, options: dict[str, Any]) -> None:
    """Make the answer's grammar now, before the request waits for the model (run it on a
    thread): a bad schema or tool is a 400 at once, and no conversion holds a slot.
    The conversion is cached, so the answer does not repeat it."""
    box = toolbox(options.get("tools"), options.get("tool_choice"))
    if box is not None:
        model.checked(box.constraint())
    elif options.get("schema") is not None or options.get("format"):
        model.constraint(options.get("schema"), options.get("format"))


def dropped_turns_header(reply: Reply) -> dict[str, str]:
    """The response header saying how many turns ``--truncate`` dropped (none when none were)."""
    return {DROPPED_TURNS_HEADER: str(reply.dropped_turns)} if reply.dropped_turns else {}


def file_mtime(path: str) -> float:
    """``path``'s modification time; 0 when it cannot be read."""
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0
