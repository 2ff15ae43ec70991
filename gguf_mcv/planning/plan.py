"""What a plan is: the quant files a model offers, the planner's verdict on each, the load's own
choices it keeps, and the :class:`Plan` that ``load()`` carries out (:mod:`gguf_mcv.planning.planner`
makes it; :mod:`gguf_mcv.planning.report` renders it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..hardware import Hardware
from ..options import N_BATCH, check_int, check_parallel
from ..vision.vision_backends import VisionSetup
from . import memory, report, speed
from .speed import Rates, SpeedPrediction


@dataclass(frozen=True)
class QuantCandidate:
    """One quant file a model offers."""

    quant: str
    file: str
    size: int  #: bytes
    exact: bool = True  #: False when ``size`` is an estimate (a catalog figure, not the Hub's)
    #: bytes by ggml weight type, when the file's header was read (speed predictions)
    weights: speed.WeightProfile | None = None


@dataclass(frozen=True)
class PlanRow:
    """What the planner concluded about one quant."""

    quant: str
    file: str
    size: int
    needed: int | None  #: predicted RAM need (None: not evaluated)
    peak_rss: int | None  #: predicted peak RSS on a machine with RAM to spare
    fits: bool
    note: str
    n_gpu_layers: int = 0
    chosen: bool = False
    decode_tokens_per_s: float | None = None  #: predicted (None: no rates given)
    first_answer_s: float | None = None  #: predicted seconds to the first token, a photo
    video_first_answer_s: float | None = None  #: the same for a 16-frame video
    vision_backend: str = "llama.cpp"  #: who runs the encoder in this row's memory figures


@dataclass(frozen=True)
class Shrink:
    """A default the planner lowered because nothing fitted with it."""

    setting: str  #: "n_ctx", "kv_cache_type" or "vision_weights"
    default: int | str
    planned: int | str

    def __str__(self) -> str:
        return f"{self.setting} {self.default} -> {self.planned}"


#: The last shrink: the ONNX encoder's weights stay in their memory-mapped file instead of being
#: packed into anonymous memory (int8 slices ~25 % slower; under memory pressure the kernel drops
#: the encoder's pages while the text model answers and reads them again for the next image).
MAPPED_VISION = Shrink("vision_weights", "packed", "mapped")


@dataclass(frozen=True)
class LoadChoices:
    """What a load fixed itself, kept by the plan as given (None or ``"auto"``: the plan decides)."""

    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_gpu_layers: int | str = "auto"  #: llama.cpp's count, -1 all, or "auto"
    vision_gpu: bool | None = None
    parallel: int | str = "auto"  #: slots, or "auto": what the budget holds

    def __post_init__(self) -> None:
        for name in ("n_threads", "n_threads_batch"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=1)
        if self.n_gpu_layers != "auto":
            check_int("n_gpu_layers", self.n_gpu_layers, low=-1)
        if self.vision_gpu not in (None, True, False):
            raise ConfigError(f"vision_gpu must be True, False or None, not {self.vision_gpu!r}.")
        check_parallel(self.parallel)

    @property
    def by_hand(self) -> bool:
        """Layers or the vision tower offloaded by hand: kept as given, not fitted to the GPU."""
        return self.n_gpu_layers != "auto" and bool(self.n_gpu_layers or self.vision_gpu)


@dataclass(frozen=True)
class Plan:
    """The chosen quant and how to load it, with the reasoning for every quant."""

    quant: str
    files: tuple[str, str]  #: (model file, mmproj file)
    predicted_bytes: int  #: RAM the chosen setup needs (``MemoryEstimate.needed``)
    budget: int
    n_ctx: int
    n_threads: int
    n_gpu_layers: int  #: llama.cpp's count (output matrix first); -1 = everything
    vision_on_gpu: bool
    kv_cache_type: str
    rows: tuple[PlanRow, ...]
    estimate: memory.MemoryEstimate
    gpu_budget: int | None = None
    fits: bool = True  #: False only for an explicit quant that does not fit
    warnings: tuple[str, ...] = ()
    budget_note: str = ""
    model: str = ""  #: the catalog name or repo id planned for (set by :func:`plan`)
    #: what ``parallel="auto"`` would load: the slots (answers at once) the budget holds
    slots: int = 1
    slot_bytes: int = 0  #: what each slot beyond the first costs (KV cache, batch row, a waiting image)
    speed: SpeedPrediction | None = None  #: the chosen quant's predicted speed
    rates: Rates | None = None  #: the machine rates the predictions used
    vision_backend: str = "llama.cpp"  #: who runs the encoder in the chosen setup
    vision_backend_reason: str = ""  #: why (the loader's rule for ``vision_backend="auto"``)
    #: the whole vision decision (backend, precision, reason, fallback) that ``load()`` carries out
    vision: VisionSetup | None = None
    #: RAM needed if the vision setup's fallback runs instead (None: it has none)
    fallback_bytes: int | None = None
    #: defaults the planner lowered so that the model fits (empty when none was needed)
    shrunk: tuple[Shrink, ...] = ()
    #: the detail the ``images`` term assumes (``detail=``): a 12 MP photo decoded for that detail's slices
    image_detail: str = "auto"
    #: what a photo at detail="high" decodes beyond that (0 when the plan assumed it already)
    high_detail_extra: int = 0
    n_threads_batch: int = 0  #: threads for prompts and the vision encoder
    #: the slots a load opens: ``parallel`` as given, or (``"auto"``) :attr:`slots`
    parallel: int = 1
    n_batch: int = N_BATCH  #: llama.cpp's n_batch and n_ubatch (the compute buffer's reserve)
    #: the machine the plan was made for (the probe's snapshot; no GPU when the load keeps to the CPU)
    hardware: Hardware | None = None
    #: the load's own choices the plan kept (:class:`LoadChoices`)
    given: LoadChoices | None = None

    def shrunk_note(self) -> str:
        """One sentence on :attr:`shrunk` ("" when nothing was shrunk)."""
        return report.shrunk_note(self)

    def images_note(self) -> str:
        """One sentence on the photo the ``images`` term assumes (and what detail="high" adds)."""
        return report.images_note(self)

    def table(self) -> str:
        """An aligned, readable table of the rows, with the budget above it."""
        return report.table(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "model": self.model, "quant": self.quant, "files": list(self.files),
            "predicted_bytes": self.predicted_bytes,
            "budget": self.budget, "gpu_budget": self.gpu_budget, "n_ctx": self.n_ctx,
            "n_threads": self.n_threads, "n_gpu_layers": self.n_gpu_layers,
            "vision_on_gpu": self.vision_on_gpu, "kv_cache_type": self.kv_cache_type,
            "fits": self.fits, "warnings": list(self.warnings), "slots": self.slots,
            "slot_bytes": self.slot_bytes, "vision_backend": self.vision_backend,
            "vision_backend_reason": self.vision_backend_reason,
            "vision": self.vision.to_dict() if self.vision is not None else None,
            "fallback_bytes": self.fallback_bytes,
            "rows": [r.__dict__.copy() for r in self.rows], "estimate": self.estimate.to_dict(),
            "speed": self.speed.to_dict() if self.speed is not None else None,
            "rates": self.rates.to_dict() if self.rates is not None else None,
            "shrunk": [s.__dict__.copy() for s in self.shrunk],
            "image_detail": self.image_detail, "high_detail_extra": self.high_detail_extra,
        }  # fmt: skip
