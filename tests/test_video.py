"""Tests of video frame sampling, on small videos written with OpenCV into tmp folders."""

from __future__ import annotations

import math
import os
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterable
from pathlib import Path

import cv2
import numpy as np
import PIL.Image
import pytest

import gguf_mcv
from gguf_mcv.errors import ConfigError, MediaError
from gguf_mcv.hardware import Gpu, Hardware
from gguf_mcv.vision import remote, video, video_decode, video_sources
from gguf_mcv.vision.media import Image
from gguf_mcv.vision.video import (
    DEFAULT_THRESHOLD,
    Frame,
    Frames,
    default_max_frames,
    format_timestamp,
    sample_frames,
    sample_indices,
)

W, H = 128, 96
CODE_ROOT = str(Path(gguf_mcv.__file__).resolve().parent.parent)

# --- writing test videos ------------------------------------------------------------------


def write_video(path: Path, frames: Iterable[np.ndarray], *, fps: float = 10.0,
                fourcc: str = "mp4v") -> Path:
    """Write RGB frames with OpenCV; skip the test when this build cannot write ``fourcc``."""
    frames = iter(frames)
    first = next(frames, None)
    h, w = first.shape[:2] if first is not None else (H, W)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (w, h))
    if not writer.isOpened():
        pytest.skip(f"this OpenCV build cannot write {fourcc} into {path.suffix}")
    for frame in ([first] if first is not None else []):
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def moving_ball(n: int, w: int = W, h: int = H) -> Iterable[np.ndarray]:
    """A white ball crossing a blue background, one pixel per frame."""
    for i in range(n):
        f = np.empty((h, w, 3), np.uint8)
        f[:] = (40, 90, 160)
        cv2.circle(f, (10 + i % (w - 20), h // 2), h // 8, (250, 250, 250), -1)
        yield f


def numbered(n: int, w: int = 64, h: int = 48) -> Iterable[np.ndarray]:
    """Frames that carry their own number in 16 black/white blocks (2 rows of 8)."""
    bw, bh = w // 8, h // 4
    for i in range(n):
        f = np.full((h, w, 3), 128, np.uint8)
        for b in range(16):
            y, x = (b // 8) * bh, (b % 8) * bw
            f[y:y + bh, x:x + bw] = 255 if (i >> b) & 1 else 0
        yield f


def read_number(rgb: np.ndarray) -> int:
    h, w = rgb.shape[:2]
    bw, bh = w // 8, h // 4
    return sum(1 << b for b in range(16)
               if rgb[(b // 8) * bh + bh // 2, (b % 8) * bw + bw // 2].mean() > 127)


def patch_avi(src: Path, dst: Path, *, scale: int | None = None, rate: int | None = None,
              length: int | None = None) -> Path:
    """Copy an AVI, rewriting its stream rate (dwScale/dwRate) or frame count in the headers."""
    data = bytearray(src.read_bytes())
    strh, avih = data.index(b"strh") + 8, data.index(b"avih") + 8
    if scale is not None and rate is not None:
        struct.pack_into("<II", data, strh + 20, scale, rate)
    if length is not None:
        struct.pack_into("<I", data, strh + 32, length)
        struct.pack_into("<I", data, avih + 16, length)  # dwTotalFrames
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Videos shared by the module's tests (each is a few KB and takes milliseconds)."""
    d = tmp_path_factory.mktemp("clips")
    write_video(d / "ball.mp4", moving_ball(100))  # 10 s at 10 fps
    write_video(d / "ball.avi", moving_ball(100), fourcc="MJPG")
    write_video(d / "scenes.mp4", scenes())
    return d


def scenes() -> Iterable[np.ndarray]:
    """30 s at 10 fps: 10 s of a moving ball, 10 s of a static shot with sensor noise, a cut
    to another colour, then 10 more static noisy seconds."""
    rng = np.random.default_rng(0)
    for i in range(300):
        f = np.empty((H, W, 3), np.uint8)
        f[:] = (40, 90, 160) if i < 200 else (160, 60, 40)
        centre = (10 + i, H // 2) if i < 100 else (110, H // 2) if i < 200 else (40, H // 3)
        cv2.circle(f, centre, 12, (250, 250, 250) if i < 200 else (20, 20, 20), -1)
        if i >= 100:
            f = np.clip(f + rng.normal(0, 3, f.shape), 0, 255).astype(np.uint8)
        yield f


# --- sample_indices ------------------------------------------------------------------------


def test_one_frame_per_second_at_interval_centres() -> None:
    assert sample_indices(100, 10.0, fps=1.0, max_frames=64) == list(range(5, 100, 10))
    assert sample_indices(100, 10.0, fps=2.0, max_frames=64) == [2 + 5 * i for i in range(20)]
    assert sample_indices(300, 30.0, fps=0.5, max_frames=64) == [30, 90, 150, 210, 270]


def test_caps_at_max_frames_with_minicpm_centred_sampling() -> None:
    got = sample_indices(6000, 10.0, fps=1.0, max_frames=64)  # 600 s at 1 fps > 64
    gap = 6000 / 64
    assert got == [int(i * gap + gap / 2) for i in range(64)]
    assert got[:3] == [46, 140, 234] and got[-1] == 5953


def test_fps_none_spreads_max_frames_uniformly() -> None:
    assert sample_indices(100, 10.0, fps=None, max_frames=4) == [12, 37, 62, 87]
    # an unusable native rate means the same: no seconds to count
    assert sample_indices(100, math.nan, fps=1.0, max_frames=4) == [12, 37, 62, 87]
    assert sample_indices(100, 0.0, fps=1.0, max_frames=4) == [12, 37, 62, 87]


def test_fewer_frames_than_asked() -> None:
    assert sample_indices(3, 30.0, fps=None, max_frames=64) == [0, 1, 2]
    assert sample_indices(5, 1.0, fps=10.0, max_frames=64) == [0, 1, 2, 3, 4]
    assert sample_indices(1, 30.0, fps=1.0, max_frames=8) == [0]  # shorter than a second
    assert sample_indices(10, 30.0, fps=1.0, max_frames=8) == [5]
    assert sample_indices(0, 30.0, fps=1.0, max_frames=8) == []


def test_indices_are_sorted_unique_and_in_range() -> None:
    rng = np.random.default_rng(1)
    for _ in range(500):
        total, native = int(rng.integers(1, 100_000)), float(rng.uniform(0.5, 120))
        fps = None if rng.random() < 0.2 else float(rng.uniform(0.05, 10))
        cap = int(rng.integers(1, 100))
        got = sample_indices(total, native, fps=fps, max_frames=cap)
        assert 1 <= len(got) <= min(cap, total)
        assert got == sorted(set(got)) and 0 <= got[0] and got[-1] < total


@pytest.mark.parametrize("kwargs", [{"max_frames": 0}, {"max_frames": 4, "fps": 0.0},
                                    {"max_frames": 4, "fps": -1.0},
                                    {"max_frames": 4, "fps": math.nan}])
def test_sample_indices_rejects_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        sample_indices(100, 10.0, **kwargs)


# --- default_max_frames ------------------------------------------------------------------------


def fake_hardware(cores: int, *, gpu: str | None = None, offload: bool = True,
                  board_kind: str | None = None, quota: float | None = None) -> Hardware:
    gpus = ()
    if gpu is not None:
        gpus = (Gpu(gpu, "cuda", 8 * 2**30, 7 * 2**30, unified=board_kind == "jetson"),)
    return Hardware(
        system="Linux", machine="x86_64", total_ram=8 * 2**30, available_ram=6 * 2**30,
        memory_limit_source=None, physical_cores=cores, performance_cores=None, cpu_quota=quota,
        allowed_cpus=None, board=None, board_kind=board_kind, gpus=gpus, gpu_offload=offload,
        gpu_offload_note=None if offload else "CPU-only build", cache_dir=Path("/tmp"),
        free_disk=None,
    )


@pytest.mark.parametrize(("hw", "expected"), [
    (fake_hardware(1), 8),
    (fake_hardware(2), 8),
    (fake_hardware(3), 12),
    (fake_hardware(4), 16),
    (fake_hardware(8), 32),
    (fake_hardware(64), 32),
    (fake_hardware(16, quota=2.0), 8),  # the cgroup quota decides the threads
    (fake_hardware(4, gpu="RTX 4060"), 64),
    (fake_hardware(6, gpu="Orin", board_kind="jetson"), 32),
    (fake_hardware(4, gpu="RTX 4060", offload=False), 16),  # llama.cpp cannot use it
])
def test_default_max_frames_rule(hw: Hardware, expected: int) -> None:
    assert default_max_frames(hw) == expected


def test_max_frames_defaults_to_the_machine_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(video, "default_max_frames", lambda hardware=None: 3)
    arr = np.zeros((50, 8, 8, 3), np.uint8)
    assert len(sample_frames(arr, dedupe=False)) == 3


# --- video files -------------------------------------------------------------------------------


def test_ten_second_clip_at_one_fps(clips: Path) -> None:
    frames = sample_frames(clips / "ball.mp4", max_frames=64, dedupe=False)
    assert isinstance(frames, Frames) and len(frames) == 10
    assert [f.index for f in frames] == list(range(5, 100, 10))
    assert [f.timestamp for f in frames] == pytest.approx([i + 0.5 for i in range(10)])
    assert (frames.sampled, frames.dropped, frames.missed) == (10, 0, 0)
    assert (frames.total_frames, frames.native_fps, frames.duration) == (100, 10.0, 10.0)
    assert frames.source == str(clips / "ball.mp4")
    first = frames[0].image
    assert isinstance(first, Image) and first.source == f"{clips / 'ball.mp4'}@0.5s"
    assert first.rgb.shape == (H, W, 3) and first.rgb.dtype == np.uint8
    assert first.rgb.flags.c_contiguous
    # RGB, not OpenCV's BGR: the background is (40, 90, 160)
    assert np.abs(first.rgb[2, 2].astype(int) - (40, 90, 160)).max() < 12


@pytest.mark.parametrize(("name", "fourcc"), [("c.avi", "MJPG"), ("c.mkv", "FFV1"),
                                              ("c.webm", "VP80"), ("c.mov", "mp4v")])
def test_other_containers(tmp_path: Path, name: str, fourcc: str) -> None:
    path = write_video(tmp_path / name, moving_ball(40, 64, 48), fourcc=fourcc)
    frames = sample_frames(path, max_frames=64, dedupe=False)
    assert [f.index for f in frames] == [5, 15, 25, 35]
    assert frames[0].image.source.endswith(f"{name}@0.5s")


def test_max_frames_caps_and_fps_none(clips: Path) -> None:
    frames = sample_frames(clips / "ball.mp4", max_frames=4, dedupe=False)
    assert [f.index for f in frames] == [12, 37, 62, 87]
    frames = sample_frames(clips / "ball.mp4", max_frames=25, fps=None, dedupe=False)
    assert [f.index for f in frames] == [int(i * 4 + 2) for i in range(25)]


def test_max_side_downsizes_kept_frames(clips: Path) -> None:
    frames = sample_frames(clips / "ball.avi", max_frames=2, max_side=64, dedupe=False)
    assert frames[0].image.rgb.shape == (48, 64, 3)


def test_dedupe_drops_static_stretch_keeps_motion_and_cut(clips: Path) -> None:
    all_frames = sample_frames(clips / "scenes.mp4", max_frames=64, dedupe=False)
    assert len(all_frames) == 30
    frames = sample_frames(clips / "scenes.mp4", max_frames=64)
    kept = [f.index for f in frames]
    # every moving second, the first static one (the ball moved since), the cut
    assert kept == list(range(5, 100, 10)) + [105, 205]
    assert (frames.sampled, frames.dropped) == (30, 18)


def test_dedupe_threshold_calibration() -> None:
    """Uncompressed 320×240: noise is dropped, a ball moving 5% of the width a second is kept."""
    rng = np.random.default_rng(2)

    def clip(speed: float, sigma: float, w: int = 320, h: int = 240) -> np.ndarray:
        out = []
        for t in range(10):
            f = np.full((h, w, 3), (70, 110, 60), np.uint8)
            cv2.circle(f, (int(w * 0.2 + t * speed * w), h // 2), h // 8, (200, 60, 60), -1)
            out.append(np.clip(f + rng.normal(0, sigma, f.shape), 0, 255).astype(np.uint8))
        return np.stack(out)

    for sigma in (3, 8):
        frames = sample_frames(clip(0.0, sigma), max_frames=64)
        assert (len(frames), frames.dropped) == (1, 9), sigma
    assert len(sample_frames(clip(0.05, 3), max_frames=64)) == 10
    assert len(sample_frames(clip(0.0, 8), max_frames=64, threshold=0)) == 10
    assert DEFAULT_THRESHOLD == 1.5


def test_dedupe_sees_a_cut_between_colours_of_equal_brightness() -> None:
    red, green = np.zeros((2, 4, 64, 64, 3), np.uint8)
    red[:] = (200, 50, 50)
    green[:] = (50, 126, 50)
    gray = [cv2.cvtColor(c[0], cv2.COLOR_RGB2GRAY)[0, 0] for c in (red, green)]
    assert abs(int(gray[0]) - int(gray[1])) <= 1  # a luma-only thumbnail would call it a repeat
    frames = sample_frames(np.concatenate([red, green]), max_frames=64)
    assert [f.index for f in frames] == [0, 4]


# --- other inputs ------------------------------------------------------------------------------


def solid(colour: tuple[int, int, int], w: int = 32, h: int = 24) -> np.ndarray:
    return np.full((h, w, 3), colour, np.uint8)


COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]


def test_animated_gif_uses_per_frame_delays(tmp_path: Path) -> None:
    path = tmp_path / "anim.gif"
    pics = [PIL.Image.fromarray(solid(c)) for c in COLOURS]
    pics[0].save(path, save_all=True, append_images=pics[1:], loop=0,
                 duration=[500, 500, 1000, 1000, 500, 500])  # starts 0 .5 1 2 3 3.5; 4 s
    frames = sample_frames(path, max_frames=64, dedupe=False)
    assert [f.index for f in frames] == [1, 2, 3, 5]  # shown at 0.5, 1.5, 2.5, 3.5 s
    assert [f.timestamp for f in frames] == [0.5, 1.0, 2.0, 3.5]
    assert [tuple(f.image.rgb[0, 0]) for f in frames] == [COLOURS[i] for i in (1, 2, 3, 5)]
    assert frames[0].image.source == f"{path}@0.5s"
    assert (frames.total_frames, frames.duration) == (6, 4.0)


def test_gif_zero_delay_plays_as_100_ms_and_still_image_is_one_frame(tmp_path: Path) -> None:
    path = tmp_path / "fast.gif"
    pics = [PIL.Image.fromarray(solid(c)) for c in COLOURS[:3]]
    pics[0].save(path, save_all=True, append_images=pics[1:], duration=0, loop=0)
    frames = sample_frames(path, max_frames=64, fps=None, dedupe=False)
    assert [f.timestamp for f in frames] == [0.0, 0.1, 0.2]
    still = tmp_path / "still.png"
    PIL.Image.fromarray(solid(COLOURS[0])).save(still)
    assert [f.index for f in sample_frames(still, max_frames=8)] == [0]


def test_folder_of_images_in_natural_order(tmp_path: Path) -> None:
    for i in range(1, 12):
        PIL.Image.fromarray(solid(COLOURS[i % 6], 16, 16)).save(tmp_path / f"frame{i}.png")
    (tmp_path / "notes.txt").write_text("not an image")
    frames = sample_frames(tmp_path, max_frames=64, dedupe=False)
    assert [Path(f.image.source).name for f in frames] == [f"frame{i}.png" for i in range(1, 12)]
    assert [f.timestamp for f in frames] == [float(i) for i in range(11)]
    assert frames.native_fps == 1.0 and frames.duration == 11.0
    frames = sample_frames(tmp_path, max_frames=64, frame_rate=2.0, dedupe=False)
    assert [f.index for f in frames] == [0, 2, 4, 6, 8, 10]  # 5.5 s → 6 centred frames
    frames = sample_frames(tmp_path, max_frames=3, dedupe=False)
    assert [f.index for f in frames] == [1, 5, 9]


def test_list_of_images(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    PIL.Image.fromarray(solid(COLOURS[0])).save(path)
    items = [str(path), PIL.Image.fromarray(solid(COLOURS[1])), solid(COLOURS[2])]
    frames = sample_frames(items, max_frames=64, dedupe=False)
    assert [tuple(f.image.rgb[0, 0]) for f in frames] == COLOURS[:3]
    assert frames[0].image.source == str(path) and frames.source == "<list of 3 images>"
    with pytest.raises(MediaError, match="missing.png"):
        sample_frames([str(path), str(tmp_path / "missing.png")], max_frames=64)


def test_numpy_array_of_frames() -> None:
    arr = np.stack(list(moving_ball(20, 32, 24)))
    frames = sample_frames(arr, max_frames=64, frame_rate=10.0, dedupe=False)
    assert [f.index for f in frames] == [5, 15]
    assert [f.timestamp for f in frames] == [0.5, 1.5]
    assert frames[0].image.source == "<frames array>@0.5s"
    assert np.array_equal(frames[0].image.rgb, arr[5])
    assert not np.shares_memory(frames[0].image.rgb, arr)  # the caller's array can be freed
    assert [f.index for f in sample_frames(arr, max_frames=64, dedupe=False)] == list(range(20))


@pytest.mark.parametrize("bad", [
    np.zeros((4, 8, 8, 3), np.float32),
    np.zeros((4, 8, 8), np.uint8),
    np.zeros((8, 8, 3), np.uint8),
    np.zeros((0, 8, 8, 3), np.uint8),
])
def test_bad_arrays_raise(bad: np.ndarray) -> None:
    with pytest.raises(MediaError, match="frames array"):
        sample_frames(bad, max_frames=4)


def test_empty_inputs_raise(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="empty"):
        sample_frames([], max_frames=4)
    empty = tmp_path / "empty_folder"
    empty.mkdir()
    with pytest.raises(MediaError, match="empty_folder"):
        sample_frames(empty, max_frames=4)
    (empty / "readme.txt").write_text("no images here")
    with pytest.raises(MediaError, match="empty_folder"):
        sample_frames(empty, max_frames=4)
    with pytest.raises(MediaError, match="int"):
        sample_frames(42, max_frames=4)  # type: ignore[arg-type]
    with pytest.raises(MediaError, match="not a usable file name"):
        sample_frames("clip\x00.mp4", max_frames=4)


def test_bad_settings_raise() -> None:
    arr = np.zeros((4, 8, 8, 3), np.uint8)
    for kwargs in ({"max_frames": 0}, {"fps": 0.0}, {"max_side": 0}, {"threshold": -1.0},
                   {"frame_rate": 0.0}):
        with pytest.raises(ConfigError):
            sample_frames(arr, **{"max_frames": 4, **kwargs})


# --- broken videos -----------------------------------------------------------------------------


def cut(src: Path, dst: Path, size: int) -> Path:
    dst.write_bytes(src.read_bytes()[:size])
    return dst


def written(dst: Path, data: bytes) -> Path:
    dst.write_bytes(data)
    return dst


def corrupt_moov(src: Path, dst: Path) -> Path:
    data = bytearray(src.read_bytes())
    at = data.index(b"moov")  # mp4v writes its index last: without it nothing can be found
    data[at:at + 200] = b"\xa5" * 200
    return written(dst, bytes(data))


BROKEN: dict[str, Callable[[Path, Path], Path]] = {
    "missing.mp4": lambda clips, d: d / "missing.mp4",
    "zero_bytes.mp4": lambda clips, d: written(d / "zero_bytes.mp4", b""),
    "text.mp4": lambda clips, d: written(d / "text.mp4", b"hello, not a video\n" * 40),
    "first_kb.mp4": lambda clips, d: cut(clips / "ball.mp4", d / "first_kb.mp4", 1024),
    "first_kb.avi": lambda clips, d: cut(clips / "ball.avi", d / "first_kb.avi", 1024),
    "bad_header.mp4": lambda clips, d: corrupt_moov(clips / "ball.mp4", d / "bad_header.mp4"),
    "no_frames.mp4": lambda clips, d: write_video(d / "no_frames.mp4", []),
    "no_frames.avi": lambda clips, d: write_video(d / "no_frames.avi", [], fourcc="MJPG"),
    "unknown_codec.avi": lambda clips, d: written(
        d / "unknown_codec.avi", (clips / "ball.avi").read_bytes().replace(b"MJPG", b"ZZZZ")),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_videos_raise_media_error_naming_the_file(clips: Path, tmp_path: Path,
                                                         name: str) -> None:
    path = BROKEN[name](clips, tmp_path)
    started = time.monotonic()
    with pytest.raises(MediaError, match=name):
        sample_frames(path, max_frames=8)
    assert time.monotonic() - started < 25  # generous, under the test's own timeout


@pytest.mark.timeout(30)
@pytest.mark.parametrize("src", ["ball.mp4", "ball.avi"])
def test_file_cut_in_half_gives_what_is_readable_or_raises(clips: Path, tmp_path: Path,
                                                           src: str) -> None:
    path = cut(clips / src, tmp_path / f"half_{src}", (clips / src).stat().st_size // 2)
    try:
        frames = sample_frames(path, max_frames=64, dedupe=False)
    except MediaError as exc:
        assert f"half_{src}" in str(exc)  # mp4v writes its index (moov) last: nothing to open
    else:
        assert 1 <= len(frames) < 10 and frames.missed == 10 - len(frames)
        assert all(f.index < 60 for f in frames)


def test_damaged_header_bytes_still_give_frames_or_raise(clips: Path, tmp_path: Path) -> None:
    data = bytearray((clips / "ball.avi").read_bytes())
    data[:64] = np.random.default_rng(3).integers(0, 256, 64, dtype=np.uint8).tobytes()
    path = tmp_path / "garbled.avi"
    path.write_bytes(bytes(data))
    try:
        frames = sample_frames(path, max_frames=8, dedupe=False)
    except MediaError as exc:
        assert "garbled.avi" in str(exc)
    else:
        assert 1 <= len(frames) <= 8


def test_damage_in_the_middle_gives_frames_around_it(clips: Path, tmp_path: Path) -> None:
    data = bytearray((clips / "ball.mp4").read_bytes())
    third = len(data) // 3
    data[third:third + 2000] = np.random.default_rng(4).integers(0, 256, 2000, np.uint8).tobytes()
    path = tmp_path / "damaged.mp4"
    path.write_bytes(bytes(data))
    frames = sample_frames(path, max_frames=64, dedupe=False)
    assert 1 <= len(frames) and len(frames) + frames.missed == 10
    assert all(f.timestamp == f.index / 10 for f in frames)


def test_plausible_count() -> None:
    assert video_decode.plausible_count(100.0, 10.0) == 100
    assert video_decode.plausible_count(100.0, None) == 100  # rate unknown, count fine
    for bad in (0.0, -1.0, -192153584101141.0, math.nan, math.inf):
        assert video_decode.plausible_count(bad, 10.0) is None
    assert video_decode.plausible_count(2**31 - 1, 10.0) is None  # ~7 years of video
    assert video_decode.plausible_count(30 * 3600 * 24, 30.0) == 30 * 3600 * 24  # a day is fine


def test_unknown_count_shorter_than_one_step_gives_its_first_frame(tmp_path: Path) -> None:
    src = write_video(tmp_path / "short.avi", moving_ball(3, 32, 24), fourcc="MJPG")
    path = patch_avi(src, tmp_path / "short_nocount.avi", length=0)
    frames = sample_frames(path, max_frames=8)
    assert [f.index for f in frames] == [0] and frames.total_frames == 3


@pytest.mark.parametrize(("scale", "rate"), [(1, 1_000_000), (100_000, 1)])
def test_absurd_frame_rate_samples_by_count_without_timestamps(clips: Path, tmp_path: Path,
                                                               scale: int, rate: int) -> None:
    path = patch_avi(clips / "ball.avi", tmp_path / "odd_rate.avi", scale=scale, rate=rate)
    assert not 0.01 <= cv2.VideoCapture(str(path)).get(cv2.CAP_PROP_FPS) <= 1000
    frames = sample_frames(path, max_frames=4, dedupe=False)
    assert [f.index for f in frames] == [12, 37, 62, 87]
    assert [f.timestamp for f in frames] == [None] * 4
    assert frames[0].image.source == f"{path}#12"
    assert frames.native_fps is None and frames.duration is None and frames.total_frames == 100


@pytest.mark.parametrize("length", [0, 2**31 - 1])
def test_unknown_frame_count_is_scanned_once(clips: Path, tmp_path: Path, length: int) -> None:
    path = patch_avi(clips / "ball.avi", tmp_path / "odd_count.avi", length=length)
    assert cv2.VideoCapture(str(path)).get(cv2.CAP_PROP_FRAME_COUNT) == length
    frames = sample_frames(path, max_frames=64, dedupe=False)
    assert [f.index for f in frames] == list(range(5, 100, 10))
    assert frames.total_frames == 100 and frames.duration == 10.0
    frames = sample_frames(path, max_frames=4, dedupe=False)
    assert len(frames) == 4 and frames.total_frames == 100


# --- long videos, seeking, memory -----------------------------------------------------------


@pytest.fixture(scope="module")
def long_clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """1 and 10 minutes of 64×48 numbered frames at 10 fps (600 and 6000 frames)."""
    d = tmp_path_factory.mktemp("long")
    return {"1min": write_video(d / "1min.mp4", numbered(600)),
            "10min": write_video(d / "10min.mp4", numbered(6000))}


def test_ten_minute_video_samples_fast_and_exactly(long_clips: dict[str, Path]) -> None:
    def timed(name: str) -> float:
        best = float("inf")
        for _ in range(2):  # the faster of two: a busy machine only ever adds time
            started = time.monotonic()
            sample_frames(long_clips[name], max_frames=16, dedupe=False)
            best = min(best, time.monotonic() - started)
        return best

    # seeking costs the same for 10 times the frames; decoding them all would cost 10 times more
    assert timed("10min") < 4 * timed("1min")
    frames = sample_frames(long_clips["10min"], max_frames=16, dedupe=False)
    gap = 6000 / 16
    want = [int(i * gap + gap / 2) for i in range(16)]
    assert [f.index for f in frames] == want
    assert [read_number(f.image.rgb) for f in frames] == want  # the seeks land where asked
    assert frames.duration == 600.0


def test_seek_and_grab_read_the_same_frames(long_clips: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(video_decode, "SEEK_MIN_GAP", 10**9)
    frames = sample_frames(long_clips["1min"], max_frames=8, dedupe=False)
    assert [read_number(f.image.rgb) for f in frames] == [f.index for f in frames]


def test_a_seek_that_lands_elsewhere_falls_back_to_grabbing(
        long_clips: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    class LyingCapture:
        """Reports a wrong position after any seek, as some broken files do."""

        def __init__(self, cap: cv2.VideoCapture) -> None:
            self.cap, self.seeked = cap, False

        def set(self, prop: int, value: float) -> bool:
            self.seeked = True
            return self.cap.set(prop, value)

        def get(self, prop: int) -> float:
            value = self.cap.get(prop)
            return value + 7 if prop == cv2.CAP_PROP_POS_FRAMES and self.seeked else value

        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(self.cap, name)

    real_open = video_decode.open_video
    monkeypatch.setattr(video_decode, "open_video", lambda path, name: LyingCapture(real_open(path, name)))
    frames = sample_frames(long_clips["1min"], max_frames=4, dedupe=False)
    assert [f.index for f in frames] == [75, 225, 375, 525]
    assert [read_number(f.image.rgb) for f in frames] == [75, 225, 375, 525]


def peak_bytes(run: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_length(long_clips: dict[str, Path]) -> None:
    one, ten = (peak_bytes(lambda p=p: sample_frames(p, max_frames=16)) for p in
                (long_clips["1min"], long_clips["10min"]))
    frame_bytes = 64 * 48 * 3
    assert ten < 64 * frame_bytes + 500_000  # 16 kept frames and change, not 6000
    assert abs(ten - one) < 8 * frame_bytes


def test_unknown_count_scan_memory_is_bounded(tmp_path: Path) -> None:
    avis = {}
    for minutes in (1, 10):
        src = write_video(tmp_path / f"{minutes}.avi", numbered(600 * minutes), fourcc="MJPG")
        avis[minutes] = patch_avi(src, tmp_path / f"{minutes}_nocount.avi", length=0)
    peaks = {}
    for minutes, path in avis.items():
        result: list[Frames] = []
        peaks[minutes] = peak_bytes(lambda: result.append(sample_frames(path, max_frames=8,
                                                                         dedupe=False)))
        frames = result[0]
        assert len(frames) == 8 and frames.total_frames == 600 * minutes
        assert [read_number(f.image.rgb) for f in frames] == [f.index for f in frames]
        spacing = np.diff([f.index for f in frames])
        assert spacing.min() > 0.5 * 75 * minutes  # spread over the whole video
    frame_bytes = 64 * 48 * 3
    assert peaks[10] < 3 * 8 * frame_bytes + 500_000  # a reservoir of at most 2×8+1 frames
    assert abs(peaks[10] - peaks[1]) < 8 * frame_bytes


# --- small things ---------------------------------------------------------------------------------


def test_format_timestamp() -> None:
    assert format_timestamp(12.0) == "12.0 s"
    assert format_timestamp(0.04) == "0.0 s"
    assert format_timestamp(3.14159) == "3.1 s"


def test_frame_and_frames_values() -> None:
    image = Image(np.zeros((2, 2, 3), np.uint8), "x@0.0s")
    frame = Frame(0, 0.0, image)
    with pytest.raises(AttributeError):
        frame.index = 1  # type: ignore[misc]
    frames = Frames([frame], sampled=2, dropped=1, duration=1.0, native_fps=2.0, total_frames=2,
                    source="x")
    assert frames == [frame] and frames.dropped == 1 and "array" not in repr(frames)
    assert "array" not in repr(frame)


def test_broken_files_print_nothing_and_log_levels_come_back(clips: Path, tmp_path: Path,
                                                              capfd: pytest.CaptureFixture) -> None:
    before = cv2.utils.logging.getLogLevel()
    half = cut(clips / "ball.avi", tmp_path / "half.avi", (clips / "ball.avi").stat().st_size // 2)
    text = tmp_path / "text.mp4"
    text.write_text("not a video")
    capfd.readouterr()
    sample_frames(half, max_frames=64)
    with pytest.raises(MediaError):
        sample_frames(text, max_frames=4)
    assert capfd.readouterr().err == ""  # FFmpeg's "huffman table decode error" etc. silenced
    assert cv2.utils.logging.getLogLevel() == before
    if video_decode._avutil:
        assert video_decode._avutil.av_log_get_level() != -8  # FFmpeg's level restored too


def test_video_as_bytes_and_data_uri(tmp_path) -> None:
    import base64

    import cv2

    path = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10, (64, 48))
    for i in range(30):
        writer.write(np.full((48, 64, 3), i * 8, dtype=np.uint8))
    writer.release()
    data = path.read_bytes()
    from_bytes = sample_frames(data, max_frames=3, dedupe=False)
    from_uri = sample_frames("data:video/x-msvideo;base64," + base64.b64encode(data).decode(),
                             max_frames=3, dedupe=False)
    from_url = sample_frames(path.as_uri(), max_frames=3, dedupe=False)
    assert [f.index for f in from_bytes] == [f.index for f in from_uri] == [f.index for f in from_url]
    assert len(from_bytes) == 3
    with pytest.raises(MediaError, match="empty"):
        sample_frames(b"")


# --- animations that cost far more to decode than their size on disk ---------------------------


def _load_tool():
    import importlib.util
    import sys

    path = Path(__file__).resolve().parent.parent / "tools" / "make_bad_inputs.py"
    spec = importlib.util.spec_from_file_location("make_bad_inputs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bad_inputs = _load_tool()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", ["gif_huge_canvas", "webp_huge_canvas"])
def test_huge_canvas_animation_is_refused_quickly(tmp_path: Path, make: str) -> None:
    data = getattr(bad_inputs, make)(8000, 8000, 300)  # 300 tiny frames on a 64-Mpixel canvas
    assert len(data) < 20_000
    path = written(tmp_path / ("bomb.gif" if make.startswith("gif") else "bomb.webp"), data)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(MediaError, match="300 frames on a 8000×8000 canvas"):
            sample_frames(path, max_frames=8)
        with pytest.raises(MediaError, match="canvas"):
            sample_frames(data, max_frames=8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 45  # generous: each frame costs a pass over 64 Mpixels: minutes
    assert peak < 50_000_000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", ["gif_huge_canvas", "webp_huge_canvas"])
def test_large_canvas_animation_within_the_limit_is_sampled(make: str) -> None:
    data = getattr(bad_inputs, make)(1500, 1000, 60)  # 6 s at 100 ms a frame
    start = time.perf_counter()
    frames = sample_frames(data, max_frames=4, dedupe=False, max_side=448)
    assert time.perf_counter() - start < 45  # generous, under the test's own timeout
    assert [f.index for f in frames] == [7, 22, 37, 52]
    assert frames.duration == pytest.approx(6.0) and frames.total_frames == 60
    assert all(f.image.rgb.shape == (299, 448, 3) for f in frames)


def test_animation_limit_counts_every_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    data = bad_inputs.gif_huge_canvas(100, 100, 40)
    monkeypatch.setattr(video_decode, "MAX_ANIMATION_PIXELS", 2 * 40 * 16_384 - 1)  # one walk too few
    with pytest.raises(MediaError, match="40 frames on a 100×100 canvas"):
        sample_frames(data, max_frames=4)
    monkeypatch.setattr(video_decode, "MAX_ANIMATION_PIXELS", 2 * 40 * 16_384 + 1)  # no room to convert
    assert len(sample_frames(data, max_frames=4, dedupe=False)) == 4  # walks 40 + 36, converts 4
    with pytest.raises(MediaError, match="pixels decoded"):
        sample_frames(data, max_frames=40, fps=None)  # would convert all 40


def test_animated_webp_uses_per_frame_delays(tmp_path: Path) -> None:
    path = tmp_path / "anim.webp"
    pics = [PIL.Image.fromarray(solid(c)) for c in COLOURS]
    pics[0].save(path, save_all=True, append_images=pics[1:], loop=0, lossless=True,
                 duration=[500, 500, 1000, 1000, 500, 500])
    frames = sample_frames(path, max_frames=64, dedupe=False)
    assert [f.index for f in frames] == [1, 2, 3, 5]
    assert [f.timestamp for f in frames] == [0.5, 1.0, 2.0, 3.5]
    assert [tuple(f.image.rgb[0, 0]) for f in frames] == [COLOURS[i] for i in (1, 2, 3, 5)]


# --- inputs that are not videos, or not files ------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
@pytest.mark.timeout(20)  # opening the FIFO for reading would wait for a writer forever
def test_fifo_and_devices_are_refused_as_what_they_are(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe.mp4"
    os.mkfifo(pipe)
    for src in (pipe, str(pipe), pipe.as_uri()):
        with pytest.raises(MediaError, match="is a FIFO"):
            sample_frames(src, max_frames=4)
    for device in ("/dev/zero", "/dev/null"):
        if os.path.exists(device):
            with pytest.raises(MediaError, match="is a character device, not a file"):
                sample_frames(device, max_frames=4)


def test_memoryview_is_bytes_and_other_types_name_what_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "anim.gif"
    pics = [PIL.Image.fromarray(solid(c)) for c in COLOURS[:3]]
    pics[0].save(path, save_all=True, append_images=pics[1:], duration=1000, loop=0)
    data = path.read_bytes()
    assert len(sample_frames(memoryview(data), max_frames=4, dedupe=False)) == 3
    with pytest.raises(MediaError, match="video file path.*numpy array"):
        sample_frames({"url": str(path)}, max_frames=4)  # type: ignore[arg-type]


def serve(folder: Path) -> tuple[str, Callable[[], None]]:
    """An HTTP server on localhost for ``folder``: its URL and how to stop it."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return f"http://127.0.0.1:{server.server_address[1]}", stop


def test_remote_video_url_says_how_to_allow_it(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pics = [PIL.Image.fromarray(solid(c)) for c in COLOURS[:3]]
    pics[0].save(tmp_path / "clip.gif", save_all=True, append_images=pics[1:], duration=1000)
    url, stop = serve(tmp_path)
    try:
        with pytest.raises(MediaError, match=r"remote URLs are off.*allow_remote=True"):
            sample_frames(f"{url}/clip.gif", max_frames=4)
        # the server is on loopback: refused as any private address is, saying what to do instead
        with pytest.raises(MediaError, match="not a public address.*pass the bytes or a file"):
            sample_frames(f"{url}/clip.gif", max_frames=4, allow_remote=True)
        with pytest.raises(MediaError, match="not a public address"):
            gguf_mcv.load_image(f"{url}/clip.gif", allow_remote=True)
        monkeypatch.setattr(remote, "_is_public", lambda ip: True)  # as if it were public
        frames = sample_frames(f"{url}/clip.gif", max_frames=4, dedupe=False, allow_remote=True)
        assert len(frames) == 3 and frames.source == f"{url}/clip.gif"
        with pytest.raises(MediaError, match="HTTP 404"):
            sample_frames(f"{url}/missing.mp4", max_frames=4, allow_remote=True)
        monkeypatch.setattr(video_sources, "MAX_REMOTE_BYTES", 100)  # refused as it arrives
        with pytest.raises(MediaError, match="larger than 100 bytes"):
            sample_frames(f"{url}/clip.gif", max_frames=4, allow_remote=True)
    finally:
        stop()


# --- habits ------------------------------------------------------------------------------------------


def test_importing_gguf_mcv_does_not_import_opencv() -> None:
    import subprocess
    import sys

    check = "import gguf_mcv, sys; assert 'cv2' not in sys.modules, 'cv2 imported'"
    env = {**os.environ, "PYTHONPATH": CODE_ROOT}  # the gguf_mcv this test imported
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr


_PEAK_CODE = """
import json, sys
from gguf_mcv.errors import GgufMcvError
def status(k): return int(open("/proc/self/status").read().split(k + ":")[1].split()[0]) * 1024
{setup}
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
try:
    {call}
    error = None
except GgufMcvError as exc:
    error = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps({{"grew": status("VmHWM") - base, "error": error}}))
"""


def peak_of(setup: str, call: str) -> tuple[int, str | None]:
    """Bytes the peak RSS of a fresh process grows by during ``call`` (after ``setup``), and the
    GgufMcvError it raised; VmHWM reset first (clear_refs), so the parent's peak does not count."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc to reset the peak")
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _PEAK_CODE.format(setup=setup, call=call)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    return int(out["grew"]), out["error"]


@pytest.fixture(scope="module")
def huge_frames_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-frame MJPG .avi of 9000×9000 flat frames (81 MP, over MAX_PIXELS): a few MB on disk.
    Written by a child process, so this process never holds its frames."""
    import subprocess
    import sys

    path = tmp_path_factory.mktemp("huge") / "huge.avi"
    code = ("import cv2, numpy as np, sys\n"
            "w = cv2.VideoWriter(sys.argv[1], cv2.VideoWriter_fourcc(*'MJPG'), 2.0, (9000, 9000))\n"
            "f = np.full((9000, 9000, 3), 60, np.uint8)\n"
            "[w.write(f) for _ in range(2)]\nw.release()\n")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=600)
    assert 0 < path.stat().st_size < 20 * 2**20
    return path


def test_frames_over_the_pixel_limit_are_refused_before_decoding(huge_frames_video: Path) -> None:
    """The size the container declares is checked first: no 243 MB frame is decoded (it peaked at 1.2 GB),
    and the error names the video."""
    frame_bytes = 9000 * 9000 * 3
    grew, error = peak_of("import cv2\nfrom gguf_mcv.vision.video import sample_frames",
                          f"sample_frames({str(huge_frames_video)!r})")
    assert error is not None and error.startswith("MediaError") and str(huge_frames_video) in error
    assert "9000×9000" in error and "pixel limit" in error
    assert grew < frame_bytes / 2, f"grew {grew / 2**20:.0f} MiB"
