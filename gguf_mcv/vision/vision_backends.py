"""Which vision backend runs the encoder: the one rule ``vision_backend="auto"`` follows.

Pure (the caller says whether onnxruntime imports), so the planner, the memory model's
callers and the loader resolve ``auto`` the same way before anything is converted.
"""

from __future__ import annotations

from ..errors import ConfigError

#: projector types the ONNX converter builds (``gguf_mcv.vision.onnx_graph.PROJECTORS``; a test
#: keeps the two equal, so this rule needs neither numpy nor onnx to be imported)
ONNX_PROJECTORS = ("resampler", "minicpmv4_6")


def choose_backend(requested: str, *, vision_gpu: bool, projector_type: str,
                   ort_version: str | None) -> tuple[str, str]:
    """(backend, reason) for ``requested`` (options.VISION_BACKENDS) before any conversion:
    ``auto`` takes ``onnx-int8`` for a CPU encoder when onnxruntime imports and the projector is
    one the converter knows, else ``llama.cpp``. An explicit ONNX backend that cannot run is a
    ConfigError."""
    if requested == "llama.cpp":
        return "llama.cpp", "asked for"
    problem = ("the vision encoder runs on the GPU" if vision_gpu
               else "onnxruntime is not installed (pip install onnxruntime onnx)" if ort_version is None
               else f"the ONNX converter does not handle the {projector_type!r} projector"
               if projector_type not in ONNX_PROJECTORS else None)
    if requested == "auto":
        if problem:
            return "llama.cpp", f"auto: {problem}"
        return "onnx-int8", f"auto: CPU encoder, onnxruntime {ort_version}"
    if problem:
        raise ConfigError(f"vision_backend={requested!r} cannot be used: {problem}. "
                          "Use vision_backend='llama.cpp' (or 'auto').")
    return requested, "asked for"
