"""ONNX Runtime sessions of the converted vision encoder: running a slice, timing one, and the
self-validation of an int8 graph against the fp32 one (the fp32 graph run one stage at a time).

:class:`OnnxEncoder` runs one slice: libmtmd's preprocessing (``mtmd_preprocess``) and the
position inputs for that slice's size. ``gguf_mcv.vision.onnx_vision`` converts and caches the
graphs these run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import EngineError
from .mtmd_preprocess import PreprocessParams, slice_pixels
from .onnx_graph import STAGES_KEY, Projector, graph_inputs

#: the bundled example photo (also the self-test's)
EXAMPLE_IMAGE = Path(__file__).resolve().parent.parent / "assets" / "example.png"


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
    reference = _reference(fp32, projector, n_threads=n_threads)
    if progress:
        progress(1, 2)
    return _score(int8, projector, reference, progress=lambda done, total: progress(2, 2) if progress else None,
                  n_threads=n_threads)


def _reference(fp32: Path, projector: Projector, *, n_threads: int | None = None) -> list[np.ndarray]:
    """The fp32 graph's embeddings of each validation image, run one stage at a time."""
    params = _params(projector)
    feeds = []
    for rgb in validation_images():
        pixels = slice_pixels(rgb, params)[0]
        h, w = pixels.shape[1] // projector.patch_size, pixels.shape[2] // projector.patch_size
        feeds.append({"pixels": pixels[None].astype(np.float32, copy=False), **graph_inputs(projector, h, w)})
    return [out[0] for out in run_in_stages(fp32, feeds, n_threads=n_threads)]


def _score(int8: Path, projector: Projector, reference: list[np.ndarray], *,
           progress: Callable[[int, int], None] | None = None, n_threads: int | None = None) -> float:
    """:func:`validate`'s figure for the int8 graph ``int8`` against ``reference`` (:func:`_reference`)."""
    encoder = OnnxEncoder(int8, projector, n_threads=n_threads)
    quantized = [encoder.encode_rgb(rgb, 0) for rgb in validation_images()]
    del encoder
    _trim_heap()  # the load that follows makes its own session: this one's memory goes back first
    if progress:
        progress(1, 1)
    scores = [float(token_cosines(a, b).mean()) for a, b in zip(reference, quantized, strict=True)]
    return min(scores) if scores else 0.0


def slice_seconds(path: Path, projector: Projector, *, n_threads: int | None = None) -> float:
    """Seconds one full-size slice takes through the graph at ``path`` in a fresh session (after a
    small slice has warmed it up): what ``onnx_variants.time_alternating`` compares."""
    encoder = OnnxEncoder(path, projector, n_threads=n_threads)
    rng = np.random.default_rng(0)
    n = projector.patch_size * max(projector.n_merge, 1) * 2
    encoder.encode_pixels(rng.standard_normal((3, n, n), np.float32))
    pixels = rng.standard_normal((3, projector.image_size, projector.image_size), np.float32)
    begin = time.perf_counter()
    encoder.encode_pixels(pixels)
    elapsed = time.perf_counter() - begin
    del encoder
    _trim_heap()
    return elapsed


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
