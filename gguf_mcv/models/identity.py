"""Content identities of model files: the SHA-256 of the whole file, hashed once per file version.

Every derived file and cache entry (ONNX conversions, BF16 copies, stand-ins, image
embeddings, kept and saved chats, batch rows) is keyed by :func:`file_identity`. The
digest is remembered in ``<cache>/identity/`` under the file's (device, inode, size,
mtime_ns, ctime_ns) — ctime too, because tools that copy a file (``cp -p``, ``tar``) set
mtime back but never ctime — so a file version is hashed once (about 1 s per GB) and a
file changed in place is hashed again. A Hub download is never hashed for this: once
:mod:`gguf_mcv.models.hub` has checked it against the Hub's LFS sha256, it records that digest
with :func:`remember`. Each memo entry is one small file written atomically; one that is
damaged, too long or not a regular file is ignored (and rewritten), never trusted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import os
import re
import stat
import tempfile
from pathlib import Path

from .. import environment
from ..cache_files import NotRegularFile, open_regular, read_regular
from ..errors import CorruptModelError, ModelNotFoundError

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
#: a memo entry is a digest and a newline: anything longer is not one of ours
MEMO_MAX_BYTES = 80
_CHUNK = 4 * 2**20


def memo_folder() -> Path:
    """Where digests are remembered: ``<cache_dir>/identity``."""
    return environment.cache_dir() / "identity"


def file_identity(path: str | os.PathLike) -> str:
    """The SHA-256 (hex) of the whole of ``path``: remembered for this version of the file,
    else hashed now and remembered. :class:`ModelNotFoundError` if it does not exist,
    :class:`CorruptModelError` if it is not a regular file or cannot be read."""
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            found = _recall(_key(st))  # a known version is not even opened
            if found is not None:
                return found
        f = open_regular(path, follow_symlinks=True)  # a FIFO must not block the open
    except NotRegularFile:
        raise CorruptModelError(f"{path} is not a regular file (a FIFO, device or folder); "
                                "pass a .gguf file.") from None
    except FileNotFoundError:
        raise ModelNotFoundError(f"Model file {path} does not exist; check the path.") from None
    except OSError as exc:
        raise CorruptModelError(f"Model file {path} cannot be opened ({exc.strerror or exc}).") from None
    with f:
        before = os.fstat(f.fileno())
        try:
            digest = _sha256(f)
        except OSError as exc:
            raise CorruptModelError(f"Model file {path} cannot be read ({exc.strerror or exc}); "
                                    "check the disk or download it again.") from None
        after = os.fstat(f.fileno())
    if _key(after) == _key(before):  # not written to while it was read
        _store(_key(after), digest)
    return digest


def _sha256(f: io.BufferedReader) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while n := f.readinto(buf):
        h.update(view[:n])
    return h.hexdigest()


def known(path: str | os.PathLike) -> str | None:
    """The remembered SHA-256 of this version of ``path``, or None (nothing is hashed)."""
    try:
        return _recall(_key(os.stat(path)))
    except OSError:
        return None


def remember(path: str | os.PathLike, digest: str) -> None:
    """Remember that this version of ``path`` has SHA-256 ``digest`` (one its caller has checked,
    such as the Hub's); best effort: a memo that cannot be written only costs a hash later."""
    if not _SHA256.fullmatch(digest):
        raise ValueError(f"not a SHA-256 hex digest: {digest!r}")
    try:
        st = os.stat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode):
        _store(_key(st), digest)


def _key(st: os.stat_result) -> str:
    return f"{st.st_dev:x}-{st.st_ino:x}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"


def _recall(key: str) -> str | None:
    """The digest of the memo entry ``key``, or None when there is none or it is not sound."""
    try:
        text = read_regular(memo_folder() / key, MEMO_MAX_BYTES)  # no symlink, no FIFO, nothing long
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            logger.debug("file identity memo %s unusable: %s", key, exc)
        return None
    digest = text.strip().decode("ascii", errors="replace")
    return digest if _SHA256.fullmatch(digest) else None


def _store(key: str, digest: str) -> None:
    """Write the memo entry atomically (a temporary file renamed over whatever is there)."""
    folder = memo_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".part")
        try:
            with os.fdopen(fd, "w") as out:
                out.write(digest + "\n")
            os.replace(tmp, folder / key)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        logger.warning("could not remember the SHA-256 of a model file in %s (%s): it is hashed again "
                       "next time", folder, exc)
