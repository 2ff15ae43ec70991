"""Every argument of plan, pull, load, watch, batch and serve is checked before anything runs.

Each call gets a bad argument on a fresh cache and must raise the right error having started no
child process (the speed probe, the native check and the ONNX conversion run in children), probed
nothing (hardware, speed, native kernels), asked the Hub stand-in nothing and written nothing to
either cache. The CLI's commands likewise exit with one ``gguf-mcv: error:`` line.
"""

from __future__ import annotations

import math
import multiprocessing.process
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gguf_mcv
from gguf_mcv import cli
from gguf_mcv.errors import ConfigError, ModelNotFoundError, OutputError
from gguf_mcv.jobs import batch
from gguf_mcv.models.quants import is_known_quant
from gguf_mcv.options import (
    KV_CACHE_TYPES,
    MAX_N_CTX,
    MIN_N_CTX,
    MMPROJ_PRECISIONS,
    VISION_BACKENDS,
    VISION_WEIGHTS,
    max_threads,
)
from gguf_mcv.units import MAX_SIZE

MODEL = "minicpm-v-2.6"
#: hypothesis examples per test: each one is a full call, but none of them may do any work
EXAMPLES = 40
CHECKED = settings(max_examples=EXAMPLES, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class ChildStarted(BaseException):
    """Raised where a child process would have started (a BaseException: no ``except Exception``
    on the way turns it into a user-facing error)."""


@dataclass
class Guard:
    """What a call did that a refused call must not do."""

    hub: Any
    caches: tuple[Path, ...]
    events: list[str] = field(default_factory=list)
    children: set[int] = field(default_factory=set)

    def reset(self) -> None:
        self.events.clear()
        self.hub.log.clear()

    def assert_untouched(self) -> None:
        assert self.events == [], f"ran before the arguments were checked: {self.events}"
        assert list(self.hub.log) == [], "asked the Hub before the arguments were checked"
        for folder in self.caches:
            assert not folder.exists() or not any(folder.rglob("*")), f"wrote into {folder}"
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= self.children


@pytest.fixture
def guard(hub, hf_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Guard]:
    """A fresh gguf_mcv cache and HF cache, the speed probe enabled (a refused call must not
    start it), and every way of starting a child process, probing or asking the Hub recorded."""
    cache = tmp_path / "gguf_mcv_cache"
    monkeypatch.setenv("GGUF_MCV_CACHE", str(cache))
    monkeypatch.delenv("GGUF_MCV_NO_PROBE", raising=False)
    g = Guard(hub, (cache, hf_env.cache), children={p.pid for p in psutil.Process().children(recursive=True)})

    def refuse(what: str):
        def started(*args: Any, **kwargs: Any) -> Any:
            g.events.append(what)
            raise ChildStarted(what)
        return started

    def record(what: str, real: Any):
        def called(*args: Any, **kwargs: Any) -> Any:
            g.events.append(what)
            return real(*args, **kwargs)
        return called

    monkeypatch.setattr(subprocess, "Popen", refuse("subprocess.Popen"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing start"))
    import gguf_mcv.hardware
    import gguf_mcv.resolver
    from gguf_mcv.runtime import native_check, speed_probe

    probe = gguf_mcv.hardware.probe
    # load() probes through resolver.this_machine(), so these two names are every way in
    for module in (gguf_mcv.hardware, gguf_mcv.resolver):
        monkeypatch.setattr(module, "probe", record("hardware probe", probe))
    monkeypatch.setattr(speed_probe, "rates", record("speed probe", speed_probe.rates))
    monkeypatch.setattr(native_check, "decide", record("native check", native_check.decide))
    g.reset()
    yield g


# --- bad values, generated -------------------------------------------------------------


def _not_in(allowed: tuple[str, ...]) -> st.SearchStrategy:
    return st.one_of(st.text(max_size=8).filter(lambda s: s not in allowed), st.integers(), st.floats(),
                     st.lists(st.text(max_size=2), max_size=2))


BAD_NUMBER = st.one_of(st.floats(max_value=0), st.just(math.inf), st.just(math.nan),
                       st.integers(min_value=2**1024, max_value=2**1100), st.integers(max_value=0),
                       st.text(max_size=4), st.booleans())
#: settings plan, pull and load share, each with values none of them accepts
PLAN_BAD: dict[str, st.SearchStrategy] = {
    "n_ctx": st.one_of(st.integers(max_value=MIN_N_CTX - 1), st.integers(min_value=MAX_N_CTX + 1),
                       st.floats(), st.text(max_size=5), st.booleans()),
    "ram_budget": st.one_of(st.integers(max_value=-1), st.integers(min_value=MAX_SIZE + 1, max_value=10**500),
                            st.floats(), st.text(alphabet="xyz!-e ", min_size=1, max_size=6),
                            st.integers(min_value=10**9 + 1, max_value=10**400).map(lambda n: f"{n}GB"),
                            st.just("1" + "0" * 5000)),
    "quant": st.one_of(st.text(max_size=8).filter(lambda s: not is_known_quant(s)), st.integers(),
                       st.floats()),
    "kv_cache_type": _not_in(KV_CACHE_TYPES),
    "min_tokens_per_s": BAD_NUMBER,
    "max_first_answer_s": BAD_NUMBER,
    "vision_backend": _not_in(VISION_BACKENDS),
    "vision_weights": _not_in(VISION_WEIGHTS),
}
#: what load() takes beyond the planning settings
LOAD_BAD: dict[str, st.SearchStrategy] = {
    **PLAN_BAD,
    "n_threads": st.one_of(st.integers(max_value=0), st.integers(min_value=max_threads() + 1), st.floats()),
    "parallel": st.one_of(st.integers(max_value=0), st.integers(min_value=65), st.text(max_size=4).filter(
        lambda s: s != "auto")),
    "n_gpu_layers": st.one_of(st.integers(max_value=-2), st.text(max_size=4).filter(lambda s: s != "auto"),
                              st.floats()),
    "mmproj_precision": _not_in(MMPROJ_PRECISIONS),
    "chat_template": st.one_of(st.integers(), st.just(""), st.just("   ")),
    "allow_remote_media": st.one_of(st.integers(), st.text(max_size=3)),
    "verbose": st.one_of(st.integers(), st.text(max_size=3)),
    "revision": st.one_of(st.integers(), st.just("")),
}
NAMES = st.one_of(st.integers(), st.just(""), st.just("  "), st.none(), st.lists(st.text(max_size=3), max_size=2))


def _one_bad(strategies: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.sampled_from(sorted(strategies)).flatmap(lambda k: strategies[k].map(lambda v: {k: v}))


@CHECKED
@given(bad=_one_bad({**PLAN_BAD, "prefer": _not_in(("quality", "speed", "size")),
                     "detail": _not_in(("auto", "low", "high")), "revision": LOAD_BAD["revision"],
                     "speed_probe": st.one_of(st.integers(min_value=2), st.text(max_size=3))}))
def test_plan_checks_its_arguments_before_it_probes_or_asks_the_hub(guard: Guard, bad: dict[str, Any]) -> None:
    guard.reset()
    with pytest.raises(ConfigError):
        gguf_mcv.plan(MODEL, **bad)
    guard.assert_untouched()


@CHECKED
@given(bad=_one_bad({**PLAN_BAD, "revision": LOAD_BAD["revision"],
                     "progress": st.one_of(st.integers(min_value=2), st.text(max_size=3))}))
def test_pull_checks_its_arguments_before_it_downloads(guard: Guard, bad: dict[str, Any]) -> None:
    guard.reset()
    with pytest.raises(ConfigError):
        gguf_mcv.pull(MODEL, **bad)
    guard.assert_untouched()


@CHECKED
@given(bad=_one_bad(LOAD_BAD))
def test_load_checks_its_arguments_before_anything_runs(guard: Guard, bad: dict[str, Any]) -> None:
    guard.reset()
    with pytest.raises(ConfigError):
        gguf_mcv.load(MODEL, **bad)
    guard.assert_untouched()


@CHECKED
@given(bad=_one_bad(LOAD_BAD))
def test_load_of_local_files_checks_its_arguments_before_the_native_check(
        guard: Guard, tiny, bad: dict[str, Any]) -> None:
    guard.reset()
    with pytest.raises(ConfigError):
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, **bad)
    guard.assert_untouched()


@CHECKED
@given(name=NAMES)
def test_a_name_that_names_nothing_is_refused_before_anything_runs(guard: Guard, name: Any) -> None:
    for call in (gguf_mcv.plan, gguf_mcv.pull, gguf_mcv.load):
        guard.reset()
        with pytest.raises(ConfigError):
            call(name)
        guard.assert_untouched()


def test_an_unknown_catalog_name_is_refused_before_the_hub_is_asked(guard: Guard) -> None:
    for call in (gguf_mcv.plan, gguf_mcv.pull, gguf_mcv.load):
        with pytest.raises(ModelNotFoundError, match="Known models"):
            call("minicpm-v-9.9", n_ctx=4096)
        guard.assert_untouched()


def test_missing_local_files_are_refused_before_anything_runs(guard: Guard, tiny, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="mmproj_path"):
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tmp_path / "none.gguf")
    with pytest.raises(ModelNotFoundError, match="model_path"):
        gguf_mcv.load(model_path=tmp_path, mmproj_path=tiny.mmproj)  # a folder
    with pytest.raises(ConfigError, match="both"):
        gguf_mcv.load(mmproj_path=tiny.mmproj)
    with pytest.raises(ConfigError, match="path"):
        gguf_mcv.load(model_path=b"model.gguf", mmproj_path=tiny.mmproj)
    guard.assert_untouched()


def test_check_load_takes_exactly_loads_keywords() -> None:
    from gguf_mcv.loader import check_load

    assert check_load(model=MODEL, n_ctx=2048).n_ctx == 2048
    with pytest.raises(ConfigError, match="n_cxt"):
        check_load(model=MODEL, n_cxt=2048)


# --- watch, batch and serve take a loaded model: their own arguments come first -----------

BAD_SOURCES = ["rtsp://cam:99999/live", "rtsp://[::1", "http://host:abc/", "rtsp://user:secret@cam:70000/",
               "rtsp:///live", "http://h:0/", "gopher://cam/", 3.5, b"rtsp://cam/", {"url": "x"}, -1, True]


@pytest.mark.parametrize("source", BAD_SOURCES, ids=repr)
def test_watch_refuses_a_bad_source_before_opening_anything(guard: Guard, tiny_model, source: Any) -> None:
    guard.reset()
    with pytest.raises(ConfigError) as info:
        gguf_mcv.watch(tiny_model, source, "What is there?")
    assert "secret" not in str(info.value)
    guard.assert_untouched()


@CHECKED
@given(bad=_one_bad({"max_tokens": st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=3)),
                     "temperature": BAD_NUMBER.filter(lambda v: not (isinstance(v, (int, float))
                                                                    and not isinstance(v, bool) and v == 0)),
                     "seed": st.one_of(st.floats(), st.text(max_size=3)),
                     "detail": _not_in(("auto", "low", "high"))}))
def test_watch_checks_its_arguments_before_opening_the_source(guard: Guard, tiny_model, bad: dict[str, Any]) -> None:
    guard.reset()
    with pytest.raises(ConfigError):
        gguf_mcv.watch(tiny_model, "rtsp://127.0.0.1:9/none", "What is there?", **bad)
    guard.assert_untouched()


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    PIL.Image.fromarray(np.zeros((40, 60, 3), dtype=np.uint8)).save(folder / "a.png")
    return folder


@CHECKED
@given(bad=_one_bad({"max_tokens": st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=3)),
                     "temperature": st.one_of(st.floats(min_value=5.01), st.just(math.nan), st.text(max_size=3)),
                     "top_k": st.one_of(st.integers(max_value=-1), st.floats()),
                     "detail": _not_in(("auto", "low", "high")),
                     "max_slices": st.one_of(st.integers(max_value=-1), st.integers(min_value=10)),
                     "max_frames": st.one_of(st.integers(max_value=0), st.floats()),
                     "fps": BAD_NUMBER, "dedupe": st.integers(), "stop": st.integers(),
                     "system": st.just("\ud800")}))
def test_batch_checks_the_job_options_before_reading_anything(guard: Guard, tiny_model, photos: Path,
                                                             tmp_path: Path, bad: dict[str, Any]) -> None:
    guard.reset()
    out = tmp_path / "results.jsonl"
    with pytest.raises(ConfigError):
        batch.run(tiny_model, photos, out, prompts=["What is it?"], options=bad, progress=False)
    assert not out.exists()
    guard.assert_untouched()


def test_batch_refuses_a_results_path_it_cannot_write_before_answering(guard: Guard, tiny_model, photos: Path,
                                                                      tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    for out in (folder, folder / "no" / "such" / "folder.jsonl"):
        with pytest.raises(OutputError):
            batch.run(tiny_model, photos, out, prompts=["What is it?"], progress=False)
    assert list(folder.iterdir()) == []
    guard.assert_untouched()


@pytest.mark.parametrize("kw", [{"port": 99999}, {"port": -1}, {"port": 0}])
def test_serve_refuses_a_bad_port_before_serving(guard: Guard, tiny_model, kw: dict[str, Any]) -> None:
    from gguf_mcv.server import serve

    with pytest.raises(ConfigError, match="[Pp]ort"):
        serve(tiny_model, **kw)
    guard.assert_untouched()


# --- the command line --------------------------------------------------------------------

CLI_BAD = [
    ("plan", MODEL, "--ctx", "100000000000"),
    ("plan", MODEL, "--ram", "9" * 30 + "GB"),
    ("plan", MODEL, "--ram", "lots"),
    ("plan", MODEL, "--min-tokens-per-s", "inf"),
    ("plan", MODEL, "--max-first-answer-s", "nan"),
    ("plan", MODEL, "--quant", "Q99"),
    ("plan", "minicpm-v-9.9"),
    ("plan", "{model}", "--ctx", "100000000000"),
    ("pull", MODEL, "--quant", "Q99"),
    ("pull", MODEL, "--ctx", "5"),
    ("pull", MODEL, "--ram", "1" + "0" * 400),
    ("pull", MODEL, "--revision", " "),
    ("watch", "{model}", "rtsp://cam:99999/live", "--prompt", "What?"),
    ("watch", "{model}", "rtsp://[::1", "--prompt", "What?"),
    ("watch", "{model}", "http://host:abc/", "--prompt", "What?"),
    ("watch", MODEL, "rtsp://127.0.0.1:9/x", "--prompt", "What?", "--max-tokens", "0"),
    ("watch", MODEL, "rtsp://127.0.0.1:9/x", "--prompt", "What?", "--temperature", "nan"),
    ("watch", MODEL, "rtsp://127.0.0.1:9/x", "--prompt", "What?", "--ctx", "5"),
    ("watch", MODEL, "rtsp://127.0.0.1:9/x", "--prompt", "What?", "--ram", "9" * 30 + "GB"),
    ("batch", MODEL, "{photos}", "--prompt", "What?", "--out", "{tmp}/no/such/r.jsonl"),
    ("batch", MODEL, "{photos}", "--prompt", "What?", "--out", "{tmp}"),
    ("batch", MODEL, "{photos}", "--prompt", "What?", "--out", "{tmp}/r.jsonl", "--max-tokens", "0"),
    ("batch", MODEL, "{photos}", "--prompt", "What?", "--out", "{tmp}/r.jsonl", "--fps", "inf"),
    ("batch", MODEL, "{photos}", "--prompt", "What?", "--out", "{tmp}/r.jsonl", "--ctx", "5"),
    ("batch", MODEL, "{photos}", "--prompt", "What?", "--out", "{tmp}/r.jsonl", "--ray", "auto", "--workers", "0"),
    ("serve", MODEL, "--ctx", "5"),
    ("serve", MODEL, "--port", "99999"),
    ("serve", MODEL, "--ram", "9" * 30 + "GB"),
    ("serve", MODEL, "--threads", "100000"),
    ("serve", MODEL, "--parallel", "0"),
    ("serve", MODEL, "--gpu-layers", "many"),
    ("serve", MODEL, "--quant", "Q99"),
    ("serve", MODEL, "--body-timeout", "inf"),
    ("serve", "{model}", "--mmproj", "{tmp}/none.gguf"),
    ("serve", "minicpm-v-9.9"),
]


@pytest.mark.parametrize("args", CLI_BAD, ids=" ".join)
def test_the_command_refuses_bad_arguments_in_one_line_before_doing_anything(
        guard: Guard, tiny, photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        args: tuple[str, ...]) -> None:
    argv = [a.format(model=tiny.quants["Q4_K_M"], photos=photos, tmp=tmp_path) for a in args]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith("gguf-mcv: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "r.jsonl").exists()
    guard.assert_untouched()


def test_the_real_command_prints_no_traceback_for_a_bad_stream_url(tiny) -> None:
    """The installed entry point, in a child process (the in-process tests patch that away)."""
    import os
    import sys

    done = subprocess.run([sys.executable, "-m", "gguf_mcv", "watch", str(tiny.quants["Q4_K_M"]),
                           "rtsp://[::1", "--prompt", "What?"], capture_output=True, text=True, env=os.environ,
                          timeout=120)
    assert done.returncode == 1
    assert "gguf-mcv: error: source" in done.stderr and "Traceback" not in done.stderr

