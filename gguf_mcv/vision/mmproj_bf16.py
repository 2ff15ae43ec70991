"""A BF16 copy of an F16 mmproj for libmtmd, converted once into the cache.

On a CPU with AVX512-BF16 ggml multiplies BF16 weights with native dot products; on the
SigLIP-400M bench shape a 448-px slice took ≈ 0.82× the F16 time here (see README). The
copy converts the vision tower's 2-D block weights (``v.blk.N.*.weight``) from F16 to BF16
and keeps every other tensor and all metadata as they are. It is written with the ``gguf``
package into ``<cache>/mmproj/<identity>-bf16.gguf`` (keyed by the source mmproj's
identity), as a temporary file renamed into place, then a manifest with its size and
SHA-256 (and a digest of its own content) is written; a copy whose manifest does not check
out, or whose header is not the mmproj's, is rebuilt, never used.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .. import environment
from ..cache_files import DamagedManifest, folder_lock, is_regular, read_manifest, set_aside, sweep, write_manifest
from ..errors import CorruptModelError, NotEnoughDiskError
from ..models.headers import ProjectorHeader, read_projector_header, read_tensors
from ..models.identity import remember
from ..units import format_size
from .mmproj_standin import copy_metadata
from .onnx_vision import sha256_file

logger = logging.getLogger(__name__)

PRECISIONS = ("auto", "as-is", "bf16")
MANIFEST_VERSION = 2  #: 2: the manifest carries a digest of its content
#: the tensors converted: the tower blocks' matrices (where the encoder spends its time)
BLOCK_WEIGHT = re.compile(r"^v\.blk\.\d+\.(attn_q|attn_k|attn_v|attn_out|ffn_up|ffn_down|ffn_gate)\.weight$")
#: the /proc/cpuinfo flag of native BF16 dot products
CPU_FLAG = "avx512_bf16"
#: ``auto`` leaves smaller mmprojs as they are: their towers encode in milliseconds, the win
#: was measured on SigLIP-400M (≈ 800 MB at F16), and the tiny test models stay comparable
#: with libmtmd's F16 oracle
AUTO_MIN_BYTES = 50_000_000
#: temporary files a copy writes (``tempfile``'s 8 random characters after the stem): those
#: of a killed copy are removed when its lock is next taken
TEMP_NAME = re.compile(r"\.(?P<stem>.+)-[a-z0-9_]{8}(?:\.json)?\.part|(?P<old>.+)\.json\.part")


@dataclass(frozen=True)
class Bf16Copy:
    """A checked BF16 copy: where it is, how many tensors were converted, how long it took."""

    path: Path
    converted: int
    convert_s: float  #: 0 when it came from the cache


def cache_folder() -> Path:
    return environment.cache_dir() / "mmproj"


def has_f16_blocks(mmproj: str | os.PathLike) -> bool:
    """Whether ``mmproj`` has tower block weights stored as F16 (what the copy converts)."""
    import gguf  # lazy: only when a copy may be made

    return any(_converts(t, gguf) for t in _reader(mmproj, gguf).tensors)


def choose(requested: str, *, backend: str, vision_gpu: bool, cpu_flags: frozenset[str],
           f16_blocks: Callable[[], bool], size: int) -> tuple[bool, str]:
    """(use a BF16 copy, why) for ``mmproj_precision=requested``: ``auto`` copies only for
    libmtmd on a CPU with :data:`CPU_FLAG` and an mmproj of at least :data:`AUTO_MIN_BYTES`
    with F16 block weights; ``bf16`` whenever there are F16 block weights. ``f16_blocks``
    is asked last (it reads the mmproj's tensor table: a few MB of RSS in the loading process)."""
    if requested == "as-is" or backend != "llama.cpp":
        return False, "as-is" if requested == "as-is" else f"as-is ({backend} encodes)"
    if requested == "auto":
        if vision_gpu:
            return False, "as-is (the encoder runs on the GPU)"
        if CPU_FLAG not in cpu_flags:
            return False, f"as-is (the CPU has no {CPU_FLAG})"
        if size < AUTO_MIN_BYTES:
            return False, f"as-is (smaller than {format_size(AUTO_MIN_BYTES)}: not worth a copy)"
    if not f16_blocks():
        return False, "as-is (no F16 block weights to convert)"
    return (True, "bf16 (asked for)") if requested == "bf16" else (True, f"bf16 (auto: the CPU has {CPU_FLAG})")


def prepare(mmproj: str | os.PathLike, identity: str) -> Bf16Copy:
    """The checked BF16 copy of ``mmproj`` (identity ``identity``): from the cache, else made now
    (under a lock, so two processes convert once). A damaged copy or manifest is made again
    with one warning; temporary files of killed copies are removed first."""
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{identity}-bf16"
    with folder_lock(folder / f"{stem}.lock"):
        sweep(folder, TEMP_NAME, stem)
        try:
            found = _load_manifest(folder, stem, Path(mmproj))
        except DamagedManifest as exc:
            logger.warning("the BF16 copy of %s in %s is unusable (%s): making it again", os.fspath(mmproj),
                           folder, exc)
            found = None
        if found is not None:
            return found
        return _convert(Path(mmproj), folder, stem)


def _load_manifest(folder: Path, stem: str, mmproj: Path) -> Bf16Copy | None:
    """The copy ``<stem>.json`` describes, intact and with the header of ``mmproj`` (its tensor
    types aside); None when there is none; :class:`DamagedManifest` when it is unusable."""
    m = read_manifest(folder / f"{stem}.json", MANIFEST_VERSION)
    if m is None:
        return None
    try:
        path = folder / f"{stem}.gguf"
        converted = m["converted"]
        if m["file"] != path.name or isinstance(converted, bool) or not isinstance(converted, int) or converted < 0:
            raise DamagedManifest("it names another file or an impossible count")
        if not is_regular(path) or path.stat().st_size != m["size"] or sha256_file(path) != m["sha256"]:
            raise DamagedManifest(f"{path.name} is missing, not a regular file or not the copy made")
        # llama.cpp aborts the process on some impossible header values: the copy's header is
        # checked as the mmproj's was, and must be the mmproj's own
        if not _same_header(read_projector_header(path), read_projector_header(mmproj)):
            raise DamagedManifest(f"{path.name}'s header is not the mmproj's")
        if _layout(path) != _layout(mmproj):
            raise DamagedManifest(f"{path.name}'s tensors are not the mmproj's")
    except (OSError, ValueError, KeyError, TypeError) as exc:  # CorruptModelError is a ValueError
        raise DamagedManifest(f"{type(exc).__name__}: {exc}") from None
    return Bf16Copy(path, converted, 0.0)


def _layout(path: Path) -> list[tuple[str, tuple[int, ...], int]]:
    return [(t.name, t.shape, t.n_bytes) for t in read_tensors(path)]


def _same_header(a: ProjectorHeader, b: ProjectorHeader) -> bool:
    return dataclasses.replace(a, path="", size=0) == dataclasses.replace(b, path="", size=0)


def _convert(mmproj: Path, folder: Path, stem: str) -> Bf16Copy:
    need = mmproj.stat().st_size + (64 << 20)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise NotEnoughDiskError(
            f"A BF16 copy of {mmproj.name} needs about {format_size(need)} free in {folder}; "
            f"{format_size(free)} is free. Free some space, point GGUF_MCV_CACHE elsewhere, or use "
            "mmproj_precision='as-is'.")
    start = time.perf_counter()
    out = folder / f"{stem}.gguf"
    fd, name = tempfile.mkstemp(prefix=f".{stem}-", suffix=".part", dir=folder)
    os.close(fd)
    tmp = Path(name)
    try:
        converted = write_bf16_copy(mmproj, tmp)
        digest = sha256_file(tmp)
        manifest = {"version": MANIFEST_VERSION, "file": out.name, "size": tmp.stat().st_size,
                    "sha256": digest, "converted": converted, "source": str(mmproj)}
        if out.is_dir() and not out.is_symlink():
            set_aside(out, "a folder where the BF16 copy belongs", warn=False)  # prepare warned
        os.replace(tmp, out)
        remember(out, digest)  # the engine keys embeddings by it: no second hash
        write_manifest(folder / f"{stem}.json", manifest)  # last: it vouches for the copy
    finally:
        tmp.unlink(missing_ok=True)
    return Bf16Copy(out, converted, time.perf_counter() - start)


def write_bf16_copy(mmproj: str | os.PathLike, out: str | os.PathLike) -> int:
    """Write ``mmproj`` to ``out`` with its F16 block weights as BF16; the number converted."""
    import gguf  # lazy: only when a copy is made

    reader = _reader(mmproj, gguf)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(os.fspath(out), arch)
    converted = 0
    try:
        copy_metadata(reader, writer)
        # tensor infos first, then the data one tensor at a time: never the whole tower in memory
        for t in reader.tensors:
            if _converts(t, gguf):
                writer.add_tensor_info(t.name, [*t.data.shape[:-1], t.data.shape[-1] * 2], np.dtype(np.uint8),
                                       t.data.nbytes, raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            if _converts(t, gguf):
                bf16 = gguf.quants.quantize(np.asarray(t.data, np.float32), gguf.GGMLQuantizationType.BF16)
                writer.write_tensor_data(bf16)
                converted += 1
            else:
                writer.write_tensor_data(np.asarray(t.data))
    finally:
        writer.close()
    return converted


def _converts(t, gguf) -> bool:
    return t.tensor_type == gguf.GGMLQuantizationType.F16 and len(t.shape) == 2 and bool(BLOCK_WEIGHT.match(t.name))


def _reader(mmproj: str | os.PathLike, gguf):
    try:
        return gguf.GGUFReader(os.fspath(mmproj))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise CorruptModelError(f"Could not read {mmproj} as a GGUF file ({exc}); download it again.") from exc
