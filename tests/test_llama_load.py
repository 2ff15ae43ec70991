"""runtime/llama_load: the load options, typed down to llama_cpp.Llama's keywords."""

from __future__ import annotations

import pytest

from gguf_mcv.options import LoadOptions
from gguf_mcv.runtime.llama_load import llama_kwargs

llama_cpp = pytest.importorskip("llama_cpp")


def test_resolved_options_become_llamas_keywords() -> None:
    kw = llama_kwargs(LoadOptions(n_ctx=1024, n_threads=2, n_gpu_layers=0, parallel=3, kv_cache_type="q8_0"))
    assert (kw["n_ctx"], kw["n_threads"], kw["n_threads_batch"], kw["n_gpu_layers"]) == (3 * 1024, 2, 2, 0)
    assert kw["flash_attn"] is True and kw["type_k"] == kw["type_v"] == llama_cpp.GGML_TYPE_Q8_0  # q8_0 needs it
    plain = llama_kwargs(LoadOptions(n_threads=4, n_threads_batch=1, n_gpu_layers=-1))
    assert (plain["flash_attn"], plain["n_threads_batch"], plain["n_gpu_layers"]) == (False, 1, -1)


@pytest.mark.parametrize("unresolved", [{"n_threads": None}, {"n_gpu_layers": "auto"}, {"parallel": "auto"}])
def test_options_left_to_the_plan_are_not_passed_on(unresolved) -> None:
    with pytest.raises(TypeError, match="not resolved"):
        llama_kwargs(LoadOptions(**{"n_threads": 2, "n_gpu_layers": 0, **unresolved}))
