"""docs/cluster.md's nginx recipe, run: Debian's nginx in front of two ``gguf-mcv serve`` of the tiny model.

The config is the doc's own block (the test puts its ports in place of the doc's addresses), so the
two cannot drift. Which server answered is read from each server's ``/metrics`` (its answers).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from raycluster import free_port  # tests/ is on sys.path

NGINX = "/usr/sbin/nginx"
DOC = Path(__file__).resolve().parent.parent / "docs" / "cluster.md"
HEADER = "X-Conversation"


def recipe() -> str:
    """The nginx block that follows the doc's ``<!-- nginx recipe: ... -->`` comment."""
    found = re.search(r"<!-- nginx recipe:.*?-->\n```nginx\n(.*?)```", DOC.read_text(), re.S)
    assert found, "docs/cluster.md has lost its nginx recipe block"
    return found.group(1)


def _wait(url: str, proc: subprocess.Popen, what: str) -> None:
    while True:  # no deadline: a server that dies ends the wait
        assert proc.poll() is None, f"{what} stopped: {proc.stderr.read() if proc.stderr else ''}"
        try:
            requests.get(url, timeout=30)
            return
        except requests.ConnectionError:
            time.sleep(0.3)


@pytest.fixture(scope="module")
def front(tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """nginx on the doc's recipe in front of two servers: (nginx's URL, the servers' URLs)."""
    if not os.access(NGINX, os.X_OK):
        pytest.skip(f"{NGINX} is not installed (apt-get install nginx): the nginx recipe cannot be tested")
    procs: list[subprocess.Popen] = []
    try:
        backends = []
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "gguf_mcv", "serve", str(tiny.quants["Q4_K_M"]),
                                           "--ctx", "2048", "--threads", "1", "--port", str(port), "--api-key", ""],
                                          env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True))
            backends.append(f"127.0.0.1:{port}")
        listen = free_port()
        block = recipe()
        for doc_address, address in zip(("10.0.0.11:8080", "10.0.0.12:8080"), backends):
            block = block.replace(f"server {doc_address};", f"server {address};")
        block = block.replace("listen 8080;", f"listen 127.0.0.1:{listen};")
        prefix = tmp_path_factory.mktemp("nginx")
        temps = "\n".join(f"{kind}_temp_path {prefix / kind};" for kind in
                          ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        user = "user root;\n" if os.geteuid() == 0 else ""  # its workers write the temp folders made here
        (prefix / "nginx.conf").write_text(
            f"{user}worker_processes 1;\npid {prefix / 'nginx.pid'};\nerror_log {prefix / 'error.log'} warn;\n"
            f"events {{}}\nhttp {{\naccess_log off;\n{temps}\n{block}\n}}\n")
        procs.append(subprocess.Popen([NGINX, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c",
                                       str(prefix / "nginx.conf"), "-g", "daemon off;"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        urls = [f"http://{b}" for b in backends]
        for url, proc in zip(urls, procs):
            _wait(url + "/health", proc, "gguf-mcv serve")
        _wait(f"http://127.0.0.1:{listen}/health", procs[-1], "nginx")
        yield f"http://127.0.0.1:{listen}", urls
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT if proc.args[0] == sys.executable else signal.SIGQUIT)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _answers(urls: list[str]) -> list[float]:
    """Each server's answers so far (completed or not)."""
    counts = []
    for url in urls:
        text = requests.get(url + "/metrics", timeout=60).text
        counts.append(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                          if s.name == "gguf_mcv_answers_total"))
    return counts


def _ask(base: str, urls: list[str], conversation: str, messages: list[dict]) -> tuple[int, dict]:
    """One turn through nginx: (the index of the server that answered, the reply)."""
    before = _answers(urls)
    answered = requests.post(base + "/v1/chat/completions", headers={HEADER: conversation}, timeout=300,
                             json={"messages": messages, "max_tokens": 3, "temperature": 0})
    assert answered.status_code == 200, answered.text
    gained = [a - b for a, b in zip(_answers(urls), before)]
    assert sorted(gained) == [0, 1], gained
    return gained.index(1), answered.json()


def test_each_conversation_stays_on_one_server_and_conversations_use_both(front: tuple[str, list[str]]) -> None:
    base, urls = front
    used = set()
    for n in range(8):
        conversation = f"conversation-{n}"
        messages: list[dict] = [{"role": "user", "content": f"Tell me about the number {n}."}]
        servers, cached = [], []
        for turn in range(3):
            server, reply = _ask(base, urls, conversation, messages)
            servers.append(server)
            cached.append(reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
            messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"And {turn}?"}]
        assert len(set(servers)) == 1, (conversation, servers)
        assert all(c > 0 for c in cached[1:]), (conversation, cached)  # the follow-ups reused its cache
        used.add(servers[0])
    assert used == {0, 1}  # the eight keys hash to both servers


def test_a_stream_comes_through_event_by_event(front: tuple[str, list[str]]) -> None:
    base, urls = front
    server, _ = _ask(base, urls, "streamed", [{"role": "user", "content": "Count."}])
    before = _answers(urls)
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 8, "stream": True}
    with requests.post(base + "/v1/chat/completions", json=body, headers={HEADER: "streamed"}, stream=True,
                       timeout=300) as streamed:
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        events = [line for line in streamed.iter_lines() if line.startswith(b"data: ")]
    assert len(events) > 2 and events[-1] == b"data: [DONE]", events[-3:]
    gained = [a - b for a, b in zip(_answers(urls), before)]
    assert gained[server] == 1 and sum(gained) == 1, gained  # the same server as its first turn


def test_the_servers_own_answers_come_through(front: tuple[str, list[str]]) -> None:
    base, _ = front
    bad = requests.post(base + "/v1/chat/completions", data=b"{not json", headers={HEADER: "x",
                        "Content-Type": "application/json"}, timeout=60)
    assert bad.status_code == 400 and "error" in bad.json()
    assert requests.get(base + "/v1/models", timeout=60).json()["data"]  # no header: any server
