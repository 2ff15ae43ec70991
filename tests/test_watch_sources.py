"""gguf_mcv.watch.sources: files, MJPEG-over-HTTP streams, iterables, and how each fails."""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.parse
from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mjpegserver import MjpegServer  # tests/ is on sys.path
from test_video import huge_frames_video  # noqa: F401 - a fixture

from gguf_mcv.errors import ConfigError, SourceError, SourceLostError
from gguf_mcv.watch.sources import STREAM_SCHEMES, IterableSource, check_source, open_source, redact, to_rgb


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
        assert last.index == 19 and time.monotonic() - start > 0.9  # 20 frames at 20 fps: never faster
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
        with pytest.raises(SourceError, match="Could not open .*tried for 0.6 s") as caught:
            source.newest(-1, timeout=10)
        assert not isinstance(caught.value, SourceLostError)  # raised: it gave up before newest's timeout
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


@pytest.mark.parametrize("url, shown", [
    ("http://cam/video.cgi?user=admin&pwd=hunter2", "http://cam/video.cgi?user=***&pwd=***"),
    ("https://cam/x?token=abc123def", "https://cam/x?token=***"),
    ("http://cam/x?password=p4ss&key=k3y&auth=a&sig=s1g&channel=1", "http://cam/x?password=***&key=***&auth=***&sig=***&channel=***"),
    ("rtsp://TOKEN123@cam/live", "rtsp://***@cam/live"),
    ("rtsp://u:p@[::1]:554/live", "rtsp://u:***@[::1]:554/live"),
    ("rtsp://[fe80::1%25eth0]/live#secret", "rtsp://[fe80::1%25eth0]/live#***"),
    ("http://cam/x?SECRETONLY", "http://cam/x?***"),
])
def test_query_secrets_and_token_users_are_masked(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert check_source(url).name == shown


_SAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~"
_secrets = st.text(_SAFE, min_size=8, max_size=24).map(lambda s: "S3" + s)  # never a piece of the URL's frame
_hosts = st.one_of(
    st.from_regex(r"[a-z][a-z0-9-]{0,12}(\.[a-z]{2,5}){0,2}", fullmatch=True),
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
)


@st.composite
def _secret_urls(draw: st.DrawFn) -> tuple[str, list[str]]:
    secrets: list[str] = []
    userinfo = ""
    how = draw(st.sampled_from(["none", "password", "token user"]))
    if how == "password":
        secrets.append(draw(_secrets))
        userinfo = f"{draw(st.sampled_from(['admin', 'root', 'viewer']))}:{secrets[-1]}@"
    elif how == "token user":
        secrets.append(draw(_secrets))
        userinfo = secrets[-1] + "@"
    port = draw(st.one_of(st.none(), st.integers(1, 65535)))
    names = draw(st.lists(st.sampled_from(["user", "pwd", "password", "token", "key", "auth", "sig", "passwd",
                                           "access_token", "apikey", "x"]), max_size=4))
    query = []
    for name in names:
        secrets.append(draw(_secrets))
        query.append(f"{name}={secrets[-1]}")
    if not secrets:
        secrets.append(draw(_secrets))
        query.append(secrets[-1])  # a bare token as the query
    host = draw(_hosts)
    url = (f"{draw(st.sampled_from(STREAM_SCHEMES))}://{userinfo}{host}{'' if port is None else f':{port}'}"
           f"/{draw(st.sampled_from(['live', 'video.cgi', 'a/b/stream.mjpg', '']))}"
           + ("?" + "&".join(query) if query else ""))
    return url, secrets


@settings(max_examples=300, deadline=None)
@given(_secret_urls())
def test_no_secret_of_a_generated_url_shows_and_the_host_stays(case: tuple[str, list[str]]) -> None:
    url, secrets = case
    shown = redact(url)
    messages = [shown, check_source(url).name]
    with pytest.raises(ConfigError) as refused:  # the other scheme's message names the URL too
        check_source("ftp" + url[url.index("://"):])
    messages.append(str(refused.value))
    for text in messages:
        for secret in secrets:
            assert secret not in text, (url, text)
    before, after = urllib.parse.urlsplit(url), urllib.parse.urlsplit(shown)
    assert (after.scheme, after.hostname, after.port, after.path) == (before.scheme, before.hostname, before.port,
                                                                      before.path)


def test_a_stream_that_fails_never_shows_its_secrets(caplog: pytest.LogCaptureFixture,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """What the user sees when the camera is down: the error, our logs and OpenCV's own lines."""
    secrets = ("S3cretPassw0rd", "S3cretT0ken", "S3cretUser")
    port = _free_port()
    urls = (f"http://admin:{secrets[0]}@127.0.0.1:{port}/video.mjpg?token={secrets[1]}",
            f"rtsp://{secrets[2]}@127.0.0.1:{port}/live?pwd={secrets[0]}")
    caplog.set_level(logging.DEBUG)
    for url in urls:
        source = open_source(url, give_up_s=0.3, network_timeout_s=1)
        try:
            with pytest.raises(SourceError) as caught:
                source.newest(-1, timeout=10)
        finally:
            source.close()
        seen = str(caught.value) + caplog.text + "".join(capfd.readouterr())
        assert "127.0.0.1" in str(caught.value)
        assert not [s for s in secrets if s in seen], seen


def test_a_stop_request_ends_the_wait_for_a_frame() -> None:
    """``newest(stop=)``: a watch stopped from another thread is not held for give_up_s."""
    server = MjpegServer([np.zeros((64, 64, 3), np.uint8)], fps=25).start()
    source = open_source(server.url, give_up_s=60, network_timeout_s=2)
    stop = threading.Event()
    try:
        first = source.newest(-1, timeout=10)
        assert first is not None
        server.stop()  # no frame will come: only the stop request can end the wait
        threading.Timer(0.3, stop.set).start()
        assert source.newest(first.index + 10**6, timeout=60, stop=stop) is None
    finally:
        source.close()
        server.stop()
    iterable = IterableSource([np.zeros((8, 8, 3), np.uint8)])
    assert iterable.newest(-1, timeout=1, stop=stop) is None


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


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), 1e9, "5", 10**400, -10**400, 1e-300])
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


def test_a_huge_grey_frame_is_refused_before_it_is_expanded() -> None:
    from test_video import peak_of

    side = 20_000
    grew, error = peak_of(f"import numpy as np\nfrom gguf_mcv.watch.sources import IterableSource\n"
                          f"a = np.ones(({side}, {side}), np.uint8)",
                          "IterableSource([a]).newest(-1, timeout=1)")
    assert error is not None and error.startswith("SourceError") and "Frame 0" in error and f"{side}×{side}" in error
    assert grew < side * side / 2, f"grew {grew / 2**20:.0f} MiB over the frame itself"
    assert to_rgb(np.zeros((8001, 8000), np.uint8)) is None  # over MAX_PIXELS: not converted


def test_a_video_of_huge_frames_is_refused_naming_it(huge_frames_video: Path) -> None:  # noqa: F811 - the imported fixture
    from test_video import peak_of

    grew, error = peak_of("from gguf_mcv.watch.sources import open_source",
                          f"s = open_source({str(huge_frames_video)!r})\n    try:\n        s.newest(-1, timeout=60)\n"
                          "    finally:\n        s.close()")
    assert error is not None and error.startswith("SourceError") and str(huge_frames_video) in error
    assert "9000×9000" in error
    assert grew < 9000 * 9000 * 3 / 2, f"grew {grew / 2**20:.0f} MiB"

