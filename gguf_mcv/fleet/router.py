"""The policy as a Ray Serve request router (``RequestRouterConfig(request_router_class=...)``).

Serve still queues, probes queue lengths, backs off and restarts replicas; this class only ranks
the candidates (:class:`~gguf_mcv.fleet.policy.Policy`) and learns which replica answered what.
The key travels as the request's first argument (:class:`~gguf_mcv.fleet.deployment.Front` puts it there).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from .keys import NO_KEY, RouteKey
from .policy import DEFAULT_IMBALANCE, Policy

ROUTER_PATH = "gguf_mcv.fleet.router:ConversationRouter"


def key_of(pending: PendingRequest | None) -> RouteKey:
    """The routing key a forwarded request carries (:data:`NO_KEY` for any other call)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return NO_KEY
    key = pending.args[0].get("route")
    return key if isinstance(key, RouteKey) else NO_KEY


class ConversationRouter(RequestRouter):
    """Each conversation to the replica that holds its cache, within an imbalance (see :mod:`..policy`)."""

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, **kwargs: Any) -> None:
        self.policy = Policy(imbalance=imbalance, **kwargs)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        capacity = {rid: r.max_ongoing_requests for rid, r in by_id.items()}
        return [[by_id[rid] for rid in rank] for rank in self.policy.choose(key_of(pending_request), loads, capacity)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        self.policy.record(key_of(pending_request), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget([replica_id.unique_id])

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        self.policy.forget(r.unique_id for r in gone)
