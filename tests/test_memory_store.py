"""Idle conversations kept in RAM (gguf_mcv/runtime/memory_store.py, Model.keep_chats_in_memory): an
evicted conversation comes back without evaluating or encoding it again; the cap holds for any
sequence of states (a property test against a plain model of the store); a RAM store sits in
front of the disk's; bad caps, huge, refused and concurrent states never break an answer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kv_store import GREEDY, evaluated, first_turn, follow_up, in_threads, kept_state, load, new_turn, others

from gguf_mcv.errors import ConfigError
from gguf_mcv.runtime.memory_store import AUTO_CAP, AUTO_MIN, MemoryKVStore, Tiers, auto_size, resolve_cap, state_bytes
from gguf_mcv.runtime.sequence import ImageUnit, KVState, usable_prefix


@pytest.mark.parametrize("parallel", [1, 2])
def test_an_evicted_conversation_comes_back_from_ram(tiny, parallel) -> None:
    with load(tiny, parallel) as model:
        store = model.keep_chats_in_memory(2**26)
        messages = first_turn()
        first = model.chat_completion(messages, max_tokens=6, **GREEDY)
        others(model, parallel + 1)  # more conversations than slots: ours is overwritten
        assert store.counts["saved"] >= 1 and 0 < store.usage() <= store.max_bytes
        encoder_calls = model.engine.encoder_calls
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert store.counts["restored"] == 1
        assert again.usage.cached_tokens >= first.usage.prompt_tokens
        assert evaluated(again) <= new_turn(first, again)
        assert again.timings.slices_encoded == again.timings.slices_from_cache == 0
        assert model.engine.encoder_calls == encoder_calls


def test_ram_is_looked_in_before_the_disk(tiny, tmp_path) -> None:
    with load(tiny, 2) as model:
        memory = model.keep_chats_in_memory(2**26)
        disk = model.keep_chats(tmp_path)  # the order they are attached in does not matter
        messages = first_turn(3)
        first = model.chat_completion(messages, max_tokens=6, **GREEDY)
        others(model, 3)
        assert disk.flush(30) and disk.counts["saved"] >= 1 and memory.counts["saved"] >= 1
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert memory.counts["restored"] == 1 and disk.counts["restored"] == 0
        assert evaluated(again) <= new_turn(first, again)
        assert model.keep_idle(30)  # the disk's tier still takes what is idle as a server stops


def test_a_state_too_small_for_the_cap_is_evaluated_again(tiny) -> None:
    with load(tiny, 2) as model:
        store = model.keep_chats_in_memory(1024)  # no real state fits in 1 KiB
        messages = first_turn(4)
        first = model.chat_completion(messages, max_tokens=6, **GREEDY)
        others(model, 3)
        assert store.counts["too_big"] >= 1 and store.counts["saved"] == 0 and store.usage() == 0
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert again.usage.completion_tokens >= 1 and evaluated(again) > first.usage.prompt_tokens - 20


def test_a_state_llama_cpp_refuses_is_forgotten_and_the_prompt_evaluated(tiny) -> None:
    with load(tiny) as model:
        messages, first, state = kept_state(model, 10)
        _, _, other = kept_state(model, 11)  # a real state, of a conversation with other positions
        store = model.keep_chats_in_memory(2**26)
        store.keep(KVState(state.units + [1] * 50, other.data))
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert store.counts["refused"] == 1 and store.counts["restored"] == 0
        assert again.usage.completion_tokens >= 1 and evaluated(again) > first.usage.prompt_tokens - 20
        assert store.entries() == 1  # only the state the answer itself left (ours was forgotten)


def test_a_second_ram_store_on_one_model_is_refused(tiny) -> None:
    with load(tiny) as model:
        model.keep_chats_in_memory(2**20)
        with pytest.raises(ConfigError, match="already keeps"):
            model.keep_chats_in_memory(2**20)


@pytest.mark.parametrize("bad", [-1, 0, True, 1.5, "1GB", None])
def test_bad_caps_are_refused(bad) -> None:
    with pytest.raises(ConfigError, match="memory cap"):
        MemoryKVStore(bad)


@pytest.mark.parametrize("bad", [-5, True, 2.0, "lots", "AUTO", b"auto"])
def test_bad_cap_settings_are_refused(bad) -> None:
    with pytest.raises(ConfigError, match="'auto' or 'off'"):
        resolve_cap(bad, lambda: 2**30)


def test_cap_settings() -> None:
    assert resolve_cap(None, lambda: 2**30) == resolve_cap("off", lambda: 2**30) == resolve_cap(0, lambda: 1) == 0
    assert resolve_cap(12345, lambda: 0) == 12345  # given: kept, whatever is free
    assert resolve_cap("auto", lambda: 2**30) == 2**28


@given(st.integers(min_value=-2**40, max_value=2**45))
def test_auto_is_a_quarter_of_what_is_free_within_its_bounds(available) -> None:
    size = auto_size(available)
    assert size == 0 or AUTO_MIN <= size <= AUTO_CAP
    assert size <= max(0, available) // 4 + 1
    if AUTO_MIN * 4 <= available <= AUTO_CAP * 4:
        assert size == available // 4


# --- the store's promises, for any sequence of states --------------------------------------------

_image = st.builds(ImageUnit, key=st.sampled_from(["a", "b"]), n_pos=st.integers(1, 40))
_units = st.lists(st.one_of(st.integers(0, 3), _image), min_size=0, max_size=12)
_ops = st.lists(st.tuples(st.sampled_from(["keep", "find", "refuse"]), _units, st.integers(0, 300),
                          st.integers(0, 6), st.booleans()), max_size=40)


@settings(max_examples=150, deadline=None)
@given(cap=st.integers(1, 1200), min_positions=st.integers(1, 20), ops=_ops)
def test_any_sequence_of_states_keeps_the_cap_and_finds_the_best(cap, min_positions, ops) -> None:
    from gguf_mcv.runtime.sequence import n_positions

    store = MemoryKVStore(cap, min_positions=min_positions)
    held: list[KVState] = []  # the plain model: least recently used first
    for op, units, size, better_than, partial in ops:
        if op == "keep":
            state = KVState(list(units), b"x" * size)
            store.keep(state)
            if n_positions(units) >= min_positions and size <= cap:
                held = [s for s in held if not (s.units == units or (len(s.units) < len(units)
                                                                      and units[:len(s.units)] == s.units))]
                held.append(state)
                while sum(map(state_bytes, held)) > cap:
                    held.pop(0)
        elif op == "find":
            found = store.find(units, better_than=better_than, partial=partial)
            best = max((usable_prefix(s, units, partial) for s in held), default=0)
            if n_positions(units) < min_positions or best <= better_than:
                assert found is None
            else:
                assert found is not None and usable_prefix(found, units, partial) == best
                held.remove(found)
                held.append(found)  # now the most recently used
        elif held:
            victim = held[len(units) % len(held)]
            store.refused(victim, "test")
            held.remove(victim)
        assert store.usage() == sum(map(state_bytes, held)) <= cap
        assert store.entries() == len(held)
        assert all(store.holds(s) for s in held)


def test_threads_keeping_and_finding_at_once() -> None:
    store = MemoryKVStore(64 * 1000, min_positions=8)

    def work(seed: int) -> None:
        for i in range(200):
            units = [seed, i] + list(range(20))
            store.keep(KVState(units, bytes([seed]) * 1000))
            found = store.find(units + [1], better_than=0, partial=True)
            assert found is None or found.data[:1] == bytes([found.units[0]])

    assert not in_threads(work)
    assert store.counts["saved"] == 800 and store.usage() <= 64 * 1000 and store.entries() == 64


def test_tiers_give_the_state_that_holds_more_and_tell_its_own_tier() -> None:
    memory, disk = MemoryKVStore(10**6, min_positions=4), MemoryKVStore(10**6, min_positions=4)
    tiers = Tiers(memory, disk)
    short, long = KVState(list(range(10)), b"s"), KVState(list(range(30)), b"l")
    memory.keep(short)
    disk.keep(long)  # the disk holds more of the prompt (e.g. kept before a restart)
    prompt = list(range(40))
    assert tiers.find(prompt, better_than=0, partial=True) is long
    tiers.restored(long)
    assert disk.counts["restored"] == 1 and memory.counts["restored"] == 0
    assert tiers.find(list(range(10)) + [99] * 10, better_than=0, partial=True) is short  # a tie: RAM's
    tiers.refused(short, "test")
    assert memory.counts["refused"] == 1 and memory.entries() == 0 and disk.entries() == 1
    tiers.keep(KVState(list(range(50)), b"n"))
    assert memory.entries() == 1 and disk.entries() == 1  # both got it; the disk's older one it extends is gone
