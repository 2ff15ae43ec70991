"""The sequence cache (gguf_mcv/runtime/sequence.py): finding a dropped stretch, and the KV
jobs on one sequence, for the engine's sequence and a parallel slot's alike."""

import ast
import inspect

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import gguf_mcv
from gguf_mcv.errors import ContextOverflowError, EngineError
from gguf_mcv.runtime import slots
from gguf_mcv.runtime.engine import IMAGE_SENTINEL
from gguf_mcv.runtime.sequence import ImageUnit, KVState, n_positions, width


def _old_shift_match(kv, new, common):
    """shift_match as it was (one scan per k, quadratic): the reference."""
    from gguf_mcv.runtime.sequence import MIN_SHIFT_MATCH, common_prefix

    if common >= len(kv) or common >= len(new):
        return None
    rest = new[common:]
    best_k, best_n = 0, 0
    for k in range(common + 1, len(kv)):
        n = common_prefix(kv[k:], rest)
        if n > best_n:
            best_k, best_n = k, n
    if best_n < min(MIN_SHIFT_MATCH, len(kv) - best_k) or best_n == 0:
        return None
    return best_k, best_n


_UNITS = st.one_of(st.integers(0, 2), st.sampled_from([ImageUnit("a", 3), ImageUnit("b", 3)]))


@settings(max_examples=150, deadline=None)
@given(st.lists(_UNITS, max_size=40), st.lists(_UNITS, max_size=40), st.integers(0, 42))
def test_shift_match_is_the_quadratic_scan_s(kv, new, common) -> None:
    from gguf_mcv.runtime.sequence import shift_match

    assert shift_match(kv, new, common) == _old_shift_match(kv, new, common)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 1), min_size=1, max_size=30), st.integers(0, 12), st.integers(0, 30))
def test_shift_match_finds_a_dropped_span_s(body, drop, common) -> None:
    """A conversation with a stretch after ``common`` dropped: ``new`` repeats ``kv`` past the stretch."""
    from gguf_mcv.runtime.sequence import shift_match

    kv = [7] * common + [5] * drop + body
    new = [7] * common + body
    assert shift_match(kv, new, common) == _old_shift_match(kv, new, common)


def test_shift_match_is_linear() -> None:
    """Counted in comparisons of units, not in seconds: the count does not depend on the machine's load."""
    from gguf_mcv.runtime.sequence import shift_match

    class Counted(int):
        calls = 0

        def __eq__(self, other: object) -> bool:
            Counted.calls += 1
            return int.__eq__(self, other)  # type: ignore[return-value]

        __hash__ = int.__hash__

    def comparisons(n: int) -> int:  # the old scan's worst case: every k matches far
        kv = [Counted(1)] * (2 * n)
        Counted.calls = 0
        assert shift_match(kv, kv[:n] + [Counted(2)], 10) == (11, n - 10)
        return Counted.calls

    small, large = comparisons(1000), comparisons(8000)
    assert large < 10 * small  # 8x the input: linear is ~8x the comparisons, the old quadratic scan ~64x


# --- the KV jobs on a real sequence (the tiny model's sequence 0) ----------------------------



@pytest.fixture(scope="module")
def engine(tiny):
    with gguf_mcv.load(model_path=tiny.quants["Q8_0"], mmproj_path=tiny.mmproj, n_ctx=512,
                       n_threads=2, vision_backend="llama.cpp") as model:
        yield model.engine


class _Store:
    """A state store that keeps states in a list (the protocol, not llama.cpp)."""

    min_positions = 4

    def __init__(self) -> None:
        self.kept: list[KVState] = []
        self.refused_why: list[str] = []
        self.restored_count = 0

    def find(self, units, *, better_than, partial):
        return None

    def keep(self, state: KVState) -> None:
        self.kept.append(state)

    def refused(self, state: KVState, why: str) -> None:
        self.refused_why.append(why)

    def restored(self, state: KVState) -> None:
        self.restored_count += 1


def _mirrored(engine) -> None:
    """The Llama object counts exactly what the sequence holds, and llama.cpp holds that much."""
    seq = engine.sequence
    lc = engine._lc
    ids = [u if isinstance(u, int) else IMAGE_SENTINEL for u in seq.units for _ in range(width(u))]
    assert seq.n_past == n_positions(seq.units) == int(engine.llama.n_tokens)
    assert list(engine.llama.input_ids[:seq.n_past]) == ids
    assert int(lc.llama_memory_seq_pos_max(lc.llama_get_memory(engine.llama.ctx), 0)) == seq.n_past - 1


def _fill(engine, n: int) -> list[int]:
    engine.reset()
    tokens = [(7 * i) % 200 + 10 for i in range(n)]
    engine._eval_tokens(tokens)
    return tokens


def test_truncate_keeps_the_llama_object_and_the_cache_in_step(engine) -> None:
    tokens = _fill(engine, 40)
    _mirrored(engine)
    engine.sequence.truncate(25)
    assert engine.sequence.units == tokens[:25]
    _mirrored(engine)
    engine.sequence.truncate(99)  # past the end: nothing to do
    assert len(engine.sequence.units) == 25


def test_shift_out_removes_a_stretch_and_shifts_the_rest_back(engine) -> None:
    tokens = _fill(engine, 60)
    seq = engine.sequence
    shifted = seq.shifted_positions
    new = tokens[:10] + tokens[30:]  # the stretch 10:30 was dropped
    match = seq.shift_match(new, 10)
    assert match == (30, 30)
    assert seq.shift_out(10, *match)
    assert seq.units == new and seq.shifted_positions - shifted == 20
    _mirrored(engine)


def test_a_saved_state_comes_back_and_a_bad_one_leaves_the_sequence_as_it_was(engine) -> None:
    tokens = _fill(engine, 30)
    seq = engine.sequence
    state = seq.save_state()
    seq.clear()
    assert seq.units == [] and seq.n_past == 0
    seq.restore(state, engine.n_ctx)
    assert seq.units == tokens and not seq.dirty
    _mirrored(engine)
    with pytest.raises(ContextOverflowError, match="larger n_ctx"):
        seq.restore(state, 10)
    bad = KVState(state.units, state.data, [(len(state.units) + 5, 3, b"x")])
    with pytest.raises(EngineError, match="checkpoint"):
        seq.restore(bad, engine.n_ctx)
    assert seq.units == tokens  # both refused before anything changed
    store = _Store()
    assert not seq.restore_from(store, KVState(tokens, b"\0" * 16), engine.n_ctx)
    assert store.refused_why and seq.units == []  # llama.cpp refused it: the sequence is empty
    _mirrored(engine)


def test_keep_in_gives_a_dirty_state_once_and_only_when_worth_it(engine) -> None:
    _fill(engine, 30)
    seq = engine.sequence
    store = _Store()
    assert not seq.keep_in(None)
    assert not seq.keep_in(store, reused=28)  # 2 positions dropped: below min_positions
    assert seq.keep_in(store, reused=0)
    assert len(store.kept) == 1 and store.kept[0].units == seq.units
    assert not seq.keep_in(store)  # the store has it now
    engine._eval_tokens([11, 12])
    assert seq.keep_in(store)


def test_the_scheduler_uses_no_private_name_of_the_engine() -> None:
    tree = ast.parse(inspect.getsource(slots))
    private = sorted({node.attr for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                      and not node.attr.startswith("__") and _names_the_engine(node.value)})
    assert private == []


def _names_the_engine(node: ast.expr) -> bool:
    """``engine`` or ``<anything>.engine``."""
    return getattr(node, "id", None) == "engine" or getattr(node, "attr", None) == "engine"
