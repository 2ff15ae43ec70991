"""The vision encoder on ONNX Runtime: converted once from the mmproj, cached, self-validated.

:func:`prepare` converts an mmproj (``gguf_mcv.vision.onnx_graph``) into ``<cache>/onnx/`` —
fp32 (rounding where ggml's CPU kernels round, so its embeddings follow libmtmd's closely),
and int8 (per-column int8 weights for the ViT blocks' MatMuls and MiniCPM-V 4.6's mergers,
activations quantized per call, LayerNorm gamma outliers folded into the weights first; the
patch embedding and the 2.x resampler stay fp32: :func:`int8_scope`), in the int8 kernel this
CPU class runs fastest among those that pass validation (``gguf_mcv.vision.onnx_variants``).
Files are keyed by the mmproj's identity, the onnxruntime version and (int8) the kernel,
written into a temporary folder and moved into place; a manifest with each file's size and
SHA-256, the CPU class and a digest of its own content is written last and checked on every
load (the projector's numbers are read again from the mmproj), so a killed conversion, a
damaged file, an edited manifest or one made on another CPU class is rebuilt, never used;
files of this conversion that no manifest vouches for (a conversion that failed, a full disk)
are removed before converting again. At conversion the int8
graph's embeddings are compared with the fp32 graph's on the bundled example image and
synthetic patterns; :data:`INT8_MIN_COSINE` decides whether ``auto`` may use int8. Both run in
a child process (``gguf_mcv.vision.onnx_child``): the caller then loads the cached result.
:class:`OnnxEncoder` runs one slice: libmtmd's preprocessing (``mtmd_preprocess``) and the
position inputs for that slice's size.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import environment, progress
from ..cache_files import (
    DamagedManifest,
    folder_lock,
    is_regular,
    open_regular,
    read_manifest,
    set_aside,
    sweep,
    write_manifest,
)
from ..errors import ConfigError, EngineError, NotEnoughDiskError
from ..units import format_size
from . import onnx_variants
from .media import Image
from .onnx_graph import INT8_KERNELS, Projector, Weights, build_model
from .onnx_session import (  # noqa: F401  (the names tools and tests use from here)
    EXAMPLE_IMAGE,
    OnnxEncoder,
    _params,
    _reference,
    _score,
    _session,
    _trim_heap,
    run_in_stages,
    slice_seconds,
    token_cosines,
    validate,
    validation_images,
)
from .vision_backends import INT8_MIN_COSINE, choose_backend, int8_passes  # noqa: F401  (the rule lives there)

logger = logging.getLogger(__name__)

VARIANTS = ("fp32", "int8")


def int8_scope(projector_type: str) -> str:
    """What the int8 graph quantizes (``onnx_graph.INT8_SCOPES``): every MatMul for MiniCPM-V 4.6's
    mergers ("all": its merger is a third of the mmproj, and its greedy answers agreed with fp32's
    at least as often as with the merger fp32), the tower blocks only for the 2.x resampler
    ("blocks": quantizing the resampler cost agreement, 59 against 69 of 96 greedy answers on the
    tiny 2.6 model; see docs/benchmarks.md)."""
    return "all" if projector_type == "minicpmv4_6" else "blocks"
#: 2: the fp32 graph rounds as ggml does; 3: the manifest carries a digest of its content; 4: the
#: int8 graph quantizes the merger and resampler too, and the graphs carry their stages; 5: the
#: resampler is fp32 again in the int8 graph (:func:`int8_scope`); 6: the int8 kernel, chosen per
#: CPU class (``onnx_variants``), and the class
MANIFEST_VERSION = 6
#: disk a conversion needs, in mmproj (f16) sizes: the fp32 graph 2x, two int8 graphs (the best
#: kernel so far and the one timed against it) about 0.6x each, with room to spare
DISK_FACTOR = 4
#: temporary entries a conversion writes (``tempfile``'s 8 random characters after the stem):
#: those of a killed conversion are removed when its lock is next taken
TEMP_NAME = re.compile(r"\.(?P<stem>.+)-[a-z0-9_]{8}(?:\.json\.part)?|(?P<old>.+)\.json\.part")
#: the same for a stand-in's temporary file (:func:`gguf_mcv.vision.mmproj_standin.write_standin`)
STANDIN_TEMP_NAME = re.compile(r"\.(?P<stem>.+)-[a-z0-9_]{8}\.part")
#: False: convert in this process (tools that patch the graph builder); True: in a child process
#: (:mod:`gguf_mcv.vision.onnx_child`), so this process's peak is a cached load's
CONVERT_IN_CHILD = True


@dataclass(frozen=True)
class Converted:
    """A validated conversion: the ONNX files and what self-validation measured."""

    fp32: Path
    int8: Path
    projector: Projector
    #: mean per-token cosine of int8 vs fp32 on the validation images; None: not validated
    #: (int8's kernels crash on the machine that converted it)
    int8_cosine: float | None
    convert_s: float  #: how long the conversion took (0 when it came from the cache)
    kernel: str = "u8s8"  #: how the int8 graph's MatMuls run (``onnx_graph.INT8_KERNELS``)
    cpu_class: str = ""  #: the CPU class the kernel was chosen on (``onnx_variants.cpu_class``)

    @property
    def int8_ok(self) -> bool:
        return self.int8_cosine is not None and int8_passes(self.int8_cosine)

    def path(self, variant: str) -> Path:
        return self.int8 if variant == "int8" else self.fp32


def onnxruntime_version() -> str | None:
    """onnxruntime's version, or None when it cannot be imported here."""
    try:
        import onnxruntime  # lazy: ~0.2 s and a native library
    except ImportError:
        return None
    return str(onnxruntime.__version__)


def cache_folder() -> Path:
    return environment.cache_dir() / "onnx"


def _stem(identity: str, ort_version: str) -> str:
    return f"{identity}-ort{ort_version}"


def prepare(mmproj_path: str | os.PathLike, identity: str, *,
            progress: Callable[[str, int, int], None] | None = None, validate_int8: bool = True) -> Converted:
    """The validated conversion of ``mmproj_path`` (identity ``identity``): from the cache when
    its manifest checks out, else converted now (under a lock, so two processes convert once).
    ``validate_int8=False`` (int8's kernels crash here) leaves the int8 graph unvalidated
    (``int8_cosine`` None); a later call that validates does so then and keeps the result.

    A damaged conversion (a file or the manifest changed, a folder or a symlink in a file's
    place) is rebuilt with one warning; temporary files of killed conversions are removed.

    Converting and validating run in a child process (:mod:`gguf_mcv.vision.onnx_child`), so
    this process peaks no higher than a later load from the cache; its errors are raised here
    as they were, and a child killed by a signal (out of memory) is an EngineError, nothing cached
    (the files it wrote are removed). A conversion made on another CPU class is made again, its
    int8 kernel chosen for this one."""
    version = onnxruntime_version()
    if version is None:
        raise ConfigError("onnxruntime is not installed: pip install onnxruntime onnx, or use "
                          "vision_backend='llama.cpp'.")
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    stem = _stem(identity, version)
    with folder_lock(folder / f"{stem}.lock"):
        sweep(folder, TEMP_NAME, stem)
        try:
            found = _load_manifest(folder, stem, Path(mmproj_path))
        except DamagedManifest as exc:
            logger.warning("the ONNX conversion of %s in %s is unusable (%s): converting it again",
                           os.fspath(mmproj_path), folder, exc)
            found = None
        here = onnx_variants.cpu_class()
        if found is not None and found.cpu_class != here:
            logger.info("the ONNX conversion of %s was made on a %s CPU, this one is %s: converting it again",
                        os.fspath(mmproj_path), found.cpu_class, here)
            found = None
        if found is not None and (found.int8_cosine is not None or not validate_int8):
            return found
        if found is not None:
            cosine = _in_child({"do": "validate", "mmproj": os.fspath(mmproj_path), "fp32": os.fspath(found.fp32),
                                "int8": os.fspath(found.int8)}, progress)["int8_cosine"]
            _update_manifest(folder, stem, int8_cosine=cosine)
            return dataclasses.replace(found, int8_cosine=cosine)
        mmproj = Path(mmproj_path)
        _remove_unvouched(folder, stem)  # what a failed conversion left; it must not count against the disk
        _check_disk(mmproj, folder)
        kernels = list(onnx_variants.candidates(here))
        if not CONVERT_IN_CHILD:
            return _convert(mmproj, folder, stem, progress, validate_int8, kernels=kernels)
        start = time.perf_counter()
        try:
            _in_child({"do": "convert", "mmproj": os.fspath(mmproj), "folder": os.fspath(folder), "stem": stem,
                       "validate_int8": validate_int8, "kernels": kernels}, progress)
        except BaseException:
            _remove_unvouched(folder, stem)  # a killed child's files, moved in before its manifest
            raise
        finally:
            sweep(folder, TEMP_NAME, stem)  # what a killed child left
        # loaded as every later run loads it: the files hashed, the projector read from the mmproj
        converted = _load_manifest(folder, stem, mmproj)
        if converted is None:
            raise EngineError(f"Converting {mmproj.name} for ONNX Runtime wrote no manifest in {folder}.")
        _trim_heap()  # what waiting on the child and hashing its files freed goes back before the load
        return dataclasses.replace(converted, convert_s=time.perf_counter() - start)


def _in_child(task: dict[str, Any], progress: Callable[[str, int, int], None] | None) -> dict[str, Any]:
    """``task`` run by :mod:`gguf_mcv.vision.onnx_child` in a child process (this one never
    imports ``onnx`` nor runs the fp32 graph's kernels: its peak stays a cached load's)."""
    from . import onnx_child

    if not CONVERT_IN_CHILD:
        projector = Weights(Path(task["mmproj"])).projector()
        return {"int8_cosine": validate(Path(task["fp32"]), Path(task["int8"]), projector,
                                        progress=_step(progress, "validation"))}
    return onnx_child.run(task, progress)


def main() -> int:
    """The converting child's entry point (:func:`gguf_mcv.vision.onnx_child.run` starts it)."""
    from . import onnx_child

    return onnx_child.child_main(_child_task)


def _child_task(task: dict[str, Any]) -> dict[str, Any]:
    """In the child: convert (``{"do": "convert", ...}``) or validate a cached conversion."""
    from . import onnx_child

    def progress(what: str, done: int, total: int) -> None:
        onnx_child.say("progress", {"what": what, "done": done, "total": total})

    mmproj = Path(task["mmproj"])
    if task["do"] == "convert":
        converted = _convert(mmproj, Path(task["folder"]), task["stem"], progress, bool(task["validate_int8"]),
                             checkpoint=onnx_child.inject_fault, kernels=list(task.get("kernels") or ["u8s8"]))
        return {"int8_cosine": converted.int8_cosine, "convert_s": converted.convert_s}
    onnx_child.inject_fault()
    cosine = validate(Path(task["fp32"]), Path(task["int8"]), Weights(mmproj).projector(),
                      progress=_step(progress, "validation"))
    return {"int8_cosine": cosine}


def _check_disk(mmproj: Path, folder: Path) -> None:
    need = DISK_FACTOR * mmproj.stat().st_size
    free = shutil.disk_usage(folder).free
    if free < need:
        raise NotEnoughDiskError(
            f"Converting {mmproj.name} for ONNX Runtime needs about {format_size(need)} free in {folder} "
            f"(the fp32 graph, a temporary copy and the int8 graph); {format_size(free)} is free. Free some "
            f"space, point GGUF_MCV_CACHE elsewhere, or use vision_backend='llama.cpp'.")


def known_int8_cosine(identity: str) -> float | None:
    """int8 vs fp32's cosine as a conversion already cached for the mmproj of ``identity`` measured
    it (its manifest only: nothing is converted, hashed or validated); None when not known."""
    version = onnxruntime_version()
    if version is None:
        return None
    try:
        manifest = read_manifest(cache_folder() / f"{_stem(identity, version)}.json", MANIFEST_VERSION)
    except (DamagedManifest, OSError):
        return None
    if manifest is None or manifest.get("cpu_class") != onnx_variants.cpu_class():
        return None  # converted again on this CPU: its figure is not this one's
    cosine = manifest.get("int8_cosine")
    if isinstance(cosine, bool) or not isinstance(cosine, (int, float)) or not -1.0 <= cosine <= 1.0:
        return None
    return float(cosine)


def _step(progress: Callable[[str, int, int], None] | None, what: str) -> Callable[[int, int], None]:
    return lambda done, total: progress(what, done, total) if progress else None


def _update_manifest(folder: Path, stem: str, **changes: Any) -> None:
    path = folder / f"{stem}.json"
    manifest = read_manifest(path, MANIFEST_VERSION)
    if manifest is not None:
        write_manifest(path, {**manifest, **changes})


def sha256_file(path: Path) -> str:
    """The SHA-256 of a regular file (never through a symlink, never blocking), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _graph_names(stem: str, kernel: str) -> dict[str, str]:
    """Each graph's file name: the int8 one names its kernel."""
    return {"fp32": f"{stem}-fp32.onnx", "int8": f"{stem}-int8-{kernel}.onnx"}


def _file_names(stem: str, kernel: str) -> set[str]:
    """The files a conversion writes: each graph and its external data."""
    return {f"{name}{data}" for name in _graph_names(stem, kernel).values() for data in ("", ".data")}


def _remove_unvouched(folder: Path, stem: str) -> None:
    """Delete this conversion's manifest and files (``<stem>.json``, ``<stem>-*``; files and
    symlinks only, a folder in the way is set aside when the new file comes) before it is made
    again: what a failed conversion moved in before its manifest, or an unusable conversion's."""
    for f in [folder / f"{stem}.json", *folder.glob(f"{stem}-*")]:
        if f.is_symlink() or f.is_file():
            f.unlink(missing_ok=True)


def _load_manifest(folder: Path, stem: str, mmproj: Path) -> Converted | None:
    """The conversion described by ``<stem>.json``, every file it lists intact and its projector
    the mmproj's own; None when there is none; :class:`DamagedManifest` when it is unusable."""
    m = read_manifest(folder / f"{stem}.json", MANIFEST_VERSION)
    if m is None:
        return None
    try:
        kernel, cpu = m["kernel"], m["cpu_class"]
        if kernel not in INT8_KERNELS or not isinstance(cpu, str):
            raise DamagedManifest(f"its int8 kernel {kernel!r} or CPU class {cpu!r} is not one a conversion writes")
        names, files = _file_names(stem, kernel), m["files"]
        if [m["fp32"], m["int8"]] != list(_graph_names(stem, kernel).values()) or set(files) != names:
            raise DamagedManifest("it names files a conversion does not write")
        cosine = m["int8_cosine"]
        if cosine is not None and (isinstance(cosine, bool) or not isinstance(cosine, (int, float))
                                   or not -1.0 <= cosine <= 1.0):
            raise DamagedManifest(f"int8_cosine {cosine!r} is not a cosine")
        for name in sorted(names):
            size, digest = files[name]
            f = folder / name
            if not is_regular(f) or f.stat().st_size != size or sha256_file(f) != digest:
                raise DamagedManifest(f"{name} is missing, not a regular file or not the file converted")
        projector = Weights(mmproj).projector()  # the mmproj's numbers, never the manifest's
        if json.loads(json.dumps(dataclasses.asdict(projector))) != m["projector"]:
            raise DamagedManifest("its projector values are not the mmproj's")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DamagedManifest(f"{type(exc).__name__}: {exc}") from None
    return Converted(fp32=folder / m["fp32"], int8=folder / m["int8"], projector=projector,
                     int8_cosine=None if cosine is None else float(cosine), convert_s=0.0, kernel=kernel,
                     cpu_class=cpu)


def _convert(mmproj: Path, folder: Path, stem: str, progress: Callable[[str, int, int], None] | None,
             validate_int8: bool = True, *, checkpoint: Callable[[str], None] | None = None,
             kernels: list[str] | None = None) -> Converted:
    """Convert and validate into ``folder`` (its lock held by the caller), the int8 graph in the
    fastest of ``kernels`` whose embeddings pass (``onnx_variants.better``; the first alone when
    int8 is not validated); ``checkpoint`` is called with "validate" once the first graphs are
    written, and with "manifest" once the files are in place (the child's fault injection).
    Whatever fails, nothing is left under a final name without its manifest."""
    import onnx

    _check_disk(mmproj, folder)
    start = time.perf_counter()
    weights = Weights(mmproj)
    projector = weights.projector()
    kernels = list(kernels or onnx_variants.candidates(onnx_variants.cpu_class()))[:None if validate_int8 else 1]
    if not kernels or any(k not in INT8_KERNELS for k in kernels):
        raise ConfigError(f"int8 kernels must be some of {', '.join(INT8_KERNELS)}, not {kernels!r}.")
    tmp = Path(tempfile.mkdtemp(prefix=f".{stem}-", dir=folder))
    moved: list[Path] = []
    built: dict[str, set[str]] = {"fp32": set(), "int8": set()}
    try:
        def graph(variant: str, kernel: str = "u8s8") -> Path:
            path = tmp / _graph_names(stem, kernel)[variant]
            if kernel not in built[variant]:
                built[variant].add(kernel)
                # both graphs are written straight from the GGUF, one weight in memory at a time (ORT's
                # quantize_dynamic loads the whole fp32 model and copies it: ~6 GB for SigLIP-400M).
                # fp32 follows libmtmd's roundings (ggml=True) and is not folded (folding is exact
                # only in exact arithmetic); int8 folds the outliers its activation quantization hates
                int8 = variant == "int8"
                model, _ = build_model(weights, fold=int8, int8=int8, ggml=not int8, kernel=kernel,
                                       int8_scope=int8_scope(projector.projector_type),
                                       external=path.with_name(path.name + ".data"),
                                       progress=_step(progress, f"{variant} graph" + (f" ({kernel})" if int8 else "")))
                onnx.save_model(model, str(path))
                del model
                _trim_heap()
            return path

        graph("fp32")
        graph("int8", kernels[0])
        if checkpoint is not None:
            checkpoint("validate")
        reference = _reference(graph("fp32"), projector) if validate_int8 else None
        cosines: dict[str, float | None] = {}
        seconds: dict[str, float] = {}

        def timed(a: str, b: str) -> dict[str, float]:
            measured = onnx_variants.time_alternating(
                {k: functools.partial(slice_seconds, graph("int8", k), projector) for k in (a, b)})
            seconds.update(measured)
            return measured

        best = ""
        for kernel in kernels:
            path = graph("int8", kernel)
            cosines[kernel] = (_score(path, projector, reference, progress=_step(progress, "validation"))
                               if reference is not None else None)
            keep = onnx_variants.better(best, kernel, cosines, timed) if best else kernel
            for dropped in {best, kernel} - {keep, ""}:  # at most two int8 graphs on disk (DISK_FACTOR)
                lost = tmp / _graph_names(stem, dropped)["int8"]
                lost.unlink()
                lost.with_name(lost.name + ".data").unlink()
            best = keep
        names = _graph_names(stem, best)
        files = {f.name: [f.stat().st_size, sha256_file(f)] for f in sorted(tmp.iterdir())}
        for f in sorted(tmp.iterdir()):  # the data files first; the manifest, written last, vouches for them
            if os.path.isdir(folder / f.name) and not os.path.islink(folder / f.name):
                set_aside(folder / f.name, "a folder where a converted file belongs", warn=False)  # warned
            os.replace(f, folder / f.name)
            moved.append(folder / f.name)
        _forget_other_versions(folder, stem)
        if checkpoint is not None:
            checkpoint("manifest")
        manifest = {"version": MANIFEST_VERSION, "fp32": names["fp32"], "int8": names["int8"],
                    "int8_cosine": cosines[best], "threshold": INT8_MIN_COSINE, "files": files,
                    "kernel": best, "cpu_class": onnx_variants.cpu_class(), "kernels_tried": cosines,
                    "kernel_seconds": seconds, "projector": dataclasses.asdict(projector), "mmproj": str(mmproj)}
        write_manifest(folder / f"{stem}.json", manifest)
    except BaseException:
        for f in moved:  # e.g. the disk filled before the manifest: no file without one
            f.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Converted(fp32=folder / names["fp32"], int8=folder / names["int8"], projector=projector,
                     int8_cosine=cosines[best], convert_s=time.perf_counter() - start, kernel=best,
                     cpu_class=onnx_variants.cpu_class())


def _forget_other_versions(folder: Path, stem: str) -> None:
    """Delete this mmproj's conversions for other onnxruntime versions (never used again)."""
    identity = stem.rsplit("-ort", 1)[0]
    for f in folder.glob(f"{identity}-ort*"):
        if not f.name.startswith(stem + "-") and not f.name.startswith(stem + ".") and f.is_file():
            f.unlink(missing_ok=True)


def save_graph(onnx: Any, model: Any, path: Path) -> None:
    """Save an ONNX ``model`` at ``path`` with its weights in one file beside it (``<name>.data``)."""
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


class OnnxVision:
    """The engine's view of an ONNX encoder (:class:`gguf_mcv.runtime.engine.VisionEncoder`)."""

    def __init__(self, converted: Converted, variant: str, mmproj_identity: str, *,
                 n_threads: int | None = None, packed: bool = True) -> None:
        if variant not in VARIANTS:
            raise ConfigError(f"ONNX variant must be one of {', '.join(VARIANTS)}, not {variant!r}.")
        self.name = f"onnx-{variant}"
        #: the embeddings' cache key names what made them: the int8 graph's kernel too
        self.key_tag = f"{mmproj_identity}+{self.name}" + (f"-{converted.kernel}" if variant == "int8" else "")
        self.encoder = OnnxEncoder(converted.path(variant), converted.projector, n_threads=n_threads, packed=packed)

    def encode(self, image: Image, index: int) -> np.ndarray:
        return self.encoder.encode_rgb(image.rgb, index, image.digest)

    @property
    def mapped_files(self) -> tuple[Path, ...]:
        """The graph and its external data, which the session reads weights from."""
        graph = self.encoder.path
        return (graph, graph.with_name(f"{graph.name}.data"))


def standin(mmproj_path: str | os.PathLike, identity: str) -> Path:
    """The stand-in of ``mmproj_path`` (``gguf_mcv.vision.mmproj_standin``) in the cache folder: written
    on every load (a few KB, atomically), so a damaged or stale copy is never used."""
    from .mmproj_standin import write_standin

    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{identity}-standin.gguf"
    with folder_lock(folder / f"{name}.lock"):
        sweep(folder, STANDIN_TEMP_NAME, name)
        return write_standin(mmproj_path, folder / name)


def progress_bar() -> Callable[[str, int, int], None]:
    """A progress callback for :func:`prepare` (bars shown on a terminal only)."""
    return progress.steps("ONNX vision")
