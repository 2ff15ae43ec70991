"""gguf_mcv.watch.jsonl: the --jsonl file — whole lines on a full disk, torn tails, files that are not ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_mcv.errors import OutputBusyError, OutputError
from gguf_mcv.watch.jsonl import LinesFile


def _line(i: int, answer: str = "a red car") -> str:
    """A line as ``gguf-mcv watch`` writes it (``time`` first)."""
    return json.dumps({"time": 1.0 + i, "frame": i, "changed": 0.0, "answer": answer}, ensure_ascii=False)


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gguf_mcv", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 64 KiB filesystem (tmpfs) that fills up; skipped where it cannot be mounted."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` until ``leave`` bytes (rounded to pages) are free; the filler file's path."""
    filler = disk / "filler"
    st_ = os.statvfs(disk)
    filler.write_bytes(b"\0" * (st_.f_bavail * st_.f_frsize - leave))
    return filler


def _lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), data[-80:]
    return [json.loads(line) for line in data.splitlines()]


def test_lines_are_appended_whole_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "seen.jsonl"
    with LinesFile(path) as out:
        for i in range(3):
            out.write(_line(i))
        assert out.lines == 0
    with LinesFile(path) as out:
        assert out.lines == 3 and out.repaired_bytes == 0
        out.write(_line(3, "ünïcode \udc80 surrogate"))
    rows = _lines(path)
    assert [r["frame"] for r in rows] == [0, 1, 2, 3] and rows[3]["answer"].endswith("\udc80 surrogate")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=40), min_size=1, max_size=5))
def test_any_answers_read_back_as_the_lines_written(tmp_path_factory: pytest.TempPathFactory,
                                                    answers: list[str]) -> None:
    path = tmp_path_factory.mktemp("any") / "seen.jsonl"
    with LinesFile(path) as out:
        for i, answer in enumerate(answers):
            out.write(_line(i, answer))
    assert [r["answer"] for r in _lines(path)] == answers


def test_a_torn_observation_line_is_cut_and_a_foreign_tail_refused(tmp_path: Path) -> None:
    path = tmp_path / "seen.jsonl"
    whole = (_line(0) + "\n").encode()
    path.write_bytes(whole + _line(1).encode()[:20])  # a watch killed mid-write
    with LinesFile(path) as out:
        assert out.repaired_bytes == 20 and out.lines == 1
        out.write(_line(2))
    assert [r["frame"] for r in _lines(path)] == [0, 2]
    for tail in (b'{"key": "x"', b"\xff\xd8\xff\xe0 not ours", b"plain words"):
        path.write_bytes(whole + tail)
        with pytest.raises(OutputError, match="ends with something that is not a line"):
            LinesFile(path).open()
        assert path.read_bytes() == whole + tail  # left as it is


@pytest.mark.parametrize("content", [
    b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\n\x89 binary \n",  # a JPEG's first bytes
    b"[1, 2]\n",  # JSON, not objects
    b'{"time": 1}\nnot json\n',
    b"x" * (17 * 2**20),  # one enormous line: refused without reading it whole into a line
])
def test_a_file_that_is_not_json_lines_is_refused_untouched(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "photo.jpg"
    path.write_bytes(content)
    with pytest.raises(OutputError, match=r"photo\.jpg"):
        LinesFile(path).open()
    assert path.read_bytes() == content


def test_a_fifo_a_device_and_a_folder_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def try_open(path: Path) -> None:
        try:
            LinesFile(path).open().close()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    for path, match in ((fifo, "not a regular file"), (Path("/dev/null"), "not a regular file"),
                        (tmp_path, "folder")):
        outcome.clear()
        opener = threading.Thread(target=try_open, args=(path,), daemon=True)
        opener.start()
        opener.join(120)  # a FIFO without a reader must not block the open
        assert not opener.is_alive(), f"opening {path} blocked"
        assert isinstance(outcome[0], OutputError) and match in str(outcome[0])


def test_a_second_watch_on_the_same_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "seen.jsonl"
    with LinesFile(path):
        with pytest.raises(OutputBusyError, match="Another watch"):
            LinesFile(tmp_path / "." / "seen.jsonl").open()


def test_a_full_disk_leaves_whole_lines_and_names_the_file(small_disk: Path) -> None:
    path = small_disk / "seen.jsonl"
    filler = _fill(small_disk, leave=4096)
    written = 0
    with LinesFile(path) as out:
        with pytest.raises(OutputError, match=f"{path}.*No space left") as caught:
            for i in range(10_000):
                out.write(_line(i, "an answer " * 8))
                written += 1
    assert "free some space" in str(caught.value)
    assert 0 < written < 10_000 and len(_lines(path)) == written  # the failed line left nothing behind
    filler.unlink()
    with LinesFile(path) as out:  # the next run appends after the last whole line
        assert out.lines == written and out.repaired_bytes == 0
        out.write(_line(written))
    assert len(_lines(path)) == written + 1


def test_the_command_stops_on_a_full_disk_with_whole_lines_and_resumes(tiny, small_disk: Path,
                                                                        tmp_path: Path) -> None:
    clip = tmp_path / "still.avi"  # 10 s of one picture: after the first answer, ticks cost no model call
    writer = cv2.VideoWriter(str(clip), cv2.VideoWriter_fourcc(*"MJPG"), 60.0, (160, 120))
    for _ in range(600):
        writer.write(np.full((120, 160, 3), 90, np.uint8))
    writer.release()
    path = small_disk / "seen.jsonl"
    filler = _fill(small_disk, leave=4096)  # about a dozen lines
    args = ("watch", str(tiny.quants["Q4_K_M"]), str(clip), "--prompt", "?", "--every", "0.01", "--max-tokens",
            "2", "--vision-backend", "llama.cpp", "--jsonl", str(path))
    done = _cli(*args)
    assert done.returncode == 1, done.stderr
    assert str(path) in done.stderr and "No space left" in done.stderr and "Traceback" not in done.stderr
    kept = _lines(path)
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    assert kept and printed == kept  # every line printed is in the file, whole
    filler.unlink()
    again = _cli(*args[:5], "--every", "0.5", *args[7:])  # fewer ticks: room enough now
    assert again.returncode == 0, again.stderr
    assert len(_lines(path)) > len(kept)


def test_the_command_refuses_a_fifo_or_a_jpeg_before_loading(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    photo = tmp_path / "photo.jpg"
    content = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + np.arange(200, dtype=np.uint8).tobytes()
    photo.write_bytes(content)
    # files that exist but are no model: loading them would fail, so the refusal must come first
    model, mmproj = tmp_path / "junk-model.gguf", tmp_path / "junk-mmproj.gguf"
    model.write_bytes(b"not a model")
    mmproj.write_bytes(b"not a projector")
    for target, match in ((fifo, "not a regular file"), (photo, "not a line gguf-mcv watch wrote|not a JSON")):
        done = _cli("watch", str(model), "0", "--mmproj", str(mmproj), "--prompt", "?", "--jsonl", str(target),
                    timeout=120)
        assert done.returncode == 1 and str(target) in done.stderr, done.stderr
        assert any(m in done.stderr for m in match.split("|")) and "junk-" not in done.stderr
    assert photo.read_bytes() == content
