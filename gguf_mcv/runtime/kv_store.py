"""Idle conversations' KV states kept on disk (``serve --keep-chats DIR``), found again by prompt prefix.

A server answers requests that carry their whole history and reuses the KV cache by prompt
prefix; when a slot (or the single sequence) moves on to another conversation, the state it
held is lost, and a restart loses all of them. A :class:`KVStore` keeps such a state — the
units the sequence holds, llama.cpp's state of that one sequence and the recurrent-state
checkpoints — before it is overwritten (and, through the server, when the server stops), and
gives it back when a later prompt starts with more of it than any slot holds.

Each entry is a saved-chat archive (:mod:`gguf_mcv.runtime.saved_chat`'s format and checks: the
model's identity, the units, the state with its SHA-256; no turns) in a folder of bytes values
(:mod:`gguf_mcv.bytes_cache`), as the embedding cache's disk tier: bounded in bytes with
least-recently-used eviction, safe for several processes and threads sharing one folder. The
key is a hash of the model's identity and the units.

What is read is checked before llama.cpp sees it: an entry made by another text model,
quant, projector, vision backend or ``n_ctx`` is ignored (logged once, counted as
``foreign``, left for its own model); a damaged, truncated or unreadable one is ignored,
deleted (counted as ``damaged``) and written again next time; a state llama.cpp refuses is
deleted (``refused``). Writes happen on a background thread (the answer that evicted the
state does not wait for the disk); at most :data:`MAX_PENDING` wait, more are dropped
(``dropped``). A folder that cannot be used never fails an answer: the problem is logged and
the conversation is evaluated again, as without the store.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import queue
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..bytes_cache import UNREADABLE_KEY, UnsafeEntry, open_bytes_cache
from ..errors import ConfigError, SavedChatError
from . import saved_chat
from .sequence import KVState, Unit, n_positions, usable_prefix

log = logging.getLogger(__name__)

#: default size cap of the folder
DEFAULT_MAX_BYTES = 4 * 2**30
#: the smallest cap accepted (diskcache's index alone takes some tens of KiB)
MIN_MAX_BYTES = 2**20
#: a state losing fewer positions than this is not kept: evaluating them again is quick
MIN_POSITIONS = 64
#: states waiting for the writer thread at most; more are dropped
MAX_PENDING = 2
#: key prefix (the format's version is in it)
KEY_PREFIX = "kv1:"
#: what a kept entry's settings say it is
KIND = "kept-state"


@dataclass(frozen=True)
class _Entry:
    """What an entry's header says: the units its state holds, the units of its checkpoints."""

    units: tuple[Unit, ...]
    checkpoints: tuple[tuple[int, int, bytes], ...]


class KVStore:
    """Kept KV states of one model (``identity``: see :meth:`gguf_mcv.Model.identity`) in ``directory``.

    ``n_vocab`` and ``n_ctx`` (positions per sequence) are the model's: entries must fit
    them. ``counts`` holds what happened: ``saved``, ``restored``, ``foreign``, ``damaged``,
    ``refused``, ``dropped``, ``write_failed``.
    """

    def __init__(self, directory: str | os.PathLike, identity: dict[str, Any], *, n_vocab: int, n_ctx: int,
                 max_bytes: int = DEFAULT_MAX_BYTES, min_positions: int = MIN_POSITIONS) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < MIN_MAX_BYTES:
            raise ConfigError(f"The kept-chats size cap must be at least {MIN_MAX_BYTES} bytes (1 MiB), "
                              f"not {max_bytes!r}.")
        if isinstance(min_positions, bool) or not isinstance(min_positions, int) or min_positions < 1:
            raise ConfigError(f"min_positions must be a positive integer, not {min_positions!r}.")
        self.directory = Path(os.fspath(directory)).expanduser()
        self.identity = {**identity, "n_ctx": n_ctx}
        self.n_vocab, self.n_ctx = n_vocab, n_ctx
        self.max_bytes, self.min_positions = max_bytes, min_positions
        self.counts: Counter[str] = Counter()
        # the name is for messages only (the same files can be loaded under other names)
        what = {k: v for k, v in self.identity.items() if k != "name"}
        self._tag = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
        self._index: dict[str, _Entry] = {}  # entries of this model, by key
        self._ignored: set[str] = set()  # keys of other models' entries (looked at once)
        self._unreadable_seen = False  # pickled keys warned about
        self._lock = threading.Lock()
        self._cache = self._open()
        self._pending: "queue.Queue[KVState | None]" = queue.Queue(MAX_PENDING)
        self._writer = threading.Thread(target=self._write_loop, name="gguf_mcv-kv-store", daemon=True)
        self._writer.start()

    def _open(self) -> Any:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            return open_bytes_cache(self.directory, self.max_bytes, cull_limit=4)
        except Exception as exc:  # noqa: BLE001 - sqlite3 / OSError / diskcache's Timeout
            raise ConfigError(f"Cannot keep conversations in {self.directory}: {exc} ({type(exc).__name__}). "
                              "Use a writable folder, or delete this one to start it afresh.") from exc

    # -- the answer path --------------------------------------------------------------

    def key(self, units: Sequence[Unit]) -> str:
        """The key of a state holding ``units`` of this model."""
        h = hashlib.sha256(self._tag.encode())
        h.update(json.dumps([u if isinstance(u, int) else [u.key, u.n_pos] for u in units]).encode())
        return KEY_PREFIX + h.hexdigest()

    def find(self, units: Sequence[Unit], *, better_than: int, partial: bool) -> KVState | None:
        """The kept state that holds most of ``units``' leading units, if that is more than
        ``better_than`` (``partial``: whether the cache can keep part of a state; see
        :func:`gguf_mcv.runtime.sequence.usable_prefix`); checked, or None."""
        if n_positions(units) < self.min_positions:
            return None
        self._refresh()
        with self._lock:
            ranked = sorted(((usable_prefix(KVState(list(e.units), b"", list(e.checkpoints)), units, partial), key)
                             for key, e in self._index.items()), reverse=True)
        for usable, key in ranked:
            if usable <= better_than:
                return None
            state = self._read(key, state=True)
            if state is not None:
                return state
        return None

    def keep(self, state: KVState) -> None:
        """Write ``state`` in the background (dropped, and counted, when the writer is behind)."""
        if n_positions(state.units) < self.min_positions:
            return
        try:
            self._pending.put_nowait(state)
        except queue.Full:
            self._count("dropped")
            log.info("kept chats in %s: the writer is behind, a conversation's state was not kept", self.directory)

    def refused(self, state: KVState, why: str) -> None:
        """llama.cpp (or the checks) refused ``state`` from :meth:`find`: it is deleted."""
        key = self.key(state.units)
        self._count("refused")
        log.warning("kept chats in %s: a kept state could not be restored (%s); it is deleted", self.directory, why)
        self._delete(key)

    def restored(self, state: KVState) -> None:
        """``state`` (from :meth:`find`) now fills a sequence (counted)."""
        self._count("restored")

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the states handed to :meth:`keep` are written; whether they were within ``timeout``."""
        pending = self._pending
        with pending.all_tasks_done:
            return pending.all_tasks_done.wait_for(lambda: pending.unfinished_tasks == 0, timeout)

    def close(self) -> None:
        """Write what is pending, stop the writer and close the folder's files."""
        if self._writer.is_alive():
            self._pending.put(None)
            self._writer.join()
        self._cache.close()

    def disk_usage(self) -> int:
        """Bytes the folder's entries take now."""
        try:
            return int(self._cache.volume())
        except Exception as exc:  # noqa: BLE001 - see _open
            log.warning("kept chats in %s: cannot measure it (%s)", self.directory, exc)
            return 0

    # -- reading ----------------------------------------------------------------------

    def _refresh(self) -> None:
        """Learn the entries other processes (or the writer) added, forget evicted ones."""
        try:
            listed = list(self._cache.iterkeys())
        except Exception as exc:  # noqa: BLE001 - see _open
            log.warning("kept chats in %s: cannot list it (%s)", self.directory, exc)
            return
        keys = {k for k in listed if isinstance(k, str) and k.startswith(KEY_PREFIX)}
        if not self._unreadable_seen and any(k is UNREADABLE_KEY for k in listed):
            self._unreadable_seen = True  # diskcache cannot delete them (their keys are unread): ignored
            self._count("damaged")
            log.warning("kept chats in %s: ignoring entries with pickled keys (never unpickled: gguf_mcv does "
                        "not write them); delete the folder to be rid of them", self.directory)
        with self._lock:
            for gone in set(self._index) - keys:
                del self._index[gone]
            new = keys - set(self._index) - self._ignored
        for key in new:
            self._read(key, state=False)

    def _read(self, key: str, *, state: bool) -> KVState | None:
        """Entry ``key``, checked (only its header unless ``state``); None, with the entry
        ignored or deleted and counted, when it cannot be used."""
        source = f"{self.directory}/{key}"
        try:
            stored = self._cache.get(key, read=True)
        except UnsafeEntry as exc:  # a row naming a file that is not its own: dropped, the file left
            self._unusable(key, False, str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - see _open
            log.warning("kept chats in %s: cannot read an entry (%s)", self.directory, exc)
            return None
        if stored is None:  # evicted meanwhile
            with self._lock:
                self._index.pop(key, None)
            return None
        try:
            with stored if not isinstance(stored, (bytes, str)) else io.BytesIO(_as_bytes(stored)) as f:
                saved = saved_chat.read_from(f, source, n_vocab=self.n_vocab, n_ctx=self.n_ctx, state=state,
                                             turns=False, check=lambda model: self._check_model(model, source))
            if saved.settings.get("kind") != KIND or saved.kv is None:
                raise SavedChatError(f"{source} is not a kept KV state")
        except _Foreign as exc:
            self._unusable(key, True, str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - SavedChatError, an OSError reading a file, anything odd
            self._unusable(key, False, f"{type(exc).__name__}: {exc}")
            return None
        kv = saved.kv
        if key != self.key(kv.units):
            self._unusable(key, False, "its key does not match its units")
            return None
        with self._lock:
            self._index[key] = _Entry(tuple(kv.units), tuple((n, p, b"") for n, p, _ in kv.checkpoints))
        return kv

    def _check_model(self, model: dict[str, Any], source: str) -> None:
        try:
            saved_chat.check_model(model, self.identity, source)
        except SavedChatError as exc:
            raise _Foreign(str(exc)) from None
        if model.get("n_ctx") != self.n_ctx:
            raise _Foreign(f"{source} was made with n_ctx {model.get('n_ctx')!r}; this model has {self.n_ctx}")

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _unusable(self, key: str, foreign: bool, why: str) -> None:
        with self._lock:
            self._index.pop(key, None)
            if foreign:
                self._ignored.add(key)
        if foreign:
            self._count("foreign")
            log.info("kept chats: ignoring an entry of another model (%s)", why)
            return
        self._count("damaged")
        log.warning("kept chats: ignoring and deleting an unusable entry (%s)", why)
        self._delete(key)

    def _delete(self, key: str) -> None:
        with self._lock:
            self._index.pop(key, None)
        try:
            self._cache.delete(key)
        except Exception as exc:  # noqa: BLE001 - see _open
            log.warning("kept chats in %s: cannot delete an entry (%s)", self.directory, exc)

    # -- writing ----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            state = self._pending.get()
            try:
                if state is None:
                    return
                self._write(state)
            except Exception as exc:  # noqa: BLE001 - a disk fault: logged, the answer goes on
                self._count("write_failed")
                log.warning("kept chats in %s: could not write a state (%s: %s)", self.directory,
                            type(exc).__name__, exc)
            finally:
                self._pending.task_done()

    def _write(self, state: KVState) -> None:
        key = self.key(state.units)
        saved = saved_chat.SavedChat(model=self.identity, settings={"kind": KIND}, turns=[], kv=state)
        with tempfile.TemporaryFile(dir=self.directory, prefix=".kv-", suffix=".tmp") as f:
            saved_chat.write_to(f, saved)
            f.seek(0)
            self._cache.set(key, f, read=True)  # diskcache copies it in, then commits its index row
        entry = _Entry(tuple(state.units), tuple((n, p, b"") for n, p, _ in state.checkpoints))
        with self._lock:
            self._index[key] = entry
            # an older state of the same conversation that this one extends is of no more use
            older = [k for k, e in self._index.items()
                     if k != key and len(e.units) < len(entry.units) and entry.units[:len(e.units)] == e.units]
        for k in older:
            self._delete(k)
        self._count("saved")


class _Foreign(SavedChatError):
    """An entry made by another model (or another n_ctx): not ours to use or delete."""


def _as_bytes(stored: bytes | str) -> bytes:
    return stored if isinstance(stored, bytes) else b""  # a str: a text value someone else stored
