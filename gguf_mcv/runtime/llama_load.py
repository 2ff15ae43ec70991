"""Make a ``llama_cpp.Llama`` with or without llama.cpp's extra buffer types.

``llama_model_params.use_extra_bufts`` (weight repacking, and the AMX kernels on Intel
CPUs that report AMX) has no keyword in ``llama_cpp.Llama``: its ``__init__`` takes the
defaults from ``llama_cpp.llama_model_default_params()`` and changes a few fields. While
:func:`open_llama` builds a model without them, that function returns defaults with the
field off; a lock keeps two such loads from overlapping (``Llama`` objects built by other
code at the same moment would see the same defaults).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()


@contextlib.contextmanager
def _default_params(**fields: Any) -> Iterator[None]:
    from llama_cpp import llama_cpp as bindings  # lazy: loads llama.cpp's native library

    original = bindings.llama_model_default_params

    def patched() -> Any:
        params = original()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    with _lock:
        bindings.llama_model_default_params = patched
        try:
            yield
        finally:
            bindings.llama_model_default_params = original


def open_llama(model_path: str | os.PathLike, *, extra_bufts: bool = True, **llama_kwargs: Any) -> Any:
    """``llama_cpp.Llama(model_path, **llama_kwargs)``, with llama.cpp's extra buffer types
    only when ``extra_bufts``."""
    import llama_cpp  # lazy: loads llama.cpp's native library

    if extra_bufts:
        return llama_cpp.Llama(model_path=os.fspath(model_path), **llama_kwargs)
    with _default_params(use_extra_bufts=False):
        return llama_cpp.Llama(model_path=os.fspath(model_path), **llama_kwargs)


def uses_extra_bufts(llama: Any) -> bool:
    """Whether a ``Llama`` was loaded with llama.cpp's extra buffer types."""
    params = getattr(llama, "model_params", None)
    return bool(getattr(params, "use_extra_bufts", True))
