"""A weights file changed under a loaded model is refused before the next answer, never a SIGBUS.

Each damage runs in a child process (a SIGBUS there fails the test that asked, not the test
run): it loads a fresh copy of the tiny model, answers once, changes one file the model maps
(the text GGUF, the mmproj, the ONNX encoder's graph or its data), asks again about another
picture (so the encoder must run) and reports what it got.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_mcv.errors import GgufMcvError, ModelFileChangedError
from gguf_mcv.runtime import native_check
from gguf_mcv.runtime.file_watch import MappedFiles

DAMAGES = ["truncated", "copied over", "same size", "same size, mtime set back", "renamed over", "removed"]

_CHILD = """
import json, os, shutil, sys
import numpy as np
import gguf_mcv
from gguf_mcv.selftest import EXAMPLE_IMAGE

text, mmproj, cache, backend, target = sys.argv[1:6]
damages = json.loads(sys.argv[6])
work = os.path.dirname(text)
results = {}


def damage(path, how):
    size = os.path.getsize(path)
    if how == "truncated":
        os.truncate(path, size // 2)
    elif how == "copied over":  # cp: the same inode, opened with O_TRUNC and written
        other = os.path.join(work, "other")
        with open(other, "wb") as f:
            f.write(os.urandom(size // 3 + 17))
        shutil.copyfile(other, path)
    elif how.startswith("same size"):
        before = os.stat(path)
        with open(path, "r+b") as f:
            f.write(os.urandom(size))
        if how.endswith("mtime set back"):
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    elif how == "renamed over":  # the safe way: the old inode stays mapped
        new = path + ".new"
        shutil.copyfile(path, new)
        os.replace(new, path)
    elif how == "removed":
        os.unlink(path)


for i, how in enumerate(damages):
    here = os.path.join(work, f"run{i}")
    os.makedirs(here)
    t, m = shutil.copy(text, here), shutil.copy(mmproj, here)
    os.environ["GGUF_MCV_CACHE"] = shutil.copytree(cache, os.path.join(here, "cache"))
    with gguf_mcv.load(model_path=t, mmproj_path=m, n_ctx=2048, n_threads=2, vision_backend=backend) as model:
        files = {"text": t, "mmproj": model.engine.mmproj_path}
        if model.engine.encoder is not None:
            files["graph"], files["data"] = map(str, model.engine.encoder.mapped_files)
        model.ask("What is in this picture?", EXAMPLE_IMAGE, max_tokens=2, seed=1)
        damage(files[target], how)
        other = np.random.default_rng(i).integers(0, 256, (96, 128, 3), dtype=np.uint8)
        try:
            model.ask("And this one?", other, max_tokens=2, seed=1)
            results[how] = {"answered": True}
        except gguf_mcv.GgufMcvError as exc:
            results[how] = {"error": type(exc).__name__, "message": str(exc), "path": getattr(exc, "path", ""),
                            "file": files[target]}
print("RESULT " + json.dumps(results), flush=True)
"""


@pytest.fixture(scope="module")
def pristine_cache(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache that holds the tiny mmproj's ONNX conversion and this machine's native-check
    verdict, copied by every child (so none converts or checks again)."""
    import gguf_mcv

    cache = tmp_path_factory.mktemp("file-watch-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GGUF_MCV_CACHE", str(cache))
        native_check.forget()  # so the verdict is written into this cache too
        try:
            for backend in ("onnx-int8", "llama.cpp"):
                with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=2048,
                                   n_threads=2, vision_backend=backend):
                    pass
        finally:
            native_check.forget()
    return cache


def _run(tiny, cache: Path, tmp_path: Path, backend: str, target: str, damages: list[str]) -> dict:
    text, mmproj = shutil.copy(tiny.quants["Q4_K_M"], tmp_path), shutil.copy(tiny.mmproj, tmp_path)
    done = subprocess.run([sys.executable, "-c", _CHILD, text, mmproj, str(cache), backend, target,
                           json.dumps(damages)], capture_output=True, text=True, timeout=600, env=os.environ)
    # a SIGBUS is -7 here (135 from a shell): the child must end normally whatever was done to its files
    assert done.returncode == 0, f"the child ended with {done.returncode}:\n{done.stderr[-3000:]}"
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.parametrize("backend,target", [("llama.cpp", "text"), ("llama.cpp", "mmproj"), ("onnx-int8", "text"),
                                            ("onnx-int8", "graph"), ("onnx-int8", "data")])
def test_a_changed_weights_file_is_refused_before_the_next_answer_in_a_child(
        tiny, pristine_cache: Path, tmp_path: Path, backend: str, target: str) -> None:
    results = _run(tiny, pristine_cache, tmp_path, backend, target, DAMAGES)
    assert set(results) == set(DAMAGES)
    for how, got in results.items():
        assert got.get("error") == "ModelFileChangedError", (how, got)
        assert got["path"] == got["file"] and got["file"] in got["message"], (how, got)
        assert "load the model again" in got["message"].lower(), (how, got)


def test_an_unchanged_model_answers_every_time(tiny_model) -> None:
    from gguf_mcv.selftest import EXAMPLE_IMAGE

    for _ in range(3):
        assert tiny_model.ask("Describe it.", EXAMPLE_IMAGE, max_tokens=2, seed=1).usage.completion_tokens >= 1
    assert tiny_model.engine.files.paths[0] == os.fspath(tiny_model.engine.llama.model_path)


def test_mapped_files_name_what_changed(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"x" * 100)
    b.write_bytes(b"y" * 100)
    files = MappedFiles([a, b, a])  # the same file twice is watched once
    assert files.paths == (str(a), str(b))
    files.check()
    os.truncate(b, 10)
    with pytest.raises(ModelFileChangedError, match="changed size") as caught:
        files.check()
    assert caught.value.path == str(b) and isinstance(caught.value, GgufMcvError)
    assert isinstance(caught.value, RuntimeError)
    b.unlink()
    with pytest.raises(ModelFileChangedError, match="is gone"):
        files.check()
    b.write_bytes(b"y" * 100)  # a new file of the same name and size: another inode (or a later ctime)
    with pytest.raises(ModelFileChangedError):
        files.check()


def test_a_file_missing_at_load_that_stays_missing_is_no_change(tmp_path: Path) -> None:
    files = MappedFiles([tmp_path / "never"])
    files.check()
    (tmp_path / "never").write_bytes(b"now")
    with pytest.raises(ModelFileChangedError, match="appeared"):
        files.check()


def test_checks_from_many_threads_agree(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "m.gguf"
    path.write_bytes(b"z" * 64)
    files = MappedFiles([path])

    def check(_: int) -> bool:
        try:
            files.check()
        except ModelFileChangedError:
            return False
        return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(check, range(200)))
        os.truncate(path, 1)
        assert not any(pool.map(check, range(200)))
