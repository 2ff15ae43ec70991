"""File identities: the whole file's SHA-256, hashed once per file version, the memo never trusted blindly."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from gguf_mcv.errors import CorruptModelError, ModelNotFoundError
from gguf_mcv.models import identity
from gguf_mcv.runtime.engine import file_identity  # the engine's, loader's and model's name for it

MIB = 2**20


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _no_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(f):
        raise AssertionError("the file was hashed again")

    monkeypatch.setattr(identity, "_sha256", refuse)


@pytest.fixture
def big(tmp_path: Path) -> Path:
    """A 5 MiB file: larger than the first and last MiB the old identity read."""
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(5 * MIB))
    return path


def test_a_retuned_projector_of_the_same_size_has_another_identity(tiny, retuned_mmproj: Path) -> None:
    assert file_identity(retuned_mmproj) == _sha(retuned_mmproj)
    assert file_identity(tiny.mmproj) == _sha(Path(tiny.mmproj))
    assert file_identity(retuned_mmproj) != file_identity(tiny.mmproj)


def test_a_file_version_is_hashed_once(big: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = file_identity(big)
    assert first == _sha(big) and identity.known(big) == first
    _no_hashing(monkeypatch)
    assert file_identity(big) == first
    assert file_identity(os.fspath(big)) == first


def test_a_file_changed_in_place_is_hashed_again(big: Path) -> None:
    before = file_identity(big)
    st = big.stat()
    with open(big, "r+b") as f:  # the same size, one byte in the middle
        f.seek(2 * MIB)
        byte = f.read(1)
        f.seek(2 * MIB)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert big.stat().st_size == st.st_size
    assert file_identity(big) == _sha(big) != before


def test_a_copy_with_its_mtime_set_back_is_not_taken_for_the_original(big: Path, tmp_path: Path) -> None:
    """``cp -p`` over a file keeps size and mtime; ctime still tells the versions apart."""
    before = file_identity(big)
    st = big.stat()
    other = os.urandom(st.st_size)
    with open(big, "r+b") as f:
        f.write(other)
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert big.stat().st_mtime_ns == st.st_mtime_ns
    assert file_identity(big) == hashlib.sha256(other).hexdigest() != before


def _memo_entry(path: Path) -> Path:
    return identity.memo_folder() / identity._key(path.stat())


@pytest.mark.parametrize("damage", ["garbage", "empty", "oversized", "wrong-length", "fifo", "symlink",
                                    "folder"])
def test_a_damaged_memo_entry_is_ignored_and_the_file_hashed(big: Path, tmp_path: Path, damage: str) -> None:
    want = file_identity(big)
    entry = _memo_entry(big)
    entry.unlink()
    lie = "0" * 64 + "\n"
    if damage == "garbage":
        entry.write_bytes(b"\xff\x00not a digest")
    elif damage == "empty":
        entry.write_bytes(b"")
    elif damage == "oversized":
        entry.write_bytes(lie.encode() + b"x" * 10 * MIB)
    elif damage == "wrong-length":
        entry.write_text("ab" * 31 + "\n")
    elif damage == "fifo":
        os.mkfifo(entry)  # opening it for reading would block without O_NONBLOCK
    elif damage == "symlink":
        (tmp_path / "elsewhere").write_text(lie)
        entry.symlink_to(tmp_path / "elsewhere")
    else:
        entry.mkdir()
    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(file_identity(big)), daemon=True)
    worker.start()
    worker.join(30)
    assert result == [want]
    if damage != "folder":  # rewritten as a sound entry
        assert entry.is_file() and not entry.is_symlink() and entry.read_text() == want + "\n"


def test_a_memo_folder_that_cannot_be_written_costs_only_a_hash(big: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("GGUF_MCV_CACHE", str(blocked))
    assert file_identity(big) == _sha(big) == file_identity(big)
    assert identity.known(big) is None
    identity.remember(big, _sha(big))  # best effort, no error


def test_remember_vouches_for_a_digest_without_reading(big: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = _sha(big)
    identity.remember(big, digest)
    _no_hashing(monkeypatch)
    assert file_identity(big) == digest
    with pytest.raises(ValueError):
        identity.remember(big, "not-a-digest")


def test_missing_and_non_regular_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        file_identity(tmp_path / "nope.gguf")
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with pytest.raises(CorruptModelError, match="not a regular file"):
        file_identity(fifo)
    with pytest.raises(CorruptModelError, match="not a regular file"):
        file_identity(tmp_path)
