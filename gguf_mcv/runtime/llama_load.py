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

from ..options import LoadOptions

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


def llama_kwargs(options: LoadOptions) -> dict[str, Any]:
    """``llama_cpp.Llama``'s keywords for resolved load ``options`` (threads and GPU layers given;
    ``parallel`` slots share one context of ``n_ctx`` positions each). Flash attention is on when
    asked for, and for a quantized KV cache, which needs it."""
    import llama_cpp  # lazy: loads llama.cpp's native library

    if options.n_threads is None or not isinstance(options.n_gpu_layers, int) or not isinstance(options.parallel, int):
        raise TypeError(f"load options not resolved (threads, GPU layers, parallel): {options}")
    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
               "q4_0": llama_cpp.GGML_TYPE_Q4_0}[options.kv_cache_type]
    return dict(n_ctx=options.n_ctx * options.parallel, n_batch=options.n_batch, n_ubatch=options.n_batch,
                n_threads=options.n_threads, n_threads_batch=options.n_threads_batch or options.n_threads,
                n_gpu_layers=options.n_gpu_layers,
                flash_attn=bool(options.flash_attn) or options.kv_cache_type != "f16",
                type_k=kv_type, type_v=kv_type)


def uses_extra_bufts(llama: Any) -> bool:
    """Whether a ``Llama`` was loaded with llama.cpp's extra buffer types."""
    params = getattr(llama, "model_params", None)
    return bool(getattr(params, "use_extra_bufts", True))
