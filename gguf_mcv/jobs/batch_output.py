"""A batch job's results file: JSONL, one locked writer, each line whole on disk before the next item.

Every line is one ``os.write`` of the whole line, then ``fsync``: a job killed at any
moment leaves at most one torn last line, which the next job on the file cuts away
(:meth:`ResultsFile.open`) once the whole lines have been read as results. A line that
is not the torn tail and does not parse, or a tail that does not start as a result
line does, is not ours to delete: the job stops with
:class:`~gguf_mcv.errors.OutputError` instead, the file untouched. An exclusive lock
(``filelock``) on ``<out>.lock``, next to the file a symlinked ``out`` names, keeps a
second job off the same file.
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

_READ_CHUNK = 1024 * 1024
#: how every line :meth:`ResultsFile.write` writes starts (rows begin with their key)
_LINE_START = b'{"key": "'


class ResultsFile:
    """The open results of one job: ``done`` (keys already answered) and :meth:`write`.

    Use as a context manager; the lock is held until it exits.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.done: set[str] = set()
        self.repaired_bytes = 0  #: bytes of a torn last line cut away when opening
        self._fd: int | None = None
        self._lock: Any = None

    def open(self) -> "ResultsFile":
        """Open (or create) the file, take the lock, read the done keys, then cut a torn last line
        (a file that is not a results file is refused untouched)."""
        from filelock import FileLock, Timeout  # lazy: batch jobs only

        if self.path.is_dir():
            raise OutputError(f"Results path {self.path} is a folder: give a file name such as "
                              f"{self.path / 'results.jsonl'}.")
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                self._close_fd()
                raise OutputError(f"Results path {self.path} is not a regular file (a device, FIFO or "
                                  "socket): give a file name for --out.")
            # the file itself, not the name: two names (symlinks) of one file share one lock
            lock_path = f"{os.path.realpath(self.path)}.lock"
            lock = FileLock(lock_path, timeout=0)
            lock.acquire()
        except Timeout:
            self._close_fd()
            raise OutputBusyError(f"Another batch job is writing {self.path} (it holds {lock_path}): "
                                  "wait for it to finish, or write to another --out.") from None
        except OutputError:
            raise
        except OSError as exc:
            self._close_fd()
            raise OutputError(f"Cannot write results to {self.path}: {exc.strerror or exc}. "
                              "Choose a writable --out.") from None
        self._lock = lock
        try:
            end = self._whole_lines_end()
            self.done = self._read_keys(end)
            self._repair(end)
        except BaseException:
            self.close()
            raise
        return self

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` as one JSON line, on disk (fsync) before returning."""
        if self._fd is None:
            raise OutputError(f"Results file {self.path} is not open.")
        text = json.dumps(row, ensure_ascii=False, allow_nan=False)
        try:
            data = (text + "\n").encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (undecodable input text): escaped, still valid JSON
            data = (json.dumps(row, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")
        start = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, start)  # no half line left for the next job to find
            except OSError:
                pass  # the next open() cuts the torn line instead
            raise OutputError(f"Cannot write results to {self.path}: {exc.strerror or exc} (the "
                              "results so far are kept; free space and rerun to resume).") from None
        if row.get("key"):
            self.done.add(str(row["key"]))

    def close(self) -> None:
        """Close the file and release the lock."""
        self._close_fd()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "ResultsFile":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _whole_lines_end(self) -> int:
        """The offset just after the file's last newline (its size when it ends with one)."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        end = size
        while end > 0:
            start = max(0, end - _READ_CHUNK)
            chunk = os.pread(self._fd, end - start, start)
            if end == size and chunk.endswith(b"\n"):
                return size
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            end = start
        return 0

    def _repair(self, end: int) -> None:
        """Cut the line after ``end`` (it has no newline): a write the previous job did not finish.

        Only a tail that starts as every results line does is cut; anything else means the
        file is not a results file, and it is left alone.
        """
        assert self._fd is not None
        torn = os.fstat(self._fd).st_size - end
        if not torn:
            return
        head = os.pread(self._fd, len(_LINE_START), end)
        if not _LINE_START.startswith(head):
            raise OutputError(
                f"The last line of {self.path} is not a batch result line: this file was not written by "
                "gguf-mcv batch, or was edited. Move it away, or give another --out; it was left as it is."
            )
        os.ftruncate(self._fd, end)
        os.fsync(self._fd)
        self.repaired_bytes = torn
        log.warning("%s: cut a torn last line (%d bytes) left by an interrupted job", self.path, torn)

    def _read_keys(self, end: int) -> set[str]:
        """The keys of the lines before offset ``end``; OutputError at a line that is not a result."""
        keys: set[str] = set()
        with open(self.path, "rb") as f:
            number = 0
            while f.tell() < end:
                line = f.readline()
                number += 1
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    key = row["key"]
                    if not isinstance(key, str) or not key:
                        raise ValueError("no key")
                except (ValueError, KeyError, TypeError, RecursionError):
                    raise OutputError(
                        f"Line {number} of {self.path} is not a batch result line: this file was not "
                        "written by gguf-mcv batch, or was edited. Move it away or fix the line."
                    ) from None
                keys.add(key)
        return keys
