"""gguf_mcv.watch.sources: files, MJPEG-over-HTTP streams, iterables, and how each fails."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from mjpegserver import MjpegServer  # tests/ is on sys.path

from gguf_mcv.errors import ConfigError, SourceError, SourceLostError
from gguf_mcv.watch.sources import IterableSource, check_source, open_source, redact, to_rgb


def write_avi(path: Path, n: int = 20, fps: float = 20.0, size: tuple[int, int] = (160, 120)) -> Path:
    """An MJPG .avi whose frame i is filled with grey level 10 * i."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, size)
    for i in range(n):
        writer.write(np.full((size[1], size[0], 3), 10 * i % 256, np.uint8))
    writer.release()
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_video_file_plays_at_its_frame_rate_and_ends(tmp_path: Path) -> None:
    source = open_source(write_avi(tmp_path / "clip.avi", n=20, fps=20.0))
    try:
        start = time.monotonic()
        first = source.newest(-1, timeout=5)
        assert first is not None and first.index == 0 and first.rgb.shape == (120, 160, 3)
        assert first.rgb.dtype == np.uint8
        time.sleep(0.3)  # ~6 frames go by: the newest is handed out, the others are skipped
        later = source.newest(first.index, timeout=5)
        assert later is not None and later.index >= 2
        assert abs(int(later.rgb[0, 0, 0]) - 10 * later.index) <= 3  # the frame of that index
        last = later
        while (grab := source.newest(last.index, timeout=5)) is not None:
            last = grab
        assert last.index == 19 and 0.9 < time.monotonic() - start < 10  # 20 frames at 20 fps: ~1 s
    finally:
        source.close()


def test_a_missing_or_unreadable_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="does not exist"):
        check_source(tmp_path / "nope.mp4")
    with pytest.raises(SourceError, match="folder"):
        check_source(tmp_path)
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"this is not a video" * 100)
    source = open_source(junk)
    try:
        with pytest.raises(SourceError, match="cannot read video file"):
            source.newest(-1, timeout=10)
    finally:
        source.close()


def test_an_mjpeg_stream_that_drops_is_reopened() -> None:
    frames = [np.full((96, 128, 3), v, np.uint8) for v in (20, 220)]
    server = MjpegServer(frames, fps=25).start()
    source = open_source(server.url, give_up_s=10, network_timeout_s=2)
    try:
        first = source.newest(-1, timeout=10)
        assert first is not None and first.rgb.shape == (96, 128, 3) and source.reconnects == 0
        server.stop()
        time.sleep(0.5)
        server.start()  # the same port
        grab = source.newest(first.index + 3, timeout=15)
        assert grab is not None and source.reconnects >= 1
    finally:
        source.close()
        server.stop()


def test_a_stream_that_never_opens_gives_up_with_a_clear_error() -> None:
    source = open_source(f"http://127.0.0.1:{_free_port()}/stream.mjpg", give_up_s=0.6, network_timeout_s=1)
    try:
        start = time.monotonic()
        with pytest.raises(SourceError, match="Could not open .*tried for 0.6 s") as caught:
            source.newest(-1, timeout=10)
        assert not isinstance(caught.value, SourceLostError) and time.monotonic() - start < 5
    finally:
        source.close()


def test_a_stream_that_dies_is_lost_after_give_up_s() -> None:
    """The unplugged camera: frames, then nothing, then SourceLostError (not a hang, not every hiccup)."""
    server = MjpegServer([np.zeros((64, 64, 3), np.uint8)], fps=25).start()
    source = open_source(server.url, give_up_s=0.8, network_timeout_s=1)
    try:
        first = source.newest(-1, timeout=10)
        assert first is not None
        server.stop()
        with pytest.raises(SourceLostError, match="stopped delivering frames.*give_up_s"):
            for _ in range(1000):
                grab = source.newest(first.index, timeout=10)
                assert grab is not None
                first = grab
    finally:
        source.close()


def test_a_password_never_shows_in_messages() -> None:
    assert redact("rtsp://admin:hunter2@10.0.0.5:554/live") == "rtsp://admin:***@10.0.0.5:554/live"
    assert redact("http://cam.local/mjpg") == "http://cam.local/mjpg"
    assert check_source("rtsp://admin:hunter2@10.0.0.5/live").name == "rtsp://admin:***@10.0.0.5/live"


def test_sources_are_recognised() -> None:
    assert check_source(0).kind == "camera" and check_source("2").target == 2
    assert check_source("/dev/video1").kind == "camera"
    assert check_source("rtsp://cam/live").kind == "stream" and check_source("HTTPS://cam/x").kind == "stream"
    assert check_source([np.zeros((4, 4, 3), np.uint8)]).kind == "frames"


@pytest.mark.parametrize("bad, match", [
    (True, "bool"), (-1, "0 or more"), (b"video.mp4", "bytes"), ({"a": 1}, "dict"), (3.5, "float"),
    ("", "empty"), ("ftp://host/video", "scheme"), (None, "NoneType"),
])
def test_wrong_sources_are_refused(bad: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_source(bad)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), 1e9, "5"])
def test_bad_give_up_times_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="give_up_s"):
        open_source([np.zeros((4, 4, 3), np.uint8)], give_up_s=bad)  # type: ignore[arg-type]


def test_an_iterable_gives_one_frame_per_request_and_copies_it() -> None:
    buffer = np.zeros((8, 8, 3), np.uint8)
    source = IterableSource([buffer, buffer])
    first = source.newest(-1, timeout=1)
    buffer[:] = 255  # the caller refills its buffer: the frame handed out does not change
    assert first is not None and first.index == 0 and int(first.rgb.max()) == 0
    second = source.newest(99, timeout=1)
    assert second is not None and second.index == 1 and int(second.rgb.min()) == 255
    assert source.newest(1, timeout=1) is None


def test_a_corrupt_frame_in_an_iterable_is_a_clear_error() -> None:
    source = IterableSource([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8, 3), np.float32)])
    assert source.newest(-1, timeout=1) is not None
    with pytest.raises(SourceError, match="Frame 1 of the frames given cannot be used.*dtype float32"):
        source.newest(0, timeout=1)


def test_an_iterable_that_raises_ends_with_source_lost() -> None:
    def frames():
        yield np.zeros((8, 8, 3), np.uint8)
        raise OSError("USB device gone")

    source = IterableSource(frames())
    source.newest(-1, timeout=1)
    with pytest.raises(SourceLostError, match="USB device gone"):
        source.newest(0, timeout=1)


def test_opencv_frames_become_rgb_or_are_refused() -> None:
    bgr = np.zeros((2, 2, 3), np.uint8)
    bgr[..., 0] = 255  # blue in OpenCV's order
    assert to_rgb(bgr)[0, 0].tolist() == [0, 0, 255]
    assert to_rgb(np.full((2, 2), 7, np.uint8)).shape == (2, 2, 3)
    assert to_rgb(np.full((2, 2, 3), 65535, np.uint16)).max() == 255
    assert to_rgb(np.zeros((2, 2, 4), np.uint8)).shape == (2, 2, 3)
    for bad in (None, np.zeros((0, 0, 3), np.uint8), np.zeros((2, 2, 3), np.float32), np.zeros((2, 2, 2), np.uint8)):
        assert to_rgb(bad) is None
