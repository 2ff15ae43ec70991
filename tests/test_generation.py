"""Answers and streams against a model's lifetime and threads."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import gguf_mcv
from gguf_mcv import ModelBusyError, ModelClosedError, Progress


def _load(tiny, **kw) -> gguf_mcv.Model:
    return gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=1024, **kw)


def test_a_stream_read_after_its_model_closed_raises_instead_of_crashing(tiny) -> None:
    """The natural pattern: the stream is read after the with block. It used to SIGSEGV."""
    code = (
        "import sys, gguf_mcv\n"
        f"with gguf_mcv.load(model_path={str(tiny.quants['Q4_K_M'])!r}, mmproj_path={str(tiny.mmproj)!r},"
        " n_ctx=1024) as m:\n"
        "    s = m.ask('hi', stream=True, max_tokens=4)\n"
        "try:\n"
        "    list(s)\n"
        "except gguf_mcv.ModelClosedError as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:")


def test_a_stream_being_read_keeps_its_model_alive_through_close(tiny) -> None:
    model = _load(tiny)
    stream = model.ask("hi", stream=True, max_tokens=6, temperature=0)
    first = next(stream)
    model.close()  # the answer in progress holds the model; memory is freed when it ends
    rest = list(stream)
    assert stream.reply is not None and str(stream.reply) == first + "".join(rest)
    assert model.closed and model._engine.closed  # freed once the stream ended
    with pytest.raises(ModelClosedError):
        model.ask("again", max_tokens=1)


def test_pieces_pulled_from_two_threads_never_strand_the_lock(tiny_model) -> None:
    stream = tiny_model.ask("Tell me a story.", stream=True, max_tokens=16)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lambda: list(stream)) for _ in range(2)]
        pieces = [f.result(timeout=60) for f in futures]
    assert stream.reply is not None
    assert sum(len(piece) for part in pieces for piece in part) == len(stream.reply)  # none lost
    done = threading.Event()
    threading.Thread(target=lambda: (tiny_model.ask("next", max_tokens=1), done.set()), daemon=True).start()
    assert done.wait(60), "a later ask blocked: the model lock was stranded"


def test_a_stream_dropped_on_another_thread_frees_the_model(tiny_model) -> None:
    stream = tiny_model.ask("Tell me a story.", stream=True, max_tokens=16)
    next(stream)

    def drop(s: gguf_mcv.Stream) -> None:
        s.close()

    worker = threading.Thread(target=drop, args=(stream,))
    worker.start()
    worker.join(30)
    del stream
    assert tiny_model.ask("next", max_tokens=1).usage.completion_tokens >= 0


def test_two_streams_in_one_thread_do_not_share_the_kv_cache(tiny_model) -> None:
    """Item 6: the re-entrant lock let a second stream start and silently mix both answers."""
    first = tiny_model.ask("one", stream=True, max_tokens=8)
    next(first)
    with pytest.raises(ModelBusyError, match="still streaming"):
        second = tiny_model.ask("two", stream=True, max_tokens=8)
        next(second)
    chat_a, chat_b = tiny_model.chat(), tiny_model.chat()
    with pytest.raises(ModelBusyError):
        chat_b.send("two", stream=False, max_tokens=2)
    first.close()
    a = chat_a.send("one", stream=True, max_tokens=4)
    list(a)
    assert chat_b.send("two", max_tokens=2).usage.completion_tokens >= 0


def test_stop_as_a_plain_string_is_one_stop_string(tiny_model) -> None:
    """Item 7: stop="ab" was split into "a" and "b" and answers came back empty."""
    free = tiny_model.ask("Say something.", max_tokens=12, temperature=0)
    word = next((w for w in str(free).split() if len(w) > 1), None)
    if word is None:
        pytest.skip("the random model answered without a two-character word")
    cut = tiny_model.ask("Say something.", max_tokens=12, temperature=0, stop=word)
    listed = tiny_model.ask("Say something.", max_tokens=12, temperature=0, stop=[word])
    assert str(cut) == str(listed) == str(free)[: str(free).index(word)]
    chat = tiny_model.chat()
    assert str(chat.send("Say something.", max_tokens=12, temperature=0, stop=word)) == str(cut)


def test_on_progress_follows_the_encoder(tiny_model) -> None:
    seen: list[Progress] = []
    image = np.random.default_rng(7).integers(0, 256, (900, 1344, 3), dtype=np.uint8)
    reply = tiny_model.ask("what?", image, detail="high", max_tokens=1, on_progress=seen.append)
    total = reply.timings.slices_encoded + reply.timings.slices_from_cache
    assert [p.done for p in seen] == list(range(total + 1))
    assert all(p.total == total for p in seen) and seen[0].eta_s is None and seen[-1].eta_s == 0
    again: list[Progress] = []
    # another system prompt: the image is not in the KV cache's prefix, so it is fed again
    tiny_model.ask("again?", image, detail="high", system="Be brief.", max_tokens=1, on_progress=again.append)
    assert again[-1].cached == again[-1].total == total  # every slice from the embedding cache


def test_deprecated_names_still_work(tiny_model) -> None:
    with pytest.warns(DeprecationWarning):
        reply = tiny_model.ask("hi", stream=True, max_tokens=1).text()
    assert isinstance(reply, gguf_mcv.Reply)
    video = [np.zeros((64, 64, 3), np.uint8), np.full((64, 64, 3), 255, np.uint8)]
    with pytest.warns(DeprecationWarning, match="prompt first"):
        old = tiny_model.ask_video(np.stack(video), "what?", max_tokens=1)
    assert old.video is not None
