"""fleet: the HTTP API on Ray Serve, on a real two-node local Ray cluster, two replicas of the tiny model."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import PIL.Image
import pytest
import raycluster  # tests/ is on sys.path
from raycluster import free_port

REPLICA_HEADER = "x-gguf-mcv-replica"



def _data_uri(seed: int) -> str:
    out = io.BytesIO()
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, tiny) -> str:
    """A head node and a worker node (one CPU each), the fleet deployed on them; its base URL."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed here (pip install 'gguf-mcv[cluster]'); "
                                            "the fleet cannot be tested")
    address, env = raycluster.start(request, "rayf", skip_why="A local Ray cluster could not start here: ")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "gguf_mcv", "serve", str(tiny.quants["Q4_K_M"]), "--mmproj",
                               str(tiny.mmproj), "--ctx", "2048", "--threads", "1", "--ray", address,
                               "--replicas", "2", "--port", str(port), "--api-key", ""],
                              env=env, stderr=subprocess.PIPE, text=True)
    request.addfinalizer(server.kill)
    seen: list[str] = []
    ready = threading.Event()

    def drain() -> None:  # deploy() returns, and says so, once both replicas have loaded
        for line in server.stderr or ():
            seen.append(line)
            if "Serving on" in line:
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    ready.wait()
    assert server.poll() is None, "".join(seen[-40:])
    return f"http://127.0.0.1:{port}"

def test_a_three_turn_image_conversation_stays_on_one_replica_and_reuses_its_cache(fleet: str) -> None:
    import openai

    client = openai.OpenAI(base_url=fleet + "/v1", api_key="none", max_retries=0)
    messages: list = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                   {"type": "image_url", "image_url": {"url": _data_uri(1)}}]}]
    replicas, usages = [], []
    for turn in range(3):
        raw = client.chat.completions.with_raw_response.create(model="ggml-model-Q4_K_M", messages=messages, max_tokens=3,
                                                               temperature=0)
        replicas.append(raw.headers[REPLICA_HEADER])
        reply = raw.parse()
        usages.append(reply.usage)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And {turn}?"}]
    assert len(set(replicas)) == 1, replicas
    assert all(u.prompt_tokens_details.cached_tokens > 0 for u in usages[1:]), usages



def _replicas(fleet: str, answers: int) -> dict[str, dict]:
    """``/health``'s replicas by name, once their reports count ``answers`` answers in all."""
    import requests

    while True:  # the replicas report every second
        listed = {r["replica"]: r for r in requests.get(fleet + "/health", timeout=60).json()["replicas"]}
        if sum(r["answers"] for r in listed.values()) >= answers:
            return listed
        time.sleep(0.5)


def test_the_same_conversation_through_the_ollama_client(fleet: str) -> None:
    import ollama
    import requests

    before = {r["replica"]: r for r in requests.get(fleet + "/health", timeout=60).json()["replicas"]}
    done = sum(r["answers"] for r in before.values())
    client = ollama.Client(host=fleet)
    image = base64.b64decode(_data_uri(2).split(",", 1)[1])
    messages: list = [{"role": "user", "content": "What is it?", "images": [image]}]
    for turn in range(3):
        reply = client.chat(model="ggml-model-Q4_K_M", messages=messages, options={"num_predict": 3, "temperature": 0})
        messages += [{"role": "assistant", "content": reply.message.content}, {"role": "user", "content": f"{turn}?"}]
    after = _replicas(fleet, done + 3)
    gained = {name: r["answers"] - before.get(name, {"answers": 0})["answers"] for name, r in after.items()}
    answered = [name for name, n in gained.items() if n]
    assert len(answered) == 1 and gained[answered[0]] == 3, gained  # every turn on one replica
    cached = after[answered[0]]["cached_tokens"] - before.get(answered[0], {"cached_tokens": 0})["cached_tokens"]
    assert cached > 100  # the follow-ups' prompts, the image's 64 positions among them, were not evaluated again


def test_eight_concurrent_new_conversations_use_both_replicas_and_health_lists_them(fleet: str) -> None:
    import requests

    def ask(seed: int) -> str:
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Which colour?"},
                                                          {"type": "image_url", "image_url": {"url": _data_uri(seed)}}]}],
                "max_tokens": 4}
        answered = requests.post(fleet + "/v1/chat/completions", json=body, timeout=300)
        assert answered.status_code == 200, answered.text
        return answered.headers[REPLICA_HEADER]

    with ThreadPoolExecutor(8) as pool:
        used = set(pool.map(ask, range(10, 18)))
    health = requests.get(fleet + "/health", timeout=60).json()
    assert used == {r["replica"] for r in health["replicas"]} and len(used) == 2
    assert len({r["pid"] for r in health["replicas"]}) == 2 and len({r["node"] for r in health["replicas"]}) == 2
    assert len({r["quant"] for r in health["replicas"]}) == 1 and health["restarts"] == 0  # one quant (None: local files)


@pytest.mark.parametrize("headers, body, status", [
    ({"Content-Type": "text/plain"}, b'{"messages": []}', 415),
    ({"Content-Type": "application/json"}, b"{not json", 400),
    ({"Content-Type": "application/json"}, b"x" * (20 * 1024 * 1024 + 1), 413),
])
def test_bad_bodies_get_the_single_servers_answers(fleet: str, headers: dict, body: bytes, status: int) -> None:
    import requests

    answered = requests.post(fleet + "/v1/chat/completions", data=body, headers=headers, timeout=120)
    assert answered.status_code == status, answered.text
    assert "error" in answered.json() and REPLICA_HEADER in answered.headers



def test_metrics_carry_every_replicas_families_with_a_replica_label(fleet: str) -> None:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    listed = _replicas(fleet, 0)
    scraped = requests.get(fleet + "/metrics", timeout=60)
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    samples = [s for f in text_string_to_metric_families(scraped.text) for s in f.samples]
    assert {s.labels.get("replica") for s in samples} == set(listed)
    answers = {s.labels["replica"]: s.value for s in samples
               if s.name == "gguf_mcv_answers_total" and s.labels["outcome"] == "completed"}
    assert answers == {name: r["answers"] for name, r in listed.items()}


def test_the_page_and_the_listing_routes_come_through_the_front(fleet: str) -> None:
    import requests

    page = requests.get(fleet + "/", headers={"Accept": "text/html"}, timeout=60)
    assert page.status_code == 200 and "<html" in page.text.lower() and REPLICA_HEADER in page.headers
    assert requests.get(fleet + "/api/tags", timeout=60).json()["models"]
    assert requests.get(fleet + "/v1/models", timeout=60).json()["data"][0]["id"] == "ggml-model-Q4_K_M"


def _answers(fleet: str) -> dict[str, float]:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(fleet + "/metrics", timeout=60).text
    out: dict[str, float] = {}
    for sample in (s for f in text_string_to_metric_families(text) for s in f.samples):
        if sample.name == "gguf_mcv_answers_total":
            out[sample.labels["outcome"]] = out.get(sample.labels["outcome"], 0) + sample.value
    return out


def test_a_client_that_hangs_up_mid_stream_stops_its_generation(fleet: str) -> None:
    import requests

    before = _answers(fleet)
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1500, "stream": True}
    with requests.post(fleet + "/v1/chat/completions", json=body, stream=True, timeout=300) as streamed:
        next(line for line in streamed.iter_lines() if line.startswith(b"data: "))
    while (now := _answers(fleet))["cancelled"] == before["cancelled"] and now["completed"] == before["completed"]:
        time.sleep(0.5)  # the replicas report every second
    assert now["cancelled"] == before["cancelled"] + 1 and now["completed"] == before["completed"]

def test_a_replica_killed_mid_stream_ends_that_stream_with_an_error_and_is_restarted(fleet: str) -> None:
    """Last in the module: it kills a replica."""
    import requests

    pids = {r["replica"]: r["pid"] for r in requests.get(fleet + "/health", timeout=60).json()["replicas"]}
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1500, "stream": True}
    with requests.post(fleet + "/v1/chat/completions", json=body, stream=True, timeout=300) as streamed:
        assert streamed.status_code == 200
        lines = streamed.iter_lines()
        first = next(line for line in lines if line.startswith(b"data: "))
        assert b"choices" in first
        os.kill(pids[streamed.headers[REPLICA_HEADER]], signal.SIGKILL)
        rest = [line for line in lines if line.startswith(b"data: ")]
    assert rest and b'"replica_lost"' in rest[-1] and b"[DONE]" not in b"".join(rest), rest[-3:]

    again = requests.post(fleet + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=300)
    assert again.status_code == 200, again.text

    while True:  # Serve starts the replica again; its predecessor's reports stop, counted as a restart
        health = requests.get(fleet + "/health", timeout=60).json()
        if health["restarts"] >= 1 and len(health["replicas"]) == 2:
            break
        time.sleep(0.5)
    assert health["restarts"] == 1 and streamed.headers[REPLICA_HEADER] in {r["replica"] for r in health["lost"]}


@pytest.mark.parametrize("extra, words", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray", "127.0.0.1:{dead}", "--replicas", "0"], "--replicas must be a whole number >= 1"),
    (["--ray", "127.0.0.1:{dead}", "--port", "70000"], "out of range"),
    (["--ray", "127.0.0.1:{dead}"], "127.0.0.1:{dead}"),  # nothing listens there: refused fast, not waited on
])
def test_serve_on_ray_refuses_bad_settings_in_one_line_before_loading(tiny, extra: list[str], words: str) -> None:
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed here (pip install 'gguf-mcv[cluster]')")
    dead = str(free_port())
    done = subprocess.run([sys.executable, "-m", "gguf_mcv", "serve", str(tiny.quants["Q4_K_M"]), "--mmproj",
                           str(tiny.mmproj), *[a.format(dead=dead) for a in extra]],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 1 and words.format(dead=dead) in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
