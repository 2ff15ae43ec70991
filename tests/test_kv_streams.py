"""A sequence's KV state in one form for any slot count (gguf_mcv/runtime/kv_streams.py): any layout
llama.cpp writes goes to the one-stream form and back, damaged ones are refused with EngineError,
and a conversation kept with N slots comes back with M."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_kv_store import GREEDY, evaluated, first_turn, follow_up, load, new_turn

from gguf_mcv.errors import EngineError
from gguf_mcv.runtime.kv_streams import HEADER, StreamLayout

U32 = struct.Struct("<I")
HEAD = U32.pack(0xAF143CD8) + U32.pack(0)  # llama.cpp's magic and a sequence id


def written(n: int, stream: int, cells: bytes, tail: bytes) -> bytes:
    """A sequence's state as llama.cpp writes it in a context of ``n`` streams (``cells``: its
    stream's entry, a cell count and the cells; empty for an empty sequence)."""
    entries = [U32.pack(0)] * n
    entries[stream] = cells or U32.pack(0)
    return HEAD + U32.pack(n) + b"".join(entries) + tail


def read(data: bytes, cells_len: int) -> tuple[int, bytes, bytes]:
    """What llama.cpp's reader takes from ``data``: the stream count, the one stream's entry
    (of ``cells_len`` bytes when its count is not 0) and what follows."""
    n, at, found = U32.unpack_from(data, HEADER)[0], HEADER + 4, b""
    for _ in range(n):
        count = U32.unpack_from(data, at)[0]
        if count:
            found, at = data[at:at + cells_len], at + cells_len
        else:
            at += 4
    return n, found, data[at:]


# a stream's entry: a cell count, then its cells (never a count without them)
cells = st.builds(lambda count, body: U32.pack(count) + body, st.integers(1, 2**32 - 1),
                  st.binary(min_size=1, max_size=64))


@given(n=st.integers(1, 8), m=st.integers(1, 8), data=st.data(), entry=st.one_of(st.just(b""), cells),
       tail=st.binary(max_size=40))
def test_any_layout_goes_to_one_stream_and_back_to_any_count(n, m, data, entry, tail) -> None:
    stream = data.draw(st.integers(0, n - 1))
    state = written(n, stream, entry, tail)
    portable = StreamLayout(n).portable(state, stream, len(tail))
    assert portable == written(1, 0, entry, tail)  # what a one-sequence context writes
    native = StreamLayout(m).native(portable)
    assert read(native, len(entry)) == (m, entry if entry else b"", tail)


@given(junk=st.binary(max_size=80), n=st.integers(2, 6), stream=st.integers(0, 5), tail=st.integers(0, 90))
def test_damaged_states_are_refused_never_misread(junk, n, stream, tail) -> None:
    layout = StreamLayout(n)
    try:
        portable = layout.portable(junk, stream, tail)
    except EngineError:
        return
    # accepted: then it was laid out as one sequence's state, and going back gives it again
    assert stream < n and layout.native(portable)[HEADER:HEADER + 4] == U32.pack(n)


@pytest.mark.parametrize("bad", [b"", HEAD, HEAD + U32.pack(2) + U32.pack(0)])
def test_a_state_not_in_the_one_stream_form_is_refused(bad) -> None:
    with pytest.raises(EngineError, match="one-stream form"):
        StreamLayout(3).native(bad)


def test_one_stream_and_recurrent_states_are_left_as_they_are() -> None:
    state = written(1, 0, U32.pack(2) + b"cells", b"tail")
    assert StreamLayout(1).portable(state, 0) is state and StreamLayout(1).native(state) is state
    assert StreamLayout(4, has_attention=False).portable(b"anything", 3) == b"anything"


@pytest.mark.parametrize(("before", "after"), [(1, 3), (3, 1), (2, 3)])
def test_a_conversation_kept_with_n_slots_comes_back_with_m(tiny, tmp_path, before, after) -> None:
    messages = first_turn(40 + before)
    with load(tiny, before) as model:
        model.keep_chats(tmp_path)
        first = model.chat_completion(messages, max_tokens=6, **GREEDY)
        assert model.keep_idle(30)
    with load(tiny, after) as model:
        store = model.keep_chats(tmp_path)
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert store.counts["restored"] == 1 and store.counts["refused"] == 0
        assert evaluated(again) <= new_turn(first, again)
        assert model.engine.encoder_calls == 0
