"""Idle conversations kept on disk (gguf_mcv/kv_store.py, Model.keep_chats): an evicted conversation
comes back without evaluating or encoding it again, also after a restart; foreign, damaged, huge,
wrong-typed, concurrent and interrupted entries never break an answer."""

from __future__ import annotations

import base64
import hashlib
import io
import multiprocessing
import os
import signal
import threading
import time
import zipfile
from pathlib import Path

import damage
import numpy as np
import PIL.Image
import pytest
from damage import run_child  # tests/ is on sys.path

import gguf_mcv
from gguf_mcv.errors import ConfigError
from gguf_mcv.runtime import kv_store, saved_chat
from gguf_mcv.runtime.sequence import KVState
from gguf_mcv.vision.embed_cache import EmbeddingCache
from gguf_mcv.vision.media import load_image

N_CTX = 1024
GREEDY = dict(temperature=0, repeat_penalty=1.0)


def load(tiny, parallel: int = 1, **kw) -> gguf_mcv.Model:
    return gguf_mcv.load(model_path=tiny.quants["Q8_0"], mmproj_path=tiny.mmproj, n_ctx=N_CTX, n_threads=2,
                         parallel=parallel, embed_cache=EmbeddingCache(), **kw)


def picture_uri(seed: int = 5) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (300, 300, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def first_turn(seed: int = 5) -> list[dict]:
    return [{"role": "system", "content": "You look at pictures and answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "What is in this picture? Describe it."},
                                         {"type": "image_url", "image_url": {"url": picture_uri(seed)}}]}]


def follow_up(messages: list[dict], answer: object) -> list[dict]:
    return messages + [{"role": "assistant", "content": str(answer)},
                       {"role": "user", "content": "And the colours?"}]


def others(model: gguf_mcv.Model, n: int) -> None:
    """``n`` other conversations, long enough to be worth keeping, taking the slots."""
    for i in range(n):
        model.chat_completion([{"role": "user", "content": f"Conversation {i}: " + "tell me more " * 30}],
                              max_tokens=3, **GREEDY)


def new_turn(first: gguf_mcv.Reply, follow: gguf_mcv.Reply) -> int:
    """Positions the follow-up's prompt has beyond the first one's: the answer and the new question."""
    return follow.usage.prompt_tokens - first.usage.prompt_tokens


def evaluated(reply: gguf_mcv.Reply) -> int:
    return reply.usage.prompt_tokens - reply.usage.cached_tokens


@pytest.mark.parametrize("parallel", [1, 2])
def test_an_evicted_conversation_comes_back_from_disk(tiny, tmp_path, parallel) -> None:
    with load(tiny, parallel) as model:
        store = model.keep_chats(tmp_path / "kept")
        messages = first_turn()
        first = model.chat_completion(messages, max_tokens=6, **GREEDY)
        others(model, parallel + 1)  # more conversations than slots: ours is overwritten
        assert store.flush(30) and store.counts["saved"] >= 1
        encoder_calls = model.engine.encoder_calls
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert store.counts["restored"] == 1
        assert again.usage.cached_tokens >= first.usage.prompt_tokens  # its image and first turn
        assert evaluated(again) <= new_turn(first, again)  # the answer (as text) and the new question
        assert again.timings.slices_encoded == again.timings.slices_from_cache == 0
        assert model.engine.encoder_calls == encoder_calls


def test_without_the_store_the_evicted_conversation_is_evaluated_again(tiny) -> None:
    with load(tiny, 2) as model:  # the control for the test above: eviction really happens
        messages = first_turn()
        first = model.chat_completion(messages, max_tokens=6, **GREEDY)
        others(model, 3)
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert evaluated(again) > first.usage.prompt_tokens - 20
        assert again.timings.slices_encoded + again.timings.slices_from_cache >= 1


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_conversation_comes_back_after_a_restart(tiny, tmp_path, parallel) -> None:
    messages = first_turn(6)
    with load(tiny, parallel) as before:
        before.keep_chats(tmp_path)
        first = before.chat_completion(messages, max_tokens=6, **GREEDY)
        assert before.keep_idle(30)  # as the server stops
    with load(tiny, parallel) as after:
        store = after.keep_chats(tmp_path)
        again = after.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert store.counts["restored"] == 1
        assert evaluated(again) <= new_turn(first, again)
        assert again.timings.slices_encoded == again.timings.slices_from_cache == 0
        assert after.engine.encoder_calls == 0


def kept_state(model: gguf_mcv.Model, seed: int) -> tuple[list[dict], gguf_mcv.Reply, KVState]:
    """A conversation answered on a model without a store, and its state (the single sequence's);
    then another conversation takes the cache."""
    messages = first_turn(seed)
    reply = model.chat_completion(messages, max_tokens=6, **GREEDY)
    state = model.engine.save_state()
    others(model, 1)
    return messages, reply, state


def entry_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*.val")]


def test_a_damaged_entry_is_ignored_deleted_and_replaced(tiny, tmp_path) -> None:
    with load(tiny) as model:
        store = model.keep_chats(tmp_path)
        messages = first_turn(7)
        first = model.chat_completion(messages, max_tokens=6, **GREEDY)
        assert model.keep_idle(30)
        [entry] = entry_files(tmp_path)
        data = entry.read_bytes()
        entry.write_bytes(data[: len(data) // 2])  # truncated, as by a crash or a full disk
        others(model, 1)
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert store.counts["damaged"] == 1 and store.counts["restored"] == 0
        assert evaluated(again) > first.usage.prompt_tokens - 20  # evaluated again, answered all the same
        assert again.usage.completion_tokens >= 1
        assert not entry.exists()
        others(model, 1)  # the conversation is overwritten again: kept again, whole this time
        assert store.flush(30)
        restored = store.counts["restored"]  # (the other conversation came back from the store too)
        newest = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert store.counts["restored"] == restored + 1 and evaluated(newest) <= new_turn(first, newest)


def test_another_models_entries_are_ignored_not_deleted(tiny, tmp_path) -> None:
    with load(tiny) as model:
        messages, first, state = kept_state(model, 8)
        identity = model.identity()
        n_vocab = int(model.engine.llama.n_vocab())
        for other in ({**identity, "quant": "Q4_K_M"}, {**identity, "projector": "another"},
                      {**identity, "backend": identity["backend"] + "-other"}):
            foreign = kv_store.KVStore(tmp_path, other, n_vocab=n_vocab, n_ctx=N_CTX)
            foreign.keep(state)
            foreign.close()
        bigger = kv_store.KVStore(tmp_path, identity, n_vocab=n_vocab, n_ctx=2 * N_CTX)  # another n_ctx
        bigger.keep(state)
        bigger.close()
        assert len(entry_files(tmp_path)) == 4
        store = model.keep_chats(tmp_path)
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert store.counts["foreign"] == 4 and store.counts["restored"] == 0, store.counts
        assert evaluated(again) > first.usage.prompt_tokens - 20
        assert len(entry_files(tmp_path)) >= 4  # still there for their own models


def raw_entry(store: kv_store.KVStore, key: str, value: object) -> None:
    store._cache.set(key, value)


def zipped(header: dict, members: dict[str, bytes] | None = None) -> bytes:
    import json

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("chat.json", json.dumps(header))
        for name, data in (members or {}).items():
            zf.writestr(name, data)
    return out.getvalue()


@pytest.mark.parametrize("kind", ["not_a_zip", "text", "pickled", "huge_state", "wrong_units", "bad_checksum",
                                  "empty", "wrong_kind", "wrong_key", "with_turns"])
def test_hostile_entries_are_ignored_and_deleted(tmp_path, kind) -> None:
    store = kv_store.KVStore(tmp_path, _fake_identity(), n_vocab=1000, n_ctx=N_CTX)
    units, data = list(range(100)), b"state" * 1000
    key = store.key(units)
    header = {"format": saved_chat.FORMAT, "version": saved_chat.VERSION, "model": store.identity,
              "settings": {"kind": kv_store.KIND}, "turns": [], "units": units,
              "state": {"bytes": len(data), "sha256": "0" * 64, "checkpoints": []}}
    good_sum = {**header, "state": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    png = io.BytesIO()
    PIL.Image.new("RGB", (64, 64)).save(png, format="PNG")
    digest = load_image(png.getvalue()).digest
    value: object = {
        "not_a_zip": b"\x00garbage" * 1000,
        "text": "a text value",
        "pickled": {"a": "dict, pickled by diskcache"},
        "huge_state": zipped({**header, "state": {"bytes": 10**13, "sha256": "0" * 64}}, {"state.bin": b"x"}),
        "wrong_units": zipped({**header, "units": [-5, "x"]}, {"state.bin": data}),
        "bad_checksum": zipped(header, {"state.bin": data}),
        "empty": b"",
        "wrong_kind": zipped({**good_sum, "settings": {"system": "a saved chat"}}, {"state.bin": data}),
        "wrong_key": zipped({**good_sum, "units": units[:-1] + [999]}, {"state.bin": data}),
        # a kept state has no turns: their images (decoded up front, a bomb's memory) are not read
        "with_turns": zipped({**good_sum, "turns": [{"role": "user", "text": "x", "images": [digest]}]},
                             {"state.bin": data, f"images/{digest}.png": png.getvalue()}),
    }[kind]
    raw_entry(store, key, value)
    assert store.find(units + [1], better_than=0, partial=True) is None
    assert store.counts["damaged"] == 1 and key not in store._cache
    store.keep(KVState(units, data))  # replaced by a good one
    assert store.flush(30)
    found = store.find(units + [1], better_than=0, partial=True)
    assert found is not None and found.data == data
    store.close()


def test_a_state_llama_cpp_refuses_is_deleted_and_the_prompt_evaluated(tiny, tmp_path) -> None:
    with load(tiny) as model:
        messages, first, state = kept_state(model, 10)
        _, _, other = kept_state(model, 11)  # a real state, of a conversation with other positions
        store = model.keep_chats(tmp_path)
        store.keep(KVState(state.units + [1] * 50, other.data))
        assert store.flush(30)
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert store.counts["refused"] == 1 and store.counts["restored"] == 0
        assert again.usage.completion_tokens >= 1 and evaluated(again) > first.usage.prompt_tokens - 20
        assert store.key(state.units + [1] * 50) not in store._cache


def test_an_interrupted_write_leaves_no_entry_and_the_store_goes_on(tiny, tmp_path, monkeypatch) -> None:
    with load(tiny) as model:
        _, _, state = kept_state(model, 12)
        store = model.keep_chats(tmp_path)
        write_to = saved_chat.write_to

        def half_then_fail(f, saved) -> None:
            f.write(b"PK\x03\x04 half an archive")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(saved_chat, "write_to", half_then_fail)
        store.keep(state)
        assert store.flush(30)
        assert store.counts["write_failed"] == 1 and not entry_files(tmp_path) and len(store._cache) == 0
        monkeypatch.setattr(saved_chat, "write_to", write_to)
        store.keep(state)
        assert store.flush(30) and store.counts["saved"] == 1
        assert store.find(state.units + [5], better_than=0, partial=True) is not None


def _fake_identity() -> dict:
    return {"name": "fake", "model": "m", "quant": "Q8_0", "projector": "p", "backend": "llama.cpp"}


def _writer(folder: str, seed: int, n: int, size: int) -> None:
    """A process keeping ``n`` states of ``size`` bytes (another server sharing the folder)."""
    store = kv_store.KVStore(folder, _fake_identity(), n_vocab=1000, n_ctx=N_CTX, max_bytes=8 * 2**20)
    rng = np.random.default_rng(seed)
    for i in range(n):
        units = [int(seed), i] + rng.integers(0, 1000, 100).tolist()
        store.keep(KVState(units, rng.bytes(size)))
        store.flush(30)
    store.close()


def test_concurrent_writers_and_a_killed_one_leave_only_whole_entries(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), seed, 12, 300_000)) for seed in (1, 2, 3)]
    victim = ctx.Process(target=_writer, args=(str(tmp_path), 4, 1000, 2_000_000))
    for p in writers + [victim]:
        p.start()
    time.sleep(3)
    os.kill(victim.pid, signal.SIGKILL)  # killed in the middle of its writes
    for p in writers:
        p.join(120)
        assert p.exitcode == 0
    victim.join(10)
    store = kv_store.KVStore(tmp_path, _fake_identity(), n_vocab=1000, n_ctx=N_CTX, max_bytes=8 * 2**20)
    store._refresh()
    assert store._index, "nothing was kept"
    for units in [list(e.units) for e in store._index.values()]:
        assert store.find(units + [7], better_than=len(units) - 1, partial=True) is not None
    assert store.counts["damaged"] == 0
    # the cap, give or take the entry each process was adding (each culls after its own write, and
    # the four wrote at once) and the index's pages: once over it by 2.85 MB, more than one entry
    assert store.disk_usage() <= 8 * 2**20 + 2_000_000 + 3 * 300_000 + 2**19
    store.close()


def in_threads(work, n: int = 4) -> list[BaseException]:
    """Run ``work(seed)`` for seeds 0..n-1 on threads at once; what they raised."""
    errors: list[BaseException] = []

    def guarded(seed: int) -> None:
        try:
            work(seed)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(s,)) for s in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def test_threads_keeping_and_finding_at_once(tmp_path) -> None:
    store = kv_store.KVStore(tmp_path, _fake_identity(), n_vocab=1000, n_ctx=N_CTX, min_positions=8)

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for i in range(10):
            units = [seed, i] + list(range(20))
            store.keep(KVState(units, rng.bytes(1000)))
            store.find(units + [1], better_than=0, partial=True)

    errors = in_threads(work)
    assert store.flush(30)
    assert not errors
    assert store.counts["saved"] + store.counts["dropped"] == 40 and store.counts["damaged"] == 0
    store.close()


def test_the_folder_is_capped_least_recently_used_first(tmp_path) -> None:
    store = kv_store.KVStore(tmp_path, _fake_identity(), n_vocab=1000, n_ctx=N_CTX, max_bytes=2**20)
    first = list(range(100))
    store.keep(KVState(first, b"a" * 200_000))
    assert store.flush(30)
    for i in range(12):
        assert store.find(first + [1], better_than=0, partial=True) is not None  # the first stays in use
        store.keep(KVState([500 + i] + list(range(100)), bytes([i]) * 200_000))
        assert store.flush(30)
    assert store.disk_usage() <= 2**20 + 200_000
    assert store.find(first + [1], better_than=0, partial=True) is not None
    store._refresh()
    assert len(store._index) < 13
    store.close()


def test_the_same_files_under_another_name_find_the_entries(tmp_path) -> None:
    units, data = list(range(100)), b"state" * 100
    first = kv_store.KVStore(tmp_path, {**_fake_identity(), "name": "minicpm-v-2.6"}, n_vocab=1000, n_ctx=N_CTX)
    first.keep(KVState(units, data))
    first.close()
    second = kv_store.KVStore(tmp_path, {**_fake_identity(), "name": "ggml-model-Q8_0"}, n_vocab=1000, n_ctx=N_CTX)
    found = second.find(units + [1], better_than=0, partial=True)
    assert found is not None and found.data == data and second.counts["damaged"] == 0
    second.close()


@pytest.mark.parametrize("bad", [dict(max_bytes=True), dict(max_bytes=10), dict(max_bytes="1GB"),
                                 dict(min_positions=0), dict(min_positions=2.5)])
def test_bad_settings_are_refused(tmp_path, bad) -> None:
    with pytest.raises(ConfigError):
        kv_store.KVStore(tmp_path, _fake_identity(), n_vocab=1000, n_ctx=N_CTX, **bad)


def test_a_folder_that_is_a_file_is_refused(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="Cannot keep conversations"):
        kv_store.KVStore(tmp_path / "file", _fake_identity(), n_vocab=1000, n_ctx=N_CTX)


def test_a_second_store_on_one_model_is_refused(tiny, tmp_path) -> None:
    with load(tiny) as model:
        model.keep_chats(tmp_path / "a")
        with pytest.raises(ConfigError, match="already keeps"):
            model.keep_chats(tmp_path / "b")


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_conversation_that_drops_turns_is_shifted_not_kept(tiny, tmp_path, parallel) -> None:
    from test_slots import long_talk

    with load(tiny, parallel) as model:
        store = model.keep_chats(tmp_path)
        replies = long_talk(model, api=True)
        assert sum(r.dropped_turns > 0 for r in replies) >= 4
        assert store.flush(30) and store.counts["saved"] == 0  # its own shift is no eviction


@pytest.mark.slow  # builds a MiniCPM-V 4.6-shaped model (~5 s)
@pytest.mark.parametrize("parallel", [1, 2])
def test_a_hybrid_models_kept_state_comes_back_to_a_checkpoint(tmp_path_factory, parallel) -> None:
    from gguf_mcv.testing.synthetic import GENERATIONS, build

    files = build(tmp_path_factory.mktemp("v46"), GENERATIONS["4.6"][0], quants=("Q8_0",))
    with gguf_mcv.load(model_path=files.quants["Q8_0"], mmproj_path=files.mmproj, n_ctx=N_CTX, n_threads=2,
                       parallel=parallel, embed_cache=EmbeddingCache()) as model:
        store = model.keep_chats(tmp_path_factory.mktemp("kept"))
        messages = first_turn(30)
        first = model.chat_completion(messages, max_tokens=6, **GREEDY)
        others(model, parallel + 1)
        assert store.flush(30) and store.counts["saved"] >= 1
        again = model.chat_completion(follow_up(messages, first), max_tokens=4, **GREEDY)
        assert store.counts["restored"] == 1
        # back to the checkpoint before the prompt's end (recurrent state cannot go back further)
        assert again.usage.cached_tokens >= first.usage.prompt_tokens - 40
        assert again.timings.slices_encoded == again.timings.slices_from_cache == 0


# --- a damaged folder: a miss with one warning, in a child (a signal fails only this test) ------

_FIND_AFTER_DAMAGE = """
import numpy as np
from gguf_mcv.runtime import kv_store
from gguf_mcv.runtime.sequence import KVState
identity = {"name": "fake", "model": "m", "quant": "Q8_0", "projector": "p", "backend": "llama.cpp"}
units, data = list(range(100)), np.random.default_rng(1).bytes(100_000)
store = kv_store.KVStore(sys.argv[1], identity, n_vocab=1000, n_ctx=1024)
found = store.find(units + [1], better_than=0, partial=True)
RESULT["hit"] = found is not None and found.data == data
RESULT["wrong"] = found is not None and not RESULT["hit"]
store.keep(KVState(units, data))
store.flush(30)
found = store.find(units + [1], better_than=0, partial=True)
RESULT["after"] = found is not None and found.data == data
store.close()
"""


def _kept_two(folder: Path) -> tuple[Path, Path]:
    store = kv_store.KVStore(folder, _fake_identity(), n_vocab=1000, n_ctx=N_CTX)
    rng = np.random.default_rng(1)
    store.keep(KVState(list(range(100)), rng.bytes(100_000)))  # what the child looks for
    store.keep(KVState([7] * 100, rng.bytes(100_000)))
    assert store.flush(30)
    names = [row[0] for row in store._cache._sql("SELECT filename FROM Cache ORDER BY rowid").fetchall()]
    store.close()
    return folder / names[0], folder / names[1]


@pytest.mark.parametrize("target", ["index", "entry"])
@pytest.mark.parametrize("damage", damage.DAMAGES, ids=lambda f: f.__name__)
def test_a_damaged_folder_is_a_miss_with_one_warning_in_a_child(tmp_path, damage, target) -> None:
    folder = tmp_path / "kept"
    entry, other = _kept_two(folder)
    damage(folder / "cache.db" if target == "index" else entry, entry if target == "index" else other)
    result = run_child(_FIND_AFTER_DAMAGE, str(folder))
    assert not result["wrong"] and result["after"], result
    damaged = 2 if (damage.__name__, target) == ("swapped", "entry") else 1  # both entries are listed
    assert len(result["warnings"]) == (0 if result["hit"] else damaged), result
    if damage.__name__ != "unreadable":  # root reads a mode-000 file: a hit there is right
        assert not result["hit"], result


def test_a_planted_pickle_key_never_runs_and_is_ignored(tmp_path, caplog) -> None:
    import pickle
    import sqlite3

    marker = tmp_path / "ran"

    class Marker:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    store = kv_store.KVStore(tmp_path / "kept", _fake_identity(), n_vocab=1000, n_ctx=N_CTX)
    with sqlite3.connect(tmp_path / "kept" / "cache.db") as con:
        con.execute("INSERT INTO Cache (key, raw, store_time, access_time, size, mode, value) "
                    "VALUES (?, 0, 0, 0, 0, 1, ?)", (pickle.dumps(Marker()), b"x"))
    with caplog.at_level("WARNING"):
        assert store.find(list(range(100)), better_than=0, partial=True) is None
        assert store.find(list(range(100)), better_than=0, partial=True) is None
    assert not marker.exists()
    assert store.counts["damaged"] == 1 and caplog.text.count("pickled keys") == 1
    store.close()


@pytest.mark.parametrize("name", ["{victim}", "../../victim", "00/00/0000000000000000000000000000.val"])
def test_a_planted_row_never_deletes_a_file_outside_the_folder(tmp_path, name) -> None:
    import sqlite3

    folder, victim = tmp_path / "kept", tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    store = kv_store.KVStore(folder, _fake_identity(), n_vocab=1000, n_ctx=N_CTX)
    if name.startswith("00/"):
        (folder / "00").mkdir()
        (folder / "00" / "00").symlink_to(tmp_path)
        (tmp_path / "0000000000000000000000000000.val").symlink_to(victim)
    units = list(range(100))
    with sqlite3.connect(folder / "cache.db") as con:
        con.execute("INSERT INTO Cache (key, raw, store_time, access_time, size, mode, filename) "
                    "VALUES (?, 1, 0, 0, 19, 2, ?)", (store.key(units), name.format(victim=victim)))
    assert store.find(units + [1], better_than=0, partial=True) is None
    assert store.counts["damaged"] == 1 and store.key(units) not in store._cache  # the row, not the file
    assert victim.read_bytes() == b"someone else's file"
    store.close()
