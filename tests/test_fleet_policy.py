"""fleet.keys and fleet.policy: the routing key and the choice of replica, without Ray."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gguf_mcv.errors import ConfigError
from gguf_mcv.fleet.keys import NO_KEY, RouteKey, route_key
from gguf_mcv.fleet.policy import Policy

PNG = b"\x89PNG fake bytes"
B64 = base64.b64encode(PNG).decode()


def _openai(*messages: dict) -> bytes:
    return json.dumps({"model": "m", "messages": list(messages)}).encode()


def _user(text: str, image: str | None = None) -> dict:
    parts: list = [{"type": "text", "text": text}]
    if image:
        parts.append({"type": "image_url", "image_url": {"url": image}})
    return {"role": "user", "content": parts}


def test_a_follow_up_extends_the_prefixes_of_its_first_turn() -> None:
    first = route_key("/v1/chat/completions", _openai(_user("What?", "data:image/png;base64," + B64)))
    follow = route_key("/v1/chat/completions", _openai(_user("What?", "data:image/png;base64," + B64),
                                                       {"role": "assistant", "content": "A cat."}, _user("Colour?")))
    assert len(first.prefixes) == 1 and follow.prefixes[:1] == first.prefixes and len(follow.prefixes) == 3
    assert first.images == follow.images and len(first.images) == 1


def test_the_same_picture_in_either_api_has_one_digest_and_other_pictures_others() -> None:
    openai = route_key("/v1/chat/completions", _openai(_user("q", "data:image/png;base64," + B64)))
    ollama = route_key("/api/chat", json.dumps({"messages": [{"role": "user", "content": "q", "images": [B64]}]}).encode())
    generate = route_key("/api/generate", json.dumps({"prompt": "q", "images": [B64]}).encode())
    other = route_key("/v1/chat/completions", _openai(_user("q", "data:image/png;base64," + B64[:-4])))
    assert openai.images == ollama.images == generate.images != other.images
    assert openai.prefixes != other.prefixes


@pytest.mark.parametrize("path, body", [("/health", b""), ("/v1/chat/completions", b"{not json"),
                                        ("/v1/chat/completions", b"[1]"), ("/api/chat", b'{"messages": 3}'),
                                        ("/v1/chat/completions", b'{"messages": [1]}'), ("/api/chat", b"\xff\xfe")])
def test_what_is_not_a_chat_request_has_no_key(path: str, body: bytes) -> None:
    assert route_key(path, body) == NO_KEY


def test_prefix_match_wins_over_image_match_and_needs_a_live_holder() -> None:
    policy = Policy(seed=1)
    policy.record(RouteKey(("a",), ("img",)), "r1")
    policy.record(RouteKey(("b",), ("img",)), "r2")  # the image, encoded again on r2
    loads = {"r1": 0, "r2": 0, "r3": 0}
    assert policy.choose(RouteKey(("a", "a2"), ("img",)), loads)[0] == ["r1"]
    assert policy.choose(RouteKey(("z",), ("img",)), loads)[0] == ["r2"]  # the latest to encode it
    assert policy.holder(RouteKey(("a", "a2"), ()), ["r2", "r3"]) is None  # r1 not live: held nowhere


def test_the_holder_is_left_when_it_is_beyond_the_imbalance_or_full() -> None:
    policy = Policy(imbalance=2, seed=2)
    key = RouteKey(("a",), ())
    policy.record(key, "r1")
    assert policy.choose(key, {"r1": 2, "r2": 0})[0] == ["r1"]  # within the imbalance
    ranks = policy.choose(key, {"r1": 3, "r2": 0})
    assert ranks == [["r2", "r1"]]  # beyond it: the less loaded first (the re-encode paid there)
    full = policy.choose(key, {"r1": 1, "r2": 1}, capacity={"r1": 1, "r2": 4})
    assert len(full) == 1 and sorted(full[0]) == ["r1", "r2"]  # full: no rank of its own


def test_a_dead_replica_is_forgotten() -> None:
    policy = Policy(seed=3)
    key = RouteKey(("a",), ("i",))
    policy.record(key, "r1")
    policy.forget(["r1"])
    assert policy.holder(key, ["r1", "r2"]) is None


def test_bad_settings_are_refused() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="imbalance"):
            Policy(imbalance=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_entries"):
        Policy(max_entries=0)


def test_entries_are_bounded_oldest_out() -> None:
    policy = Policy(max_entries=2)
    for i in range(3):
        policy.record(RouteKey((f"p{i}",), ()), "r")
    assert policy.holder(RouteKey(("p0",), ()), ["r"]) is None
    assert policy.holder(RouteKey(("p2",), ()), ["r"]) == "r"


@given(loads=st.dictionaries(st.sampled_from(["r1", "r2", "r3", "r4"]), st.integers(0, 20), min_size=1),
       holder=st.sampled_from(["r1", "r2", "r3", "r4"]), imbalance=st.integers(0, 6), seed=st.integers(0, 99))
def test_property_the_choice_is_live_the_holder_first_exactly_within_the_imbalance(
        loads: dict[str, int], holder: str, imbalance: int, seed: int) -> None:
    policy = Policy(imbalance=imbalance, seed=seed)
    key = RouteKey(("p",), ("i",))
    policy.record(key, holder)
    ranks = policy.choose(key, loads)
    chosen = [r for rank in ranks for r in rank]
    assert chosen and set(chosen) <= set(loads) and len(chosen) == len(set(chosen))
    keeps = holder in loads and loads[holder] - min(loads.values()) <= imbalance
    assert (ranks[0] == [holder]) == keeps
    if not keeps:  # the less loaded of two candidates first
        assert len(ranks) == 1 and ranks[0] == sorted(ranks[0], key=lambda r: loads[r])


def test_replicas_expositions_merge_into_one_family_each_with_a_replica_label() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from gguf_mcv.fleet.metrics import merged

    one = '# HELP x_total Things.\n# TYPE x_total counter\nx_total{kind="a"} 2.0\n'
    text = merged({"r1": one, "r2": one.replace("2.0", "5.0")}).decode()
    families = list(text_string_to_metric_families(text))
    assert [f.name for f in families] == ["x"] and text.count("# TYPE") == 1
    assert {(s.labels["replica"], s.labels["kind"], s.value) for s in families[0].samples} == {
        ("r1", "a", 2.0), ("r2", "a", 5.0)}
