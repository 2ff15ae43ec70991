"""A watch's ``--jsonl`` file: JSON lines appended whole, one writer, never a torn line left behind.

Opening checks the file before anything expensive runs: it must be a regular file (a FIFO
would block, a device is not a log) whose existing content is JSON lines, each a JSON object;
a JPEG or any other file is refused untouched. A torn last line (no newline: a watch killed
mid-write, a disk that filled up) that starts as every observation line does is cut away
(:attr:`LinesFile.repaired_bytes`); any other unfinished tail is refused. Each line is then
written whole (one ``os.write`` loop, then ``fsync``); a write that fails (a full disk) is cut
back to the last whole line and raised as :class:`~gguf_mcv.errors.OutputError` naming the
file. An exclusive lock (``filelock``) on ``<file>.lock`` keeps a second watch off it.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import OutputBusyError, OutputError

log = logging.getLogger(__name__)

#: How every line a watch writes starts (:meth:`~gguf_mcv.watch.Observation.to_dict` puts ``time`` first).
LINE_START = b'{"time": '
#: The longest line an existing file may hold: no observation line comes near it, and a binary
#: file without newlines is refused without being read whole.
MAX_LINE_BYTES = 16 * 2**20


class LinesFile:
    """The ``--jsonl`` file of one watch, opened (:meth:`open`, or as a context manager) for :meth:`write`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser()
        self.lines = 0  #: whole lines in the file before this watch
        self.repaired_bytes = 0  #: bytes of a torn last line cut away when opening
        self._fd: int | None = None
        self._lock: Any = None

    def open(self) -> "LinesFile":
        """Open or create the file, take its lock, check its content and cut a torn last line."""
        from filelock import FileLock, Timeout  # lazy: the command's --jsonl only

        if self.path.is_dir():
            raise OutputError(f"--jsonl {self.path} is a folder: name a file (lines are appended to it).")
        lock_path = f"{os.path.realpath(self.path)}.lock"
        try:
            # O_NONBLOCK: a FIFO or device is refused below instead of blocking here
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
            if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                raise OutputError(f"--jsonl {self.path} is not a regular file (a FIFO, device or socket): "
                                  "name a file (lines are appended to it).")
            lock = FileLock(lock_path, timeout=0)
            lock.acquire()
        except Timeout:
            self._close_fd()
            raise OutputBusyError(f"Another watch is writing --jsonl {self.path} (it holds {lock_path}): "
                                  "stop it, or name another file.") from None
        except OutputError:
            self._close_fd()
            raise
        except OSError as exc:
            self._close_fd()
            raise OutputError(f"Cannot write --jsonl {self.path}: {exc.strerror or exc}.") from None
        self._lock = lock
        try:
            self._check_and_repair()
        except BaseException:
            self.close()
            raise
        return self

    def write(self, line: str) -> None:
        """Append ``line`` (one JSON text, without its newline) whole; a failed write leaves the
        file as it was and raises :class:`OutputError` naming it."""
        if self._fd is None:
            raise OutputError(f"--jsonl {self.path} is not open.")
        # a lone surrogate can only sit in a JSON string, where its \\uXXXX escape is still valid JSON
        data = (line + "\n").encode("utf-8", "backslashreplace")
        start = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, start)  # no half line for the next watch to append after
            except OSError:
                pass  # the next open cuts the torn line instead
            raise OutputError(f"Cannot write to --jsonl {self.path}: {exc.strerror or exc} (the lines so far "
                              "are kept, each whole; free some space, or name another file).") from None

    def close(self) -> None:
        """Close the file and release the lock."""
        self._close_fd()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "LinesFile":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _check_and_repair(self) -> None:
        """Refuse a file whose whole lines are not JSON objects; cut a torn observation line at its end."""
        assert self._fd is not None
        whole = 0
        with open(self._fd, "rb", closefd=False) as f:
            f.seek(0)
            number = 0
            while True:
                line = f.readline(MAX_LINE_BYTES + 1)
                if not line.endswith(b"\n"):
                    break
                number += 1
                if line.strip():
                    self._check_line(number, line)
                    self.lines += 1
                whole += len(line)
            tail = line
        if not tail:
            return
        if len(tail) > MAX_LINE_BYTES or not LINE_START.startswith(tail[:len(LINE_START)]):
            raise OutputError(f"--jsonl {self.path} ends with something that is not a line gguf-mcv watch wrote "
                              "(no JSON lines file, or edited): it was left as it is; name another file.")
        os.ftruncate(self._fd, whole)
        self.repaired_bytes = len(tail)
        log.warning("%s: cut a torn last line (%d bytes) left by an interrupted watch", self.path, len(tail))

    def _check_line(self, number: int, line: bytes) -> None:
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            raise OutputError(f"Line {number} of --jsonl {self.path} is not a JSON object: this is not a JSON "
                              "lines file (lines would be appended to it); it was left as it is, name another file.")
