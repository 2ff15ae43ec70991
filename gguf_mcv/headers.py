"""Read GGUF headers and check that a text model and its projector belong together.

llama.cpp aborts the whole process on some malformed files and on some model /
projector mismatches; everything here runs before any native load, so those
files are refused with a Python error instead. Headers are read with the
``gguf`` package's reader; its memory map never reads tensor data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CorruptModelError, IncompatibleProjectorError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"

# clip.minicpmv_version of each MiniCPM-V release, and what we call the release
MINICPMV_VERSIONS = {2: "MiniCPM-Llama3-V 2.5", 3: "MiniCPM-V 2.6", 4: "MiniCPM-o 2.6",
                     5: "MiniCPM-V 4.0", 6: "MiniCPM-V 4.5"}


@dataclass(frozen=True)
class TextHeader:
    """What the planner and the engine need to know about a text model file."""

    path: str
    size: int
    architecture: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    file_type: int | None
    chat_template: str | None


@dataclass(frozen=True)
class ProjectorHeader:
    """What matters about an mmproj (vision projector) file."""

    path: str
    size: int
    projector_type: str
    has_vision: bool
    minicpmv_version: int | None
    n_embd_out: int | None
    image_size: int
    patch_size: int
    vision_width: int
    vision_blocks: int
    query_num: int | None


def read_fields(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """All metadata keys and tensor shapes (numpy order) of a GGUF file, checked for damage."""
    from gguf import GGUFReader

    path = Path(path)
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
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, OSError) as exc:
        raise CorruptModelError(
            f"{path} is a damaged or truncated GGUF file ({exc}). Delete it and download it again."
        ) from exc
    shapes: dict[str, tuple[int, ...]] = {}
    for tensor in reader.tensors:
        if tensor.data_offset + int(tensor.n_bytes) > size:
            raise CorruptModelError(
                f"{path} is truncated: tensor {tensor.name} ends at byte "
                f"{tensor.data_offset + int(tensor.n_bytes)} but the file has {size} bytes. "
                "Delete it and download it again."
            )
        shapes[tensor.name] = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    fields = {name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    del reader  # release the memory map
    return fields, shapes


def read_text_header(path: str | os.PathLike) -> TextHeader:
    """Read a text model's header; raise if it is not a usable text model file."""
    fields, shapes = read_fields(path)
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise CorruptModelError(f"{path} has no general.architecture: not a model file.")
    if arch == "clip":
        raise IncompatibleProjectorError(
            f"{path} is a vision projector (mmproj), not a text model: pass it as mmproj_path."
        )

    def num(key: str, default: int = 0) -> int:
        value = fields.get(f"{arch}.{key}", default)
        return int(value[0] if isinstance(value, list) else value)

    n_embd, n_head = num("embedding_length"), num("attention.head_count")
    tokens = shapes.get("token_embd.weight")
    return TextHeader(
        path=os.fspath(path),
        size=os.path.getsize(path),
        architecture=arch,
        n_layers=num("block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=num("attention.head_count_kv", n_head),
        head_dim=num("attention.key_length", n_embd // n_head if n_head else 0),
        n_vocab=tokens[0] if tokens else 0,
        n_ctx_train=num("context_length"),
        file_type=fields.get("general.file_type"),
        chat_template=fields.get("tokenizer.chat_template"),
    )


def read_projector_header(path: str | os.PathLike) -> ProjectorHeader:
    """Read an mmproj's header; raise if it is not a vision projector."""
    fields, shapes = read_fields(path)
    if fields.get("general.architecture") != "clip":
        raise IncompatibleProjectorError(
            f"{path} is not a vision projector (architecture "
            f"{fields.get('general.architecture')!r}, expected 'clip')."
        )
    proj = shapes.get("resampler.proj.weight")
    version = fields.get("clip.minicpmv_version")
    return ProjectorHeader(
        path=os.fspath(path),
        size=os.path.getsize(path),
        projector_type=str(fields.get("clip.projector_type", fields.get("clip.vision.projector_type", ""))),
        has_vision=bool(fields.get("clip.has_vision_encoder", False)),
        minicpmv_version=int(version) if version is not None else None,
        n_embd_out=proj[0] if proj else None,
        image_size=int(fields.get("clip.vision.image_size", 0)),
        patch_size=int(fields.get("clip.vision.patch_size", 0)),
        vision_width=int(fields.get("clip.vision.embedding_length", 0)),
        vision_blocks=int(fields.get("clip.vision.block_count", 0)),
        query_num=_maybe_int(fields.get("clip.minicpmv_query_num")),
    )


def check_pair(
    text: TextHeader, projector: ProjectorHeader, *, minicpmv_version: int | None = None
) -> None:
    """Refuse a text model / projector pair that llama.cpp would crash on or mis-run.

    ``minicpmv_version`` is what the catalog says this model family uses, when known.
    """
    names = f"text model {text.path} and projector {projector.path}"
    if not projector.has_vision:
        raise IncompatibleProjectorError(f"The projector has no vision encoder ({names}).")
    if projector.n_embd_out is not None and projector.n_embd_out != text.n_embd:
        raise IncompatibleProjectorError(
            f"The projector outputs {projector.n_embd_out}-wide embeddings but the text model "
            f"is {text.n_embd} wide: they are not a pair ({names}). Use the mmproj file from "
            "the same repository as the model."
        )
    if minicpmv_version is not None and projector.minicpmv_version not in (None, minicpmv_version):
        raise IncompatibleProjectorError(
            f"The projector is for {_release(projector.minicpmv_version)} but the model is "
            f"{_release(minicpmv_version)} ({names}). Use the mmproj from the model's repository."
        )


def _release(version: int | None) -> str:
    return MINICPMV_VERSIONS.get(version or -1, f"minicpmv_version {version}")


def _maybe_int(value: Any) -> int | None:
    return int(value) if value is not None else None


def _value(field: Any) -> Any:
    """A reader field as a plain Python value (str, number, bool or list)."""
    from gguf import GGUFValueType

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        if len(field.types) > 1 and field.types[1] == GGUFValueType.STRING:
            return None if len(field.data) > 64 else [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [_scalar(field.parts[i]) for i in field.data[:64]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return _scalar(field.parts[field.data[0]])


def _scalar(part: np.ndarray) -> Any:
    value = part[0] if len(part) else None
    return value.item() if hasattr(value, "item") else value
