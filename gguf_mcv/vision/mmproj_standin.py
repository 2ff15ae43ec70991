"""A stand-in mmproj: the real one's metadata with every tensor shrunk to a few numbers.

With the ONNX vision backend libmtmd still tokenizes prompts (image markers, slice layout,
positions: all from the metadata) and feeds embeddings into the text context, but it must
not hold the vision tower a second time. libmtmd builds the encoder graph only to encode
or warm up, neither of which happens with this backend, and reads from the tensors only
their presence and the projector's output width (``clip_n_mmproj_embd``: ne[0] of
``resampler.proj.weight``, ne[1] of 4.6's ``mm.down.weight``). So every tensor keeps its
name and type class but holds one element — that one keeps the output width. The file is a few KB whatever the tower.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..cache_files import set_aside
from ..errors import CorruptModelError

#: the tensor whose size libmtmd reads at load (clip_n_mmproj_embd: the output width), and
#: which ggml dimension holds it: ne[0] of the resampler's projection, ne[1] of 4.6's merger
KEEP = {"resampler.proj.weight": 0, "mm.down.weight": 1}


def write_standin(mmproj: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the stand-in of ``mmproj`` to ``out`` (atomically: a temp file, then renamed over
    whatever is there, unless that is a regular file with the same bytes; a folder in the way is
    set aside)."""
    import gguf  # lazy: only when a stand-in is made

    try:
        reader = gguf.GGUFReader(os.fspath(mmproj))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise CorruptModelError(f"Could not read {mmproj} as a GGUF file ({exc}); download it again.") from exc
    out = Path(out)
    if out.is_dir() and not out.is_symlink():  # a rename cannot replace a folder
        set_aside(out, "a folder where a stand-in mmproj belongs")
    # a fresh name (never a file, FIFO or symlink already there); a killed writer's is swept
    # by the caller (gguf_mcv.vision.onnx_vision.standin)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}-", suffix=".part", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        copy_metadata(reader, writer)
        for t in reader.tensors:
            ne = [1, 1]
            if t.name in KEEP:
                ne[KEEP[t.name]] = int(t.shape[KEEP[t.name]])
            dtype = np.float32 if t.tensor_type == gguf.GGMLQuantizationType.F32 else np.float16
            writer.add_tensor(t.name, np.zeros((ne[1], ne[0]) if len(t.shape) > 1 else (ne[0],), dtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if not _same_bytes(tmp, out):  # an identical one stays: models loaded from it watch its inode
            os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _same_bytes(new: Path, old: Path) -> bool:
    """Whether ``old`` is a regular file (not a symlink) holding exactly ``new``'s bytes."""
    try:
        return (not old.is_symlink() and old.is_file() and old.stat().st_size == new.stat().st_size
                and old.read_bytes() == new.read_bytes())
    except OSError:
        return False


def copy_metadata(reader: Any, writer: Any) -> None:
    """Every metadata key of a ``gguf.GGUFReader`` into a ``gguf.GGUFWriter`` (the
    architecture, which the writer was made with, and the reader's own keys excepted)."""
    import gguf

    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), main, sub_type=sub)
