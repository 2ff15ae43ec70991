"""Every hostile input of tools/make_bad_inputs.py, through the public API, in child processes.

For each item the child prints one JSON line: an answer (with its usage counts) or the error
raised. An item passes when the child did not die (no signal, no abort, exit code 0), the
outcome is an answer with sensible counts or a ``GgufMcvError`` raised by gguf_mcv itself
(never a bare ``ValueError``/``RuntimeError`` from llama.cpp, PIL or OpenCV), it took less
than ``ITEM_TIMEOUT_S``, and it is the outcome the manifest expects.

Items run in a few batched children (one per kind) to keep the file fast; a child that
dies or hangs is blamed on the item it had started (it printed a ``start`` line), and the
rest of its batch continues in a new child.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

# The corpus runs once, in the first test's setup: ~30 s alone, more on a busy machine.
# Children use one llama.cpp thread: two threads of the tiny model mostly wait for each other
# when another process holds a core.
pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parent.parent
ITEM_TIMEOUT_S = 60.0
MAX_TOKENS = 8
MAX_FRAMES = 4
TAG = "@corpus "  # marks the child's result lines on stdout


def _load_tool() -> Any:
    spec = importlib.util.spec_from_file_location("make_bad_inputs", REPO / "tools" / "make_bad_inputs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bad_inputs = _load_tool()

# Items whose outcome is a known, not yet fixed bug in gguf_mcv, with the bug's description: they
# run as strict xfails (the test fails once the bug is fixed, so the entry gets removed). Empty:
# every bug the corpus has found so far is fixed.
KNOWN_BUGS: dict[str, str] = {}


# --- the child: run items through the public API -----------------------------------------------


def _error_record(exc: BaseException) -> dict[str, Any]:
    import gguf_mcv

    tb = traceback.extract_tb(exc.__traceback__)
    raised_in = tb[-1].filename if tb else ""
    return {
        "outcome": "error",
        "error_class": type(exc).__name__,
        "error_mro": [c.__name__ for c in type(exc).__mro__],
        "is_gguf_error": isinstance(exc, gguf_mcv.GgufMcvError),
        "raised_in": os.path.relpath(raised_in, REPO) if raised_in else "",
        "message": str(exc)[:400],
        "traceback": "" if isinstance(exc, gguf_mcv.GgufMcvError) else traceback.format_exc()[-3000:],
    }


def _answer_record(reply: Any) -> dict[str, Any]:
    u = reply.usage
    video = getattr(reply, "video", None)
    return {
        "outcome": "answer",
        "usage": {"prompt_tokens": u.prompt_tokens, "image_tokens": u.image_tokens,
                  "completion_tokens": u.completion_tokens, "cached_tokens": u.cached_tokens},
        "video": None if video is None else {"sampled": video.sampled, "used": video.used,
                                             "encoded": video.encoded},
        "finish_reason": reply.finish_reason,
        "text_type": type(reply).__name__,
    }


class _Runner:
    """Holds the shared tiny model of one child (loaded on first use)."""

    def __init__(self, tiny_model: str, tiny_mmproj: str) -> None:
        self.tiny_model, self.tiny_mmproj = tiny_model, tiny_mmproj
        self._model: Any = None

    def shared(self) -> Any:
        import gguf_mcv

        if self._model is None:
            self._model = gguf_mcv.load(model_path=self.tiny_model, mmproj_path=self.tiny_mmproj,
                                        n_ctx=4096, n_threads=1)
        return self._model

    def run(self, kind: str, path: str) -> dict[str, Any]:
        import numpy as np

        import gguf_mcv

        extra: dict[str, Any] = {}
        if kind == "image":
            try:
                image = gguf_mcv.load_image(path)
                extra["size"] = [image.width, image.height]
            except gguf_mcv.MediaError:
                pass  # the ask below must raise it too
            reply = self.shared().ask("What is in this picture?", path, max_tokens=MAX_TOKENS)
        elif kind == "video":
            reply = self.shared().ask_video("What happens?", path, max_frames=MAX_FRAMES,
                                            max_tokens=MAX_TOKENS)
        elif kind == "prompt":
            picture = str(Path(path).parent / bad_inputs.BASE_PICTURE)
            question = Path(path).read_text(encoding="utf-8")
            extra["plain_image_tokens"] = self.shared().ask("?", picture, max_tokens=1).usage.image_tokens
            reply = self.shared().ask(question, picture, max_tokens=MAX_TOKENS)
        elif kind == "call":
            reply = self.call(json.loads(Path(path).read_text()), str(Path(path).parent / bad_inputs.BASE_PICTURE))
        else:
            pair = ({"model_path": path, "mmproj_path": self.tiny_mmproj} if kind == "model"
                    else {"model_path": self.tiny_model, "mmproj_path": path})
            rgb = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
            with gguf_mcv.load(**pair, n_ctx=2048, n_threads=1) as model:
                reply = model.ask("What is in this picture?", rgb, max_tokens=MAX_TOKENS)
        return {**_answer_record(reply), **extra}


    def call(self, spec: dict[str, Any], picture: str) -> Any:
        """Run a ``call`` item: a method of the shared model (``send``: of a new chat)."""
        fill = lambda v: picture if v == "$image" else (  # noqa: E731
            {k: fill(x) for k, x in v.items()} if isinstance(v, dict) else v)
        args, kwargs = [fill(a) for a in spec["args"]], {k: fill(v) for k, v in spec["kwargs"].items()}
        target = self.shared().chat() if spec["method"] == "send" else self.shared()
        kwargs.setdefault("max_tokens", MAX_TOKENS)
        return getattr(target, spec["method"])(*args, **kwargs)


def child_main() -> None:
    """Read a batch from stdin, print ``{"start": name}`` then one result line per item."""
    batch = json.loads(sys.stdin.read())
    runner = _Runner(batch["tiny_model"], batch["tiny_mmproj"])
    for item in batch["items"]:
        print(TAG + json.dumps({"start": item["name"]}), flush=True)
        start = time.perf_counter()
        try:
            record = runner.run(item["kind"], item["path"])
        except Exception as exc:  # noqa: BLE001 - every escape is recorded and judged by the parent
            record = _error_record(exc)
        record.update(name=item["name"], seconds=round(time.perf_counter() - start, 3))
        print(TAG + json.dumps(record), flush=True)


# --- the parent: batches with crash attribution ----------------------------------------------------


def _child_cmd() -> list[str]:
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); "
            "import test_corpus; test_corpus.child_main()")
    return [sys.executable, "-c", code]


def _run_child(batch: dict[str, Any], names: list[str],
               log: Path) -> tuple[dict[str, dict], str | None, dict]:
    """Run one child on ``batch``; return the results it printed and, if it died or hung,
    the item it was on and how it ended."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "GGML_NO_BACKTRACE": "1"}  # an abort must not spend seconds attaching gdb
    with open(log, "wb") as err:
        proc = subprocess.Popen(_child_cmd(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, cwd=REPO, env=env, text=True, errors="replace")
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(batch))
        proc.stdin.close()
        results: dict[str, dict] = {}
        current: str | None = None
        started = time.monotonic()
        timed_out = False
        while True:
            try:
                line = lines.get(timeout=max(0.1, started + ITEM_TIMEOUT_S - time.monotonic()))
            except queue.Empty:
                timed_out = True
                proc.kill()
                break
            if line is None:
                break
            if not line.startswith(TAG):
                continue  # native libraries may print to stdout too
            msg = json.loads(line[len(TAG):])
            if "start" in msg:
                current, started = msg["start"], time.monotonic()
            else:
                results[msg["name"]] = msg
                current, started = None, time.monotonic()
        rc = proc.wait()
    stderr_tail = log.read_bytes()[-2000:].decode("utf-8", "replace")
    ending = {"returncode": rc, "timed_out": timed_out, "stderr": stderr_tail}
    if current is None and rc == 0 and len(results) == len(names):
        return results, None, ending
    if current is None:  # died between items (or before the first): blame the next one
        current = next((n for n in names if n not in results), None)
    return results, current, ending


def run_items(items: list[Any], tiny_model: Path, tiny_mmproj: Path, log_dir: Path) -> dict[str, dict]:
    """Every item's result; items after a crash are rerun in a fresh child."""
    results: dict[str, dict] = {}
    pending = [{"name": i.name, "kind": i.kind, "path": str(i.path)} for i in items]
    while pending:
        names = [p["name"] for p in pending]
        batch = {"tiny_model": str(tiny_model), "tiny_mmproj": str(tiny_mmproj), "items": pending}
        got, culprit, ending = _run_child(batch, names, log_dir / f"{names[0]}.stderr")
        results.update(got)
        if culprit is None:
            if ending["returncode"] != 0:  # all items reported, then a bad exit: blame the last
                results[names[-1]] = {**results[names[-1]], "exit": ending}
            break
        results[culprit] = {"name": culprit, "outcome": "died", "exit": ending}
        pending = pending[names.index(culprit) + 1:]
    return results


@pytest.fixture(scope="module")
def corpus(tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    out = tmp_path_factory.mktemp("bad_inputs")
    items = bad_inputs.make_corpus(out, tiny.out_dir)
    return items, out


@pytest.fixture(scope="module")
def results(corpus: tuple[list[Any], Path], tiny: Any) -> dict[str, dict]:
    items, out = corpus
    manifest = json.loads((out / bad_inputs.MANIFEST).read_text())
    model, mmproj = Path(manifest["tiny_model"]), Path(manifest["tiny_mmproj"])
    logs = out / "logs"
    logs.mkdir()
    found: dict[str, dict] = {}
    for kinds in (("image",), ("video",), ("model", "mmproj"), ("prompt", "call")):
        found.update(run_items([i for i in items if i.kind in kinds], model, mmproj, logs))
    (out / "results.json").write_text(json.dumps(found, indent=2))
    return found


# --- the checks ------------------------------------------------------------------------------------


def _params() -> list[Any]:
    out = []
    for spec in bad_inputs.SPECS:
        bug = KNOWN_BUGS.get(spec.name)
        marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
        out.append(pytest.param(spec, id=spec.name, marks=marks))
    return out


def _check_answer(spec: Any, r: dict[str, Any]) -> None:
    u = r["usage"]
    assert r["text_type"] == "Reply"
    assert 0 <= u["completion_tokens"] <= MAX_TOKENS, u
    assert 0 <= u["cached_tokens"] < u["prompt_tokens"], u
    assert 0 < u["image_tokens"] < u["prompt_tokens"], u  # the image is in the prompt, with text around it
    assert r["finish_reason"] in ("stop", "length"), r
    if spec.kind == "video":
        v = r["video"]
        assert v is not None and 1 <= v["used"] <= MAX_FRAMES and v["used"] <= v["sampled"], v
    if spec.size is not None:
        assert tuple(r["size"]) == tuple(spec.size), f"decoded as {r['size']}, expected {spec.size}"
    if spec.kind == "prompt":  # typed markup adds no image and no control token
        assert u["image_tokens"] == r["plain_image_tokens"], u


@pytest.mark.parametrize("spec", _params())
def test_item(spec: Any, results: dict[str, dict]) -> None:
    r = results[spec.name]
    if r["outcome"] == "died":
        e = r["exit"]
        how = "hung" if e["timed_out"] else f"exited with {e['returncode']}"
        pytest.fail(f"the child {how} on {spec.name} ({spec.what}); stderr tail:\n{e['stderr']}")
    assert "exit" not in r, f"the child exited badly after {spec.name}: {r['exit']}"
    assert r["seconds"] < ITEM_TIMEOUT_S
    if r["outcome"] == "error":
        assert r["is_gguf_error"], (
            f"{spec.name}: a bare {r['error_class']} escaped (not a GgufMcvError): {r['message']}\n"
            f"{r['traceback']}"
        )
        assert r["raised_in"].startswith("gguf_mcv" + os.sep), f"raised in {r['raised_in']}"
    want = spec.expected + (f" ({spec.error_class})" if spec.error_class else "")
    assert r["outcome"] == spec.expected, (
        f"{spec.name} ({spec.what}): expected {want}, got {r['outcome']}"
        + (f" {r['error_class']}: {r['message']}" if r["outcome"] == "error" else f" {r.get('usage')}")
    )
    if r["outcome"] == "answer":
        _check_answer(spec, r)
    elif spec.error_class is not None:
        assert spec.error_class in r["error_mro"], (
            f"{spec.name}: expected {spec.error_class}, got {r['error_class']}: {r['message']}"
        )


def test_manifest_matches_specs(corpus: tuple[list[Any], Path]) -> None:
    """The manifest lists every item with a path that exists, relative to the corpus folder."""
    items, out = corpus
    manifest = json.loads((out / bad_inputs.MANIFEST).read_text())
    assert [i["name"] for i in manifest["items"]] == [s.name for s in bad_inputs.SPECS]
    for entry in manifest["items"]:
        assert (out / entry["path"]).is_file(), entry
        assert entry["kind"] in bad_inputs.KINDS and entry["expected"] in ("answer", "error")


def test_slowest_items(results: dict[str, dict]) -> None:
    """No item that finished comes near the time limit (a child that died or hung fails its own
    item's test); the slowest are named in the failure message."""
    timed = sorted(((r["seconds"], n) for n, r in results.items() if "seconds" in r), reverse=True)
    slowest = ", ".join(f"{n} {s:.1f}s" for s, n in timed[:5])
    assert timed[0][0] < ITEM_TIMEOUT_S / 2, f"slowest items: {slowest}"


if __name__ == "__main__":
    child_main()
