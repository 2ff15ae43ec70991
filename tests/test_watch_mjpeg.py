"""gguf_mcv.watch.mjpeg: MJPEG over HTTP read by us — honest and hostile cameras (lengths, sizes, logins)."""

from __future__ import annotations

import base64

import cv2
import numpy as np
import pytest
from mjpegserver import MjpegServer  # tests/ is on sys.path
from test_video import peak_of

from gguf_mcv.errors import SourceError
from gguf_mcv.watch.mjpeg import MAX_PART_BYTES
from gguf_mcv.watch.sources import open_source


def _jpeg_declaring(width: int, height: int) -> bytes:
    """A small JPEG whose frame header (SOF0) is patched to declare ``width``×``height``."""
    data = bytearray(cv2.imencode(".jpg", np.zeros((16, 16, 3), np.uint8))[1].tobytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def test_mjpeg_parts_without_content_length_are_read() -> None:
    frame = np.zeros((96, 128, 3), np.uint8)
    frame[:, 64:] = 200
    with MjpegServer([frame], fps=25, lengths="none") as server:
        source = open_source(server.url, give_up_s=10, network_timeout_s=2)
        try:
            grab = source.newest(-1, timeout=10)
            assert grab is not None and grab.rgb.shape == (96, 128, 3)
            assert abs(int(grab.rgb[0, 0, 0]) - 0) <= 8 and abs(int(grab.rgb[0, 100, 0]) - 200) <= 8
            later = source.newest(grab.index + 2, timeout=10)
            assert later is not None and source.bad_frames == 0
        finally:
            source.close()


def test_a_stream_login_in_the_url_is_sent_as_basic_auth() -> None:
    with MjpegServer([np.zeros((32, 32, 3), np.uint8)], fps=25) as server:
        url = server.url.replace("http://", "http://admin:p%40ss@")
        source = open_source(url, give_up_s=10, network_timeout_s=2)
        try:
            assert source.newest(-1, timeout=10) is not None
        finally:
            source.close()
        assert server.authorization == "Basic " + base64.b64encode(b"admin:p@ss").decode()


@pytest.mark.parametrize("width, height, shown", [(9000, 9000, "9000×9000"), (20000, 20000, "more than 178 million")])
def test_an_mjpeg_jpeg_declaring_too_many_pixels_is_refused_undecoded(width: int, height: int, shown: str) -> None:
    with MjpegServer([_jpeg_declaring(width, height)], fps=25) as server:
        source = open_source(server.url, give_up_s=10, network_timeout_s=2)
        try:
            with pytest.raises(SourceError, match=f"{shown} pixels.*pixel limit"):
                source.newest(-1, timeout=10)
        finally:
            source.close()


def test_an_http_answer_that_is_not_mjpeg_goes_on_to_opencv() -> None:
    with MjpegServer([np.zeros((32, 32, 3), np.uint8)], fps=25) as server:
        source = open_source(server.url.replace("stream.mjpg", "missing"), give_up_s=0.5, network_timeout_s=1)
        try:
            with pytest.raises(SourceError, match="Could not open"):
                source.newest(-1, timeout=30)
        finally:
            source.close()


def test_a_part_declaring_a_huge_length_is_refused_before_buffering() -> None:
    """Content-Length: 99999999999 and then endless bytes: refused on the header (it peaked at 931 MB)."""
    setup = "from gguf_mcv.watch.sources import open_source"
    call = ("s = open_source({url!r}, give_up_s=5, network_timeout_s=2)\n    try:\n"
            "        s.newest(-1, timeout=60); s.newest(0, timeout=60)\n    finally:\n        s.close()")
    with MjpegServer([np.zeros((240, 320, 3), np.uint8)], fps=25) as honest:
        baseline, error = peak_of(setup, call.format(url=honest.url))
    assert error is None
    with MjpegServer([np.zeros((240, 320, 3), np.uint8)], fps=25, declare=99_999_999_999) as hostile:
        grew, error = peak_of(setup, call.format(url=hostile.url))
    assert error is not None and error.startswith("SourceError") and "99,999,999,999 bytes" in error
    assert "127.0.0.1" in error
    assert grew < baseline + 64 * 2**20, f"grew {grew / 2**20:.0f} MiB, honest stream {baseline / 2**20:.0f} MiB"


def test_a_part_without_length_that_never_ends_is_refused_at_the_limit() -> None:
    endless = b"\xff\xd8" + b"\0" * (MAX_PART_BYTES + 1024)  # no boundary within MAX_PART_BYTES
    with MjpegServer([endless], fps=25, lengths="none") as server:
        source = open_source(server.url, give_up_s=10, network_timeout_s=5)
        try:
            with pytest.raises(SourceError, match="part of more than .* bytes"):
                source.newest(-1, timeout=60)
        finally:
            source.close()
