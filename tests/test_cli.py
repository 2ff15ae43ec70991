"""Each gguf-mcv subcommand as a subprocess: exit codes, --json output, one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest


def run(*args: str, stdin: str | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "gguf_mcv", *args], input=stdin, env=os.environ,
                          capture_output=True, text=True, timeout=timeout)
    done.stderr = without_native_notices(done.stderr)
    return done


def without_native_notices(stderr: str) -> str:
    """stderr less the one-line notice of a native fallback (on a machine whose AMX kernels fault
    every command prints it once: tests/test_native_check.py tests it)."""
    return "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith("gguf_mcv: "))


@pytest.fixture(scope="module")
def picture(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "picture.png"
    PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 300, 3), dtype=np.uint8)).save(path)
    return path


def test_no_command_is_a_usage_error() -> None:
    assert run().returncode == 2
    assert run("ask").returncode == 2
    assert run("nonsense").returncode == 2


def test_ask_prints_an_answer(tiny, picture: Path) -> None:
    done = run("ask", str(tiny.quants["Q4_K_M"]), str(picture), "What is it?", "--max-tokens", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and done.stderr == ""


def test_ask_json_with_explicit_mmproj_and_example(tiny) -> None:
    done = run("ask", str(tiny.quants["Q2_K"]), "--mmproj", str(tiny.mmproj), "--example",
               "What is it?", "--max-tokens", "2", "--json", "--seed", "1")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["usage"]["image_tokens"] > 0 and out["usage"]["completion_tokens"] <= 2
    assert set(out["timings"]) >= {"ttft_ms", "encode_ms", "decode_ms"}


@pytest.mark.parametrize("args", [
    ("ask", "/no/such/model.gguf", "x.png", "?"),
    ("ask", "{model}", "/no/such/picture.png", "?"),
    ("video", "{model}", "/no/such/clip.mp4", "?"),
])
def test_bad_paths_give_one_clear_line(tiny, args) -> None:
    done = run(*(a.format(model=tiny.quants["Q4_K_M"]) for a in args))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gguf-mcv: error: ") and "/no/such/" in lines[0]
    assert "Traceback" not in done.stderr


def test_debug_shows_the_traceback(tiny) -> None:
    done = run("--debug", "ask", str(tiny.quants["Q4_K_M"]), "/no/such/picture.png", "?")
    assert done.returncode == 1 and "Traceback" in done.stderr


def test_video_json_reports_frames(tiny, tmp_path: Path) -> None:
    frames = np.stack([np.full((48, 64, 3), i * 20, dtype=np.uint8) for i in range(5)])
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, frame in enumerate(frames):
        PIL.Image.fromarray(frame).save(folder / f"f{i}.png")
    done = run("video", str(tiny.quants["Q4_K_M"]), str(folder), "What changes?", "--frames", "3",
               "--max-tokens", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["video"]["used"] == 3


def test_chat_session_with_commands(tiny, picture: Path) -> None:
    script = f"/again\n/image {picture}\nWhat is it?\n/again\nAnd now?\n/reset\n/image /no/such.png\n/exit\n"
    done = run("chat", str(tiny.quants["Q4_K_M"]), "--max-tokens", "3", stdin=script)
    assert done.returncode == 0, done.stderr
    assert "(image added" in done.stderr and "(conversation cleared)" in done.stderr
    assert "(no such file" in done.stderr
    assert done.stderr.count("Nothing to regenerate") == 1  # only before the first answer


def test_chat_keeps_the_session_when_the_context_fills(tiny, picture: Path) -> None:
    """A ContextOverflowError ended `gguf-mcv chat` and the conversation was lost."""
    questions = "".join(f"/image {picture}\nQuestion number {i}?\n" for i in range(8))
    done = run("chat", str(tiny.quants["Q4_K_M"]), "--ctx", "512", "--max-tokens", "8",
               stdin=questions + "Still there?\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert "oldest question(s)" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stdout.strip().splitlines()) >= 9  # every question, the last one included, got an answer


def test_chat_says_when_one_question_cannot_fit(tiny, picture: Path) -> None:
    huge = "word " * 600
    done = run("chat", str(tiny.quants["Q4_K_M"]), "--ctx", "256", "--max-tokens", "2",
               stdin=f"{huge}\nshort?\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert "does not fit in the context" in done.stderr and "conversation is kept" in done.stderr


def test_invalid_utf8_in_an_argument_is_one_line(tiny) -> None:
    """It raised a raw UnicodeEncodeError."""
    done = subprocess.run([sys.executable, "-m", "gguf_mcv", "ask", os.fsencode(str(tiny.quants["Q4_K_M"])),
                           b"What is \xff\xfe?", "--max-tokens", "1"], capture_output=True, timeout=180)
    assert done.returncode == 1
    err = without_native_notices(done.stderr.decode(errors="replace")).strip().splitlines()
    assert len(err) == 1 and "not valid Unicode" in err[0]


def test_absurd_thread_counts_are_refused_before_llama_cpp_sees_them(tiny, picture: Path) -> None:
    """--threads 100000 crashed inside llama.cpp or libgomp."""
    done = run("ask", str(tiny.quants["Q4_K_M"]), str(picture), "?", "--threads", "100000")
    assert done.returncode == 1 and "n_threads must be between 1 and" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,match", [
    (("--ctx", "0"), "n_ctx must be between"),
    (("--ctx", "-1"), "n_ctx must be between"),
    (("--ram", "abc"), "cannot read 'abc' as a size"),
])
def test_plan_refuses_bad_numbers_as_load_does(args, match) -> None:
    done = run("plan", "minicpm-v-2.6", *args)
    assert done.returncode == 1 and match in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_ask_shows_progress_on_a_terminal_and_not_otherwise(tiny, picture: Path, tmp_path: Path) -> None:
    """A progress line while slices are encoded, on a terminal only, and not with --quiet."""
    import pty

    big = tmp_path / "big.png"
    PIL.Image.fromarray(np.random.default_rng(3).integers(0, 256, (900, 1344, 3), dtype=np.uint8)).save(big)
    base = [sys.executable, "-m", "gguf_mcv", "ask", str(tiny.quants["Q4_K_M"]), str(big), "?",
            "--max-tokens", "1", "--detail", "high"]

    def stderr_on_a_tty(extra: list[str]) -> str:
        leader, follower = pty.openpty()
        with subprocess.Popen(base + extra, stderr=follower, stdout=subprocess.DEVNULL, env=os.environ) as proc:
            os.close(follower)
            chunks = []
            while True:
                try:
                    data = os.read(leader, 4096)
                except OSError:
                    break
                if not data:
                    break
                chunks.append(data)
            proc.wait(180)
        os.close(leader)
        return b"".join(chunks).decode(errors="replace")

    shown = stderr_on_a_tty([])
    assert re.search(r"encoding image slices: .*\d+/\d+", shown), shown  # tqdm's bar: done/total
    assert "encoding" not in stderr_on_a_tty(["--quiet"])
    assert "encoding" not in run(*base[3:]).stderr  # not a terminal


def test_bench_json(tiny, picture: Path) -> None:
    done = run("bench", str(tiny.quants["Q4_K_M"]), str(picture), "--max-tokens", "4", "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    # the benchmarks' record: where and how it ran, around the results
    assert record["benchmark"] == "gguf-mcv bench" and record["command"].split()[:2] == ["gguf-mcv", "bench"]
    assert record["machine"]["cpu_class"] and record["machine"]["versions"]["llama_cpp_python"]
    assert record["settings"]["max_tokens"] == 4 and record["date"].startswith("20")
    out = record["results"]
    assert out["slices_encoded"] >= 1 and out["follow_up_ttft_s"] >= 0
    # predicted next to measured (from the default rates: the suite does not probe)
    assert out["rates_source"] == "defaults"
    assert out["predicted_decode_tokens_per_s"] > 0 and out["predicted_encode_s"] > 0
    assert out["predicted_first_ttft_s"] > out["predicted_encode_s"]


def test_models_json_lists_the_catalog_and_the_cache(hub, tiny) -> None:
    hub.add_repo("acme/tiny-gguf", {"ggml-model-Q4_0.gguf": tiny.quants["Q4_0"],
                                    "mmproj-model-f16.gguf": tiny.mmproj})
    assert run("pull", "acme/tiny-gguf", "--quant", "Q4_0", "--no-progress").returncode == 0
    done = run("models", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert any(row["name"] == "minicpm-v-2.6" for row in out["catalog"])
    cached = {row["repo"]: row["cached"] for row in out["other_cached"]}
    assert {f["file"] for f in cached["acme/tiny-gguf"]} == {"ggml-model-Q4_0.gguf",
                                                            "mmproj-model-f16.gguf"}


def test_pull_json_and_errors(hub, tiny) -> None:
    hub.add_repo("acme/tiny-gguf", {"ggml-model-Q8_0.gguf": tiny.quants["Q8_0"],
                                    "mmproj-model-f16.gguf": tiny.mmproj})
    done = run("pull", "acme/tiny-gguf", "--quant", "Q8_0", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert Path(out["model"]).is_file() and out["quant"] == "Q8_0"
    missing = run("pull", "acme/missing-gguf", "--quant", "Q8_0")
    assert missing.returncode == 1 and "No model repository" in missing.stderr


def test_python_dash_m_and_console_script_agree() -> None:
    import shutil

    script = shutil.which("gguf-mcv", path=os.path.dirname(sys.executable))
    assert script is not None
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "selftest" in done.stdout


def test_serve_answers_health_and_stops_on_sigint(tiny) -> None:
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gguf_mcv", "serve", str(tiny.quants["Q4_K_M"]),
                             "--port", str(port), "--api-key", "sekret"], env=os.environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        health = None
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    health = json.loads(r.read())
                break
            except OSError:
                time.sleep(0.3)
        assert health is not None and health["status"] == "ok", proc.stderr.read() if proc.poll() else ""
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
        try:
            urllib.request.urlopen(request, timeout=5)
            raise AssertionError("the API key was not checked")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_plan_table_json_and_nothing_fits(hub, tiny) -> None:
    hub.add_repo("acme/plan-gguf", {**{f"ggml-model-{q}.gguf": p for q, p in tiny.quants.items()},
                                    "mmproj-model-f16.gguf": tiny.mmproj})
    table = run("plan", "acme/plan-gguf", "--ram", "8GB", "--ctx", "2048")
    assert table.returncode == 0, table.stderr
    assert "Chosen Q8_0" in table.stdout and "->  Q8_0" in table.stdout
    data = json.loads(run("plan", "acme/plan-gguf", "--ram", "8GB", "--json").stdout)
    assert data["quant"] == "Q8_0" and len(data["rows"]) == len(tiny.quants)
    refused = run("plan", "acme/plan-gguf", "--ram", "10MB")
    assert refused.returncode == 1 and "No quantization fits" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("port", ["99999", "-1", "0"])
def test_serve_refuses_a_bad_port_before_loading_the_model(port: str) -> None:
    done = run("serve", "/no/such/model.gguf", "--port", port)  # the port is checked first
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gguf-mcv: error: Port") and "65535" in lines[0]


def test_serve_refuses_a_port_in_use_or_a_bad_host_in_one_line(tiny) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        in_use = run("serve", str(tiny.quants["Q4_K_M"]), "--port", port)
    not_here = run("serve", str(tiny.quants["Q4_K_M"]), "--host", "192.0.2.1", "--port", port)
    unknown = run("serve", str(tiny.quants["Q4_K_M"]), "--host", "no-such-host.invalid", "--port", port)
    for done, words in ((in_use, "already in use"), (not_here, "not an address of this machine"),
                        (unknown, "no-such-host.invalid")):
        assert done.returncode == 1, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gguf-mcv: error: ") and words in lines[0]


def test_plan_takes_a_local_gguf_and_predicts_speed(tiny) -> None:
    data = json.loads(run("plan", str(tiny.quants["Q4_K_M"]), "--ram", "8GB", "--json").stdout)
    assert data["quant"] == "Q4_K_M" and data["rates"]["source"] == "defaults"
    (row,) = data["rows"]
    assert row["decode_tokens_per_s"] > 0 and row["video_first_answer_s"] > row["first_answer_s"] > 0
    table = run("plan", str(tiny.quants["Q4_K_M"]), "--mmproj", str(tiny.mmproj), "--ram", "8GB", "--detail", "low")
    assert table.returncode == 0, table.stderr
    assert "tok/s" in table.stdout and "detail='low' (1 encoder passes)" in table.stdout


def test_plan_speed_limits_from_the_command_line(hub, tiny) -> None:
    hub.add_repo("acme/plan-speed", {**{f"ggml-model-{q}.gguf": p for q, p in tiny.quants.items()},
                                     "mmproj-model-f16.gguf": tiny.mmproj})
    free = json.loads(run("plan", "acme/plan-speed", "--ram", "8GB", "--json").stdout)
    rows = sorted(free["rows"], key=lambda r: -r["decode_tokens_per_s"])
    floor = (rows[0]["decode_tokens_per_s"] + rows[1]["decode_tokens_per_s"]) / 2
    fast = json.loads(run("plan", "acme/plan-speed", "--ram", "8GB", "--json",
                          "--min-tokens-per-s", str(floor)).stdout)
    assert fast["quant"] == rows[0]["quant"] != free["quant"]
    pulled = run("pull", "acme/plan-speed", "--ram", "8GB", "--no-progress", "--json", "--min-tokens-per-s", str(floor))
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["quant"] == rows[0]["quant"]
    refused = run("plan", "acme/plan-speed", "--ram", "8GB", "--min-tokens-per-s", "1e12")
    assert refused.returncode == 1 and f"the fastest that fits is {rows[0]['quant']}" in refused.stderr
    for bad in ("nan", "-1"):  # 0, inf and the rest: tests/test_speed.py
        done = run("plan", "acme/plan-speed", "--ram", "8GB", "--max-first-answer-s", bad)
        assert done.returncode == 1 and "max_first_answer_s must be a positive number" in done.stderr, bad
    assert run("plan", "acme/plan-speed", "--min-tokens-per-s", "fast").returncode == 2  # argparse


def test_plan_of_a_missing_local_file_is_one_line() -> None:
    done = run("plan", "/no/such/model.gguf")
    assert done.returncode == 1 and "does not exist" in done.stderr


def test_speed_limits_with_local_files_are_refused_before_loading(tiny) -> None:
    done = run("ask", str(tiny.quants["Q4_K_M"]), "x.png", "hi", "--min-tokens-per-s", "5")
    assert done.returncode == 1 and "Speed limits choose a model and quant" in done.stderr


def test_ask_uses_a_disk_cache_across_processes_unless_told_not_to(tiny, picture: Path, tmp_path: Path) -> None:
    def encoded(*flags: str, image: Path = picture) -> int:
        done = run("ask", str(tiny.quants["Q4_K_M"]), str(image), "?", "--max-tokens", "1", "--json", *flags)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["timings"]["slices_encoded"]

    cache = tmp_path / "emb"
    assert encoded("--cache-dir", str(cache), "--cache-size", "50MB") > 0
    assert encoded("--cache-dir", str(cache)) == 0  # a new process: from the disk cache
    assert encoded("--no-disk-cache") > 0
    default = Path(os.environ["GGUF_MCV_CACHE"]) / "embeddings"
    before = sum(1 for _ in default.rglob("*")) if default.is_dir() else 0
    fresh = tmp_path / "fresh.png"
    PIL.Image.fromarray(np.random.default_rng(11).integers(0, 256, (60, 70, 3), dtype=np.uint8)).save(fresh)
    assert encoded(image=fresh) > 0  # stored in the default folder, in $GGUF_MCV_CACHE
    assert sum(1 for _ in default.rglob("*")) > before


@pytest.mark.parametrize("flags, match", [
    (("--cache-dir", "{file}"), "is a file"),
    (("--cache-size", "lots"), "size"),
    (("--cache-size", "10"), "max_disk_bytes"),
    (("--cache-dir", "{dir}", "--no-disk-cache"), "not both"),
])
def test_bad_cache_options_are_one_line(tiny, picture: Path, tmp_path: Path, flags, match) -> None:
    (tmp_path / "file").write_text("x")
    done = run("ask", str(tiny.quants["Q4_K_M"]), str(picture), "?",
               *(f.format(file=tmp_path / "file", dir=tmp_path) for f in flags))
    assert done.returncode == 1 and match in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_chat_saves_and_a_new_process_continues_it(tiny, picture: Path, tmp_path: Path) -> None:
    saved = tmp_path / "talk.chat"
    done = run("chat", str(tiny.quants["Q4_K_M"]), "--max-tokens", "3",
               stdin=f"/image {picture}\nWhat is it?\n/save {saved}\n/save {tmp_path}\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert f"(saved to {saved})" in done.stderr and "(error: Could not save" in done.stderr
    done = run("chat", str(tiny.quants["Q4_K_M"]), "--max-tokens", "3",
               stdin=f"/load {tmp_path / 'nothing'}\n/load {saved}\nAnd now?\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert "(error: No saved conversation" in done.stderr and "(loaded 1 question(s)" in done.stderr
    assert done.stdout.strip()  # the follow-up was answered

@pytest.mark.parametrize(("value", "words"), [("lots", "--parallel takes an integer or 'auto'"),
                                              ("0", "parallel must be between 1 and 64")])
def test_serve_refuses_a_bad_parallel_in_one_line(tiny, value: str, words: str) -> None:
    import socket

    with socket.socket() as free:  # a port nobody uses: the check before loading passes
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    done = run("serve", str(tiny.quants["Q4_K_M"]), "--port", port, "--parallel", value)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0]


def test_serve_refuses_a_bad_keep_chats_size_in_one_line(tiny, tmp_path) -> None:
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    done = run("serve", str(tiny.quants["Q4_K_M"]), "--port", port, "--keep-chats", str(tmp_path),
               "--keep-chats-size", "lots")
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot read 'lots' as a size" in lines[0]


def test_serve_refuses_a_bad_ram_cap_in_one_line(tiny) -> None:
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    done = run("serve", str(tiny.quants["Q4_K_M"]), "--port", port, "--keep-chats-memory", "plenty")
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--keep-chats-memory takes 'auto', 'off'" in lines[0]


def test_serve_keeps_the_idle_conversation_when_stopped_by_sigint(tiny, tmp_path) -> None:
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kept = tmp_path / "kept"
    proc = subprocess.Popen([sys.executable, "-m", "gguf_mcv", "serve", str(tiny.quants["Q8_0"]), "--port",
                             str(port), "--api-key", "", "--keep-chats", str(kept), "--no-disk-cache"],
                            env=os.environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "Tell me a story. " * 20}],
                           "max_tokens": 3}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(request, timeout=30) as r:
                    assert r.status == 200
                break
            except OSError:
                assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
                time.sleep(0.3)
        assert not list(kept.rglob("*.val"))  # nothing overwrote the conversation yet
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?format=json", timeout=30) as r:
            in_ram = json.load(r)["kept_chats_memory"]  # --keep-chats-memory auto, the default
        assert in_ram["cap_bytes"] > 0 and in_ram["saved"] == 0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert len(list(kept.rglob("*.val"))) == 1  # kept as the server stopped


def test_plan_says_what_it_shrank_and_keeps_what_was_given(tiny) -> None:
    from gguf_mcv.resolver import plan_local

    budget = plan_local(tiny.quants["Q4_K_M"], tiny.mmproj, ram_budget=10**12, n_ctx=2048,
                        kv_cache_type="q8_0").predicted_bytes
    data = json.loads(run("plan", str(tiny.quants["Q4_K_M"]), "--ram", str(budget), "--json", "--no-probe").stdout)
    assert (data["n_ctx"], data["kv_cache_type"], data["fits"]) == (2048, "q8_0", True)
    assert {s["setting"]: s["planned"] for s in data["shrunk"]} == {"n_ctx": 2048, "kv_cache_type": "q8_0"}
    table = run("plan", str(tiny.quants["Q4_K_M"]), "--ram", str(budget), "--no-probe")
    assert "Shrunk to fit the budget: n_ctx 4096 -> 2048, kv_cache_type f16 -> q8_0" in table.stdout
    given = json.loads(run("plan", str(tiny.quants["Q4_K_M"]), "--ram", str(budget), "--ctx", "4096", "--kv", "f16",
                           "--json", "--no-probe").stdout)
    assert (given["n_ctx"], given["kv_cache_type"], given["fits"], given["shrunk"]) == (4096, "f16", False, [])


def test_watch_prints_one_json_line_per_observation(tiny, tmp_path: Path) -> None:
    from test_watch_sources import write_avi

    clip = write_avi(tmp_path / "clip.avi", n=16, fps=20.0, size=(320, 240))
    out = tmp_path / "seen.jsonl"
    done = run("watch", str(tiny.quants["Q4_K_M"]), str(clip), "--prompt", "What happens?", "--every", "0.3",
               "--max-tokens", "2", "--vision-backend", "llama.cpp", "--jsonl", str(out))
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines and lines[0]["frame"] == 0 and lines[0]["asked"] is True and lines[0]["slices_encoded"] == 1
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines


def test_watch_sends_its_events_to_a_webhook_and_keeps_their_snapshots(tiny, tmp_path: Path) -> None:
    from test_watch_sources import write_avi
    from test_watch_webhook import Receiver

    clip = write_avi(tmp_path / "clip.avi", n=8, fps=20.0, size=(320, 240))
    schema = tmp_path / "count.json"  # a count of at least 1: the first tick always starts an event
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                         "maximum": 3}}, "required": ["n"]}))
    receiver = Receiver()
    try:
        done = run("watch", str(tiny.quants["Q4_K_M"]), str(clip), "--prompt", "How many?", "--every", "0.2",
                   "--max-tokens", "24", "--vision-backend", "llama.cpp", "--schema", str(schema), "--event-on", "n",
                   "--snapshots", str(tmp_path / "snaps"), "--webhook", receiver.url)
    finally:
        receiver.close()
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    events = [line for line in lines if "event" in line]
    assert events and events[0]["frame"] == 0 and events[0]["event"]["event"] == "started"
    assert [b["frame"] for b in receiver.bodies] == [e["frame"] for e in events]  # each once, in order
    for body, line in zip(receiver.bodies, events, strict=True):
        assert body["event"] == line["event"]["event"] and body["snapshot"] == line["event"]["snapshot"]
        assert Path(body["snapshot"]).is_file()


def test_watch_zone_events_reach_the_webhook_and_the_broker_as_the_log_says(tiny, tmp_path: Path) -> None:
    """The issue's run: two zones of one clip, something appearing in "door" at frame 10. Each
    zone's events follow its values; the webhook and the broker get exactly the JSONL's events,
    each once, in order, with snapshots that decode; ticks without a change in a zone encode
    nothing there. The random weights choose the values, so the events are read from the log;
    a count of at least 1 is followed, so each zone's first tick starts exactly one event."""
    import cv2
    import PIL.Image
    from mqttbroker import Broker, Subscriber, mosquitto
    from test_watch_webhook import Receiver

    from gguf_mcv.watch.events import something

    if mosquitto() is None:
        pytest.skip("no MQTT broker: install Debian's mosquitto (apt-get install mosquitto) to run this test")
    clip = tmp_path / "door.avi"
    writer = cv2.VideoWriter(str(clip), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (640, 240))
    scene = cv2.resize(np.random.default_rng(5).integers(0, 255, (15, 40, 3), dtype=np.uint8), (640, 240),
                       interpolation=cv2.INTER_NEAREST)  # the two halves differ: no embedding shared by content
    for i in range(20):
        frame = scene.copy()
        if i >= 10:
            frame[60:180, 80:240] = 250  # appears in the left half: the door
        writer.write(frame)
    writer.release()
    schema = tmp_path / "count.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                         "maximum": 3}}, "required": ["n"]}))
    broker = Broker(tmp_path).start()
    receiver = Receiver()
    sub = Subscriber(broker.port, "door", "homeassistant/#")
    try:
        done = run("watch", str(tiny.quants["Q4_K_M"]), str(clip), "--prompt", "How many are there?", "--every", "0.25",
                   "--max-tokens", "32", "--vision-backend", "llama.cpp", "--schema", str(schema),
                   "--zone", "door=0,0,0.5,1:Is someone at the door?", "--zone", "wall=320,0,320,240",
                   "--event-on", "n", "--snapshots", str(tmp_path / "snaps"), "--webhook", receiver.url,
                   "--mqtt", f"mqtt://127.0.0.1:{broker.port}/door", "--mqtt-discovery",
                   "--jsonl", str(tmp_path / "log.jsonl"))
        assert done.returncode == 0, done.stderr
        lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
        events = [line for line in lines if "event" in line]
        for zone in ("door", "wall"):
            mine = [line for line in lines if line["zone"] == zone]
            expected, current = [], None  # hold 1, no cooldown: each new value, "started" from nothing
            for k, line in enumerate(mine):
                if line["parsed"] is None:  # cut short: no value this tick
                    continue
                value = line["parsed"]["n"]
                if (current is None and something(value)) or (current is not None and value != current):
                    expected.append(line["frame"])
                current = value
            assert [line["frame"] for line in mine if "event" in line] == expected, zone
            assert [line["event"]["event"] for line in mine if "event" in line].count("started") == 1
            frames = [line["frame"] for line in mine]
            encoded = [line["frame"] for line in mine if line["slices_encoded"]]
            changed_at = min((f for f in frames if f >= 10), default=None)
            assert encoded == ([frames[0]] + ([changed_at] if zone == "door" and changed_at is not None else []))
            published = [json.loads(p) for p in sub.wait_for(f"door/{zone}/event", len(expected))]
            assert [(b["frame"], b["event"]) for b in published] == [(e["frame"], e["event"]["event"])
                                                                      for e in events if e["zone"] == zone]
        assert [(b["zone"], b["frame"], b["event"], b["snapshot"]) for b in receiver.bodies] == [
            (e["zone"], e["frame"], e["event"]["event"], e["event"]["snapshot"]) for e in events]
        for e in events:
            with PIL.Image.open(e["event"]["snapshot"]) as image:
                assert image.size == (320, 240)
        for zone in ("door", "wall"):  # a count: a sensor, announced once
            config = sub.wait_for(f"homeassistant/sensor/gguf_mcv_door_{zone}/config", 1)
            assert len(config) == 1 and json.loads(config[0])["state_topic"] == f"door/{zone}/state"
        assert sub.wait_for("door/availability", 2)[-1] == "offline"
    finally:
        sub.close()
        receiver.close()
        broker.stop()


def test_watch_refuses_zone_and_mqtt_mistakes_before_loading(tiny) -> None:
    for extra, match in ((["--mqtt", "mqtt://127.0.0.1/d"], "give --event-on"),
                         (["--event-on", "answer", "--mqtt", "mqtt://127.0.0.1"], "needs a topic"),
                         (["--event-on", "answer", "--mqtt-discovery"], "give --mqtt too"),
                         (["--zone", "a=0,0,1,1", "--region", "0,0,1,1"], "not both"),
                         (["--zone", "a=0,0,1,1", "--zone", "a=1,1,2,2"], "must differ"),
                         (["--zone", "a b=0,0,1,1"], "NAME="), (["--zone", "a=0,0,1"], "--zone needs")):
        done = run("watch", str(tiny.quants["Q4_K_M"]), "0", "--prompt", "?", *extra)
        assert done.returncode == 1 and match in done.stderr, (extra, done.stderr)


def test_watch_refuses_event_options_without_events_before_loading(tiny, tmp_path: Path) -> None:
    for extra, match in ((["--hold", "3"], "give --event-on"), (["--webhook", "http://x"], "give --event-on"),
                         (["--event-on", "present"], "give schema="),
                         (["--event-on", "answer", "--webhook", "ftp://x"], "webhook"),
                         (["--event-on", "answer", "--snapshots", str(tiny.mmproj)], "not a folder")):
        done = run("watch", str(tiny.quants["Q4_K_M"]), "0", "--prompt", "?", *extra)
        assert done.returncode == 1 and match in done.stderr, (extra, done.stderr)


def test_watch_refuses_a_missing_source_before_loading(tiny, tmp_path: Path) -> None:
    done = run("watch", str(tiny.quants["Q4_K_M"]), str(tmp_path / "none.mp4"), "--prompt", "?")
    assert done.returncode == 1 and "does not exist" in done.stderr and len(done.stderr.splitlines()) == 1
    done = run("watch", str(tiny.quants["Q4_K_M"]), "0", "--prompt", "?", "--every", "0")
    assert done.returncode == 1 and "every_s must be at least 0.001" in done.stderr


def test_watch_stops_cleanly_on_ctrl_c_and_keeps_its_lines(tiny, tmp_path: Path) -> None:
    import signal
    import time

    from mjpegserver import MjpegServer

    out = tmp_path / "seen.jsonl"
    with MjpegServer([np.zeros((240, 320, 3), np.uint8)], fps=10) as server:
        proc = subprocess.Popen([sys.executable, "-m", "gguf_mcv", "watch", str(tiny.quants["Q4_K_M"]), server.url,
                                 "--prompt", "?", "--every", "0.2", "--max-tokens", "2", "--vision-backend",
                                 "llama.cpp", "--jsonl", str(out)], env=os.environ, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            started = time.monotonic()
            first = proc.stdout.readline()  # the first observation is out
            to_first_line = time.monotonic() - started  # this machine's pace now: loading, one answer
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            # stopping takes at most the answer under way: far less than loading plus an answer
            rest, stderr = proc.communicate(timeout=max(300.0, 10 * to_first_line))
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130 and "stopped after" in stderr and "Traceback" not in stderr
    printed = [json.loads(line) for line in (first + rest).splitlines()]
    kept = [json.loads(line) for line in out.read_text().splitlines()]  # each line parses: every line whole
    # each line goes to the file before it is printed: a Ctrl-C between the two leaves the file one ahead
    assert printed and kept[:len(printed)] == printed and len(kept) - len(printed) in (0, 1), (kept, printed)
