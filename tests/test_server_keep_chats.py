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
