"""Read GGUF headers and check that a text model and its projector belong together.

llama.cpp aborts the whole process on some malformed files and on some model /
projector mismatches; everything here runs before any native load, so those
files are refused with a Python error instead. Headers are read as a stream
(:func:`parse_header`), which also works on the first bytes of a remote file.
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Iterable

from ..errors import CorruptModelError, IncompatibleProjectorError, ModelNotFoundError
from ..generations import named_by_version, of_projector, text_arch_of
from .shapes import TextShape, VisionShape

GGUF_MAGIC = b"GGUF"

# clip.minicpmv_version of each MiniCPM-V release, and what we call the release (libmtmd's
# clip.cpp / mtmd.cpp accept 2-6 and 100045). MiniCPM-V 4.6 has no version: its projector
# type is "minicpmv4_6".
MINICPMV_VERSIONS = named_by_version()


@dataclass(frozen=True)
class TextHeader:
    """A text model file: where it is, how big, its shape and its chat template."""

    path: str
    size: int
    shape: TextShape
    file_type: int | None
    chat_template: str | None


@dataclass(frozen=True)
class ProjectorHeader:
    """An mmproj (vision projector) file: its kind, MiniCPM-V generation and tower shape."""

    path: str
    size: int
    projector_type: str
    has_vision: bool
    minicpmv_version: int | None
    n_embd_out: int | None  #: width of the embeddings it feeds the text model
    shape: VisionShape
    n_positions: int | None = None  #: rows of the vision position embedding


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array too long to keep (e.g. the vocabulary): its element type and length."""

    element_type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the header: name, numpy-order shape, ggml type, data range."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  #: from the start of the file
    n_bytes: int


class _Truncated(Exception):
    """The data ended before the header did."""


#: arrays up to this many elements are kept as lists; longer ones become ArrayInfo
_KEEP_ARRAY = 64
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Stream:
    """Little-endian GGUF fields read from a binary stream, with running position."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.pos = f, 0

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) < n:
            raise _Truncated
        self.pos += n
        return data

    def num(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.num("<Q")
        if n > 2**24:
            raise ValueError(f"implausible string length {n} at byte {self.pos}")
        return self.take(n).decode("utf-8", "replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.num(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        etype, count = self.num("<I"), self.num("<Q")
        if count > 2**32:
            raise ValueError(f"implausible array length {count} at byte {self.pos}")
        if count <= _KEEP_ARRAY:
            return [self.value(etype) for _ in range(count)]
        self.on_long_array(ArrayInfo(etype, count))
        if etype in _SCALARS:
            self.take(count * struct.calcsize(_SCALARS[etype]))
        else:
            for _ in range(count):
                self.value(etype)
        return ArrayInfo(etype, count)

    def on_long_array(self, info: ArrayInfo) -> None:
        """Called when a long array starts (before its elements are read)."""


def parse_header(f: BinaryIO, *, tensors: bool = True,
                 partial: bool = False) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Metadata and tensor entries of the GGUF file open as ``f``, read as a stream.

    gguf-py's ``GGUFReader`` builds one numpy view per vocabulary entry (hundreds of MB
    for a 150k-token vocabulary) and needs the whole file; this reads the header
    sequentially, keeps long arrays as :class:`ArrayInfo`, and works on a prefix of a
    file (a ranged download): raises ``_Truncated`` when the data ends too early, or with
    ``partial`` returns the metadata read so far (a long array cut short is recorded as
    its :class:`ArrayInfo`).
    """
    r = _Stream(f)
    fields: dict[str, Any] = {}
    try:
        return _parse(r, fields, tensors)
    except _Truncated:
        if partial:
            return fields, []
        raise


def _parse(r: _Stream, fields: dict[str, Any], tensors: bool) -> tuple[dict[str, Any], list[TensorInfo]]:
    if r.take(4) != GGUF_MAGIC:
        raise ValueError("bad magic")
    version = r.num("<I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = r.num("<Q"), r.num("<Q")
    if n_tensors > 2**20 or n_kv > 2**20:
        raise ValueError(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys")
    for _ in range(n_kv):
        key = r.string()
        r.on_long_array = partial(fields.__setitem__, key)  # type: ignore[method-assign]
        fields[key] = r.value(r.num("<I"))
    if not tensors:
        return fields, []
    entries = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.num("<I")
        if n_dims > 8:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        dims = [r.num("<Q") for _ in range(n_dims)]
        entries.append((name, dims, r.num("<I"), r.num("<Q")))
    align = int(fields.get("general.alignment", 32)) or 32
    data_start = -(-r.pos // align) * align
    return fields, [_tensor(name, dims, kind, data_start + off) for name, dims, kind, off in entries]


def _tensor(name: str, dims: list[int], kind: int, offset: int) -> TensorInfo:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # lazy: gguf takes ~0.2 s to import

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError) as exc:
        raise ValueError(f"tensor {name} has unknown ggml type {kind}") from exc
    n = 1
    for d in dims:
        n *= d
    return TensorInfo(name, tuple(reversed(dims)), kind, offset, n * size // block)


def read_fields(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """All metadata keys and tensor shapes (numpy order) of a GGUF file, checked for damage."""
    fields, tensors = _read_checked(Path(path))
    return fields, {t.name: t.shape for t in tensors}


def read_tensors(path: str | os.PathLike) -> list[TensorInfo]:
    """Every tensor's header entry (name, shape, ggml type, bytes) of a GGUF file, checked
    for damage as :func:`read_fields` checks it."""
    return _read_checked(Path(path))[1]


def _read_checked(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    if not path.is_file():
        raise ModelNotFoundError(f"Model file {path} does not exist: check the path.")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise CorruptModelError(
                f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'). "
                "Pass a .gguf model file."
            )
        f.seek(0)
        try:
            fields, tensors = parse_header(io.BufferedReader(f, buffer_size=2**20))
        except _Truncated:
            raise CorruptModelError(
                f"{path} is truncated: it ends inside its header. Delete it and download it again."
            ) from None
        except (ValueError, UnicodeDecodeError, struct.error) as exc:
            raise CorruptModelError(
                f"{path} has a damaged GGUF header ({exc}). Delete it and download it again."
            ) from exc
    for t in tensors:
        if t.offset + t.n_bytes > size:
            raise CorruptModelError(
                f"{path} is truncated: tensor {t.name} ends at byte {t.offset + t.n_bytes} but "
                f"the file has {size} bytes. Delete it and download it again."
            )
    return fields, tensors


def read_text_header(path: str | os.PathLike) -> TextHeader:
    """Read a text model's header; raise if it is not a usable text model file."""
    fields, shapes = read_fields(path)
    header = text_header(fields, shapes, os.fspath(path), os.path.getsize(path))
    _check_text_values(header, fields)
    return header


def text_header(fields: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: str,
                size: int) -> TextHeader:
    """A :class:`TextHeader` from parsed metadata (``shapes`` may be empty for a remote prefix)."""
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise CorruptModelError(f"{path} has no general.architecture: not a model file.")
    if arch == "clip":
        raise IncompatibleProjectorError(
            f"{path} is a vision projector (mmproj), not a text model: pass it as mmproj_path."
        )
    return TextHeader(path=path, size=size, shape=TextShape.from_gguf(fields, shapes),
                      file_type=fields.get("general.file_type"),
                      chat_template=fields.get("tokenizer.chat_template"))


def read_projector_header(path: str | os.PathLike) -> ProjectorHeader:
    """Read an mmproj's header; raise if it is not a vision projector."""
    fields, shapes = read_fields(path)
    if fields.get("general.architecture") != "clip":
        raise IncompatibleProjectorError(
            f"{path} is not a vision projector (architecture "
            f"{fields.get('general.architecture')!r}, expected 'clip')."
        )
    # the tensor whose rows are the text model's width: the resampler's projection (2.5-4.5),
    # the merger's down projection (4.6, minicpmv4_6)
    proj = shapes.get("resampler.proj.weight") or shapes.get("mm.down.weight")
    version = fields.get("clip.minicpmv_version")
    header = ProjectorHeader(
        path=os.fspath(path),
        size=os.path.getsize(path),
        projector_type=str(fields.get("clip.projector_type", fields.get("clip.vision.projector_type", ""))),
        has_vision=bool(fields.get("clip.has_vision_encoder", False)),
        minicpmv_version=int(version) if version is not None else None,
        n_embd_out=proj[0] if proj else None,
        shape=VisionShape.from_gguf(fields),
        n_positions=(shapes.get("v.position_embd.weight") or (None,))[0],
    )
    _check_projector_values(header, fields)
    return header


# llama.cpp stops the whole process (GGML_ASSERT) on values like these instead of
# returning an error, so they are refused here, before it sees the file.
LLAMA_MAX_LAYERS = 512


def _check_text_values(header: TextHeader, fields: dict[str, Any]) -> None:
    h = header.shape
    eps = fields.get(f"{h.architecture}.attention.layer_norm_rms_epsilon", 0.0)
    problems = [
        (not 1 <= h.n_layers <= LLAMA_MAX_LAYERS, f"block_count {h.n_layers}"),
        (h.n_embd <= 0 or h.n_head <= 0, f"embedding_length {h.n_embd} / head_count {h.n_head}"),
        (h.n_head_kv <= 0 or h.n_head % h.n_head_kv, f"head_count_kv {h.n_head_kv} for {h.n_head} heads"),
        (h.n_vocab <= 0, f"a vocabulary of {h.n_vocab} tokens"),
        (not (isinstance(eps, (int, float)) and 0 <= eps < 1), f"layer_norm_rms_epsilon {eps}"),
    ]
    _refuse(header.path, problems)


def _check_projector_values(header: ProjectorHeader, fields: dict[str, Any]) -> None:
    h = header.shape
    eps = fields.get("clip.vision.attention.layer_norm_epsilon", 0.0)
    problems = [
        (h.image_size <= 0 or h.patch_size <= 0 or h.image_size % h.patch_size,
         f"image_size {h.image_size} with patch_size {h.patch_size}"),
        (header.n_positions is not None and h.patches > header.n_positions,
         f"{h.patches} patches per slice but {header.n_positions} position embeddings"),
        (h.width <= 0 or h.heads <= 0 or h.width % h.heads,
         f"vision width {h.width} with {h.heads} attention heads"),
        (not 1 <= h.blocks <= LLAMA_MAX_LAYERS, f"{h.blocks} vision blocks"),
        (not (isinstance(eps, (int, float)) and 0 <= eps < 1), f"layer_norm_epsilon {eps}"),
    ]
    _refuse(header.path, problems)


def _refuse(path: str, problems: list[tuple[Any, str]]) -> None:
    bad = [what for wrong, what in problems if wrong]
    if bad:
        raise CorruptModelError(
            f"{path} has impossible header values ({'; '.join(bad)}): it is damaged or was not "
            "written for llama.cpp. Download it again or use another file."
        )


def check_pair(
    text: TextHeader, projector: ProjectorHeader, *, minicpmv_version: int | None = None,
    projector_type: str | None = None,
) -> None:
    """Refuse a text model / projector pair that llama.cpp would crash on or mis-run.

    ``minicpmv_version`` and ``projector_type`` are what the catalog says this model family
    uses, when known.
    """
    names = f"text model {text.path} and projector {projector.path}"
    if not projector.has_vision:
        raise IncompatibleProjectorError(f"The projector has no vision encoder ({names}).")
    if projector_type and projector.projector_type and projector.projector_type != projector_type:
        raise IncompatibleProjectorError(
            f"The projector is a {projector.projector_type!r} projector but this model uses "
            f"{projector_type!r} ones ({names}). Use the mmproj from the model's repository."
        )
    if projector.n_embd_out is not None and projector.n_embd_out != text.shape.n_embd:
        raise IncompatibleProjectorError(
            f"The projector outputs {projector.n_embd_out}-wide embeddings but the text model "
            f"is {text.shape.n_embd} wide: they are not a pair ({names}). Use the mmproj file from "
            "the same repository as the model."
        )
    if minicpmv_version is not None and projector.minicpmv_version not in (None, minicpmv_version):
        raise IncompatibleProjectorError(
            f"The projector is for {_release(projector.minicpmv_version)} but the model is "
            f"{_release(minicpmv_version)} ({names}). Use the mmproj from the model's repository."
        )
    expected_arch = text_arch_of(projector.minicpmv_version, projector.projector_type)
    if expected_arch is not None and text.shape.architecture != expected_arch:
        raise IncompatibleProjectorError(
            f"The projector is for {_projector_release(projector)}, whose text model is "
            f"'{expected_arch}', but this text model is '{text.shape.architecture}' ({names}). Use the "
            "mmproj from the model's repository."
        )


def _release(version: int | None) -> str:
    return MINICPMV_VERSIONS.get(version or -1, f"minicpmv_version {version}")


def _projector_release(projector: ProjectorHeader) -> str:
    g = of_projector(projector.minicpmv_version, projector.projector_type)
    return g.name if g else _release(projector.minicpmv_version)


def tensor_list(tensors: Iterable[Any]) -> list[tuple[str, str, int]]:
    """(name, ggml type name, bytes) per tensor of a parsed header, as the memory and speed models
    take them (:func:`gguf_mcv.planning.memory.repacked_bytes`)."""
    from gguf import GGMLQuantizationType  # lazy: gguf takes ~0.2 s to import

    return [(t.name, GGMLQuantizationType(t.ggml_type).name, t.n_bytes) for t in tensors]
