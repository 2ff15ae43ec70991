"""fleet.quant: one quant for every replica, the best every node allows (pure: no Ray)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gguf_mcv.errors import ClusterError, NoQuantFitsError
from gguf_mcv.fleet.quant import FleetQuantError, NodeAllowance, common_quant
from gguf_mcv.models.quants import QUANT_ORDER, quality_rank

QUANTS = [q for q in QUANT_ORDER if q not in ("F16", "BF16", "F32")]


def _node(i: int, allows: set[str]) -> NodeAllowance:
    ordered = tuple(sorted(allows, key=quality_rank))
    return NodeAllowance(f"{i:02d}" * 16, f"board-{i}", ordered[-1] if ordered else None, ordered,
                         "" if ordered else "No quantization fits in 1.0 GB.")


@given(st.lists(st.sets(st.sampled_from(QUANTS), min_size=1), min_size=1, max_size=5))
def test_the_pick_fits_every_node_and_no_better_quant_does(allowed: list[set[str]]) -> None:
    nodes = [_node(i, a) for i, a in enumerate(allowed)]
    common = set.intersection(*allowed)
    if not common:
        with pytest.raises(FleetQuantError, match="No quant fits every node"):
            common_quant(nodes)
        return
    pick, reason = common_quant(nodes)
    assert all(pick in a for a in allowed)
    assert not [q for q in QUANTS if quality_rank(q) > quality_rank(pick) and all(q in a for a in allowed)]
    assert reason.startswith("fits every node: ") and all(f"node {n.label} allows {n.chosen}" in reason for n in nodes)


def test_two_nodes_the_smaller_ones_best() -> None:
    big, small = _node(1, {"Q4_K_M", "Q6_K", "Q8_0"}), _node(2, {"Q4_0", "Q4_K_M"})
    assert common_quant([big, small]) == (
        "Q4_K_M", f"fits every node: node {big.label} allows Q8_0, node {small.label} allows Q4_K_M")


def test_a_node_that_fits_nothing_is_named_with_the_ways_out() -> None:
    full = _node(3, set())
    with pytest.raises(FleetQuantError) as caught:
        common_quant([_node(1, {"Q8_0"}), full])
    message = str(caught.value)
    assert full.label in message and "No quantization fits in 1.0 GB." in message and "--quant" in message
    assert isinstance(caught.value, ClusterError) and isinstance(caught.value, NoQuantFitsError)


def test_no_node_at_all() -> None:
    with pytest.raises(FleetQuantError, match="No node of the Ray cluster"):
        common_quant([])
