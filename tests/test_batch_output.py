"""batch_output: whole lines on disk, a torn tail cut, damaged lines refused, one writer at a time."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_mcv.errors import OutputBusyError, OutputError
from gguf_mcv.jobs import batch_output
from gguf_mcv.jobs.batch_output import ResultsFile


def _row(key: str, **extra) -> dict:
    return {"key": key, "input": f"{key}.png", **extra}


def test_rows_are_appended_and_read_back_as_done(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    with ResultsFile(out) as results:
        assert results.done == set()
        results.write(_row("a", answer="ünïcode ✓"))
        results.write(_row("b", prompt="\udcff lone surrogate"))
    lines = out.read_bytes().splitlines()
    assert json.loads(lines[0])["answer"] == "ünïcode ✓"
    assert json.loads(lines[1])["prompt"] == "\udcff lone surrogate"  # escaped, still valid JSON
    with ResultsFile(out) as results:
        assert results.done == {"a", "b"} and results.repaired_bytes == 0


def test_torn_last_line_is_cut_and_whole_lines_kept(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    whole = (json.dumps(_row("a")) + "\n" + json.dumps(_row("b")) + "\n").encode()
    out.write_bytes(whole + b'{"key": "c", "inp')
    with ResultsFile(out) as results:
        assert results.done == {"a", "b"} and results.repaired_bytes == len(b'{"key": "c", "inp')
    assert out.read_bytes() == whole


def test_file_of_only_a_torn_line_becomes_empty(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    out.write_bytes(b'{"key": "x"' + b"y" * (3 * 1024 * 1024))  # longer than one read chunk
    with ResultsFile(out) as results:
        assert results.done == set()
    assert out.read_bytes() == b""


def test_damaged_middle_line_is_refused_and_the_file_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    content = (json.dumps(_row("a")) + "\nnot json at all\n" + json.dumps(_row("b")) + "\n").encode()
    out.write_bytes(content)
    with pytest.raises(OutputError, match="Line 2"):
        ResultsFile(out).open()
    out.write_bytes(b'{"no_key": 1}\n')
    with pytest.raises(OutputError, match="Line 1"):
        ResultsFile(out).open()
    with ResultsFile(out.with_name("other.jsonl")):  # the lock of the refused file was released
        pass
    out.write_bytes(content)
    with pytest.raises(OutputError):
        ResultsFile(out).open()
    assert out.read_bytes() == content
    with pytest.raises(OutputError):  # released after the refusal too: a second try reports the same
        ResultsFile(out).open()


def test_second_writer_in_another_process_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    code = ("import sys; from gguf_mcv.jobs.batch_output import ResultsFile; from gguf_mcv.errors import OutputBusyError\n"
            "try:\n    ResultsFile(sys.argv[1]).open()\nexcept OutputBusyError as e:\n    print('busy:', e)\n")
    with ResultsFile(out) as results:
        results.write(_row("a"))
        done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                              timeout=60, env=os.environ)
        assert done.stdout.startswith("busy: Another batch job is writing"), done.stderr
        with pytest.raises(OutputBusyError):
            ResultsFile(out).open()  # a second writer in this process too
    with ResultsFile(out) as results:  # free again once the first has finished
        assert results.done == {"a"}


@pytest.mark.parametrize("where", ["folder", "under_a_file", "missing_dir", "fifo", "device"])
def test_unwritable_output_is_a_clean_error(tmp_path: Path, where: str) -> None:
    (tmp_path / "plain").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    out = {"folder": tmp_path, "under_a_file": tmp_path / "plain" / "r.jsonl",
           "missing_dir": tmp_path / "no" / "such" / "r.jsonl", "fifo": tmp_path / "fifo",
           "device": Path("/dev/null")}[where]
    with pytest.raises(OutputError):
        ResultsFile(out).open()


def test_disk_full_mid_line_leaves_no_torn_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "r.jsonl"
    real_write = os.write

    def half_then_full(fd: int, data) -> int:
        if len(data) > 10:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    with ResultsFile(out) as results:
        results.write(_row("a"))
        before = out.read_bytes()
        monkeypatch.setattr(batch_output.os, "write", half_then_full)
        with pytest.raises(OutputError, match="No space left"):
            results.write(_row("b", answer="x" * 100))
        monkeypatch.setattr(batch_output.os, "write", real_write)
        assert out.read_bytes() == before and results.done == {"a"}
        results.write(_row("c"))
    with ResultsFile(out) as results:
        assert results.done == {"a", "c"}


def test_write_after_close_is_refused(tmp_path: Path) -> None:
    results = ResultsFile(tmp_path / "r.jsonl").open()
    results.close()
    with pytest.raises(OutputError, match="not open"):
        results.write(_row("a"))


@pytest.mark.parametrize("content", [b"image,prompt\na.png,what?\nb.png,and this?",  # no newline at the end
                                     b"image,prompt\na.png,what?\n", b"just one line", b"\n\nhello"])
def test_a_file_that_is_not_a_results_file_is_refused_untouched(tmp_path: Path, content: bytes) -> None:
    out = tmp_path / "in.csv"
    out.write_bytes(content)
    with pytest.raises(OutputError, match="not a batch result line"):
        ResultsFile(out).open()
    assert out.read_bytes() == content


def test_a_symlinked_out_is_locked_as_the_file_it_names(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    (tmp_path / "link.jsonl").symlink_to(out)
    with ResultsFile(out) as results:
        results.write(_row("a"))
        with pytest.raises(OutputBusyError):
            ResultsFile(tmp_path / "link.jsonl").open()
    with ResultsFile(tmp_path / "link.jsonl") as results:
        assert results.done == {"a"}
