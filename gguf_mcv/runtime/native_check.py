"""Try the native CPU kernels in a child process before this process trusts them.

A CPU can advertise instructions its (virtual) machine cannot run. On Intel Xeon VMs
that report AMX, pip's default native build of llama-cpp-python dies with SIGILL at
the first matrix product of a quantized model (``tilezero`` in llama.cpp's AMX
kernels), and the process dies with it. So before the first model of a process is
loaded, :func:`decide` runs the kernels the load will use in a child process:

* ``text:<TYPE>:extra`` / ``text:<TYPE>:plain``: a tiny generated text model whose
  matrices are all of that ggml type, loaded with and without llama.cpp's extra buffer
  types (weight repacking, AMX), then a prompt and two decoded tokens;
* ``vision:llama.cpp``, ``vision:onnx-fp32``, ``vision:onnx-int8``: one small image
  through libmtmd, and through ONNX Runtime graphs converted from a tiny mmproj.

A child killed by a signal, or silent past :func:`path_timeout`, marks the path it was
running as failed; the paths after it run in a new child. A hang is kept with the limit it ran
under and checked again by later loads under a longer one (:func:`due`: twice as long, up to
:data:`HANG_RETRY_CAP_S`, or the variable's when longer), so a slow first run on a busy machine
is not taken for a fault for good. A Python error in the child
(llama.cpp refusing a file, say) is not a crash and does not mark a path unsafe: the
real load then reports it as usual.

Verdicts are kept by :mod:`gguf_mcv.native_verdict`, per machine and build (:func:`fingerprint`:
CPU model and flags, kernel, Python, llama-cpp-python and onnxruntime versions, the native
libraries' sizes and times), in ``<cache_dir>/native-check/<fingerprint>.json`` and in memory,
so a kept verdict costs a few file stats. Delete the folder (or the file a
:class:`NativeKernelError` names) to check again.

``GGUF_MCV_NATIVE_FAULT`` (for tests) makes the child fail given paths on purpose, or slow them
down: ``"text:Q4_K:extra=SIGILL,vision:onnx-int8=hang,text:F16:plain=sleep2"``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import environment, native_verdict
from ..children import child_command, child_env, describe_exit
from ..errors import NativeKernelError
from ..native_verdict import (  # noqa: F401  (the verdicts' names, as this module's)
    CHECK_VERSION,
    ENV_FAULT,
    FOLDER,
    MAX_VERDICT_BYTES,
    Outcome,
    _lock,
    extra_bufts_known_to_crash,
    fingerprint,
    kept,
    read_verdict,
    verdict_path,
    write_verdict,
)

logger = logging.getLogger(__name__)

ENV_TIMEOUT = environment.ENV_NATIVE_TIMEOUT
#: Seconds one path may run in the child before it counts as hung (a path takes ~0.1 s).
DEFAULT_TIMEOUT_S = environment.DEFAULT_NATIVE_TIMEOUT_S
#: A hang is checked again under twice its limit until it has hung under this long a limit
#: (a longer ``$GGUF_MCV_NATIVE_TIMEOUT`` also checks it again): then it is kept for good.
HANG_RETRY_CAP_S = 2 * DEFAULT_TIMEOUT_S
#: What ``vision_backend="auto"`` falls back to when its choice crashes, in order.
VISION_FALLBACKS = {"onnx-int8": ("onnx-fp32", "llama.cpp"), "onnx-fp32": ("llama.cpp",), "llama.cpp": ()}
#: The kernels each vision backend runs: int8 is validated against fp32 when converted.
VISION_NEEDS = {"onnx-int8": ("onnx-fp32", "onnx-int8"), "onnx-fp32": ("onnx-fp32",), "llama.cpp": ("llama.cpp",)}
_PROTOCOL = "gguf-mcv-native-check:"


@dataclass(frozen=True)
class Decision:
    """How to load on this machine: llama.cpp's extra buffer types or not, which vision
    backend, and the notices that say what was changed and why."""

    extra_bufts: bool = True
    vision_backend: str | None = None
    notices: tuple[str, ...] = field(default=())


def text_path(ggml_type: str, extra_bufts: bool) -> str:
    return f"text:{ggml_type}:{'extra' if extra_bufts else 'plain'}"


def vision_path(backend: str) -> str:
    return f"vision:{backend}"


# --- the verdict: memory, disk, children -------------------------------------------------

_announced: set[str] = set()
_notices: list[str] = []


def outcomes(paths: Iterable[str]) -> dict[str, Outcome]:
    """Each path's :class:`Outcome` on this machine and build: from memory, from the kept
    verdict, or run now in child processes (and kept)."""
    wanted = list(dict.fromkeys(paths))
    limit = path_timeout()  # a bad value is refused before anything runs
    key = fingerprint()
    with _lock:
        known = kept(key)
        if any(due(known.get(p), limit) is not None for p in wanted):
            path = verdict_path(key)
            with _folder_lock(path.parent, key):
                known.update(read_verdict(path, key))  # another process may have checked meanwhile
                limits = {p: t for p in wanted if (t := due(known.get(p), limit)) is not None}
                for t in sorted(set(limits.values())):
                    again = [p for p, u in limits.items() if u == t and p in known]
                    if again:
                        logger.info("checking %s again under %g s: it hung under a shorter limit", ", ".join(again), t)
                    known.update(run_paths([p for p, u in limits.items() if u == t], t))
                if limits:
                    write_verdict(path, key, known)
        return {p: known[p] for p in wanted}


def due(outcome: Outcome | None, limit: float) -> float | None:
    """The limit to run a path under now, given its kept ``outcome`` and the limit of this
    process (:func:`path_timeout`): ``limit`` for a path never run; for a hang, the longer of
    ``limit`` and twice the limit it hung under (at most :data:`HANG_RETRY_CAP_S`) when that
    is longer than the one it hung under (a hang kept without its limit counts as under 0 s);
    None when the outcome stands."""
    if outcome is None:
        return limit
    if outcome.status != "hung":
        return None
    ran = outcome.limit_s or 0.0
    longer = max(limit, min(2 * ran, HANG_RETRY_CAP_S))
    return longer if longer > ran else None


@contextlib.contextmanager
def _folder_lock(folder: Path, key: str) -> Iterator[None]:
    """Two processes starting at once check once: the second waits, then reads the verdict.
    A folder that cannot be written checks without the lock (and keeps nothing)."""
    from filelock import FileLock, Timeout

    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(folder / f"{key}.lock"), timeout=10 * DEFAULT_TIMEOUT_S)
        lock.acquire()
    except (OSError, Timeout):
        yield
        return
    try:
        yield
    finally:
        lock.release()


def forget() -> None:
    """Drop what this process remembers, notices included (the kept verdict files stay)."""
    native_verdict.forget()
    with _lock:
        _announced.clear()
        _notices.clear()


def path_timeout() -> float:
    """Seconds a path may run (``$GGUF_MCV_NATIVE_TIMEOUT``, default 60); :class:`ConfigError`
    when the variable is not a number of seconds in (0, 3600] (:func:`gguf_mcv.environment.native_timeout`)."""
    return environment.native_timeout()


def run_paths(paths: list[str], timeout: float | None = None) -> dict[str, Outcome]:
    """Run ``paths`` in child processes, a new child after each one that died."""
    timeout = path_timeout() if timeout is None else timeout
    results: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="gguf-mcv-native-") as tmp:
        pending = list(paths)
        while pending:
            _one_child(pending, Path(tmp), timeout, results)
            pending = [p for p in pending if p not in results]
    return results


def _unchecked(paths: list[str], results: dict[str, Outcome], why: str) -> None:
    logger.warning("The native check could not run (%s): loading without it.", why)
    for p in paths:
        results.setdefault(p, Outcome("unchecked", why))


def _one_child(paths: list[str], workdir: Path, timeout: float, results: dict[str, Outcome]) -> None:
    try:
        proc = subprocess.Popen(child_command("gguf_mcv.runtime.native_check", str(workdir), *paths),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=child_env(), start_new_session=True)
    except OSError as exc:  # no process could be made (out of memory, no Python executable)
        _unchecked(paths, results, f"no child process: {exc}")
        return
    lines: queue.Queue[str | None] = queue.Queue()
    stderr_tail: collections.deque[str] = collections.deque(maxlen=8)
    threads = [threading.Thread(target=_read_protocol, args=(proc.stdout, lines), daemon=True),
               threading.Thread(target=_read_tail, args=(proc.stderr, stderr_tail), daemon=True)]
    for t in threads:
        t.start()
    current: str | None = None
    # starting Python and importing llama.cpp is not a path: a short limit must not cut it off
    deadline = time.monotonic() + max(timeout, DEFAULT_TIMEOUT_S)
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                proc.kill()
                if current is not None:
                    results[current] = Outcome("hung", f"no result after {timeout:g} s", limit_s=timeout)
                else:  # the child never started a path: it cannot import what it needs
                    _unchecked(paths, results,
                               f"its process hung for {max(timeout, DEFAULT_TIMEOUT_S):g} s before starting")
                return
            if line is None:
                break
            kind, _, rest = line.partition(" ")
            name, _, detail = rest.partition(" ")
            if kind == "start":
                current, deadline = name, time.monotonic() + timeout
            elif kind in ("ok", "error") and name:
                results[name] = Outcome(kind, detail)
                current = None
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # it closed its output but does not end
            proc.kill()
            code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in threads:
            t.join(timeout=5)
    if current is not None and current not in results:
        results[current] = Outcome("crashed", describe_exit(code, stderr_tail))
    elif not any(p in results for p in paths):
        _unchecked(paths, results, f"its process {describe_exit(code, stderr_tail)} before it ran anything")


def _read_protocol(stream: Any, lines: queue.Queue[str | None]) -> None:
    """The child's protocol lines (its other output is llama.cpp's), then None at its end."""
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", errors="replace").strip()
        if text.startswith(_PROTOCOL):
            lines.put(text[len(_PROTOCOL):].strip())
    stream.close()
    lines.put(None)


def _read_tail(stream: Any, tail: collections.deque[str]) -> None:
    for raw in iter(stream.readline, b""):
        tail.append(raw.decode("utf-8", errors="replace").rstrip())
    stream.close()


# --- the decisions the loader acts on -------------------------------------------------------


def decide(text_types: Iterable[str], vision_backend: str | None = None, *, vision_auto: bool = False,
           what: str = "this model") -> Decision:
    """How to load a model whose text matrices are of ``text_types`` with ``vision_backend``
    (None: nothing encodes on the CPU) on this machine.

    Extra buffer types that crash are left off; a vision backend that crashes is replaced
    (``vision_auto``) or refused. Each change is announced once per process on stderr and
    kept for :func:`notices`. Raises :class:`NativeKernelError` when nothing safe is left.
    """
    types = sorted(set(text_types))
    wanted = [text_path(t, True) for t in types]
    if vision_backend is not None:
        wanted += [vision_path(b) for b in VISION_NEEDS[vision_backend]]
    found = outcomes(wanted)
    crashed = {p: o for p, o in found.items() if not o.safe}
    text_crashed = {p: o for p, o in crashed.items() if p.startswith("text:")}
    notices: list[str] = []
    if text_crashed:
        plain = outcomes([text_path(t, False) for t in types])
        still = {p: o for p, o in plain.items() if not o.safe}
        if still:
            raise NativeKernelError(
                f"llama.cpp's CPU kernels crash on this machine for {what}: {_list(text_crashed)}; "
                f"without the extra buffer types too: {_list(still)}. {rebuild_advice()} {kept_advice()}")
        notices.append(
            f"llama.cpp's extra buffer types (AMX/repacked kernels) crashed on this machine "
            f"({_list(text_crashed)}): loading without them (use_extra_bufts=False, 0-9 % slower "
            f"prompts). {rebuild_advice()}")
    backend = vision_backend
    vision_crashed = {p: o for p, o in crashed.items() if p.startswith("vision:")}
    if vision_backend is not None and vision_crashed:
        if not vision_auto:
            raise NativeKernelError(
                f"the {vision_backend} vision encoder crashes on this machine ({_list(vision_crashed)}). "
                f"Use vision_backend='auto' to fall back to one that works. {rebuild_advice()} {kept_advice()}")
        backend = _first_safe(VISION_FALLBACKS[vision_backend])
        if backend is None:
            raise NativeKernelError(
                f"no vision encoder runs on this machine ({_list(vision_crashed)}). {rebuild_advice()} {kept_advice()}")
        notices.append(f"the {vision_backend} vision encoder crashed on this machine ({_list(vision_crashed)}): "
                       f"using {backend} instead. {rebuild_advice()}")
    if text_crashed:
        announce(notices[0], key="extra buffer types")
    if backend != vision_backend:
        announce(notices[-1], key=f"vision {vision_backend}")
    return Decision(extra_bufts=not text_crashed, vision_backend=backend, notices=tuple(notices))


def crashing_extra_bufts(text_types: Iterable[str]) -> str:
    """Which of ``text_types`` crash with llama.cpp's extra buffer types here ('' if none)."""
    found = outcomes([text_path(t, True) for t in sorted(set(text_types))])
    return _list({p: o for p, o in found.items() if not o.safe})


def vision_safe(backend: str) -> bool:
    """Whether ``backend``'s kernels run on this machine (checked in a child if not known)."""
    paths = [vision_path(b) for b in VISION_NEEDS[backend]]
    return all(o.safe for o in outcomes(paths).values())


def _first_safe(backends: Iterable[str]) -> str | None:
    return next((b for b in backends if vision_safe(b)), None)


def _list(found: dict[str, Outcome]) -> str:
    return "; ".join(f"{p} {o.detail or o.status}" for p, o in sorted(found.items()))


def announce(notice: str, *, key: str | None = None) -> None:
    """Print ``notice`` on stderr once per process and ``key`` (default: the notice itself; the
    same fallback for another file's types is not said twice), and keep it for :func:`notices`."""
    with _lock:
        if (key or notice) in _announced:
            return
        _announced.add(key or notice)
        _notices.append(notice)
    print(f"gguf_mcv: {notice}", file=sys.stderr, flush=True)


def notices() -> tuple[str, ...]:
    """The fallbacks this process announced (for ``plan``, ``selftest`` and ``/health``)."""
    with _lock:
        return tuple(_notices)


def rebuild_advice() -> str:
    """The rebuild of llama-cpp-python that leaves out the kernels that crash (AMX)."""
    from ..hardware import cpu_flags

    flags = cpu_flags()
    wanted = [("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"), ("avx512f", "GGML_AVX512"),
              ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16")]
    args = " ".join(["-DGGML_NATIVE=OFF", *(f"-D{name}=ON" for flag, name in wanted if flag in flags)])
    return (f'Rebuilding removes the need: CMAKE_ARGS="{args}" pip install --force-reinstall --no-cache-dir '
            "--no-deps llama-cpp-python")


def kept_advice() -> str:
    """Where this machine's verdict is kept, and how to have it checked again."""
    return (f"This verdict is kept in {verdict_path(fingerprint())}; delete that file to check again "
            f"(a hang is checked again by itself under a longer limit, up to {HANG_RETRY_CAP_S:g} s).")


def weight_types(model_path: str | os.PathLike) -> set[str]:
    """The ggml type names of a GGUF file's matrices (what llama.cpp's matrix kernels see)."""
    from gguf import GGMLQuantizationType

    from ..models.headers import read_tensors

    return {GGMLQuantizationType(t.ggml_type).name for t in read_tensors(model_path) if len(t.shape) >= 2}


# --- the child ----------------------------------------------------------------------------


def inject_fault(name: str) -> None:
    """In a child process: die (or hang) as ``$GGUF_MCV_NATIVE_FAULT`` says for ``name``, as a
    kernel that faults there would (tests only; nothing happens when the variable is unset)."""
    faults = dict(item.split("=", 1) for item in os.environ.get(ENV_FAULT, "").split(",") if "=" in item)
    fault = faults.get(name)
    if fault == "hang":
        while True:
            time.sleep(3600)
    elif fault and fault.startswith("sleep"):  # a slow path: "sleep2.5" takes 2.5 s, then runs
        time.sleep(float(fault.removeprefix("sleep")))
    elif fault:
        signal.signal(getattr(signal, fault), signal.SIG_DFL)
        os.kill(os.getpid(), getattr(signal, fault))


def _child(workdir: Path, paths: list[str]) -> int:
    for path in paths:
        _say(f"start {path}")
        inject_fault(path)
        try:
            _run(path, workdir)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
            _say(f"error {path} {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        else:
            _say(f"ok {path}")
    return 0


def _say(line: str) -> None:
    sys.stdout.write(f"{_PROTOCOL} {line}\n")
    sys.stdout.flush()


def _run(path: str, workdir: Path) -> None:
    kind, _, rest = path.partition(":")
    if kind == "text":
        ggml_type, _, mode = rest.partition(":")
        _run_text(workdir, ggml_type, extra_bufts=mode == "extra")
    elif kind == "vision" and rest == "llama.cpp":
        _run_libmtmd(workdir)
    elif kind == "vision" and rest in ("onnx-fp32", "onnx-int8"):
        _run_onnx(workdir, rest.removeprefix("onnx-"))
    else:
        raise ValueError(f"unknown path {path!r}")


def _spec() -> Any:
    from ..testing.synthetic import TINY

    return TINY


def _run_text(workdir: Path, ggml_type: str, *, extra_bufts: bool) -> None:
    from ..testing.synthetic import write_text_model
    from .llama_load import open_llama

    path = workdir / f"text-{ggml_type}.gguf"
    if not path.exists():
        write_text_model(path, _spec(), weight_type=None if ggml_type == "F16" else ggml_type)
    llama = open_llama(path, extra_bufts=extra_bufts, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2,
                       n_threads_batch=2, verbose=False)
    try:
        tokens = llama.tokenize(b"a picture of a cat on a red chair " * 3)
        llama.eval(tokens)  # a batch: the matrix-matrix kernels
        for _ in range(2):  # single tokens: the matrix-vector kernels
            llama.eval([tokens[-1]])
    finally:
        llama.close()


def _vision_files(workdir: Path) -> tuple[Path, Path]:
    from ..testing.synthetic import write_mmproj, write_text_model

    text, mmproj = workdir / "vision-text.gguf", workdir / "vision-mmproj.gguf"
    if not text.exists():
        write_text_model(text, _spec())
    if not mmproj.exists():
        write_mmproj(mmproj, _spec())
    return text, mmproj


def _run_libmtmd(workdir: Path) -> None:
    import numpy as np

    from ..vision.media import Image
    from .engine import Engine
    from .llama_load import open_llama

    text, mmproj = _vision_files(workdir)
    llama = open_llama(text, extra_bufts=False, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2,
                       n_threads_batch=2, verbose=False)
    try:
        engine = Engine(llama, mmproj, n_threads=2, slice_size=_spec().image_size)
        try:
            image = Image(np.random.default_rng(0).integers(0, 256, (112, 112, 3), dtype=np.uint8), "check")
            with engine.tokenize(f"{engine.marker}\n", [image]) as prompt:
                engine.prefill(prompt)
        finally:
            engine.close()
    finally:
        llama.close()


def _run_onnx(workdir: Path, variant: str) -> None:
    import numpy as np
    import onnx

    from ..vision.onnx_graph import Weights, build_model
    from ..vision.onnx_vision import OnnxEncoder

    _, mmproj = _vision_files(workdir)
    weights = Weights(mmproj)
    model, _ = build_model(weights, fold=True, int8=variant == "int8")
    path = workdir / f"vision-{variant}.onnx"
    onnx.save_model(model, str(path))
    encoder = OnnxEncoder(path, weights.projector(), n_threads=2)
    encoder.encode_pixels(np.random.default_rng(0).standard_normal((3, 112, 112), np.float32))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m gguf_mcv.runtime.native_check WORKDIR PATH...", file=sys.stderr)
        return 2
    return _child(Path(args[0]), args[1:])


if __name__ == "__main__":
    sys.exit(main())
