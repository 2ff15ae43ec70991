"""Model and Chat on the real llama.cpp path, with the tiny generated model."""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

import gguf_mcv
from gguf_mcv import ConfigError, ContextOverflowError, CorruptModelError, MediaError, ModelNotFoundError


def picture(seed: int, size: tuple[int, int] = (320, 240)) -> np.ndarray:
    """A random RGB picture, different for every seed (so the embedding cache cannot help)."""
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    PIL.Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def image_file(tmp_path: Path) -> Path:
    path = tmp_path / "picture.png"
    path.write_bytes(png_bytes(picture(1)))
    return path


def test_answer_for_each_image_input_kind(tiny_model, image_file: Path) -> None:
    data = image_file.read_bytes()
    inputs = {
        "str path": str(image_file),
        "Path": image_file,
        "file URL": image_file.as_uri(),
        "bytes": data,
        "data URI": "data:image/png;base64," + base64.b64encode(data).decode(),
        "PIL": PIL.Image.open(io.BytesIO(data)),
        "numpy": np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB")),
    }
    for kind, image in inputs.items():
        reply = tiny_model.ask("What is this?", image, max_tokens=4, seed=3)
        assert isinstance(reply, str), kind
        assert reply.usage.image_tokens == 64, kind
        assert reply.usage.completion_tokens >= 1, kind


def test_same_pixels_from_any_input_kind_share_the_embedding(tiny_model, image_file: Path) -> None:
    tiny_model.ask("a", image_file, max_tokens=1)
    before = tiny_model.engine.encoder_calls
    tiny_model.ask("a different question", image_file.read_bytes(), max_tokens=1)
    assert tiny_model.engine.encoder_calls == before


def test_stream_yields_pieces_that_make_the_reply(tiny_model) -> None:
    stream = tiny_model.ask("Describe it.", picture(2), stream=True, max_tokens=12, seed=5)
    assert isinstance(stream, gguf_mcv.Stream)
    pieces = list(stream)
    assert stream.reply is not None
    assert "".join(pieces) == str(stream.reply)
    assert stream.reply.usage.completion_tokens >= len(pieces) >= 1


def test_two_images_in_one_question(tiny_model) -> None:
    reply = tiny_model.ask("Compare them.", [picture(3), picture(4)], max_tokens=3)
    assert reply.usage.image_tokens == 128
    assert reply.timings.slices_encoded == 2


def test_large_image_is_sliced_and_low_detail_is_not(tiny_model) -> None:
    big = picture(6, (1344, 1344))
    high = tiny_model.ask("What?", big, max_tokens=1, detail="high")
    assert high.usage.image_tokens == 640  # overview + 3x3 slices, 64 each
    low = tiny_model.ask("What?", big, max_tokens=1, detail="low")
    assert low.usage.image_tokens == 64


def test_usage_counts_prompt_and_completion(tiny_model) -> None:
    reply = tiny_model.ask("Count.", picture(7), max_tokens=5, seed=1)
    usage = reply.usage
    assert usage.prompt_tokens > usage.image_tokens == 64
    assert 1 <= usage.completion_tokens <= 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert reply.finish_reason in ("stop", "length")


def test_seed_makes_sampling_repeatable(tiny_model) -> None:
    image = picture(8)
    first = tiny_model.ask("Same?", image, max_tokens=8, seed=42, temperature=0.9)
    second = tiny_model.ask("Same?", image, max_tokens=8, seed=42, temperature=0.9)
    assert str(first) == str(second)


def test_missing_image_file(tiny_model, tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="does not exist"):
        tiny_model.ask("?", tmp_path / "nope.jpg")


def test_unsupported_image_type(tiny_model) -> None:
    with pytest.raises(MediaError, match="Unsupported image input"):
        tiny_model.ask("?", [12345])


def test_broken_image_bytes(tiny_model, tmp_path: Path) -> None:
    path = tmp_path / "broken.jpg"
    path.write_bytes(b"this is not a jpeg at all")
    with pytest.raises(MediaError, match="broken.jpg"):
        tiny_model.ask("?", path)


def test_prompt_longer_than_context(tiny_model) -> None:
    with pytest.raises(ContextOverflowError, match="n_ctx is 4096"):
        tiny_model.ask("word " * 5000, max_tokens=1)
    assert tiny_model.ask("still fine?", max_tokens=1).usage.completion_tokens == 1


def test_missing_model_file(tiny, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        gguf_mcv.load(model_path=tmp_path / "missing.gguf", mmproj_path=tiny.mmproj)


def test_file_that_is_not_gguf(tiny, tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>Not found</html>" * 100)
    with pytest.raises(CorruptModelError, match="not a GGUF file"):
        gguf_mcv.load(model_path=fake, mmproj_path=tiny.mmproj)


def test_close_releases_and_context_manager(tiny) -> None:
    with gguf_mcv.load(model_path=tiny.quants["Q2_K"], mmproj_path=tiny.mmproj, n_ctx=1024) as model:
        assert model.ask("hi", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(gguf_mcv.ModelClosedError, match="closed"):
        model.ask("hi")
    model.close()  # a second close is harmless


def test_native_logging_is_silent_unless_verbose(tiny, capfd) -> None:
    with gguf_mcv.load(model_path=tiny.quants["Q4_0"], mmproj_path=tiny.mmproj, n_ctx=1024) as model:
        model.ask("hi", picture(9), max_tokens=2)
    captured = capfd.readouterr()
    # the one line a native fallback prints (tests/test_native_check.py) is not llama.cpp's logging
    err = "".join(line for line in captured.err.splitlines(keepends=True) if not line.startswith("gguf_mcv: "))
    assert err == "" and captured.out == ""


def test_verbose_prints_native_logs(tiny, capfd) -> None:
    with gguf_mcv.load(model_path=tiny.quants["Q4_0"], mmproj_path=tiny.mmproj, n_ctx=1024,
                       verbose=True) as model:
        model.ask("hi", max_tokens=1)
    assert "llama" in capfd.readouterr().err


def test_threads_share_one_model(tiny_model) -> None:
    errors: list[BaseException] = []
    replies: list[str] = []

    def worker(n: int) -> None:
        try:
            for i in range(5):
                replies.append(tiny_model.ask(f"thread {n} question {i}", picture(100 + n), max_tokens=3))
        except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert len(replies) == 20


# --- video ---------------------------------------------------------------------------


def moving_ball_video(path: Path, seconds: int = 12, fps: int = 10, static_from: int | None = None) -> Path:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (640, 360))
    for i in range(seconds * fps):
        frame = np.full((360, 640, 3), 40, dtype=np.uint8)
        x = 20 + (i if static_from is None else min(i, static_from)) * 5
        cv2.circle(frame, (x % 640, 180), 30, (0, 0, 255), -1)
        writer.write(frame)
    writer.release()
    return path


def test_video_answer_frames_are_never_sliced(tiny_model, tmp_path: Path) -> None:
    video = moving_ball_video(tmp_path / "ball.avi")
    reply = tiny_model.ask_video("What happens?", video, max_frames=6, max_tokens=3)
    stats = reply.video
    assert stats.used == 6 and stats.encoded == 6 and stats.thinned == 0
    assert reply.usage.image_tokens == 6 * 64  # 640×360 frames would be sliced as images
    again = tiny_model.ask_video("And then?", video, max_frames=6, max_tokens=3)
    assert again.video.encoded == 0 and again.timings.slices_encoded == 0


def test_video_dedupe_drops_a_static_stretch(tiny_model, tmp_path: Path) -> None:
    video = moving_ball_video(tmp_path / "static.avi", seconds=12, static_from=30)
    reply = tiny_model.ask_video("Moving?", video, max_frames=12, max_tokens=1)
    assert reply.video.sampled == 12 and reply.video.dropped >= 7
    assert reply.video.used == 12 - reply.video.dropped


def test_video_in_a_chat_then_a_follow_up(tiny_model, tmp_path: Path) -> None:
    from gguf_mcv.model import VideoOptions

    chat = tiny_model.chat()
    video = moving_ball_video(tmp_path / "chat.avi", seconds=4)
    first = chat.send("What moves?", videos=[video], video_options=VideoOptions(max_frames=4),
                      max_tokens=2)
    assert first.video.used == 4
    follow = chat.send("Which colour?", max_tokens=2)
    assert follow.timings.slices_encoded == 0 and follow.video is None


def test_too_many_frames_are_thinned_or_refused(tiny, tmp_path: Path) -> None:
    video = moving_ball_video(tmp_path / "long.avi", seconds=12)
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=512) as m:
        thinned = m.ask_video("?", video, fps=1.0, max_tokens=4)
        assert thinned.video.thinned > 0 and thinned.usage.prompt_tokens <= 512
        with pytest.raises(ContextOverflowError, match="max_frames="):
            m.ask_video("?", video, max_frames=12, max_tokens=4)
        assert m.engine.encoder_calls == thinned.video.encoded  # the refusal encoded nothing


def test_bad_video_raises_media_error(tiny_model, tmp_path: Path) -> None:
    bad = tmp_path / "broken.mp4"
    bad.write_text("not a video")
    with pytest.raises(MediaError, match="broken.mp4"):
        tiny_model.ask_video("?", bad)


# --- OpenAI-style messages -------------------------------------------------------------


def test_chat_completion_with_parts_and_policy(tiny_model, image_file: Path) -> None:
    from gguf_mcv.prompt.messages import MediaPolicy

    uri = "data:image/png;base64," + base64.b64encode(image_file.read_bytes()).decode()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "What is it?"}]}]
    reply = tiny_model.chat_completion(messages, max_tokens=2, temperature=0.5)
    assert reply.usage.image_tokens == 64
    server_policy = MediaPolicy(allow_files=False)
    local = [{"role": "user", "content": [{"type": "image_url", "image_url": str(image_file)}]}]
    with pytest.raises(MediaError, match="Local file paths are not allowed"):
        tiny_model.chat_completion(local, policy=server_policy)
    with pytest.raises(MediaError, match="not allowed"):
        tiny_model.chat_completion([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}], policy=server_policy)
    with pytest.raises(ConfigError, match="role"):
        tiny_model.chat_completion([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ConfigError, match="temprature"):
        tiny_model.chat_completion(messages, temprature=0.1)


def test_chat_completion_with_a_video_part(tiny_model, tmp_path: Path) -> None:
    video = moving_ball_video(tmp_path / "v.avi", seconds=3)
    uri = "data:video/x-msvideo;base64," + base64.b64encode(video.read_bytes()).decode()
    reply = tiny_model.chat_completion([{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": uri}}, {"type": "text", "text": "What moves?"}]}],
        max_tokens=2)
    assert reply.usage.image_tokens == 3 * 64


# --- long conversations: dropping the oldest turns ---------------------------------------------


@pytest.fixture(scope="module")
def small_ctx(tiny):
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=512) as m:
        yield m


def _long_chat(chat, model, turns: int, on_drop=None) -> list:
    replies = []
    for i in range(turns):
        image = picture(100 + i, (200, 200)) if i % 5 == 0 else ()
        calls = model.engine.encoder_calls
        reply = chat.send(f"Question {i}: what now?", image, max_tokens=12, temperature=0)
        # a drop never sends an image through the encoder again: at most this turn's new image
        assert model.engine.encoder_calls <= calls + (1 if i % 5 == 0 else 0), i
        if reply.dropped_turns and on_drop is not None:
            on_drop(i, reply, image)
        replies.append(reply)
    return replies


def test_a_long_chat_keeps_going_when_the_context_fills(small_ctx) -> None:
    chat = small_ctx.chat()  # drop_oldest is the default
    replies = _long_chat(chat, small_ctx, 20)
    assert sum(r.dropped_turns for r in replies) >= 5
    assert all(r.usage.prompt_tokens + 12 <= 512 for r in replies)
    questions = [t["content"].split("\n")[-1] for t in chat.history if t["role"] == "user"]
    assert questions[-1] == "Question 19: what now?" and "Question 0: what now?" not in questions
    with pytest.raises(ContextOverflowError):
        _long_chat(small_ctx.chat(overflow="error"), small_ctx, 20)


def test_without_shifting_an_answer_after_a_drop_is_a_fresh_chats(small_ctx) -> None:
    chat = small_ctx.chat(context_shift=False)
    compared = []

    def compare(i: int, reply, image) -> None:
        fresh = small_ctx.chat()
        fresh._turns = list(chat._turns[:-2])  # exactly the kept turns, before this question
        small_ctx.engine.reset()  # nothing reused: every kept turn evaluated anew
        again = fresh.send(f"Question {i}: what now?", image, max_tokens=12, temperature=0)
        compared.append(str(again) == str(reply))

    _long_chat(chat, small_ctx, 14, on_drop=compare)
    assert compared and all(compared)


def test_shifting_reuses_the_kept_turns(small_ctx) -> None:
    chat = small_ctx.chat()
    shifted = small_ctx.engine.shifted_positions
    reused = []
    _long_chat(chat, small_ctx, 14, on_drop=lambda i, r, image: reused.append(r.usage.cached_tokens
                                                                               / r.usage.prompt_tokens))
    assert small_ctx.engine.shifted_positions > shifted
    assert reused and max(reused) > 0.5  # most of the prompt came from the shifted cache


def test_pinned_turns_stay_and_a_question_too_big_alone_is_refused(small_ctx) -> None:
    chat = small_ctx.chat(keep_first=1)
    _long_chat(chat, small_ctx, 14)
    first = chat.history[0]
    assert first["content"].endswith("Question 0: what now?") and len(first["images"]) == 1
    with pytest.raises(ContextOverflowError, match="pinned"):
        chat.send("word " * 400, max_tokens=12)
    with pytest.raises(gguf_mcv.ConfigError, match="keep_first"):
        small_ctx.chat(keep_first=-1)


def test_a_hybrid_model_drops_turns_without_encoding_again(tmp_path) -> None:
    """MiniCPM-V 4.6's qwen35 text model cannot shift its cache: the kept turns are evaluated
    again, their images fed from the embedding cache."""
    from gguf_mcv.testing.synthetic import GENERATIONS, build

    files = build(tmp_path / "v46", GENERATIONS["4.6"][0], quants=("Q4_K_M",))
    with gguf_mcv.load("minicpm-v-4.6", model_path=files.quants["Q4_K_M"], mmproj_path=files.mmproj,
                       n_ctx=512) as m:
        chat = m.chat()
        replies = _long_chat(chat, m, 14)
        assert sum(r.dropped_turns for r in replies) >= 2
        assert m.engine.shifted_positions == 0  # nothing shifted: re-evaluated instead


def test_regenerate_replaces_the_last_answer_and_refuses_when_there_is_none(tiny_model) -> None:
    from gguf_mcv.errors import ConfigError

    chat = tiny_model.chat()
    with pytest.raises(ConfigError, match="Nothing to regenerate"):
        chat.regenerate()
    chat.send("One?", max_tokens=3, temperature=0)
    chat.send("Two?", max_tokens=3, temperature=0)
    answers = {str(chat.regenerate(max_tokens=6, temperature=1.5, seed=s)) for s in range(4)}
    assert len(chat.history) == 4 and chat.history[2]["content"] == "Two?"
    assert len(answers) > 1  # other seeds, other answers: it really samples again
    # a regenerated stream closed early keeps what was said, and can be regenerated again
    stream = chat.regenerate(stream=True, max_tokens=8, temperature=0)
    next(stream, None)
    stream.close()
    assert len(chat.history) == 4
    assert str(chat.regenerate(max_tokens=4, temperature=0, format="json")).lstrip().startswith("{")


def test_regenerate_keeps_the_last_answer_until_the_new_one_ends(tiny_model) -> None:
    chat = tiny_model.chat()
    chat.send("One?", max_tokens=3, temperature=0)
    chat.send("Two?", max_tokens=3, temperature=0)
    before = chat.history
    chat.regenerate(stream=True, max_tokens=4).close()  # closed unread
    assert chat.history == before
    with pytest.raises(ConfigError):
        chat.regenerate(max_tokens=4, stop=5)  # type: ignore[arg-type]  # fails inside the answer
    assert chat.history == before
    stream = chat.regenerate(stream=True, max_tokens=4, temperature=0)
    next(stream, None)  # started, nothing said yet or one piece: either way a whole history
    stream.close()
    assert len(chat.history) == 4 and chat.history[2]["content"] == "Two?"


def test_tools_of_a_failed_send_do_not_stay(tiny_model) -> None:
    tool = {"type": "function", "function": {"name": "now"}}
    chat = tiny_model.chat()
    first = chat.send("One?", max_tokens=3, temperature=0)
    with pytest.raises(MediaError):
        chat.send("Now?", b"not an image", tools=[tool], tool_choice="required")
    again = chat.regenerate(max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens  # no tool prompt came in
    assert not again.tool_calls and str(again) == str(first)


def test_a_misspelt_keyword_names_itself_in_every_question(tiny_model, tmp_path: Path) -> None:
    """The sampling keywords are one TypedDict (checked by mypy in tests/typing_calls.py); at run
    time a keyword that is none of a question's is refused before anything runs, by name."""
    chat = tiny_model.chat()
    chat.send("Hi.", max_tokens=1, min_p=0.05)  # every question takes every sampling keyword
    calls = {
        "ask": lambda: tiny_model.ask("Hi.", temprature=0.1),
        "ask_video": lambda: tiny_model.ask_video("Hi.", str(tmp_path / "none.mp4"), temprature=0.1),
        "chat_completion": lambda: tiny_model.chat_completion([{"role": "user", "content": "Hi."}],
                                                              temprature=0.1),
        "send": lambda: chat.send("Hi.", temprature=0.1),
        "regenerate": lambda: chat.regenerate(temprature=0.1),
    }
    for name, call in calls.items():
        with pytest.raises(ConfigError, match="temprature"):
            call()
        assert len(chat.history) == 2, name
