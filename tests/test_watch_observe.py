"""gguf_mcv.watch.observe: watch() on the tiny synthetic model — encoder calls, reuse, events, failures."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from mjpegserver import MjpegServer  # tests/ is on sys.path
from test_watch_sources import write_avi

import gguf_mcv
from gguf_mcv.errors import ConfigError, SourceError
from gguf_mcv.vision.embed_cache import EmbeddingCache
from gguf_mcv.vision.slicing import slice_grid


@pytest.fixture(scope="module")
def model(tiny):
    """The tiny model with libmtmd's encoder (the fastest to start in tests)."""
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=2048, n_threads=2,
                       vision_backend="llama.cpp") as loaded:
        yield loaded


def _scene(w: int, h: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
    return np.ascontiguousarray(cv2.resize(small, (w, h), interpolation=cv2.INTER_NEAREST))


def _noisy(rgb: np.ndarray, seed: int, sigma: float = 4.0) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0, sigma, rgb.shape)
    return np.clip(rgb + noise, 0, 255).astype(np.uint8)


def _run(model, frames, **kw) -> list[gguf_mcv.Observation]:
    kw = {"every_s": 0.001, "max_tokens": 3, **kw}
    return list(gguf_mcv.watch(model, frames, "What is happening?", **kw))


def test_slice_indexes_follow_libmtmd_chunk_order(model) -> None:
    """Index 0 is the overview, then the slices row by row: a change in the right half of a
    2×1 image changes the embeddings of 0 and 2 only (what watch relies on to reuse 1)."""
    engine = model.engine
    left_right = _scene(900, 448)
    assert slice_grid(900, 448, engine.slice_size) == (2, 1)
    changed = left_right.copy()
    changed[150:300, 600:750] = 255 - changed[150:300, 600:750]

    def embeddings(rgb: np.ndarray) -> list[np.ndarray]:
        image = model.prepare_image(rgb, detail="high")
        reply = model.ask("Describe.", image, detail="high", max_tokens=1)
        assert reply.timings.slices_encoded == 3
        return [engine.embed_cache.get(engine.image_key(image.digest, i)) for i in range(3)]

    before, after = embeddings(left_right), embeddings(changed)
    assert np.array_equal(before[1], after[1])
    assert not np.array_equal(before[0], after[0]) and not np.array_equal(before[2], after[2])


def test_one_region_changing_encodes_its_slice_and_the_overview_only(model) -> None:
    engine = model.engine
    scene = _scene(900, 448, seed=1)
    moved = scene.copy()
    moved[100:200, 100:200] = 0  # in the left slice (index 1)
    calls = engine.encoder_calls
    first, second, third = _run(model, [scene, moved, _noisy(moved, 1)], detail="high")
    assert (first.slices_encoded, first.slices_reused, first.asked) == (3, 0, True)
    assert (second.slices_encoded, second.slices_reused, second.asked) == (2, 1, True)
    assert 0 < second.changed < 0.1 and second.frame_index == 1 and second.frames_skipped == 0
    assert (third.slices_encoded, third.asked) == (0, False)  # noise only: nothing to encode
    assert engine.encoder_calls - calls == 5


def test_a_static_scene_costs_no_encoder_call_after_the_first(model) -> None:
    engine = model.engine
    scene = _scene(448, 336, seed=2)
    calls = engine.encoder_calls
    seen = _run(model, [_noisy(scene, s) for s in range(5)])
    assert engine.encoder_calls - calls == 1 and seen[0].slices_encoded == 1
    assert all(o.slices_encoded == 0 and not o.asked and o.answer is seen[0].answer for o in seen[1:])
    assert [o.frame_index for o in seen] == [0, 1, 2, 3, 4]
    assert seen[1].ticks_skipped > 0  # the first answer took longer than every_s
    assert all(o.latency_s < 2.0 for o in seen[1:])  # no model call: milliseconds, on a busy machine too


def test_answer_unchanged_asks_again_from_the_kv_cache(model) -> None:
    engine = model.engine
    scene = _scene(448, 336, seed=3)
    calls = engine.encoder_calls
    seen = _run(model, [scene, _noisy(scene, 1), _noisy(scene, 2)], answer_unchanged=True)
    assert engine.encoder_calls - calls == 1
    for o in seen[1:]:
        assert o.asked and o.slices_encoded == 0 and o.answer is not seen[0].answer
        usage = o.answer.usage
        assert usage.prompt_tokens - usage.cached_tokens <= 1  # only the last token evaluated again
        assert str(o.answer) == str(seen[0].answer)  # greedy by default


def test_a_colour_change_of_equal_brightness_is_asked_about(model) -> None:
    """The whole frame turns from red to a green of the same grey level: a change, not a repeat."""
    red = np.full((336, 448, 3), (200, 0, 0), np.uint8)
    green = np.full((336, 448, 3), (0, 102, 0), np.uint8)
    first, second = _run(model, [red, green])
    assert second.asked and second.changed == 1.0 and second.slices_encoded == 1
    assert second.answer is not first.answer


def test_kept_slices_never_stand_in_a_shared_disk_cache_for_the_new_frame(tiny, model, tmp_path: Path) -> None:
    """A cache entry is always the encoding of its key's pixels: another process sharing the disk
    tier and asking about exactly the watched frame gets that frame's own embeddings."""
    scene = _scene(900, 448, seed=7)
    moved = _noisy(scene, 1, sigma=3.0)  # the right slice: noise only, kept from the first frame
    moved[100:200, 100:200] = 0  # the left slice changes
    disk = tmp_path / "embeddings"
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=2048, n_threads=2,
                       vision_backend="llama.cpp", embed_cache=EmbeddingCache(disk_dir=disk)) as watcher:
        seen = _run(watcher, [scene, moved], detail="high")
        assert (seen[1].slices_encoded, seen[1].slices_reused) == (2, 1)
        digest = watcher.prepare_image(moved, detail="high").digest
        keys = [watcher.engine.image_key(digest, i) for i in range(3)]
        in_memory = [watcher.engine.embed_cache.get(key) for key in keys]
    model.ask("Describe.", model.prepare_image(moved, detail="high"), detail="high", max_tokens=1)
    truth = [model.engine.embed_cache.get(key) for key in keys]  # the frame encoded as it is
    assert all(t is not None for t in truth)
    other_process = EmbeddingCache(disk_dir=disk)
    for stored in ([other_process.get(key) for key in keys], in_memory):
        for i, (entry, expected) in enumerate(zip(stored, truth, strict=True)):
            assert entry is None or np.array_equal(entry, expected), f"slice {i}: another frame's encoding"


def test_stop_from_another_thread_ends_the_watch(model) -> None:
    scene = _scene(448, 336, seed=8)
    watching = gguf_mcv.watch(model, (scene for _ in itertools.count()), "What?", every_s=0.05, max_tokens=2)
    seen: list[gguf_mcv.Observation] = []
    two = threading.Event()

    def consume() -> None:
        for o in watching:
            seen.append(o)
            if len(seen) == 2:
                two.set()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert two.wait(300)
    watching.stop()
    consumer.join(300)
    assert not consumer.is_alive() and watching.stopped  # the endless iterable was stopped
    count = len(seen)
    assert next(watching, None) is None and len(seen) == count  # a stopped watch stays ended


def test_close_from_another_thread_stops_and_releases_the_stream(model) -> None:
    with MjpegServer([_scene(448, 336, seed=9)], fps=20) as server:
        watching = gguf_mcv.watch(model, server.url, "What?", every_s=0.1, max_tokens=2, give_up_s=60)
        first = threading.Event()
        errors: list[BaseException] = []

        def consume() -> None:
            try:
                for _ in watching:
                    first.set()
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        assert first.wait(300)
        watching.close()  # from this thread, while the consumer is inside the loop
        consumer.join(300)
        assert not consumer.is_alive() and errors == []
    assert not [t for t in threading.enumerate() if t.name.startswith("gguf-mcv watch")]  # released


def test_a_watch_closed_before_it_starts_opens_nothing(model) -> None:
    frames = iter([_scene(448, 336, seed=10)])
    with gguf_mcv.watch(model, frames, "What?", every_s=0.05, max_tokens=2) as watching:
        watching.stop()
        assert list(watching) == []
    assert next(frames, None) is not None  # never read


def test_only_changes_yields_when_the_answer_changes(model) -> None:
    scene = _scene(448, 336, seed=4)
    seen = _run(model, [scene] * 4, answer_unchanged=True, only_changes=True)
    assert len(seen) == 1 and seen[0].frame_index == 0


def test_schema_answers_carry_parsed_and_serialise(model) -> None:
    schema = {"type": "object", "properties": {"people": {"type": "integer"}}, "required": ["people"]}
    seen = _run(model, [_scene(448, 336, seed=5)] * 2, schema=schema, max_tokens=12)
    assert seen[0].parsed == seen[0].answer.parsed
    line = json.loads(json.dumps(seen[1].to_dict()))
    assert line["frame"] == 1 and line["asked"] is False and line["answer"] == str(seen[0].answer)
    assert set(line) >= {"time", "changed", "slices_encoded", "slices_reused", "parsed", "latency_s",
                         "frames_skipped", "ticks_skipped", "reconnects"}


def test_events_come_on_the_observations_with_snapshots_that_decode(model, tmp_path: Path) -> None:
    """Two scenes, three ticks each: a repeated frame never completes an event; the first tick
    starts one when something is there; the second scene's first tick changes the value or not."""
    import PIL.Image

    from gguf_mcv.watch.events import something

    schema = {"type": "object", "properties": {"present": {"type": "boolean"}}, "required": ["present"]}
    frames = [_scene(448, 336, seed=11)] * 3 + [_scene(448, 336, seed=12)] * 3
    seen = _run(model, frames, schema=schema, max_tokens=24, event_on="present", snapshots=tmp_path / "snaps")
    values = [o.parsed["present"] for o in seen]
    assert [o.event is not None for o in seen] == [
        something(values[0]), False, False, values[3] != values[0], False, False]
    for o in seen:
        if o.event is not None:
            assert o.event.after == values[o.frame_index] and o.event.kind in ("started", "ended")
            with PIL.Image.open(o.event.snapshot) as image:
                assert image.size == (448, 336)
            line = o.to_dict()
            assert line["event"]["event"] == o.event.kind and line["event"]["snapshot"] == o.event.snapshot
        else:
            assert "event" not in o.to_dict()
    assert len(list((tmp_path / "snaps").glob("snapshot-*.jpg"))) == sum(o.event is not None for o in seen)


def test_an_event_is_yielded_under_only_changes_and_a_missing_field_says_so(model) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}},
              "required": ["n"]}
    seen = _run(model, [_scene(448, 336, seed=13)] * 2, schema=schema, max_tokens=24, event_on="n",
                only_changes=True)
    assert len(seen) == 1 and seen[0].event is not None and seen[0].event.kind == "started"  # n >= 1: something
    missing = _run(model, [_scene(448, 336, seed=13)], schema=schema, max_tokens=24, event_on="people")
    assert missing[0].event is None and "has no field 'people'" in (missing[0].event_warning or "")
    assert missing[0].to_dict()["event_warning"] == missing[0].event_warning


def test_a_region_encodes_only_what_changes_inside_it(model) -> None:
    """A change outside the region costs no encoder call; one inside re-encodes the region's slices."""
    base = _scene(896, 448, seed=21)
    outside, inside = base.copy(), base.copy()
    outside[100:200, 100:200] = 255  # in the left half
    inside[100:200, 600:700] = 255  # in the right half: the region
    seen = _run(model, [base, outside, inside], region=(0.5, 0.0, 0.5, 1.0), detail="high")
    assert seen[0].slices_encoded >= 1
    assert seen[1].slices_encoded == 0 and seen[1].changed == 0.0 and not seen[1].asked
    assert seen[2].slices_encoded >= 1 and seen[2].asked


def test_two_zones_encode_and_follow_their_own_changes(model, tmp_path: Path) -> None:
    """One source, two named zones: each tick answers each zone in order; a change in one zone
    encodes that zone's slices only; each zone's events are its own, with a snapshot of its crop."""
    import PIL.Image

    base = _scene(896, 448, seed=31)
    right = base.copy()
    right[100:200, 600:700] = 255  # inside "right" only
    both = right.copy()
    both[300:400, 100:200] = 0  # then inside "left" too
    zones = {"left": (0, 0, 448, 448), "right": ((0.5, 0.0, 0.5, 1.0), "Is anything white here?")}
    seen = _run(model, [base, right, both], zones=zones, detail="high", event_on="answer",
                snapshots=tmp_path / "snaps")
    assert [(o.frame_index, o.zone) for o in seen] == [(0, "left"), (0, "right"), (1, "left"), (1, "right"),
                                                        (2, "left"), (2, "right")]
    by = {(o.frame_index, o.zone): o for o in seen}
    assert by[0, "left"].slices_encoded >= 1 and by[0, "right"].slices_encoded >= 1
    assert by[1, "left"].slices_encoded == 0 and not by[1, "left"].asked and by[1, "left"].event is None
    assert by[1, "right"].slices_encoded >= 1 and by[1, "right"].asked
    assert by[2, "right"].slices_encoded == 0 and by[2, "left"].slices_encoded >= 1
    for o in seen:
        assert o.to_dict()["zone"] == o.zone
        if o.event is not None:
            assert o.event.zone == o.zone and o.event.to_dict()["zone"] == o.zone
            assert o.event.snapshot is not None and o.event.snapshot.endswith(f"-{o.zone}.jpg")
            with PIL.Image.open(o.event.snapshot) as image:
                assert image.size == (448, 448)
    # the first tick of each zone starts its own event (a non-empty answer is something there)
    assert by[0, "left"].event is not None and by[0, "right"].event is not None


def test_overlapping_zones_each_see_the_change_in_their_common_part(model) -> None:
    base = _scene(896, 448, seed=32)
    changed = base.copy()
    changed[100:200, 400:500] = 255  # in both zones' overlap
    seen = _run(model, [base, changed], zones={"a": (0, 0, 512, 448), "b": (384, 0, 512, 448)}, detail="high")
    assert [o.asked and o.slices_encoded >= 1 for o in seen[2:]] == [True, True]


def test_a_changing_scene_leaves_one_frame_in_the_embedding_cache(model) -> None:
    cache = model.engine.embed_cache
    held = len(cache)
    _run(model, [_scene(448, 336, seed=10 + i) for i in range(4)])
    assert len(cache) <= held + 1  # each frame's entries are dropped once the next one replaces it


def test_a_video_file_is_watched_in_real_time(model, tmp_path: Path) -> None:
    clip = write_avi(tmp_path / "clip.avi", n=30, fps=20.0, size=(448, 336))  # 1.5 s
    seen = _run(model, clip, every_s=0.4)
    assert 2 <= len(seen) <= 6
    indexes = [o.frame_index for o in seen]
    assert indexes == sorted(set(indexes)) and indexes[-1] <= 29
    assert sum(o.frames_skipped for o in seen[1:]) > 0  # a tick takes the newest frame, not the next


def test_an_mjpeg_stream_that_drops_is_reported_not_raised(model) -> None:
    server = MjpegServer([_scene(448, 336, seed=6)], fps=20).start()
    restarted = threading.Event()

    def bounce() -> None:
        server.stop()
        time.sleep(0.5)
        server.start()
        restarted.set()

    try:
        seen = []
        for o in gguf_mcv.watch(model, server.url, "What is happening?", every_s=0.2, max_tokens=2, give_up_s=10):
            seen.append(o)
            if len(seen) == 2:
                threading.Thread(target=bounce, daemon=True).start()
            if o.reconnects >= 1 or len(seen) > 60:
                break
        assert seen[-1].reconnects >= 1 and restarted.is_set()
        assert seen[-1].slices_encoded == 0  # the same picture after the reconnect: nothing encoded
    finally:
        server.stop()
    time.sleep(0.3)
    assert not [t for t in threading.enumerate() if t.name.startswith("gguf-mcv watch")]  # released


def test_a_corrupt_frame_ends_the_watch_with_a_clear_error(model) -> None:
    frames = iter([_scene(448, 336, seed=2), np.zeros((10, 10, 3), np.float64)])
    watching = gguf_mcv.watch(model, frames, "What?", every_s=0.001, max_tokens=2)
    assert next(watching).frame_index == 0
    with pytest.raises(SourceError, match="Frame 1 .*cannot be used"):
        next(watching)


@pytest.mark.parametrize("change, match", [
    ({"every_s": 0}, "every_s"), ({"every_s": -1}, "every_s"), ({"every_s": 1e12}, "every_s"),
    ({"every_s": 10**400}, "every_s"), ({"every_s": -10**400}, "every_s"), ({"every_s": 1e-300}, "every_s"),
    ({"every_s": 0.0009}, "every_s"), ({"give_up_s": 10**400}, "give_up_s"), ({"threshold": 10**400}, "threshold"),
    ({"every_s": float("nan")}, "every_s"), ({"every_s": "2"}, "every_s"), ({"threshold": 2}, "threshold"),
    ({"detail": "ultra"}, "detail"), ({"max_slices": 10}, "max_slices"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"only_changes": "yes"}, "only_changes"),
    ({"answer_unchanged": 1}, "answer_unchanged"), ({"give_up_s": 0}, "give_up_s"), ({"seed": 1.5}, "seed"),
    ({"schema": {"type": "no such type"}}, "schema|type"), ({"system": 5}, "system"),
    ({"event_on": "present"}, "give schema="), ({"event_on": "answer", "hold": 0}, "hold"),
    ({"event_on": "answer", "cooldown_s": -1}, "cooldown_s"), ({"hold": 3}, "give event_on"),
    ({"snapshots": "/tmp/x"}, "give event_on"), ({"event_on": ["answer"]}, "event_on"),
    ({"region": (0, 0, 0, 0)}, "region"), ({"region": "left"}, "region"),
    ({"zones": {}}, "zones"), ({"zones": [(0, 0, 1, 1)]}, "zones"), ({"zones": {"a b": (0, 0, 1, 1)}}, "zone name"),
    ({"zones": {"a": (0, 0, 0, 0)}}, "zone a"), ({"zones": {"a": ((0, 0, 1, 1), "")}}, "zone a"),
    ({"zones": {"a": ((0, 0, 1, 1), 5)}}, "zone a"), ({"zones": {"a": None}}, "zone a"),
    ({"zones": {f"z{i}": (0, 0, 1, 1) for i in range(17)}}, "at most 16"),
    ({"zones": {"a": (0, 0, 1, 1)}, "region": (0, 0, 1, 1)}, "not both"),
])
def test_wrong_arguments_are_refused_before_anything_opens(model, change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        gguf_mcv.watch(model, [np.zeros((8, 8, 3), np.uint8)], "What?", **change)


def test_wrong_model_prompt_or_source_is_refused(model, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gguf_mcv Model"):
        gguf_mcv.watch("model.gguf", 0, "What?")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="prompt"):
        gguf_mcv.watch(model, 0, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="source"):
        gguf_mcv.watch(model, 2.5, "What?")  # type: ignore[arg-type]
    with pytest.raises(SourceError, match="does not exist"):
        gguf_mcv.watch(model, tmp_path / "missing.mp4", "What?")
