"""fleet: the HTTP API on Ray Serve, on a real two-node local Ray cluster, two replicas of the tiny model."""

from __future__ import annotations

import base64
import io
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import raycluster  # tests/ is on sys.path
from raycluster import free_port

REPLICA_HEADER = "x-gguf-mcv-replica"
REPORT_PERIOD_S = 1.0  # gguf_mcv.fleet.registry's (imported there, it would import Ray here)



def _data_uri(seed: int) -> str:
    out = io.BytesIO()
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@dataclass
class Cluster:
    address: str
    env: dict[str, str]
    board: Path  # the worker node's hardware root (GGUF_MCV_HW_ROOT): its proc/meminfo says its RAM


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, hub_server, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """A head node and a worker node (one CPU each); the worker sees the machine through a hardware
    root whose RAM a test may change, and both reach the Hub stand-in."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed here (pip install 'gguf-mcv[cluster]'); "
                                            "the fleet cannot be tested")
    board = tmp_path_factory.mktemp("board")
    (board / "proc").mkdir()
    (board / "_fake").mkdir()
    shutil.copy("/proc/cpuinfo", board / "proc" / "cpuinfo")
    shutil.copy("/proc/meminfo", board / "proc" / "meminfo")
    (board / "_fake" / "platform").write_text(f"{platform.system()} {platform.machine()}")
    hf = tmp_path_factory.mktemp("fleet_hf")
    hub_env = {"HF_ENDPOINT": hub_server.url, "HF_HOME": str(hf), "HF_HUB_CACHE": str(hf / "hub"),
               "HF_TOKEN_PATH": str(hf / "token"), "HF_HUB_DISABLE_TELEMETRY": "1",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    address, env = raycluster.start(request, "rayf", skip_why="A local Ray cluster could not start here: ",
                                    extra_env=hub_env, worker_env={"GGUF_MCV_HW_ROOT": str(board)})
    return Cluster(address, env, board)


#: A request whose answer takes the tiny model ~80 s on one thread, unless stopped (7,000 tokens
#: took 4.4 s, and a busy machine's hang-up once reached the replica later than that)
LONG_STORY = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 30000}


def _serve(request: pytest.FixtureRequest, cluster: Cluster, model: list[str],
           port: int | None = None, ctx: int = 2048) -> tuple[str, subprocess.Popen]:
    """``gguf-mcv serve MODEL --ray`` with two replicas, once it says it serves; (its URL, the process)."""
    port = port or free_port()
    server = subprocess.Popen([sys.executable, "-m", "gguf_mcv", "serve", *model, "--ctx", str(ctx), "--threads", "1",
                               "--ray", cluster.address, "--replicas", "2", "--port", str(port), "--api-key", ""],
                              env=cluster.env, stderr=subprocess.PIPE, text=True)
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
    server.seen = seen  # type: ignore[attr-defined]
    return f"http://127.0.0.1:{port}", server


@pytest.fixture(scope="module")
def fleet_server(request: pytest.FixtureRequest, cluster: Cluster, tiny) -> tuple[str, subprocess.Popen]:
    """The fleet of the tiny model's local files deployed on the cluster: (its base URL, its process).
    Its context (the tiny model's whole 32,768) fits a :data:`LONG_STORY`: a busy machine must not
    finish the story before a hang-up or a kill mid-stream reaches the replica."""
    return _serve(request, cluster, [str(tiny.quants["Q4_K_M"]), "--mmproj", str(tiny.mmproj)], ctx=32768)


@pytest.fixture
def fleet(fleet_server: tuple[str, subprocess.Popen]) -> str:
    return fleet_server[0]


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
    assert health["quant"] == "Q4_K_M" and health["quant_reason"] == "the local file given, the same on every node"


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


def _settled_answers(fleet: str) -> dict[str, float]:
    """:func:`_answers` once two reads a few report periods apart agree: the replicas report every
    second, so an earlier test's last answer can still be on its way into ``/metrics``."""
    last = _answers(fleet)
    while True:
        time.sleep(3 * REPORT_PERIOD_S)
        if (now := _answers(fleet)) == last:
            return now
        last = now


def test_a_client_that_hangs_up_mid_stream_stops_its_generation(fleet: str) -> None:
    import requests

    before = _settled_answers(fleet)
    body = {**LONG_STORY, "stream": True}
    with requests.post(fleet + "/v1/chat/completions", json=body, stream=True, timeout=300) as streamed:
        next(line for line in streamed.iter_lines() if line.startswith(b"data: "))
    while (now := _answers(fleet))["cancelled"] == before["cancelled"] and now["completed"] == before["completed"]:
        time.sleep(0.5)  # the replicas report every second
    assert now["cancelled"] == before["cancelled"] + 1 and now["completed"] == before["completed"]

def test_a_second_fleet_on_the_same_cluster_is_refused_before_loading_and_the_first_keeps_serving(
        cluster: Cluster, fleet: str, tiny) -> None:
    """Deploying would replace the running fleet under its clients (Serve also keeps its first port)."""
    def replicas() -> tuple:
        health = requests_health(fleet)
        return health["restarts"], [(r["replica"], r["pid"], r["quant"]) for r in health["replicas"]]

    before = replicas()
    done = subprocess.run([sys.executable, "-m", "gguf_mcv", "serve", str(tiny.quants["Q8_0"]), "--mmproj",
                           str(tiny.mmproj), "--threads", "1", "--ray", cluster.address, "--replicas", "2",
                           "--port", str(free_port()), "--api-key", ""],
                          env=cluster.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "A gguf-mcv fleet already runs on the Ray cluster" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert replicas() == before and len(before[1]) == 2  # the same replicas, untouched


def test_a_replica_killed_mid_stream_ends_that_stream_with_an_error_and_is_restarted(fleet: str) -> None:
    """The last test of the local files' fleet: it kills a replica."""
    import requests

    pids = {r["replica"]: r["pid"] for r in requests.get(fleet + "/health", timeout=60).json()["replicas"]}
    body = {**LONG_STORY, "stream": True}
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


def _publish(hub, tiny) -> str:
    hub.add_repo("acme/tiny-fleet", {**{f"ggml-model-{q}.gguf": p for q, p in tiny.quants.items()},
                                     "mmproj-model-f16.gguf": tiny.mmproj})
    return "acme/tiny-fleet"


def _set_board_ram(cluster: Cluster, budget: int) -> None:
    """The worker node's RAM: ``budget`` left to a model once the planner's 300 MB reserve is kept."""
    kb = (budget + 300_000_000) // 1024
    (cluster.board / "proc" / "meminfo").write_text(f"MemTotal: {2 * kb} kB\nMemAvailable: {kb} kB\n")


def _between_q4_k_m_and_q5_k_m(repo: str) -> int:
    """A RAM budget that holds the repo's Q4_K_M and not its Q5_K_M, as the fleet's replicas plan them."""
    import gguf_mcv
    from gguf_mcv.planning.planner import LoadChoices

    rows = {r.quant: r.needed for r in gguf_mcv.plan(repo, n_ctx=2048, ram_budget=10**12, speed_probe=False,
                                                     given=LoadChoices(n_threads=1, n_gpu_layers=0, parallel=1)).rows}
    assert rows["Q4_K_M"] < rows["Q5_K_M"] < rows["Q8_0"] < 2 * 10**9, rows
    return (rows["Q4_K_M"] + rows["Q5_K_M"]) // 2


def test_one_quant_for_every_replica_the_best_every_node_allows(cluster: Cluster, fleet: str, hub, tiny) -> None:
    """The worker node, a smaller board, allows up to Q4_K_M, the head Q8_0: Q4_K_M for both."""
    import ray

    from gguf_mcv.fleet.quant import FleetQuantError
    from gguf_mcv.fleet.run import fleet_quant

    repo = _publish(hub, tiny)
    load = {"model": repo, "n_ctx": 2048, "n_threads": 1, "n_gpu_layers": 0, "parallel": 1}
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        _set_board_ram(cluster, _between_q4_k_m_and_q5_k_m(repo))
        chosen, reason = fleet_quant(load, num_cpus=1)
        assert chosen == {**load, "quant": "Q4_K_M"}
        assert reason.startswith("fits every node: ") and "allows Q8_0" in reason and "allows Q4_K_M" in reason
        assert fleet_quant({**load, "quant": "Q2_K"}, num_cpus=1) == ({**load, "quant": "Q2_K"}, "given by --quant")

        worker = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" not in n["Resources"])
        _set_board_ram(cluster, 1_000_000)  # nothing fits there
        with pytest.raises(FleetQuantError, match=f"No quant of the model fits node .*{worker[:8]}") as refused:
            fleet_quant(load, num_cpus=1)
        assert "No quantization fits" in str(refused.value) and "--quant" in str(refused.value)
    finally:
        ray.shutdown()
        shutil.copy("/proc/meminfo", cluster.board / "proc" / "meminfo")
    assert len(requests_health(fleet)["replicas"]) == 2  # the running fleet was left alone


def requests_health(fleet: str) -> dict:
    import requests

    return requests.get(fleet + "/health", timeout=60).json()


def test_a_fleet_of_a_hub_model_loads_the_common_quant_and_health_says_why(
        request: pytest.FixtureRequest, cluster: Cluster, fleet_server, hub, tiny) -> None:
    """Last of the module: the local files' fleet is stopped (Ctrl-C) and a Hub model's deployed."""
    repo = _publish(hub, tiny)
    fleet_server[1].send_signal(signal.SIGINT)  # serve_on_ray deletes its application on the way out
    assert fleet_server[1].wait(timeout=120) == 0
    _set_board_ram(cluster, _between_q4_k_m_and_q5_k_m(repo))
    try:
        # Serve's HTTP proxy outlives the first application, on its port: the second one is served there
        url, server = _serve(request, cluster, [repo], port=int(fleet_server[0].rsplit(":", 1)[1]))
        health = requests_health(url)
        assert health["quant"] == "Q4_K_M" and health["quant_reason"].startswith("fits every node: "), health
        assert [r["quant"] for r in health["replicas"]] == ["Q4_K_M", "Q4_K_M"]
        assert any("One quant for every replica: Q4_K_M" in line for line in server.seen)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=120) == 0
    finally:
        shutil.copy("/proc/meminfo", cluster.board / "proc" / "meminfo")


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
