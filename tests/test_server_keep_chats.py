"""The server's ``keep_chats`` (``serve --keep-chats DIR``): conversations evicted from the slots, and
those idle when the server stops, come back from disk — after a restart too — and ``/metrics`` counts it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
requests = pytest.importorskip("requests")
uvicorn = pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_kv_store import first_turn, follow_up  # noqa: E402
from test_server import Running as _Running  # noqa: E402

import gguf_mcv  # noqa: E402  (after the importorskips)
from gguf_mcv import server  # noqa: E402
from gguf_mcv.errors import ConfigError  # noqa: E402
from gguf_mcv.vision.embed_cache import EmbeddingCache  # noqa: E402


class Running(_Running):
    """test_server's server with its lifespan on (so stopping it runs the shutdown)."""

    def __init__(self, app: Any) -> None:
        super().__init__(app, lifespan="on")

    def stop(self) -> None:
        super().stop()
        assert not self.thread.is_alive()

    def chat(self, messages: list[dict], max_tokens: int = 6) -> dict:
        reply = requests.post(self.url + "/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "repeat_penalty": 1.0})
        assert reply.status_code == 200, reply.text
        return reply.json()

    def kept(self) -> dict[str, float]:
        text = requests.get(self.url + "/metrics", timeout=60).text
        family = {f.name: f for f in text_string_to_metric_families(text)}["gguf_mcv_kept_chats"]
        return {s.labels["event"]: s.value for s in family.samples if s.name.endswith("_total")}


def load(tiny, parallel: int) -> gguf_mcv.Model:
    return gguf_mcv.load(model_path=tiny.quants["Q8_0"], mmproj_path=tiny.mmproj, n_ctx=1024, n_threads=2,
                         parallel=parallel, embed_cache=EmbeddingCache())


def evaluated(body: dict) -> int:
    usage = body["usage"]
    return usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]


def new_turn(first: dict, follow: dict) -> int:
    """Positions the follow-up's prompt has beyond the first one's: the answer and the new question."""
    return follow["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]


def test_kept_conversations_survive_eviction_and_a_restart(tiny, tmp_path: Path) -> None:
    evicted, idle = first_turn(20), first_turn(21)
    with load(tiny, parallel=2) as before:
        srv = Running(server.build_app(before, api_key="", keep_chats=tmp_path, keep_chats_bytes=2**26))
        try:
            first = srv.chat(evicted)
            for i in range(3):  # more conversations than slots
                srv.chat([{"role": "user", "content": f"Client {i}: " + "tell me more " * 30}], max_tokens=3)
            back = srv.chat(follow_up(evicted, first["choices"][0]["message"]["content"]), max_tokens=3)
            assert evaluated(back) <= new_turn(first, back)
            idle_first = srv.chat(idle)  # held by a slot when the server stops
            kept = srv.kept()
            assert kept["restored"] == 1 and kept["saved"] >= 1 and kept["damaged"] == 0
            json_view = requests.get(srv.url + "/metrics?format=json", timeout=60).json()
            assert json_view["kept_chats"]["restored"] == 1
        finally:
            srv.stop()  # the lifespan's shutdown keeps the idle slots' conversations
    with load(tiny, parallel=1) as after:  # a restart, even with another slot count
        srv = Running(server.build_app(after, api_key="", keep_chats=tmp_path, keep_chats_bytes=2**26))
        try:
            again = srv.chat(follow_up(idle, idle_first["choices"][0]["message"]["content"]), max_tokens=3)
            assert evaluated(again) <= new_turn(idle_first, again)
            assert after.engine.encoder_calls == 0  # its image is in the restored state
            assert srv.kept()["restored"] == 1
        finally:
            srv.stop()


def test_a_bad_keep_chats_folder_or_size_is_refused(tiny, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with load(tiny, parallel=1) as model:
        with pytest.raises(ConfigError, match="Cannot keep conversations"):
            server.build_app(model, api_key="", keep_chats=tmp_path / "file")
        with pytest.raises(ConfigError, match="at least"):
            server.build_app(model, api_key="", keep_chats=tmp_path / "ok", keep_chats_bytes=100)


def memory_metrics(srv: Running) -> dict[str, float]:
    text = requests.get(srv.url + "/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    events = {s.labels["event"]: s.value for s in families["gguf_mcv_kept_chats_memory"].samples
              if s.name.endswith("_total")}
    return {**events, "bytes": families["gguf_mcv_kept_chats_memory_bytes"].samples[0].value,
            "cap": families["gguf_mcv_kept_chats_memory_cap_bytes"].samples[0].value}


def test_an_evicted_conversation_comes_back_from_ram_and_metrics_count_it(tiny) -> None:
    evicted = first_turn(22)
    with load(tiny, parallel=2) as model:
        srv = Running(server.build_app(model, api_key="", keep_chats_memory=2**26))
        try:
            first = srv.chat(evicted)
            for i in range(3):  # more conversations than slots
                srv.chat([{"role": "user", "content": f"Client {i}: " + "tell me more " * 30}], max_tokens=3)
            encoder_calls = model.engine.encoder_calls
            back = srv.chat(follow_up(evicted, first["choices"][0]["message"]["content"]), max_tokens=3)
            assert evaluated(back) <= new_turn(first, back)
            assert model.engine.encoder_calls == encoder_calls
            kept = memory_metrics(srv)
            assert kept["restored"] == 1 and kept["saved"] >= 1 and 0 < kept["bytes"] <= kept["cap"] == 2**26
            json_view = requests.get(srv.url + "/metrics?format=json", timeout=60).json()
            assert json_view["kept_chats_memory"]["restored"] == 1
            assert "gguf_mcv_kept_chats" not in {f.name for f in text_string_to_metric_families(
                requests.get(srv.url + "/metrics", timeout=60).text)}  # no folder: no disk families
        finally:
            srv.stop()


@pytest.mark.parametrize(("available_mib", "cap_mib"), [(4096, 1024), (32, None), (65536, 2048)])
def test_auto_takes_a_quarter_of_the_free_ram_within_bounds(tiny, tmp_path: Path, monkeypatch,
                                                            available_mib, cap_mib) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: {2 * available_mib * 1024} kB\n"
                                               f"MemAvailable: {available_mib * 1024} kB\n")
    with load(tiny, parallel=1) as model:
        monkeypatch.setenv("GGUF_MCV_HW_ROOT", str(tmp_path))  # after loading: the board only as the app sees it
        server.build_app(model, api_key="", keep_chats_memory="auto")
        store = model.kept_in_memory
        assert (store.max_bytes if store is not None else None) == (cap_mib and cap_mib * 2**20)


def test_a_model_serving_in_two_apps_keeps_one_ram_store(tiny) -> None:
    with load(tiny, parallel=1) as model:
        server.build_app(model, api_key="", keep_chats_memory=2**24)
        store = model.kept_in_memory
        server.build_app(model, api_key="", keep_chats_memory="auto")
        assert model.kept_in_memory is store and store is not None and store.max_bytes == 2**24


@pytest.mark.parametrize("bad", ["lots", -1, 1.5, True])
def test_a_bad_ram_cap_is_refused_before_anything_is_kept(tiny, bad) -> None:
    with load(tiny, parallel=1) as model:
        with pytest.raises(ConfigError, match="'auto' or 'off'"):
            server.build_app(model, api_key="", keep_chats_memory=bad)
        assert model.kept_in_memory is None
