"""The file a saved conversation lives in: written atomically, read back only after checks.

A saved chat is a zip archive (stdlib ``zipfile``: every member carries a CRC-32, so a
damaged or truncated file is noticed) holding:

* ``chat.json`` — the format and version, the identity of the model it was made with
  (text model file, quant, projector, vision backend), the chat's settings, its turns
  (role, text, the digests of their images) and what the KV cache held (the engine's
  units: a token id, or an image chunk's cache key and width);
* ``state.bin`` — llama.cpp's state of the KV-cache sequence (absent when the model's
  cache held another conversation when it was saved), with its SHA-256 in ``chat.json``,
  and ``checkpoint-N.bin``, the engine's checkpoints of a recurrent state (MiniCPM-V 4.6),
  which let a follow-up go back a little way without evaluating everything again;
* ``images/<digest>.png`` — each image of the conversation, lossless, so that a
  follow-up can lay the prompt out again without encoding anything.

Everything read is checked before it reaches llama.cpp: that the path is a regular file
(a FIFO or a device is refused unopened), member sizes against limits (before reading;
``chat.json``'s scales with the context), the images' pixels in all against a budget
(from their headers, before any is decoded), the state's length and checksum, token ids
against the vocabulary, image digests against their pixels. Any failure is a
:class:`SavedChatError` that says what is wrong and what to do.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Sequence

import numpy as np
import PIL.Image

from ..cache_files import NotRegularFile, open_regular
from ..errors import MediaError, SavedChatError
from ..hardware import available_ram
from ..prompt import plaintext
from ..vision.media import Image, load_image, open_pil
from .sequence import ImageUnit, KVState, Unit

FORMAT = "gguf_mcv.chat"
VERSION = 1
#: ``chat.json`` may not be larger than this (uncompressed), whatever the context; see :func:`json_limit`
MAX_JSON_BYTES = 32 * 2**20
#: ``chat.json`` bytes allowed per position of the context (a token's unit and its text, JSON-escaped)
JSON_BYTES_PER_POSITION = 64
#: one stored image may not be larger than this (its PNG)
MAX_IMAGE_BYTES = 256 * 2**20
#: at most this many images in one saved conversation
MAX_IMAGES = 4096
#: the images of one saved conversation may hold this many pixels in all (3 bytes each decoded);
#: less when the machine has less memory available (see :func:`pixel_budget`)
MAX_CHAT_PIXELS = 256_000_000
#: the KV state is never larger than this, whatever the machine (checked before reading)
MAX_STATE_BYTES = 16 * 2**30
#: at most this many recurrent-state checkpoints (the engine keeps 2)
MAX_CHECKPOINTS = 8


@dataclass
class SavedChat:
    """What a saved-chat file holds, checked (see the module doc)."""

    model: dict[str, Any]
    settings: dict[str, Any]
    turns: list[tuple[str, str, tuple[Image, ...]]]
    kv: KVState | None = None
    images: dict[str, Image] = field(default_factory=dict)


def write(path: str | os.PathLike, saved: SavedChat) -> Path:
    """Write ``saved`` to ``path`` atomically (a temporary file in the same folder, then a
    rename): a crash or a full disk leaves the old file, or none, never half of one."""
    target = _as_path(path)
    tmp: str | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            write_to(f, saved)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise SavedChatError(f"Could not save the conversation to {target}: {exc.strerror or exc}. "
                             "Check that the folder exists, is writable and has free space.") from exc
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return target


def write_to(f: IO[bytes], saved: SavedChat) -> None:
    """Write ``saved`` as a saved-chat archive into the open binary file ``f`` (not atomic:
    :func:`write` makes it so for a path)."""
    header = {
        "format": FORMAT, "version": VERSION, "model": saved.model, "settings": saved.settings,
        "turns": [{"role": role, "text": text, "images": [im.digest for im in images]}
                  for role, text, images in saved.turns],
        "units": None if saved.kv is None else [u if isinstance(u, int) else [u.key, u.n_pos]
                                                for u in saved.kv.units],
        "state": None if saved.kv is None else {
            **_blob_meta(saved.kv.data),
            "checkpoints": [{"n_units": n, "n_pos": p, **_blob_meta(d)} for n, p, d in saved.kv.checkpoints]},
    }
    images = {im.digest: im for _, _, ims in saved.turns for im in ims}
    with zipfile.ZipFile(f, "w") as zf:
        zf.writestr("chat.json", json.dumps(header), compress_type=zipfile.ZIP_DEFLATED)
        if saved.kv is not None:
            zf.writestr("state.bin", saved.kv.data, compress_type=zipfile.ZIP_STORED)
            for i, (_, _, data) in enumerate(saved.kv.checkpoints):
                zf.writestr(f"checkpoint-{i}.bin", data, compress_type=zipfile.ZIP_STORED)
        for digest, image in images.items():
            zf.writestr(f"images/{digest}.png", _png(image), compress_type=zipfile.ZIP_STORED)


def read(path: str | os.PathLike, *, n_vocab: int, n_ctx: int, max_state_bytes: int = MAX_STATE_BYTES) -> SavedChat:
    """The checked contents of the saved chat at ``path``; :class:`SavedChatError` if unusable.

    ``n_vocab`` and ``n_ctx`` are the loaded model's: token ids and positions must fit them.
    """
    source = _as_path(path)
    try:
        # the user's path: a symlink is followed; a FIFO is refused without waiting for a writer
        f = open_regular(source, follow_symlinks=True)
    except NotRegularFile as exc:
        kind = "a folder" if stat.S_ISDIR(exc.mode) else "a FIFO, device or socket"
        raise SavedChatError(f"{source} is {kind}, not a saved conversation: give the path of a file "
                             "Chat.save wrote.") from None
    except FileNotFoundError:
        raise SavedChatError(f"No saved conversation at {source}: check the path.") from None
    except (OSError, ValueError) as exc:
        raise SavedChatError(f"Cannot open the saved conversation {source}: "
                             f"{getattr(exc, 'strerror', None) or exc}. Check the path and its permissions.") from None
    with f:
        return read_from(f, source, n_vocab=n_vocab, n_ctx=n_ctx, max_state_bytes=max_state_bytes)


def read_from(f: Path | IO[bytes], source: str | os.PathLike, *, n_vocab: int, n_ctx: int,
              max_state_bytes: int = MAX_STATE_BYTES, state: bool = True, turns: bool = True,
              check: Callable[[dict[str, Any]], None] | None = None) -> SavedChat:
    """The checked contents of the saved chat in ``f`` (a path to a regular file, or a seekable
    binary file; ``source`` names it in messages); :class:`SavedChatError` if unusable. With
    ``state=False`` only ``chat.json`` is read: the KV state's units and checkpoint positions
    come back with empty data (enough to decide whether the state is worth reading). With
    ``turns=False`` a file that holds turns is refused, none of its images read (a kept KV
    state has none). ``check`` sees the file's model identity first, before anything else is
    read or checked, and may raise."""
    where = Path(os.fspath(source))
    try:
        with zipfile.ZipFile(f) as zf:
            header = _header(zf, where, json_limit(n_ctx))
            if check is not None:
                check(_typed(header.get("model"), dict, "model", where))
            if not turns and header.get("turns"):
                raise _damaged(where, "it holds turns, and a kept KV state has none")
            return _contents(zf, header, where, n_vocab=n_vocab, n_ctx=n_ctx, max_state_bytes=max_state_bytes,
                             state=state)
    except (SavedChatError, FileNotFoundError):
        raise
    except Exception as exc:  # noqa: BLE001
        # zipfile and zlib report damage in many ways (BadZipFile, a bad CRC, EOFError, zlib.error,
        # OSError, ValueError...): each one means an unusable file, never a crash
        raise _damaged(where, f"{type(exc).__name__}: {exc}") from exc


def json_limit(n_ctx: int) -> int:
    """The largest ``chat.json`` a saved chat of a model with context ``n_ctx`` may have."""
    return min(MAX_JSON_BYTES, 2**20 + JSON_BYTES_PER_POSITION * max(0, n_ctx))


def pixel_budget() -> int:
    """The most pixels one saved chat's images may hold in all, on this machine now."""
    # decoding one image briefly takes about twice its RGB bytes
    return min(MAX_CHAT_PIXELS, available_ram() // 8)


def _as_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise SavedChatError(f"A saved conversation's path must be a file name, not {path!r}.")
    return Path(os.fspath(path)).expanduser()


def _damaged(source: Path, why: str) -> SavedChatError:
    return SavedChatError(f"{source} is not a usable saved conversation ({why}): it is damaged, "
                          "truncated or not a gguf_mcv chat file. Save the conversation again.")


def _entry(zf: zipfile.ZipFile, name: str, limit: int, source: Path) -> zipfile.ZipInfo:
    """The archive's entry ``name``, if it is there and claims at most ``limit`` bytes."""
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise _damaged(source, f"{name} is missing") from None
    if info.file_size > limit:
        raise _damaged(source, f"{name} claims {info.file_size} bytes, more than the {limit} allowed")
    return info


def _member(zf: zipfile.ZipFile, name: str, limit: int, source: Path) -> bytes:
    info = _entry(zf, name, limit, source)
    with zf.open(info) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _damaged(source, f"{name} is larger than the {limit} bytes allowed")
    return data


def _header(zf: zipfile.ZipFile, source: Path, limit: int) -> dict[str, Any]:
    try:
        header = json.loads(_member(zf, "chat.json", limit, source))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _damaged(source, f"chat.json is not valid JSON: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _damaged(source, "it does not say it is a gguf_mcv chat")
    if header.get("version") != VERSION:
        raise SavedChatError(f"{source} was saved in format version {header.get('version')!r}; this "
                             f"gguf_mcv reads version {VERSION}. Use the gguf_mcv that saved it.")
    return header


def _typed(value: Any, kind: type | tuple[type, ...], what: str, source: Path) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise _damaged(source, f"{what} has the wrong type ({type(value).__name__})")
    return value


def _contents(zf: zipfile.ZipFile, header: dict[str, Any], source: Path, *, n_vocab: int, n_ctx: int,
              max_state_bytes: int, state: bool = True) -> SavedChat:
    model = _typed(header.get("model"), dict, "model", source)
    settings = _typed(header.get("settings"), dict, "settings", source)
    turn_list = _typed(header.get("turns"), list, "turns", source)
    digests = {d for t in turn_list for d in _typed(_typed(t, dict, "a turn", source).get("images"), list,
                                                    "a turn's images", source)}
    if len(digests) > MAX_IMAGES:
        raise _damaged(source, f"it names {len(digests)} images, more than {MAX_IMAGES}")
    pixels = sum(_declared_pixels(zf, _typed(d, str, "an image digest", source), source) for d in digests)
    budget = pixel_budget()
    if pixels > budget:
        raise SavedChatError(f"{source} holds images of {pixels:,} pixels in all, more than the {budget:,} a "
                             "saved conversation may hold on this machine now: it is damaged or hostile, or "
                             "needs a machine with more free memory.")
    images = {d: _image(zf, d, source) for d in digests}
    turns = []
    for t in turn_list:
        role = _typed(t.get("role"), str, "a turn's role", source)
        if role not in ("user", "assistant"):
            raise _damaged(source, f"a turn has the role {role!r}")
        turns.append((role, _typed(t.get("text"), str, "a turn's text", source),
                      tuple(images[d] for d in t["images"])))
    kv = None
    if header.get("state") is not None:
        if header.get("units") is None:
            raise _damaged(source, "it has a KV state but no units")
        units = _units(header["units"], source, n_vocab, n_ctx)
        meta = _typed(header["state"], dict, "state", source)
        limit = min(max_state_bytes, available_ram() // 2)
        kv = KVState(units, _blob(zf, "state.bin", meta, source, limit) if state else b"")
        checkpoints = _typed(meta.get("checkpoints", []), list, "the checkpoints", source)
        if len(checkpoints) > MAX_CHECKPOINTS:
            raise _damaged(source, f"it has {len(checkpoints)} checkpoints")
        for i, c in enumerate(checkpoints):
            c = _typed(c, dict, "a checkpoint", source)
            n_units = _typed(c.get("n_units"), int, "a checkpoint's units", source)
            n_pos = _typed(c.get("n_pos"), int, "a checkpoint's positions", source)
            data = _blob(zf, f"checkpoint-{i}.bin", c, source, limit) if state else b""
            kv.checkpoints.append((n_units, n_pos, data))
    return SavedChat(model=model, settings=settings, turns=turns, kv=kv, images=images)


def _units(raw: Any, source: Path, n_vocab: int, n_ctx: int) -> list[Unit]:
    units: list[Unit] = []
    n_pos = 0
    for item in _typed(raw, list, "units", source):
        if isinstance(item, int) and not isinstance(item, bool):
            if not 0 <= item < n_vocab:
                raise SavedChatError(f"{source} holds token {item}, outside this model's vocabulary of "
                                     f"{n_vocab}: it was saved with another model.")
            units.append(item)
            n_pos += 1
        elif (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], int) and not isinstance(item[1], bool) and 0 < item[1] <= n_ctx):
            units.append(ImageUnit(item[0], item[1]))
            n_pos += item[1]
        else:
            raise _damaged(source, f"a unit of the KV cache is {str(item)[:60]}")
        if n_pos > n_ctx:
            raise SavedChatError(f"{source} holds more positions than this model's context of {n_ctx}: "
                                 "load the model with the n_ctx it was saved with (or larger).")
    return units


def _blob_meta(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _blob(zf: zipfile.ZipFile, name: str, meta: dict[str, Any], source: Path, limit: int) -> bytes:
    """Member ``name``, whose size and SHA-256 ``meta`` gives; at most ``limit`` bytes."""
    size = _typed(meta.get("bytes"), int, f"the size of {name}", source)
    digest = _typed(meta.get("sha256"), str, f"the checksum of {name}", source)
    if size > limit:
        raise SavedChatError(f"{source} holds a KV state of {size} bytes, more than the {limit} this machine "
                             "can take now: it is damaged, or was saved on a larger machine.")
    data = _member(zf, name, size, source)
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise _damaged(source, f"{name} does not match its checksum")
    return data


def _declared_pixels(zf: zipfile.ZipFile, digest: str, source: Path) -> int:
    """The pixels image ``digest``'s header declares (Pillow reads only the header)."""
    info = _entry(zf, f"images/{digest}.png", MAX_IMAGE_BYTES, source)
    with zf.open(info) as f, open_pil(f) as pil:
        width, height = pil.size
    return int(width) * int(height)


def _image(zf: zipfile.ZipFile, digest: str, source: Path) -> Image:
    data = _member(zf, f"images/{digest}.png", MAX_IMAGE_BYTES, source)
    try:
        image = load_image(data)
    except MediaError as exc:
        raise _damaged(source, f"image {digest[:12]}… cannot be decoded: {exc}") from exc
    if image.digest != digest:
        raise _damaged(source, f"image {digest[:12]}… does not have the pixels it was saved with")
    return Image(image.rgb, f"<saved image {digest[:12]}>")


def _png(image: Image) -> bytes:
    out = io.BytesIO()
    PIL.Image.fromarray(np.ascontiguousarray(image.rgb)).save(out, format="PNG", compress_level=1)
    return out.getvalue()


#: how gguf_mcv identified model files before whole-file SHA-256 digests
_PARTIAL_HASH = re.compile(r"[0-9a-f]{16}")


def check_model(saved: dict[str, Any], current: dict[str, Any], source: str | os.PathLike) -> None:
    """:class:`SavedChatError` unless ``saved`` (the file's model identity) is ``current``'s."""
    names = {"model": "text model file", "quant": "quantization", "projector": "vision projector (mmproj)",
             "backend": "vision backend"}
    if isinstance(saved.get("model"), str) and _PARTIAL_HASH.fullmatch(saved["model"]):
        raise SavedChatError(
            f"{source} was saved by an older gguf_mcv, which told model files apart by a hash of their "
            "first and last MiB only: whether it was made with this model cannot be checked. Start the "
            "conversation anew."
        )
    for key, what in names.items():
        if saved.get(key) != current.get(key):
            raise SavedChatError(
                f"{source} was saved with another {what} ({saved.get(key)!r}, this model has "
                f"{current.get(key)!r}; saved with {saved.get('name')!r}). Load the model it was saved "
                "with to continue it."
            )


def check_turns(turns: Sequence[tuple[str, str, tuple[Image, ...]]], marker: str,
                source: str | os.PathLike) -> None:
    """:class:`SavedChatError` unless every turn's text is what a live turn's is: what people
    wrote marked plain (:mod:`gguf_mcv.prompt.plaintext`), and outside it only line breaks, video
    frames' times and one media ``marker`` per image of a user turn. Anything else would
    be read as control tokens (a crafted ``<|im_start|>system``) or break every later turn."""
    markup = re.compile(rf"(?:\n|at [0-9]+\.[0-9] s: |{re.escape(marker)})*")
    for number, (role, text, images) in enumerate(turns, 1):
        outside = [seg for seg, is_plain in plaintext.split(text) if not is_plain]
        if not all(markup.fullmatch(seg) for seg in outside):
            raise _damaged(Path(os.fspath(source)), f"turn {number} holds text not marked as written by a "
                                                    "person (control tokens)")
        markers = sum(seg.count(marker) for seg in outside)
        if markers != len(images) or (images and role != "user"):
            raise _damaged(Path(os.fspath(source)), f"turn {number} has {markers} media markers for "
                                                    f"{len(images)} images")


def pairs(turns: Sequence[Any]) -> list[tuple[str, str, tuple[Image, ...]]]:
    """``(role, text, images)`` of each :class:`~gguf_mcv.prompt.turns.Turn`."""
    return [(t.role, t.text, tuple(t.images)) for t in turns]

