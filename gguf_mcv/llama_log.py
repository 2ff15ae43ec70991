"""llama.cpp's native logging, routed through Python.

llama.cpp, ggml, libmtmd and clip each print to stderr by default. Once :func:`install` has
run (the one place the package sets llama.cpp's log hooks), their messages go to the
``gguf_mcv.llama_log`` logger, reach stderr only while something verbose is open
(:func:`verbose_acquire`, :func:`shown`), and the most recent warnings and errors are kept so a
failure can quote what llama.cpp said.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import sys
import threading
from typing import Iterator

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())  # silent unless the application configures logging

# ggml.h: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (llama-cpp-python's own
# table predates this order, which is one reason we install our own handler)
_GGML_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING,
                4: logging.ERROR}
_recent: collections.deque[str] = collections.deque(maxlen=40)
_state = {"verbose": 0, "installed": False, "last_level": logging.INFO}
_lock = threading.Lock()
_callback = None  # the ctypes callback must stay referenced while installed


def _on_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # level 5 (GGML_LOG_LEVEL_CONT) continues the previous message at its level
    py_level = _state["last_level"] if level == 5 else _GGML_LEVELS.get(level, logging.INFO)
    _state["last_level"] = py_level
    message = text.decode("utf-8", errors="replace") if text else ""
    if py_level >= logging.WARNING and message.strip():
        _recent.append(message.strip())
    if _state["verbose"]:
        sys.stderr.write(message)
    elif logger.isEnabledFor(py_level) and message.strip():
        logger.log(py_level, message.rstrip())


def install() -> None:
    """Route llama.cpp's and libmtmd's logs through this module (idempotent)."""
    global _callback
    with _lock:
        if _state["installed"]:
            return
        import llama_cpp
        import llama_cpp.llama  # noqa: F401  (importing it installs llama-cpp-python's own handler)
        from llama_cpp import mtmd_cpp

        _callback = llama_cpp.llama_log_callback(_on_log)
        llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
        mtmd_cpp.mtmd_log_set(_callback, ctypes.c_void_p(0))
        mtmd_cpp.mtmd_helper_log_set(_callback, ctypes.c_void_p(0))
        _state["installed"] = True


def verbose_acquire() -> None:
    """Print native logs to stderr until the matching :func:`verbose_release`."""
    with _lock:
        _state["verbose"] += 1


def verbose_release() -> None:
    """Undo one :func:`verbose_acquire`."""
    with _lock:
        _state["verbose"] = max(0, _state["verbose"] - 1)


@contextlib.contextmanager
def shown(verbose: bool) -> Iterator[None]:
    """For the block: llama.cpp's logs routed here (:func:`install`), printed to stderr if ``verbose``."""
    install()
    if not verbose:
        yield
        return
    verbose_acquire()
    try:
        yield
    finally:
        verbose_release()


def clear_recent() -> None:
    """Forget the remembered warnings and errors."""
    _recent.clear()


def recent_errors(limit: int = 3) -> str:
    """The last few warnings/errors llama.cpp logged, joined for an error message."""
    return " | ".join(list(_recent)[-limit:])
