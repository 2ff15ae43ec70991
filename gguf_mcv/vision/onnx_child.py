"""The ONNX conversion and its self-validation in a child process (the parent's side and the protocol).

A process that converts an mmproj imports the ``onnx`` package, touches the fp32 graph's
kernels and leaves heap behind: about 30 MiB that a later load from the cache never has. So
:func:`run` does that work in a child Python (``gguf_mcv.vision.onnx_vision.main``, through
:func:`child_main`) while the caller holds the conversion's lock; the caller then loads the
cached result as every later run does, and its peak is a cached run's. The child reports
progress and its result on stdout (lines that begin with :data:`PROTOCOL`); its own errors
come back as the same exception classes, and a child killed by a signal (the kernel's OOM
killer, say) is an :class:`~gguf_mcv.errors.EngineError` that says so, with nothing left in
the cache.

``GGUF_MCV_ONNX_FAULT`` (for tests) makes the child fail just before it validates:
a signal's name (``SIGKILL``) kills it, ``OSError`` / ``EngineError`` / ``KeyboardInterrupt``
is raised; with ``@manifest`` after it (``SIGKILL@manifest``) it fails instead once the
converted files are under their final names, just before their manifest is written.
"""

from __future__ import annotations

import builtins
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Callable

from .. import errors
from ..children import child_command, child_env, describe_exit
from ..errors import EngineError, GgufMcvError

PROTOCOL = "gguf-mcv-onnx-child:"
ENV_FAULT = "GGUF_MCV_ONNX_FAULT"
_RAISED: dict[str, type[BaseException]] = {"OSError": OSError, "EngineError": EngineError,
                                           "KeyboardInterrupt": KeyboardInterrupt}


def run(task: dict[str, Any], progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run ``task`` (``{"do": "convert" | "validate", ...}``: ``onnx_vision._child_task``) in a child and
    return its result; ``progress`` is called with the child's progress as it comes. The child's
    own error is raised again here as the same class; a child killed or silent is an EngineError."""
    env = child_env()
    command = child_command("gguf_mcv.vision.onnx_vision", json.dumps(task))
    what = f"Converting {Path(task['mmproj']).name} for ONNX Runtime"
    with tempfile.TemporaryFile() as stderr:
        try:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
                                    env=env)
        except OSError as exc:  # no process could be made (out of memory, no Python executable)
            raise EngineError(f"{what} needs a child process, which could not be started ({exc}). "
                              "Free some memory, or use vision_backend='llama.cpp'.") from exc
        result: dict[str, Any] | None = None
        try:
            assert proc.stdout is not None
            for kind, body in _protocol(proc.stdout):
                if kind == "progress" and progress is not None:
                    progress(body["what"], int(body["done"]), int(body["total"]))
                elif kind in ("done", "error"):
                    result = {"kind": kind, **body}
            code = proc.wait()
        finally:
            if proc.poll() is None:  # this process was interrupted: the child goes with it
                proc.kill()
                proc.wait()
        if result is not None and result["kind"] == "error":
            raise _exception(result["type"], result["message"], what)
        if result is None or code != 0:
            stderr.seek(0)
            raise EngineError(f"{what} failed: its process {_describe_exit(code, _tail(stderr))}; nothing was cached. "
                              "If it ran out of memory, free some (or convert once on a larger machine and "
                              "copy the cache folder), or use vision_backend='llama.cpp'.")
    return dict(result["value"])


def _protocol(stream: IO[bytes]) -> Any:
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", errors="replace").strip()
        if text.startswith(PROTOCOL):
            kind, _, body = text[len(PROTOCOL):].strip().partition(" ")
            try:
                yield kind, json.loads(body)
            except ValueError:
                continue


def _tail(stream: IO[bytes]) -> list[str]:
    lines = collections.deque(stream.read().decode("utf-8", errors="replace").splitlines(), maxlen=8)
    return [line.strip() for line in lines if line.strip()]


def _describe_exit(code: int, tail: list[str]) -> str:
    if code == 0:
        return "ended without a result" + (f" ({tail[-1][:200]})" if tail else "")
    oom = " (the out-of-memory killer's signal)" if code == -signal.SIGKILL else ""
    return describe_exit(code) + oom + (f" ({tail[-1][:200]})" if tail else "")


def _exception(name: str, message: str, what: str) -> BaseException:
    """The child's exception as this process raises it: gguf_mcv's own and the built-in classes
    as they were; anything else an EngineError that names it."""
    cls = getattr(errors, name, None) or getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, GgufMcvError):
        return cls(message)
    if isinstance(cls, type) and issubclass(cls, (OSError, KeyboardInterrupt, MemoryError)):
        return cls(f"{what} failed: {message}")
    return EngineError(f"{what} failed: {name}: {message}")


# --- the child ----------------------------------------------------------------------------


def say(kind: str, body: Any) -> None:
    """In the child: one protocol line (``progress``, ``done`` or ``error``) for the parent."""
    print(f"{PROTOCOL} {kind} {json.dumps(body)}", flush=True)


def inject_fault(stage: str = "validate") -> None:
    """In the child, at ``stage`` ("validate" or "manifest"): fail as ``$GGUF_MCV_ONNX_FAULT``
    says (tests only; nothing when it is unset or names another stage)."""
    fault, _, at = os.environ.get(ENV_FAULT, "").partition("@")
    if (at or "validate") != stage:
        return
    if fault.startswith("SIG"):
        if fault not in ("SIGKILL", "SIGSTOP"):  # those two have no handler to reset
            signal.signal(getattr(signal, fault), signal.SIG_DFL)
        os.kill(os.getpid(), getattr(signal, fault))
    elif fault in _RAISED:
        raise _RAISED[fault](f"{ENV_FAULT}={fault}")


def child_main(do: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The child's ``main``: ``do`` the task given as JSON in ``argv[1]``; say its result or its error."""
    try:
        value = do(json.loads(sys.argv[1]))
    except BaseException as exc:  # KeyboardInterrupt too: the parent raises it again
        say("error", {"type": type(exc).__name__, "message": str(exc)})
        return 1
    say("done", {"value": value})
    return 0
