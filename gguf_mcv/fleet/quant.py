"""One quant for the whole fleet: the best one that every node that may hold a replica can hold.

Each such node plans the model for its own machine (:func:`node_allowance`, run there as a Ray
task by :func:`survey`); a node *allows* the quants its plan says fit, up to the one that plan
picks itself (so a node's speed limits and GPU rule count too). :func:`common_quant` (pure, no
Ray) takes the best of the quants every node allows, in the planner's quality order
(:data:`gguf_mcv.models.quants.QUANT_ORDER`), and says why; every replica then loads that one.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ClusterError, NoQuantFitsError
from ..models.quants import quality_rank, quant_from_name

#: The reason ``/health`` gives for a quant named with ``--quant`` (``quant=``).
GIVEN = "given by --quant"


class FleetQuantError(ClusterError, NoQuantFitsError):
    """No quant of the model fits some node that may hold a replica (or none fits them all)."""


@dataclass(frozen=True)
class NodeAllowance:
    """What one node's own plan allows: the quants that fit there, up to the one it picks."""

    node: str  #: Ray's node id
    host: str
    chosen: str | None  #: the quant this node's plan picks on its own (None: nothing fits)
    allows: tuple[str, ...]  #: worst to best
    refusal: str = ""  #: the planner's first line when nothing fits

    @property
    def label(self) -> str:
        """``"board-2 (5f1c09a2)"``: the host and the start of the node id."""
        return f"{self.host} ({self.node[:8]})"


def common_quant(nodes: Sequence[NodeAllowance]) -> tuple[str, str]:
    """The best quant (by quality rank) that every node allows, and the reason ``/health`` gives.

    :class:`FleetQuantError` when a node allows nothing (its refusal and the ways out quoted)
    or no quant is allowed by all of them."""
    if not nodes:
        raise FleetQuantError("No node of the Ray cluster can hold a replica (none is alive with enough CPUs "
                              "for --threads): start one, or lower --threads.")
    for node in nodes:
        if not node.allows:
            raise FleetQuantError(
                f"No quant of the model fits node {node.label}, which may hold a replica: {node.refusal} "
                "Give that node more memory or a smaller --ctx, pass --quant to load one quant anyway, "
                "or take the node out of the cluster (ray stop on it).")
    common = set(nodes[0].allows).intersection(*(n.allows for n in nodes[1:]))
    if not common:
        each = "; ".join(f"node {n.label} allows {', '.join(n.allows)}" for n in nodes)
        raise FleetQuantError(f"No quant fits every node that may hold a replica ({each}): pass --quant "
                              "to choose one, or take the odd node out of the cluster.")
    pick = max(common, key=quality_rank)
    return pick, "fits every node: " + ", ".join(f"node {n.label} allows {n.chosen}" for n in nodes)


def allowance(node: str, plan: Any, *, host: str | None = None) -> NodeAllowance:
    """A node's :class:`NodeAllowance` from its :class:`~gguf_mcv.planning.plan.Plan`."""
    rank = quality_rank(plan.quant)
    allows = tuple(r.quant for r in sorted(plan.rows, key=lambda r: quality_rank(r.quant))
                   if r.fits and quality_rank(r.quant) <= rank)
    return NodeAllowance(node, host or socket.gethostname(), plan.quant, allows)


def local_reason(load_kwargs: dict[str, Any]) -> tuple[str | None, str]:
    """The quant of local files (from the file name) and the reason ``/health`` gives."""
    name = os.path.basename(str(load_kwargs["model_path"]))
    return quant_from_name(name), "the local file given, the same on every node"
