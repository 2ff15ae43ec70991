"""Parallel slots on the tiny model: batched answers equal lone ones, prefixes are reused and
shared, cancellation frees a slot within one slice, and hostile loads neither hang nor leak."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import gguf_mcv
from gguf_mcv.errors import AnswerCancelled, ConfigError, ContextOverflowError, EngineError, ModelClosedError
from gguf_mcv.options import GenerationOptions, Sampling
from gguf_mcv.runtime.slots import Job
from gguf_mcv.runtime.tokenizer import Prompt
from gguf_mcv.vision.embed_cache import EmbeddingCache

N_CTX = 1024
#: pure greedy: with a repeat penalty, near-equal penalised tokens make rare ~1e-2 logit
#: differences of batched kernels flip picks (112 of 120 answers equal on Q8_0, measured)
GREEDY = dict(temperature=0, repeat_penalty=1.0)
QUESTIONS = [f"Question {i}: what comes after {i * 7}?" for i in range(6)]


def picture(seed: int, size: tuple[int, int]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def load(tiny, **kw):
    # Q8_0: llama.cpp's batched kernels for K-quants (Q4_K, Q5_K: repacked for the CPU) give
    # logits up to ~2e-2 off its one-token kernels as soon as a batch has 4 rows (measured; see
    # README "Parallel slots"), which flips greedy picks between near-equal tokens of a random
    # model. Q8_0's agree (exactly, but for rare ~1e-2 steps in a busy batch).
    kw.setdefault("embed_cache", EmbeddingCache())
    return gguf_mcv.load(model_path=tiny.quants["Q8_0"], mmproj_path=tiny.mmproj, n_ctx=N_CTX,
                         n_threads=2, **kw)


@pytest.fixture(scope="module")
def alone(tiny):
    with load(tiny) as model:
        yield model


@pytest.fixture(scope="module")
def par(tiny):
    with load(tiny, parallel=4) as model:
        yield model


def together(fn, args, workers):
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, args, timeout=60))


def test_concurrent_greedy_answers_equal_lone_ones(alone, par) -> None:
    lone = [str(alone.ask(q, max_tokens=24, **GREEDY)) for q in QUESTIONS]
    steps = par.scheduler.steps
    replies = together(lambda q: par.ask(q, max_tokens=24, **GREEDY), QUESTIONS, len(QUESTIONS))
    assert [str(r) for r in replies] == lone
    assert all(r.usage.completion_tokens == 24 for r in replies)
    # decoded together: far fewer batches than tokens (6 answers x 24 tokens, 4 slots)
    assert par.scheduler.steps - steps < 6 * 24 * 0.6
    assert par.scheduler.active == 0


def test_concurrent_image_answers_equal_lone_ones(alone, par) -> None:
    # greedy answers of random weights sit on near ties that the batched kernels' ~1e-2 logit steps can
    # flip (see load() above): which pictures avoid one depends on the encoder's exact embeddings
    # (pictures 3-5 tie at the third answer with the fp32 resampler; 0-2 did with the int8 one)
    images = [picture(i, (700, 500)) for i in range(3)]
    lone = [str(alone.ask("What is this?", im, max_tokens=12, **GREEDY)) for im in images]
    replies = together(lambda im: par.ask("What is this?", im, max_tokens=12, **GREEDY), images, 3)
    assert [str(r) for r in replies] == lone
    assert all(r.timings.slices_encoded + r.timings.slices_from_cache > 1 for r in replies)


def test_schema_answers_in_slots_equal_lone_ones(alone, par) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    lone = [str(alone.ask(q, schema=schema, max_tokens=40, **GREEDY)) for q in QUESTIONS[:3]]
    replies = together(lambda q: par.ask(q, schema=schema, max_tokens=40, **GREEDY), QUESTIONS[:3], 3)
    assert [str(r) for r in replies] == lone


def test_follow_up_reuses_its_slot_and_its_image(par) -> None:
    chat = par.chat()
    first = chat.send("Describe it.", picture(9, (900, 600)), max_tokens=6, **GREEDY)
    calls = par.engine.encoder_calls
    second = chat.send("And the colours?", max_tokens=6, **GREEDY)
    assert par.engine.encoder_calls == calls
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    assert second.timings.slices_encoded == second.timings.slices_from_cache == 0


def test_a_new_conversation_takes_an_empty_slot_not_one_sharing_only_the_template(tiny) -> None:
    # every prompt starts with the chat template's tokens: a slot holding another conversation
    # shares those, and taking it for a new one overwrote that conversation while slots were empty
    with load(tiny, parallel=4) as model:
        chat = model.chat()
        first = chat.send("Describe it.", picture(11, (900, 600)), max_tokens=6, **GREEDY)
        model.chat().send("What is this?", picture(12, (900, 600)), max_tokens=6, **GREEDY)
        second = chat.send("And the colours?", max_tokens=6, **GREEDY)
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    assert second.timings.slices_encoded == second.timings.slices_from_cache == 0


def test_a_busy_slots_prefix_is_copied_not_evaluated(tiny) -> None:
    system = "You are a careful assistant. " * 30
    with load(tiny, parallel=2) as model:
        held = model.chat(system=system).send("First?", stream=True, max_tokens=400, **GREEDY)
        next(held)  # the slot holding the system prompt is busy answering
        copied = model.scheduler.copied_positions
        reply = model.chat(system=system).send("Second?", max_tokens=4, **GREEDY)
        held.close()
    assert model.scheduler.copied_positions - copied >= 200
    assert reply.usage.cached_tokens >= 200


def test_one_thread_may_stream_several_answers(par, alone) -> None:
    streams = [par.ask(q, stream=True, max_tokens=10, **GREEDY) for q in QUESTIONS[:5]]
    pieces = ["" for _ in streams]
    for _ in range(3):  # interleaved reading: no ModelBusyError, no deadlock with 5 > 4 slots
        for i, s in enumerate(streams):
            pieces[i] += next(s, "")
    texts = [p + "".join(s) for p, s in zip(pieces, streams)]
    assert texts == [str(alone.ask(q, max_tokens=10, **GREEDY)) for q in QUESTIONS[:5]]


def slow_encoder(model, monkeypatch, seconds: float = 0.05) -> None:
    encode = model.engine._encode

    def slow(chunk, unit, source=None):
        time.sleep(seconds)
        return encode(chunk, unit, source)

    monkeypatch.setattr(model.engine, "_encode", slow)


@pytest.mark.parametrize("parallel", [1, 3])
def test_close_during_a_multi_slice_encode_stops_within_one_slice(tiny, monkeypatch, parallel) -> None:
    with load(tiny, parallel=parallel) as model:
        slow_encoder(model, monkeypatch)
        at_close: list[int] = []
        holder: list[gguf_mcv.Stream] = []

        def on_progress(p) -> None:
            if p.done == 1 and not at_close:
                at_close.append(model.engine.encoder_calls)
                threading.Thread(target=holder[0].close).start()  # a hang-up, from another thread

        stream = model.ask("What is it?", picture(11, (1344, 1344)), detail="high", stream=True,
                           max_tokens=4, on_progress=on_progress)
        holder.append(stream)
        with pytest.raises(AnswerCancelled):
            stream.result()
        time.sleep(0.2)  # anything still running would encode another slice by now
        assert model.engine.encoder_calls - at_close[0] <= 1
        assert model.engine.encoder_calls < 10
        # the slot (or the model) is free again: a new question runs
        assert model.ask("Still there?", max_tokens=2).usage.completion_tokens == 2
        if model.scheduler is not None:
            assert model.scheduler.active == 0


def test_running_answers_keep_decoding_while_a_big_image_is_encoded(par, monkeypatch) -> None:
    """A slice takes seconds on a CPU (0.3 s here) and no answer advances during it: the running
    answers must get their share of time between slices, not one token per slice (a 16-client
    soak on the bench preset: a 16-token text answer took minutes behind photos' slices)."""
    slow_encoder(par, monkeypatch, 0.3)
    text = par.ask(QUESTIONS[0], max_tokens=32, stream=True, **GREEDY)
    first = next(text)  # answering now
    before = par.engine.encoder_calls
    with ThreadPoolExecutor(1) as pool:
        image = pool.submit(par.ask, "What is it?", picture(31, (1344, 1344)), detail="high", max_tokens=2)
        while par.engine.encoder_calls == before:  # the image's first slice is under way
            time.sleep(0.01)
        rest = "".join(text)
        slices_meanwhile = par.engine.encoder_calls - before
        assert image.result(timeout=60).usage.completion_tokens == 2
    assert text.reply.usage.completion_tokens >= 24, "the answer ended early: nothing was measured"
    assert first + rest == str(text.reply)
    # before: one token per slice, so the answer outlived all 10 slices; now a slice or two
    assert slices_meanwhile <= 5, slices_meanwhile


def test_hang_ups_mid_prefill_and_mid_decode_leave_others_intact(par, alone, monkeypatch) -> None:
    lone = [str(alone.ask(q, max_tokens=16, **GREEDY)) for q in QUESTIONS[:3]]
    slow_encoder(par, monkeypatch, 0.02)
    holder: list[gguf_mcv.Stream] = []

    def hang_up(p) -> None:
        if p.done == 2:
            holder[0].cancel()

    dropped_prefill = par.ask("Look.", picture(12, (1344, 1344)), detail="high", stream=True,
                              max_tokens=8, on_progress=hang_up)
    holder.append(dropped_prefill)
    dropped_decode = par.ask("Talk a lot.", stream=True, max_tokens=300, **GREEDY)
    next(dropped_decode)

    def ask(q):
        return str(par.ask(q, max_tokens=16, **GREEDY))

    with ThreadPoolExecutor(4) as pool:
        prefilling = pool.submit(dropped_prefill.result)
        futures = [pool.submit(ask, q) for q in QUESTIONS[:3]]
        dropped_decode.close()
        assert [f.result(timeout=60) for f in futures] == lone
        with pytest.raises(AnswerCancelled):
            prefilling.result(timeout=60)
    deadline = time.time() + 5
    while par.scheduler.active and time.time() < deadline:
        time.sleep(0.01)
    assert par.scheduler.active == 0


def test_more_clients_than_slots_queue_without_deadlock(tiny) -> None:
    with load(tiny, parallel=2) as model:
        replies = together(lambda i: model.ask(f"Client {i} says hello.", max_tokens=8), range(12), 12)
        assert all(r.usage.completion_tokens <= 8 for r in replies)
        assert model.scheduler.active == 0 and model.scheduler.queued == 0


def test_an_overflowing_slot_does_not_hurt_the_others(par, alone) -> None:
    long_question = "tell me " * 2000
    lone = str(alone.ask(QUESTIONS[0], max_tokens=16, **GREEDY))
    with ThreadPoolExecutor(3) as pool:
        too_long = pool.submit(par.ask, long_question, max_tokens=4)
        # a prompt that fits, with an answer that fills its slot's context to the end
        near = pool.submit(par.ask, "go " * 300, max_tokens=N_CTX, **GREEDY)
        normal = pool.submit(par.ask, QUESTIONS[0], max_tokens=16, **GREEDY)
        with pytest.raises(ContextOverflowError):
            too_long.result(timeout=60)
        filled = near.result(timeout=120)
        assert str(normal.result(timeout=60)) == lone
    # the last token is sampled but never evaluated, as on a model without slots
    assert filled.usage.prompt_tokens + filled.usage.completion_tokens <= N_CTX + 1
    assert max(len(units) for units in par.scheduler.slot_units()) <= N_CTX
    assert filled.finish_reason in ("length", "stop")


def test_close_while_slots_run(tiny) -> None:
    model = load(tiny, parallel=3)
    streams = [model.ask(q, stream=True, max_tokens=20, **GREEDY) for q in QUESTIONS[:3]]
    for s in streams:
        next(s)
    model.close()
    with pytest.raises(ModelClosedError):
        model.ask("New question?")
    for s in streams:  # the running answers end normally; then the memory is freed
        assert s.result().usage.completion_tokens >= 1
    assert not model.scheduler._thread.is_alive()


def test_a_job_for_a_closed_scheduler_is_refused(tiny) -> None:
    model = load(tiny, parallel=2)
    scheduler = model.scheduler
    model.close()
    with pytest.raises(ModelClosedError):
        scheduler.submit(Job(Prompt(units=[1, 2, 3], image_tokens=0), GenerationOptions(Sampling(), 4)))


@pytest.mark.parametrize("bad", [0, -1, 65, "many", 2.5, True, None])
def test_parallel_must_be_a_slot_count_or_auto(tiny, bad) -> None:
    with pytest.raises(ConfigError, match="parallel"):
        load(tiny, parallel=bad)


def test_auto_parallel_follows_the_budget(tiny) -> None:
    with load(tiny, parallel="auto", ram_budget="64GB") as big:
        assert big.info.parallel == 8
        assert big.scheduler is not None
    from dataclasses import replace

    from gguf_mcv.resolver import plan_local

    cpu = replace(gguf_mcv.probe(), gpu_offload=False)
    one = plan_local(tiny.quants["Q8_0"], tiny.mmproj, hardware=cpu, ram_budget=10**12, n_ctx=N_CTX,
                     kv_cache_type="f16").predicted_bytes  # a budget that holds one slot and no more
    with load(tiny, parallel="auto", ram_budget=one) as small:
        assert small.info.parallel == 1
        assert small.scheduler is None


def test_a_failing_step_loop_fails_answers_instead_of_hanging(tiny, monkeypatch) -> None:
    with load(tiny, parallel=2) as model:
        def broken() -> None:
            raise RuntimeError("injected fault")

        monkeypatch.setattr(model.scheduler, "_step", broken)
        with pytest.raises(EngineError, match="injected fault"):
            model.ask("Hello?", max_tokens=2)
        with pytest.raises(EngineError, match="stopped"):  # later questions: an error, not a hang
            model.ask("Anyone?", max_tokens=2)


@pytest.mark.slow  # builds a MiniCPM-V 4.6-shaped model (~5 s)
def test_a_hybrid_model_answers_in_slots_and_rewinds_to_its_checkpoints(tmp_path_factory) -> None:
    from gguf_mcv.testing.synthetic import GENERATIONS, build

    files = build(tmp_path_factory.mktemp("v46"), GENERATIONS["4.6"][0], quants=("Q8_0",))
    kw = dict(model_path=files.quants["Q8_0"], mmproj_path=files.mmproj, n_ctx=N_CTX, n_threads=2)

    def conversation(model):
        chat = model.chat()
        first = chat.send("Hello there. " * 30, max_tokens=6, **GREEDY)
        return first, chat.send("And then?", max_tokens=6, **GREEDY)

    with gguf_mcv.load(**kw) as alone_46:
        lone = [str(alone_46.ask(q, max_tokens=12, **GREEDY)) for q in QUESTIONS[:4]]
        serial = conversation(alone_46)
    with gguf_mcv.load(**kw, parallel=2) as par_46:
        assert [str(r) for r in together(lambda q: par_46.ask(q, max_tokens=12, **GREEDY), QUESTIONS[:4], 4)] == lone
        slots = conversation(par_46)
        assert par_46.scheduler.restored_checkpoints >= 1  # its recurrent state went back, not to 0
    assert [str(r) for r in slots] == [str(r) for r in serial]
    assert slots[1].usage.cached_tokens == serial[1].usage.cached_tokens > 100


def test_a_saved_chat_of_a_parallel_model_keeps_its_turns_not_another_slots_cache(par, tmp_path) -> None:
    chat = par.chat()
    first = chat.send("Remember this.", max_tokens=4, **GREEDY)
    par.ask("Another client's question.", max_tokens=4)  # sequence 0 may hold anything
    assert chat.save(tmp_path / "chat.json") is False  # the KV state of a slot is not saved
    again = par.load_chat(tmp_path / "chat.json")
    assert [t["content"] for t in again.history] == [t["content"] for t in chat.history]
    assert str(again.send("And now?", max_tokens=4, **GREEDY)) == str(chat.send("And now?", max_tokens=4, **GREEDY))
    assert first.usage.completion_tokens == 4


def long_talk(model, *, api: bool, context_shift: bool = True) -> list[gguf_mcv.Reply]:
    """12 turns of ~140 positions in a 1024-position slot: from the 7th on, the oldest are dropped
    (by ``Chat``, or by ``chat_completion(truncate=True)`` as the server's ``--truncate`` does)."""
    questions = [f"Turn {i}: " + "say something about the weather " * 12 for i in range(12)]
    if not api:
        chat = model.chat(system="Answer in a few words.", context_shift=context_shift)
        return [chat.send(q, max_tokens=8, **GREEDY) for q in questions]
    messages: list[dict] = [{"role": "system", "content": "Answer in a few words."}]
    replies = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        replies.append(model.chat_completion(messages, max_tokens=8, truncate=True, **GREEDY))
        messages.append({"role": "assistant", "content": str(replies[-1])})
    return replies


def evaluated(reply: gguf_mcv.Reply) -> int:
    return reply.usage.prompt_tokens - reply.usage.cached_tokens


@pytest.mark.parametrize("api", [False, True], ids=["chat", "chat_completion"])
def test_dropped_turns_are_shifted_out_of_a_slot_as_out_of_one_sequence(tiny, alone, api) -> None:
    lone_shifted = alone.engine.shifted_positions
    lone = long_talk(alone, api=api)
    # a fresh context: cells laid out as on one sequence (a busy unified cache may order them
    # otherwise, and then sums come out ~1e-2 off, enough to flip a random model's greedy picks)
    with load(tiny, parallel=2) as par:
        slots = long_talk(par, api=api)
        slot_shifted = par.scheduler.shifted_positions
    assert [str(r) for r in slots] == [str(r) for r in lone]
    assert [r.dropped_turns for r in slots] == [r.dropped_turns for r in lone]
    drops = [r for r in slots if r.dropped_turns]
    assert len(drops) >= 4
    new_turn = max(evaluated(r) for r in slots[1:] if not r.dropped_turns)  # one question and its markup
    assert all(evaluated(r) <= new_turn + 2 for r in drops)  # the kept turns were not evaluated again
    assert [evaluated(r) for r in slots[1:]] == [evaluated(r) for r in lone[1:]]  # (the first: what each held)
    assert slot_shifted == alone.engine.shifted_positions - lone_shifted > 0


def test_without_context_shift_a_slot_evaluates_the_kept_turns_again(par) -> None:
    shifted = par.scheduler.shifted_positions
    replies = long_talk(par, api=False, context_shift=False)
    assert par.scheduler.shifted_positions == shifted
    assert all(evaluated(r) > 400 for r in replies if r.dropped_turns)  # everything after the system prompt
