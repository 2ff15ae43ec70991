"""Token sampling (gguf_mcv/runtime/sampling.py): the chains' shortcuts sample exactly as the
full vocabulary would. (Grammars and the UTF-8 mask: tests/test_structured.py, tests/test_utf8mask.py.)"""

from __future__ import annotations

import pytest

import gguf_mcv
from gguf_mcv.options import Sampling
from gguf_mcv.runtime.sampling import PENALTY_LAST_N
from gguf_mcv.vision.embed_cache import EmbeddingCache


@pytest.fixture
def model(tiny):
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096,
                       embed_cache=EmbeddingCache()) as m:
        yield m


def test_penalty_shortcut_samples_exactly_like_the_full_vocabulary(model) -> None:
    import llama_cpp as lc

    engine, llama = model.engine, model.engine.llama

    def full_vocabulary_chain(s: Sampling):
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        add = lambda smpl: lc.llama_sampler_chain_add(chain, smpl)  # noqa: E731
        add(lc.llama_sampler_init_penalties(llama.n_vocab(), PENALTY_LAST_N, s.repeat_penalty, 0, 0))
        if s.temperature <= 0:
            add(lc.llama_sampler_init_greedy())
            return chain
        add(lc.llama_sampler_init_top_k(s.top_k))
        add(lc.llama_sampler_init_top_p(s.top_p, 1))
        add(lc.llama_sampler_init_temp(s.temperature))
        add(lc.llama_sampler_init_dist(s.seed))
        return chain

    for sampling in (Sampling(temperature=0, repeat_penalty=1.5),
                     Sampling(temperature=1.0, top_k=20, top_p=0.95, repeat_penalty=1.5, seed=7)):
        model.ask("Start.", max_tokens=1)  # a fresh prompt in the context
        fast, slow = engine.sampler.chain(sampling), full_vocabulary_chain(sampling)
        try:
            for _ in range(40):
                a = lc.llama_sampler_sample(fast, llama.ctx, -1)
                b = lc.llama_sampler_sample(slow, llama.ctx, -1)
                assert a == b
                engine._eval_tokens([a])
        finally:
            lc.llama_sampler_free(fast)
            lc.llama_sampler_free(slow)
