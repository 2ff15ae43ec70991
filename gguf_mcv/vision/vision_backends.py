"""Which vision backend runs the encoder, at what precision, and what happens if int8 fails.

Pure (the caller says whether onnxruntime imports, what the native check lets run and what a
cached conversion already measured), so :func:`choose_setup` is the one place the decision is
made: the planner calls it for each quant and puts its :class:`VisionSetup` in the plan, and
the loader carries out the plan's (or, with no plan, calls it once itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import ConfigError
from ..generations import onnx_projectors

#: projector types the ONNX converter builds (the generations' own word, so this rule needs
#: neither numpy nor onnx to be imported)
ONNX_PROJECTORS = onnx_projectors()
#: ``auto`` uses int8 only when its embeddings agree with fp32's at least this well
#: (mean over tokens of the per-token cosine, on the validation images; :mod:`gguf_mcv.vision.onnx_vision`)
INT8_MIN_COSINE = 0.995
#: what ``auto`` runs instead of ``onnx-int8`` when int8 fails that check at its first conversion
INT8_FALLBACK = "onnx-fp32"


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


def int8_passes(cosine: float) -> bool:
    """Whether int8 embeddings this close to fp32's (mean per-token cosine) are good enough for ``auto``."""
    return cosine >= INT8_MIN_COSINE


@dataclass(frozen=True)
class VisionSetup:
    """Who runs the vision encoder and why, and the one change still allowed at load time.

    Made by :func:`choose_setup`; the plan carries it and the loader carries it out. ``fallback``
    is the backend the loader runs instead when int8's embeddings fail their check against fp32
    at the conversion's first use (``auto`` only; the plan counts its memory too)."""

    backend: str  #: "llama.cpp", "onnx-int8" or "onnx-fp32" (never "auto")
    reason: str
    vision_gpu: bool = False  #: the placement this was decided for
    fallback: str | None = None
    #: the fallback ``auto`` would have had, left out because the memory budget does not hold it
    #: (int8 is then kept whatever its check says)
    over_budget: str | None = None
    int8_cosine: float | None = None  #: int8 vs fp32, once measured (then nothing is left to change)
    #: ONNX Runtime packs the weights into anonymous memory (True), or reads them from the mapped
    #: file (False: the planner's last shrink for a small budget, see ``memory.estimate``'s ``vision_mapped``)
    packed: bool = True

    @property
    def onnx(self) -> bool:
        return self.backend.startswith("onnx-")

    @property
    def precision(self) -> str:
        """The encoder's weights: ``int8``/``fp32`` (ONNX Runtime) or ``mmproj`` (libmtmd runs the
        mmproj's own, or its BF16 copy: ``mmproj_precision``)."""
        return self.backend.removeprefix("onnx-") if self.onnx else "mmproj"

    def validated(self, cosine: float | None) -> VisionSetup:
        """This setup once int8 has been checked against fp32 (``cosine``; None: not checked, e.g.
        int8's kernels crash here): the announced fallback when int8 fails, else the same backend
        with the figure in its reason. A setup already checked is returned as it is."""
        if cosine is None or self.int8_cosine is not None or not self.onnx:
            return self
        if self.fallback is not None and not int8_passes(cosine):
            return replace(self, backend=self.fallback, fallback=None, int8_cosine=cosine,
                           reason=f"auto: int8 embeddings agree with fp32 only to cosine {cosine:.4f} "
                                  f"(< {INT8_MIN_COSINE}) on this mmproj")
        kept = (f" (< {INT8_MIN_COSINE}; kept: {self.over_budget} does not fit the memory budget)"
                if self.over_budget is not None and not int8_passes(cosine) else "")
        return replace(self, fallback=None, int8_cosine=cosine,
                       reason=f"{self.reason}; int8 vs fp32 cosine {cosine:.4f}{kept}")

    def unconverted(self, why: str) -> VisionSetup:
        """The libmtmd setup ``auto`` falls back to when the ONNX conversion cannot be made at all."""
        return replace(self, backend="llama.cpp", fallback=None,
                       reason=f"auto: the ONNX conversion cannot be made ({why})")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "precision": self.precision}


def choose_setup(requested: str, *, vision_gpu: bool, projector_type: str, ort_version: str | None,
                 runs_instead: Callable[[str], str] | None = None, int8_cosine: float | None = None,
                 fallback_fits: Callable[[str], bool] | None = None) -> VisionSetup:
    """The vision setup for ``requested`` (``load()``'s ``vision_backend``): the rule
    (:func:`choose_backend`), then, for a CPU encoder, ``runs_instead(backend)`` -- the backend the
    native check lets run in its place (:func:`gguf_mcv.runtime.native_check.decide`; it raises for
    an explicit backend that crashes). ``auto``'s int8 gets :data:`INT8_FALLBACK` as its fallback
    where ``fallback_fits(INT8_FALLBACK)`` (the memory budget holds it; else int8 is kept whatever
    its check says); ``int8_cosine`` known already (a cached conversion) settles that now."""
    backend, reason = choose_backend(requested, vision_gpu=vision_gpu, projector_type=projector_type,
                                     ort_version=ort_version)
    if not vision_gpu and runs_instead is not None:
        safe = runs_instead(backend)
        if safe != backend:
            backend, reason = safe, f"{reason}; {backend} crashed on this machine (see the notice)"
    setup = VisionSetup(backend, reason, vision_gpu)
    if requested == "auto" and backend == "onnx-int8":
        fits = fallback_fits is None or fallback_fits(INT8_FALLBACK)
        setup = replace(setup, fallback=INT8_FALLBACK if fits else None, over_budget=None if fits else INT8_FALLBACK)
    return setup.validated(int8_cosine)
