"""The vision encoder on ONNX Runtime: converted once from the mmproj, cached, self-validated.

:func:`prepare` converts an mmproj (``gguf_mcv.vision.onnx_graph``) into ``<cache>/onnx/`` —
fp32 (rounding where ggml's CPU kernels round, so its embeddings follow libmtmd's closely),
and int8 (ONNX Runtime's DynamicQuantizeMatMul: per-column int8 weights for the ViT
blocks' MatMuls and MiniCPM-V 4.6's mergers, activations quantized per call, LayerNorm gamma
outliers folded into the weights first; the patch embedding and the 2.x resampler stay fp32:
:func:`int8_scope`). Files are keyed by the mmproj's identity
and the onnxruntime version, written into a temporary folder and moved into place; a
manifest with each file's size and SHA-256 and a digest of its own content is written last
and checked on every load (the projector's numbers are read again from the mmproj), so a
killed conversion, a damaged file or an edited manifest is rebuilt, never used. At conversion the int8
graph's embeddings are compared with the fp32 graph's on the bundled example image and
synthetic patterns; :data:`INT8_MIN_COSINE` decides whether ``auto`` may use int8. Both run in
a child process (``gguf_mcv.vision.onnx_child``): the caller then loads the cached result.
:class:`OnnxEncoder` runs one slice: libmtmd's preprocessing (``mtmd_preprocess``) and the
position inputs for that slice's size.
"""

from __future__ import annotations

import dataclasses
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

from .. import constants, progress
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
from .media import Image
from .mtmd_preprocess import PreprocessParams, slice_pixels
from .onnx_graph import STAGES_KEY, Projector, Weights, build_model, graph_inputs
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
#: resampler is fp32 again in the int8 graph (:func:`int8_scope`)
MANIFEST_VERSION = 5
#: disk a conversion needs, in mmproj (f16) sizes: the fp32 graph 2x, the int8 graph about
#: 0.6x, with room to spare
DISK_FACTOR = 3
#: temporary entries a conversion writes (``tempfile``'s 8 random characters after the stem):
#: those of a killed conversion are removed when its lock is next taken
TEMP_NAME = re.compile(r"\.(?P<stem>.+)-[a-z0-9_]{8}(?:\.json\.part)?|(?P<old>.+)\.json\.part")
#: the same for a stand-in's temporary file (:func:`gguf_mcv.vision.mmproj_standin.write_standin`)
STANDIN_TEMP_NAME = re.compile(r"\.(?P<stem>.+)-[a-z0-9_]{8}\.part")
#: the bundled example photo (also the self-test's)
EXAMPLE_IMAGE = Path(__file__).resolve().parent.parent / "assets" / "example.png"
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
    return constants.cache_dir() / "onnx"


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
    as they were, and a child killed by a signal (out of memory) is an EngineError, nothing cached."""
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
        if found is not None and (found.int8_cosine is not None or not validate_int8):
            return found
        if found is not None:
            cosine = _in_child({"do": "validate", "mmproj": os.fspath(mmproj_path), "fp32": os.fspath(found.fp32),
                                "int8": os.fspath(found.int8)}, progress)["int8_cosine"]
            _update_manifest(folder, stem, int8_cosine=cosine)
            return dataclasses.replace(found, int8_cosine=cosine)
        mmproj = Path(mmproj_path)
        _check_disk(mmproj, folder)
        if not CONVERT_IN_CHILD:
            return _convert(mmproj, folder, stem, progress, validate_int8)
        start = time.perf_counter()
        try:
            _in_child({"do": "convert", "mmproj": os.fspath(mmproj), "folder": os.fspath(folder), "stem": stem,
                       "validate_int8": validate_int8}, progress)
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
                             checkpoint=onnx_child.inject_fault)
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
    cosine = manifest.get("int8_cosine") if manifest is not None else None
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


def _file_names(stem: str) -> set[str]:
    """The files a conversion writes: each graph and its external data."""
    return {f"{stem}-{v}.onnx{data}" for v in VARIANTS for data in ("", ".data")}


def _load_manifest(folder: Path, stem: str, mmproj: Path) -> Converted | None:
    """The conversion described by ``<stem>.json``, every file it lists intact and its projector
    the mmproj's own; None when there is none; :class:`DamagedManifest` when it is unusable."""
    m = read_manifest(folder / f"{stem}.json", MANIFEST_VERSION)
    if m is None:
        return None
    try:
        names = _file_names(stem)
        files = m["files"]
        if (m["fp32"], m["int8"]) != (f"{stem}-fp32.onnx", f"{stem}-int8.onnx") or set(files) != names:
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
                     int8_cosine=None if cosine is None else float(cosine), convert_s=0.0)


def _convert(mmproj: Path, folder: Path, stem: str, progress: Callable[[str, int, int], None] | None,
             validate_int8: bool = True, *, checkpoint: Callable[[], None] | None = None) -> Converted:
    """Convert and validate into ``folder`` (its lock held by the caller); ``checkpoint`` is
    called once the graphs are written, before validating (the child's fault injection)."""
    import onnx

    _check_disk(mmproj, folder)
    start = time.perf_counter()
    weights = Weights(mmproj)
    projector = weights.projector()
    tmp = Path(tempfile.mkdtemp(prefix=f".{stem}-", dir=folder))
    try:
        names = {v: f"{stem}-{v}.onnx" for v in VARIANTS}

        # both graphs are written straight from the GGUF, one weight in memory at a time (ORT's
        # quantize_dynamic loads the whole fp32 model and copies it: ~6 GB for SigLIP-400M)
        for variant in VARIANTS:
            path = tmp / names[variant]
            # fp32 follows libmtmd's roundings (ggml=True) and is not folded (folding is exact
            # only in exact arithmetic); int8 folds the outliers its activation quantization hates
            int8 = variant == "int8"
            model, _ = build_model(weights, fold=int8, int8=int8, ggml=not int8,
                                   int8_scope=int8_scope(projector.projector_type),
                                   external=path.with_name(path.name + ".data"),
                                   progress=_step(progress, f"{variant} graph"))
            onnx.save_model(model, str(path))
            del model
        del weights
        _trim_heap()
        if checkpoint is not None:
            checkpoint()
        cosine = (validate(tmp / names["fp32"], tmp / names["int8"], projector, progress=_step(progress, "validation"))
                  if validate_int8 else None)
        files = {}
        for f in sorted(tmp.iterdir()):
            files[f.name] = [f.stat().st_size, sha256_file(f)]
        for f in sorted(tmp.iterdir()):  # the data files first; the manifest, written last, vouches for them
            if os.path.isdir(folder / f.name) and not os.path.islink(folder / f.name):
                set_aside(folder / f.name, "a folder where a converted file belongs", warn=False)  # warned
            os.replace(f, folder / f.name)
        _forget_other_versions(folder, stem)
        manifest = {"version": MANIFEST_VERSION, "fp32": names["fp32"], "int8": names["int8"],
                    "int8_cosine": cosine, "threshold": INT8_MIN_COSINE, "files": files,
                    "projector": dataclasses.asdict(projector), "mmproj": str(mmproj)}
        write_manifest(folder / f"{stem}.json", manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Converted(fp32=folder / names["fp32"], int8=folder / names["int8"], projector=projector,
                     int8_cosine=cosine, convert_s=time.perf_counter() - start)


def _forget_other_versions(folder: Path, stem: str) -> None:
    """Delete this mmproj's conversions for other onnxruntime versions (never used again)."""
    identity = stem.rsplit("-ort", 1)[0]
    for f in folder.glob(f"{identity}-ort*"):
        if not f.name.startswith(stem + "-") and not f.name.startswith(stem + ".") and f.is_file():
            f.unlink(missing_ok=True)


def _save(onnx: Any, model: Any, path: Path) -> None:
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def validation_images() -> list[np.ndarray]:
    """The bundled example photo and synthetic patterns (a gradient, a checkerboard), one slice each."""
    from .media import load_image

    photo = load_image(EXAMPLE_IMAGE).resized_to(448, 448).rgb
    y, x = np.mgrid[0:448, 0:448]
    gradient = np.stack([x * 255 // 447, y * 255 // 447, (x + y) * 255 // 894], axis=-1).astype(np.uint8)
    checker = (((x // 32 + y // 32) % 2) * 255).astype(np.uint8)[..., None].repeat(3, axis=-1)
    return [photo, gradient, checker]


def token_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each token (row) of two (tokens × width) embeddings."""
    a = a.reshape(-1, a.shape[-1]).astype(np.float64)
    b = b.reshape(-1, b.shape[-1]).astype(np.float64)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.where(den > 0, (a * b).sum(axis=1) / np.maximum(den, 1e-30), 1.0)


def validate(fp32: Path, int8: Path, projector: Projector, *,
             progress: Callable[[int, int], None] | None = None, n_threads: int | None = None) -> float:
    """Mean per-token cosine of the int8 graph's embeddings vs the fp32 graph's (the worst
    validation image's). The fp32 graph runs one stage at a time (:func:`run_in_stages`), so
    validating never holds more weights than the int8 session a later load holds."""
    images = validation_images()
    params = _params(projector)
    feeds = []
    for rgb in images:
        pixels = slice_pixels(rgb, params)[0]
        h, w = pixels.shape[1] // projector.patch_size, pixels.shape[2] // projector.patch_size
        feeds.append({"pixels": pixels[None].astype(np.float32, copy=False), **graph_inputs(projector, h, w)})
    reference = [out[0] for out in run_in_stages(fp32, feeds, n_threads=n_threads)]
    if progress:
        progress(1, 2)
    encoder = OnnxEncoder(int8, projector, n_threads=n_threads)
    quantized = [encoder.encode_rgb(rgb, 0) for rgb in images]
    del encoder
    _trim_heap()  # the load that follows makes its own session: this one's memory goes back first
    if progress:
        progress(2, 2)
    scores = [float(token_cosines(a, b).mean()) for a, b in zip(reference, quantized, strict=True)]
    return min(scores) if scores else 0.0


def run_in_stages(path: Path, feeds: list[dict[str, np.ndarray]], *,
                  n_threads: int | None = None) -> list[np.ndarray]:
    """The graph at ``path`` run on each of ``feeds``, one stage (patch embedding, block, merger,
    projector: ``onnx_graph.STAGES_KEY``) at a time, each stage a session of its own that holds
    only that stage's weights; returns each feed's ``embeddings``. A graph without stages runs whole."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    if not props.get(STAGES_KEY):
        session = _session(str(path), n_threads, None)
        return [session.run(["embeddings"], f)[0] for f in feeds]
    graph = model.graph
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    inits = {t.name: t for t in graph.initializer}
    graph_inputs_ = {i.name: i for i in graph.input}
    values = [dict(f) for f in feeds]
    start = 0
    for name in [*props[STAGES_KEY].split(","), "embeddings"]:
        end = producer[name] + 1
        nodes = list(graph.node[start:end])
        made = {o for node in nodes for o in node.output}
        needed = list(dict.fromkeys(i for node in nodes for i in node.input if i and i not in made))
        inputs = [n for n in needed if n not in inits]
        if any(n not in values[0] for n in inputs):
            raise EngineError(f"{path.name}: stage {name!r} needs {inputs}, which earlier stages do not give.")
        stage = helper.make_graph(
            nodes, f"stage_{name}",
            [graph_inputs_[n] if n in graph_inputs_ else helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
             for n in inputs],
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)],
            initializer=[inits[n] for n in needed if n in inits])
        sub = helper.make_model(stage, opset_imports=model.opset_import, ir_version=model.ir_version)
        session = _session(sub.SerializeToString(), n_threads, path.parent, arena=False)
        for v in values:
            v[name] = session.run([name], {n: v[n] for n in inputs})[0]
            for n in inputs:  # a stage's input is no later stage's (graph inputs stay)
                if n not in graph_inputs_:
                    del v[n]
        del session, sub, stage
        _trim_heap()
        start = end
    return [v["embeddings"] for v in values]


def _trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing): each stage's session frees its weights, and they must not add up in RSS."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def _session(model: str | bytes, n_threads: int | None, data_folder: Path | None, *, arena: bool = True,
             packed: bool = True) -> Any:
    """An ONNX Runtime CPU session: all graph optimizations, ``n_threads`` intra-op threads, no
    spinning; ``data_folder`` is where a model given as bytes finds its external data.
    ``arena=False``: no memory arena (what a short-lived session's arena held stays in the
    process's heap after the session is gone). ``packed=False``: no prepacking, so the weights
    stay in their memory-mapped data file (file pages the kernel may drop and read again)
    instead of being copied into anonymous memory; int8 slices then take ~25 % longer."""
    import onnxruntime as ort  # lazy: a native library

    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = arena
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if n_threads:
        options.intra_op_num_threads = int(n_threads)
    options.inter_op_num_threads = 1
    # ORT's pool spins after each run by default; llama.cpp's threads need those cores then
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not packed:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if data_folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(data_folder))
    try:
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... classes
        shown = model if isinstance(model, str) else "a stage of a converted graph"
        raise EngineError(f"ONNX Runtime could not load {shown}: {exc}") from exc


def _params(projector: Projector) -> PreprocessParams:
    return PreprocessParams(image_size=projector.image_size, patch_size=projector.patch_size,
                            mean=projector.mean, std=projector.std, n_merge=projector.n_merge)


class OnnxEncoder:
    """One ONNX Runtime session of the vision encoder; encodes slices of an image."""

    def __init__(self, path: str | os.PathLike, projector: Projector, *, n_threads: int | None = None,
                 packed: bool = True) -> None:
        self.path = Path(path)
        self.projector = projector
        self.params = _params(projector)
        self.packed = packed  #: False: weights read from the mapped file (see :func:`_session`)
        self._session = _session(str(self.path), n_threads, None, packed=packed)
        self._last: tuple[str, list[np.ndarray]] | None = None
        self.calls = 0

    def encode_rgb(self, rgb: np.ndarray, index: int, digest: str | None = None) -> np.ndarray:
        """Embeddings (tokens × width, float32) of slice ``index`` (0 = the overview) of ``rgb``."""
        if digest is None or self._last is None or self._last[0] != digest:
            slices = slice_pixels(rgb, self.params)
            self._last = (digest, slices) if digest is not None else None
        else:
            slices = self._last[1]
        if not 0 <= index < len(slices):
            raise EngineError(f"libmtmd asked for slice {index} of an image that has {len(slices)}; "
                              "the ONNX preprocessing disagrees with libmtmd's slicing.")
        return self.encode_pixels(slices[index])

    def encode_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """Embeddings of one normalised 3×H×W slice."""
        h, w = pixels.shape[1] // self.projector.patch_size, pixels.shape[2] // self.projector.patch_size
        feeds = {"pixels": pixels[None].astype(np.float32, copy=False), **graph_inputs(self.projector, h, w)}
        try:
            (out,) = self._session.run(["embeddings"], feeds)
        except Exception as exc:  # onnxruntime's own error classes
            raise EngineError(f"The ONNX vision encoder failed: {exc}") from exc
        self.calls += 1
        return np.ascontiguousarray(out[0], dtype=np.float32)


class OnnxVision:
    """The engine's view of an ONNX encoder (:class:`gguf_mcv.runtime.engine.VisionEncoder`)."""

    def __init__(self, converted: Converted, variant: str, mmproj_identity: str, *,
                 n_threads: int | None = None, packed: bool = True) -> None:
        if variant not in VARIANTS:
            raise ConfigError(f"ONNX variant must be one of {', '.join(VARIANTS)}, not {variant!r}.")
        self.name = f"onnx-{variant}"
        self.key_tag = f"{mmproj_identity}+{self.name}"
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
