"""``gguf-mcv serve`` keeps its model in a worker process (gguf_mcv/server/supervisor.py): a worker
killed mid-answer is started again by the same supervisor, /health and /metrics count it, kept
conversations come back (a killed supervisor takes its worker down cleanly), and a worker that
dies while loading again and again stops the server."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn")
requests = pytest.importorskip("requests")
psutil = pytest.importorskip("psutil")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_kv_store import first_turn, follow_up  # noqa: E402

START_S = 120  # a worker's start on a busy machine: a fresh interpreter, llama.cpp, the tiny model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_core_files() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Served:
    """A ``gguf-mcv serve`` child process (the supervisor) on a free port."""

    def __init__(self, model: Path, log: Path, *extra: str, env: dict[str, str] | None = None,
                 session: bool = False, supervisor: dict[str, Any] | None = None) -> None:
        """``supervisor``: constants of gguf_mcv.server.supervisor to set in the child (shorter waits)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        setting = "".join(f"s.{name} = {value!r}; " for name, value in (supervisor or {}).items())
        command = ["-c", "import sys; import gguf_mcv.server.supervisor as s; " + setting +
                   "from gguf_mcv.cli import main; sys.exit(main(sys.argv[1:]))"] if setting else ["-m", "gguf_mcv"]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *command, "serve", str(model), "--port", str(self.port), "--api-key", "",
                 "--threads", "2", *extra], env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=_no_core_files, start_new_session=session)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def health(self, until: Callable[[dict[str, Any]], bool] = lambda h: True, timeout: float = START_S,
               status: int = 200) -> dict:
        """``/health`` once it answers ``status`` and ``until`` holds; fails if the supervisor exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.output()}"
            try:
                r = requests.get(self.url + "/health", timeout=30)
                if r.status_code == status and until(r.json()):
                    return r.json()
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise AssertionError(f"/health did not say so within {timeout} s:\n{self.output()}")

    def supervising(self) -> None:
        """Wait until the supervisor has seen its worker start (its hang check runs from then on)."""
        deadline = time.monotonic() + START_S
        while "Serving on" not in self.output():
            assert time.monotonic() < deadline and self.proc.poll() is None, self.output()
            time.sleep(0.3)

    def worker(self) -> Any:
        """The worker process (the supervisor's child that is not multiprocessing's resource tracker)."""
        (worker,) = [p for p in psutil.Process(self.proc.pid).children()
                     if "spawn_main" in " ".join(p.cmdline())]
        return worker

    def chat(self, messages: list[dict], max_tokens: int = 6) -> dict:
        r = requests.post(self.url + "/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> dict:
        return requests.get(self.url + "/metrics?format=json", timeout=60).json()

    def prometheus(self) -> dict[str, float]:
        text = requests.get(self.url + "/metrics", timeout=60).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    def stop(self) -> int:
        """SIGINT, as Ctrl-C; the exit status."""
        children = psutil.Process(self.proc.pid).children(recursive=True) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        for child in children:  # none should be left; a failed test must not leave a model running
            try:
                child.wait(timeout=30)
            except psutil.TimeoutExpired:
                child.kill()
        return self.proc.returncode


@contextmanager
def serving(tiny, tmp_path: Path, *extra: str, env: dict[str, str] | None = None, model: Path | None = None,
            supervisor: dict[str, Any] | None = None) -> Iterator[Served]:
    srv = Served(model or tiny.quants["Q4_K_M"], tmp_path / "serve.log", *extra, env=env, supervisor=supervisor)
    try:
        yield srv
    finally:
        srv.stop()


QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=["SIGKILL", "SIGSEGV"])
def test_a_worker_killed_mid_stream_is_started_again_by_the_same_supervisor(tiny, tmp_path, sig) -> None:
    with serving(tiny, tmp_path, "--no-disk-cache") as srv:
        assert srv.health()["worker_restarts"] == 0
        before = srv.chat(QUESTION)
        worker = srv.worker()
        body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 4000,
                "temperature": 0, "stream": True}
        began = time.monotonic()
        with requests.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith(b"data: ")
            os.kill(worker.pid, sig)
            rest: list[bytes] = []
            with pytest.raises(requests.RequestException):  # the connection closes mid-stream
                rest.extend(lines)
        assert b"data: [DONE]" not in rest and time.monotonic() - began < START_S  # an error, not a hang
        health = srv.health(lambda h: h["worker_restarts"] == 1)
        assert health["status"] == "ok" and health["last_worker_exit"].startswith(f"killed by {sig.name}")
        assert health["last_worker_restart"] <= time.time()
        assert srv.proc.poll() is None and srv.worker().pid != worker.pid  # same supervisor, new worker
        after = srv.chat(QUESTION)  # the same settings: the same greedy answer
        assert after["choices"][0]["message"] == before["choices"][0]["message"]
        assert after["usage"] == before["usage"]
        assert srv.metrics()["worker_restarts"] == 1
        assert srv.prometheus()["gguf_mcv_worker_restarts_total"] == 1
    assert srv.proc.returncode == 0


def test_kept_conversations_survive_a_killed_worker_and_a_killed_supervisor(tiny, tmp_path) -> None:
    kept = tmp_path / "kept"
    # TMPDIR: the supervisor's run folder, left behind when it is killed, goes with the test's
    with serving(tiny, tmp_path, "--no-disk-cache", "--keep-chats", str(kept), env={"TMPDIR": str(tmp_path)}) as srv:
        srv.health()
        evicted = first_turn(20)
        first = srv.chat(evicted)
        srv.chat([{"role": "user", "content": "Another client: " + "tell me more " * 30}], max_tokens=3)
        deadline = time.monotonic() + 30  # the first conversation is written on a background thread
        while srv.metrics()["kept_chats"]["saved"] < 1:
            assert time.monotonic() < deadline, srv.output()
            time.sleep(0.2)
        srv.worker().kill()
        srv.health(lambda h: h["worker_restarts"] == 1)
        back = srv.chat(follow_up(evicted, first["choices"][0]["message"]["content"]), max_tokens=3)
        new_turn = back["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]
        evaluated = back["usage"]["prompt_tokens"] - back["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert evaluated <= new_turn  # restored from the folder the killed worker wrote
        counts = srv.metrics()["kept_chats"]
        assert counts["restored"] == 1 and counts.get("damaged", 0) == 0
        files = set(kept.rglob("*.val"))
        worker = srv.worker()
        srv.proc.kill()  # the supervisor dies: its worker stops too, cleanly, keeping the idle conversation
        worker.wait(timeout=60)
        assert set(kept.rglob("*.val")) - files


def test_a_hang_up_stops_the_server_and_its_worker_cleanly(tiny, tmp_path) -> None:
    kept = tmp_path / "kept"
    srv = Served(tiny.quants["Q4_K_M"], tmp_path / "serve.log", "--no-disk-cache", "--keep-chats", str(kept),
                 session=True)  # a process group of its own, as a terminal's
    try:
        srv.health()
        worker = srv.worker()
        srv.chat([{"role": "user", "content": "Tell me a story. " * 20}], max_tokens=3)
        os.killpg(srv.proc.pid, signal.SIGHUP)  # the terminal closed
        assert srv.proc.wait(timeout=90) == 0, srv.output()
        worker.wait(timeout=30)
    finally:
        srv.stop()
    assert len(list(kept.rglob("*.val"))) == 1  # the idle conversation was kept as the worker stopped


def test_a_worker_that_dies_while_loading_stops_the_server(tiny, tmp_path) -> None:
    began = time.monotonic()
    srv = Served(tiny.quants["Q4_K_M"], tmp_path / "serve.log", env={"GGUF_MCV_NATIVE_FAULT": "serve-worker=SIGSEGV"})
    try:
        srv.proc.wait(timeout=3 * START_S)
    finally:
        srv.stop()
    out = srv.output()
    assert srv.proc.returncode == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("gguf-mcv: error: The model worker died 3 times in a row while loading"), out
    assert "killed by SIGSEGV" in last and "Traceback" not in out
    assert out.count("starting it again") == 2  # two restarts, then it stopped
    assert time.monotonic() - began < 3 * START_S


def test_a_load_that_fails_is_one_line_and_not_tried_again(tiny, tmp_path) -> None:
    srv = Served(tiny.quants["Q4_K_M"], tmp_path / "serve.log", "--keep-chats", str(tmp_path / "kept"),
                 "--keep-chats-size", "1KB")  # checked by the store, once the model is loaded
    try:
        srv.proc.wait(timeout=START_S)
    finally:
        srv.stop()
    # less the one line a native fallback prints where AMX kernels fault (tests/test_native_check.py)
    lines = [line for line in srv.output().strip().splitlines() if not line.startswith("gguf_mcv: ")]
    assert srv.proc.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("gguf-mcv: error: ") and "kept-chats size cap" in lines[0]


def test_serve_supervised_refuses_what_a_worker_could_not_use_before_binding() -> None:
    from functools import partial

    import gguf_mcv
    from gguf_mcv.errors import ConfigError
    from gguf_mcv.server import serve_supervised

    with pytest.raises(ConfigError, match="must pickle"):
        serve_supervised(lambda: None, port=free_port())  # type: ignore[arg-type, return-value]
    with pytest.raises(ConfigError, match="build_app's options"):
        serve_supervised(partial(gguf_mcv.load, "x"), port=free_port(), max_queeu=3)
    with pytest.raises(ConfigError, match="max_queue"):
        serve_supervised(partial(gguf_mcv.load, "x"), port=free_port(), max_queue=-1)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match="already in use"):
            serve_supervised(partial(gguf_mcv.load, "x"), port=busy.getsockname()[1])


#: Shorter waits between loads (the real schedule: supervisor.LOAD_RETRY_DELAYS_S); each try
#: that fails leaves the stand-in up for that long, so /health can be seen saying why.
QUICK_RETRIES = {"LOAD_RETRY_DELAYS_S": (2.0,) * 30}


def retrying(health: dict[str, Any]) -> bool:
    return health["status"] == "retrying" and bool(health["last_load_error"]) and health["next_load_retry"] > 0


def test_a_worker_killed_while_its_model_file_is_replaced_loads_it_once_the_copy_completes(tiny, tmp_path) -> None:
    served_file = tmp_path / "model.gguf"
    whole = tiny.quants["Q4_K_M"].read_bytes()
    served_file.write_bytes(whole)
    with serving(tiny, tmp_path, "--no-disk-cache", "--mmproj", str(tiny.mmproj), model=served_file,
                 supervisor=QUICK_RETRIES) as srv:
        srv.health()
        before = srv.chat(QUESTION)
        worker = srv.worker()
        with open(served_file, "r+b") as f:  # `cp` over it, half-way through
            f.truncate(len(whole) // 2)
        os.kill(worker.pid, signal.SIGBUS)  # what touching the truncated mapping does
        health = srv.health(retrying, status=503)
        assert health["worker_restarts"] >= 1 and health["last_worker_exit"]
        assert health["next_load_retry"] > time.time() - 60
        refused = requests.post(srv.url + "/v1/chat/completions", json={"messages": QUESTION}, timeout=30)
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "model_not_loaded"  # OpenAI's error shape
        refused = requests.post(srv.url + "/api/chat", json={"messages": QUESTION}, timeout=30)
        assert refused.status_code == 503 and isinstance(refused.json()["error"], str)  # Ollama's
        served_file.write_bytes(whole)  # the copy completes
        health = srv.health(lambda h: h["status"] == "ok")
        assert health["last_load_error"] and health["next_load_retry"] is None
        after = srv.chat(QUESTION)
        assert after["choices"][0]["message"] == before["choices"][0]["message"]
    assert srv.proc.returncode == 0, srv.output()
    assert "Traceback" not in srv.output()


def test_a_model_file_replaced_under_a_serving_worker_is_refused_then_loaded_again(tiny, tmp_path) -> None:
    served_file = tmp_path / "model.gguf"
    served_file.write_bytes(tiny.quants["Q4_K_M"].read_bytes())
    with serving(tiny, tmp_path, "--no-disk-cache", "--mmproj", str(tiny.mmproj), model=served_file,
                 supervisor=QUICK_RETRIES) as srv:
        srv.health()
        before = srv.chat(QUESTION)
        worker = srv.worker()
        fresh = tmp_path / "model.gguf.new"
        fresh.write_bytes(tiny.quants["Q4_K_M"].read_bytes())
        os.replace(fresh, served_file)  # the safe way to replace it: the old inode stays mapped
        refused = requests.post(srv.url + "/v1/chat/completions", json={"messages": QUESTION}, timeout=60)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "model_file_changed"
        assert str(served_file) in refused.json()["error"]["message"]
        health = srv.health(lambda h: h["status"] == "ok" and h.get("worker_restarts", 0) >= 1)
        assert "weights file changed" in health["last_worker_exit"]
        assert srv.worker().pid != worker.pid
        after = srv.chat(QUESTION)
        assert after["choices"][0]["message"] == before["choices"][0]["message"]
    assert srv.proc.returncode == 0, srv.output()
    assert "Traceback" not in srv.output()


def test_a_keep_chats_folder_replaced_by_a_file_is_waited_for_after_a_crash(tiny, tmp_path) -> None:
    kept = tmp_path / "kept"
    with serving(tiny, tmp_path, "--no-disk-cache", "--keep-chats", str(kept), supervisor=QUICK_RETRIES) as srv:
        srv.health()
        srv.chat(QUESTION)
        kept.rename(tmp_path / "moved")
        kept.write_text("not a folder")
        assert srv.chat(QUESTION)["usage"]["completion_tokens"] >= 1  # the running worker copes
        srv.worker().kill()
        health = srv.health(retrying, status=503)
        assert str(kept) in health["last_load_error"]
        kept.unlink()
        (tmp_path / "moved").rename(kept)
        health = srv.health(lambda h: h["status"] == "ok")
        assert srv.chat(QUESTION)["usage"]["completion_tokens"] >= 1
    assert srv.proc.returncode == 0, srv.output()


def test_loads_that_keep_failing_after_serving_stop_the_server_when_the_schedule_ends(tiny, tmp_path) -> None:
    kept = tmp_path / "kept"
    srv = Served(tiny.quants["Q4_K_M"], tmp_path / "serve.log", "--no-disk-cache", "--keep-chats", str(kept),
                 supervisor={"LOAD_RETRY_DELAYS_S": (0.5, 0.5)})
    try:
        srv.health()
        shutil.rmtree(kept)
        kept.write_text("not a folder")
        srv.worker().kill()
        srv.proc.wait(timeout=4 * START_S)
    finally:
        srv.stop()
    out = srv.output()
    assert srv.proc.returncode == 1, out
    (error,) = [line for line in out.splitlines() if line.startswith("gguf-mcv: error: ")]
    assert error.startswith("gguf-mcv: error: The model could not be loaded again: 3 tries in a row failed"), out
    assert str(kept) in error and out.count("trying again in 0.5 s") == 2 and "Traceback" not in out


def test_a_hung_worker_is_killed_and_health_says_the_supervisor_did_it(tiny, tmp_path) -> None:
    with serving(tiny, tmp_path, "--no-disk-cache", supervisor={"HEALTHCHECK_TIMEOUT_S": 5}) as srv:
        srv.health()
        srv.supervising()
        worker = srv.worker()
        os.kill(worker.pid, signal.SIGSTOP)
        health = srv.health(lambda h: h["worker_restarts"] == 1)
        exit_ = health["last_worker_exit"]
        assert exit_.startswith("killed by the supervisor: hung") and "out of memory" not in exit_, exit_
        assert int(exit_.split("answered for ")[1].split(" s")[0]) >= 5  # how long it was unresponsive
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert srv.chat(QUESTION)["usage"]["completion_tokens"] >= 1
    assert srv.proc.returncode == 0, srv.output()


def _answer_pings(conn) -> None:
    while True:
        conn.recv()
        conn.send(True)


def _exit_when_pinged(conn) -> None:
    conn.recv()
    os._exit(3)


def _stay_silent(conn) -> None:
    time.sleep(600)


@pytest.mark.parametrize(("behaviour", "expected"), [(_answer_pings, True), (_exit_when_pinged, False),
                                                     (_stay_silent, None)])
def test_a_ping_tells_an_answer_an_exit_and_silence_apart(behaviour, expected) -> None:
    """A worker that exits while pinged (as one whose files changed does) is an exit, seen at once,
    not a worker hung for the whole healthcheck timeout (uvicorn's ping waits on the pipe only)."""
    import multiprocessing
    from types import SimpleNamespace

    from gguf_mcv.server.supervisor import ping

    parent_conn, child_conn = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=behaviour, args=(child_conn,), daemon=True)
    child.start()
    try:
        worker = SimpleNamespace(parent_conn=parent_conn, process=child)
        assert ping(worker, 120 if expected is not None else 1) is expected  # type: ignore[arg-type]
    finally:
        child.kill()
        child.join()
