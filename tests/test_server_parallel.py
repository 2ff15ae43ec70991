"""The server with parallel slots (``--parallel``): several answers at once, queueing past them,
and a client that hangs up during a multi-slice image encode freeing its slot within one slice."""

from __future__ import annotations

import http.client
import io
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import PIL.Image
import pytest

pytest.importorskip("fastapi")
requests = pytest.importorskip("requests")

from test_server import Running, data_uri, image_message, wait_for  # noqa: E402

import gguf_mcv  # noqa: E402  (after the importorskips)
from gguf_mcv import server  # noqa: E402
from gguf_mcv.vision.embed_cache import EmbeddingCache  # noqa: E402


def health(running: Running) -> dict:
    return requests.get(running.url + "/health", timeout=30).json()


@pytest.fixture(scope="module", params=[1, 3], ids=["parallel1", "parallel3"])
def model(tiny, request) -> Iterator[gguf_mcv.Model]:
    m = gguf_mcv.load(model_path=tiny.quants["Q8_0"], mmproj_path=tiny.mmproj, n_ctx=2048, n_threads=2,
                      parallel=request.param, embed_cache=EmbeddingCache())
    yield m
    m.close()


@pytest.fixture(scope="module")
def srv(model) -> Iterator[Running]:
    running = Running(server.build_app(model, api_key="", max_queue=2))
    yield running
    running.stop()


def test_health_says_how_many_answers_run_at_once(srv: Running, model) -> None:
    # what a load tool needs to compare the server's memory with the plan for --parallel auto
    assert health(srv)["parallel"] == model.info.parallel


def test_answers_run_side_by_side_up_to_the_slot_count(srv: Running, model, monkeypatch) -> None:
    if model.info.parallel == 1:
        pytest.skip("one answer at a time is tests/test_server.py's case")
    n = model.info.parallel
    slow_encoder(model, monkeypatch, 0.1)
    held = [post_unread(srv, big_image_body(200 + i)) for i in range(n)]  # seconds of encoding each
    wait_for(lambda: health(srv)["in_flight"] == n, timeout=60)  # all of them admitted to a slot
    with ThreadPoolExecutor(1) as pool:  # one more waits for a slot
        queued = pool.submit(requests.post, srv.url + "/api/generate",
                             json={"prompt": "Hi", "stream": False, "options": {"num_predict": 3}},
                             timeout=60)
        wait_for(lambda: health(srv)["queue_length"] == 1, timeout=60)
        held[0].close()  # a hang-up frees its slot: the queued request runs
        assert queued.result(timeout=60).status_code == 200
    for conn in held[1:]:
        conn.close()
    wait_for(lambda: health(srv)["in_flight"] == 0, timeout=60)
    if model.scheduler is not None:
        wait_for(lambda: model.scheduler.active == 0, timeout=60)


def test_past_slots_and_queue_the_server_answers_503(srv: Running, model, monkeypatch) -> None:
    if model.info.parallel == 1:
        pytest.skip("one answer at a time is tests/test_server.py's case")
    n = model.info.parallel
    slow_encoder(model, monkeypatch, 0.1)
    held = [post_unread(srv, big_image_body(100 + i)) for i in range(n)]  # encoding: seconds each
    wait_for(lambda: health(srv)["in_flight"] == n, timeout=60)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(requests.post, srv.url + "/api/generate",
                               json={"prompt": "Hi", "stream": False, "options": {"num_predict": 2}},
                               timeout=60) for _ in range(4)]
        wait_for(lambda: sum(f.done() for f in futures) >= 2, timeout=60)
        for conn in held:
            conn.close()  # hang-ups: the two queued requests get their turn
        statuses = sorted(f.result(timeout=60).status_code for f in futures)
    assert statuses == [200, 200, 503, 503]  # max_queue=2 wait, the rest are refused unread
    wait_for(lambda: health(srv)["in_flight"] == 0, timeout=60)


def slow_encoder(model, monkeypatch, seconds: float) -> threading.Event:
    """Each image slice takes ``seconds`` more to encode; the event is set after the first."""
    encode = model.engine._encode
    encoded = threading.Event()

    def slow(chunk, unit, source=None):
        time.sleep(seconds)
        out = encode(chunk, unit, source)
        encoded.set()
        return out

    monkeypatch.setattr(model.engine, "_encode", slow)
    return encoded


def big_image_body(seed: int) -> dict:
    """A 1344×1344 picture (10 slices at detail "high"), smooth so that its PNG is small."""
    ramp = np.linspace(0, 255, 1344, dtype=np.float32)
    pixels = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, -ramp) % 256,
                       np.full((1344, 1344), seed % 256, np.float32)], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, format="PNG")
    body = {"messages": image_message(data_uri(buf.getvalue())), "max_tokens": 4}
    body["messages"][0]["content"][1]["image_url"]["detail"] = "high"  # 10 slices
    return body


def post_unread(srv: Running, body: dict) -> http.client.HTTPConnection:
    """A request sent and never read: close the connection to hang up."""
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def test_a_hang_up_during_a_multi_slice_encode_frees_the_slot_within_one_slice(srv: Running, model,
                                                                             monkeypatch) -> None:
    encoded = slow_encoder(model, monkeypatch, 0.15)
    before = model.engine.encoder_calls
    conn = post_unread(srv, big_image_body(77))
    assert encoded.wait(30)
    at_hang_up = model.engine.encoder_calls
    conn.close()  # the client hangs up while the image is being encoded
    wait_for(lambda: health(srv)["in_flight"] == 0, timeout=60)
    time.sleep(0.5)  # a runaway encoder would have done three more slices by now
    # the slice in progress when the hang-up was noticed, and at most one more
    assert model.engine.encoder_calls - at_hang_up <= 2
    assert model.engine.encoder_calls - before < 10
    reply = requests.post(srv.url + "/api/generate", json={"prompt": "Hi", "stream": False,
                                                           "options": {"num_predict": 2}}, timeout=60)
    assert reply.status_code == 200
