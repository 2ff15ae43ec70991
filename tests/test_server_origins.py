"""Which sites may use the server (``server.origins``): local Host names only on a loopback server
(DNS rebinding), web pages only from the server's own origin or allowed ones (CORS)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
requests = pytest.importorskip("requests")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

from test_server import Running  # noqa: E402

import gguf_mcv  # noqa: E402  (after the importorskips)
from gguf_mcv import server  # noqa: E402
from gguf_mcv.errors import ConfigError  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
APP = "https://app.example.com"


@pytest.fixture(scope="module")
def model(tiny) -> Iterator[gguf_mcv.Model]:
    m = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=1024, n_threads=2)
    yield m
    m.close()


@pytest.fixture(scope="module")
def local(model) -> Iterator[Running]:
    """The defaults, as ``gguf-mcv serve`` on 127.0.0.1 without a key."""
    running = Running(server.build_app(model, api_key=""))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def configured(model) -> Iterator[Running]:
    running = Running(server.build_app(model, api_key="", allowed_hosts=["gpu-box.lan", "*.example.net"],
                                       allowed_origins=[APP + "/"]))
    yield running
    running.stop()


def post(running: Running, path: str = "/v1/chat/completions", **headers: str) -> requests.Response:
    return requests.post(running.url + path, json=CHAT, headers=headers, timeout=60)


def port_of(running: Running) -> str:
    return running.url.rsplit(":", 1)[1]


def test_a_loopback_server_refuses_other_host_names(local: Running) -> None:
    # a page at attacker.example whose name now resolves to 127.0.0.1 sends its own name
    r = post(local, Host="attacker.example")
    assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
    assert "--allowed-host attacker.example" in r.json()["error"]["message"]
    r = requests.get(local.url + "/api/tags", headers={"Host": f"attacker.example:{port_of(local)}"}, timeout=60)
    assert r.status_code == 421 and "--allowed-host" in r.json()["error"]
    assert requests.get(local.url + "/health", headers={"Host": "localhost.attacker.example"},
                        timeout=60).status_code == 421


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LocalHost", "[::1]", "app.localhost",
                                  "192.168.1.20", socket.gethostname()])
def test_local_names_and_addresses_are_answered(local: Running, host: str) -> None:
    r = post(local, Host=f"{host}:{port_of(local)}")
    assert r.status_code == 200, r.text


def test_allowed_hosts_are_answered_too(configured: Running) -> None:
    for host in ("gpu-box.lan", "a.example.net", "localhost"):
        assert post(configured, Host=host).status_code == 200, host
    assert post(configured, Host="example.net.attacker.example").status_code == 421


def test_pages_of_other_sites_are_refused(local: Running) -> None:
    # a browser's "simple request": no preflight, so the content type alone would not stop it
    r = requests.post(local.url + "/api/generate", data=json.dumps({"prompt": "Hi"}), timeout=60,
                      headers={"Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert r.status_code == 403 and "--allowed-origin https://evil.example" in r.json()["error"]
    r = post(local, Origin="null")  # a sandboxed frame, a file:// page
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = post(local, Origin=f"http://localhost:{port_of(local)}")  # another origin than the Host's
    assert r.status_code == 403


def test_the_servers_own_page_and_clients_without_origin_are_answered(local: Running) -> None:
    assert post(local, Origin=local.url).status_code == 200  # what page.html's fetch sends
    assert post(local, "/api/chat", Origin=f"http://localhost:{port_of(local)}",
                Host=f"localhost:{port_of(local)}").status_code == 200
    client = openai.OpenAI(base_url=local.url + "/v1", api_key="none", max_retries=0, timeout=60)
    name = requests.get(local.url + "/health", timeout=60).json()["model"]
    assert client.chat.completions.create(model=name, **CHAT).usage.completion_tokens >= 1
    reply = ollama.Client(host=local.url, timeout=60).chat(messages=CHAT["messages"], model=name,
                                                          options={"num_predict": 2})
    assert reply.done


def test_allowed_origins_get_cors_others_do_not(configured: Running) -> None:
    preflight = requests.options(configured.url + "/v1/chat/completions", timeout=60, headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["Access-Control-Allow-Origin"] == APP
    r = post(configured, Origin=APP)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == APP
    refused = requests.options(configured.url + "/v1/chat/completions", timeout=60, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert refused.status_code == 403 and "Access-Control-Allow-Origin" not in refused.headers


def test_refusals_are_counted(local: Running) -> None:
    def refused() -> int:
        counted = requests.get(local.url + "/metrics?format=json", timeout=60).json()["requests"]
        return counted.get("POST (unmatched)", {}).get("421", 0)

    before = refused()
    post(local, Host="attacker.example")
    assert refused() == before + 1


def test_serve_answers_any_host_on_a_network_address_unless_told(model, monkeypatch) -> None:
    apps: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    server.serve(model, host="0.0.0.0", api_key="k")
    server.serve(model, host="0.0.0.0", api_key="k", allowed_hosts=["gpu-box.lan"])
    server.serve(model, host="127.0.0.1", api_key="k")
    checks = [next(m.kwargs for m in app.user_middleware if m.cls is server.origins.CheckSite) for app in apps]
    assert [c["allowed_hosts"] for c in checks] == [["*"], ["gpu-box.lan"], []]


@pytest.mark.parametrize("hosts, origins", [(["http://x.lan"], []), (["x.lan:8080"], []), ([], ["x.lan"]),
                                            ([], ["https://x.lan/path"])])
def test_malformed_allowed_hosts_and_origins_are_refused(model, hosts: list[str], origins: list[str]) -> None:
    with pytest.raises(ConfigError, match="Allowed (host|origin)"):
        server.build_app(model, api_key="", allowed_hosts=hosts, allowed_origins=origins)
