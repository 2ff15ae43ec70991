"""Choose the quantization, context and GPU split that fit a machine.

:func:`choose` is pure: it takes the quant files a model offers (name, file, size),
the model's shape and a :class:`~gguf_mcv.hardware.Hardware`, predicts each quant's
memory with :func:`gguf_mcv.planning.memory.estimate` and returns a :class:`Plan`: the best
quant that fits, the settings to load it with, and one row per quant saying why it
was or was not chosen. It does no I/O: :func:`gguf_mcv.resolver.plan` gathers those
inputs for a model name (the machine, the Hub's file list, the shapes) and calls it.

Rules, in order:

* **Budget**: ``ram_budget`` when given (bytes or ``"6GB"``), taken as is; else the
  machine's available RAM less a safety reserve (:attr:`gguf_mcv.hardware.Hardware.ram_reserve`):
  max(10 %, 300 MB) of the host's free RAM -- the OS, page cache and whatever else starts later
  need room, and predictions are within ~5 % -- and 64 MiB of what a container's memory limit
  leaves, where that is less.
* **Fit**: a quant fits when the memory model's ``needed`` (peak RSS less page cache
  the kernel can drop, plus a long prompt's compute) is at most the budget, and its
  GPU share fits the GPU.
* **Pick**: ``prefer="quality"`` takes the best quality that fits
  (:data:`gguf_mcv.models.quants.QUANT_ORDER`); ``"size"`` and ``"speed"`` the smallest file
  that fits (token generation is memory-bound: fewer bytes per token, faster tokens).
* **GPU** (discrete, llama.cpp built with offload): the vision tower goes to the GPU
  first when it fits -- on a CPU it takes ~9 s per 448-pixel slice, ~90 s for one
  full-detail image -- then as many text layers as fit with 5 % headroom
  (:func:`gguf_mcv.planning.gpu_fit.fit_gpu_layers`). When some quants fit the GPU entirely,
  the pick is made among those only: layers left on the CPU cost far more speed than
  one quant step costs quality. **Unified memory** (Jetson, Apple): everything is
  offloaded and the GPU's allocations count against the one RAM budget; if no quant
  fits that way (device copies cost RAM there), the plan is for the CPU alone.
* **Vision backend** (``vision_backend``, decided per quant by the one function the loader
  carries out, :func:`gguf_mcv.vision.vision_backends.choose_setup`): ``"auto"`` is ``onnx-int8``
  when the encoder stays on the CPU and ``onnxruntime`` (its version passed as ``onnxruntime``)
  imports, else ``llama.cpp``; a backend the native check saw crash (``vision_moves``) is
  replaced as the loader replaces it; the memory of the backend each row assumes is what is
  fitted. On a CPU, ``auto``'s int8 tower is smaller than libmtmd's F16 one, so a tight budget
  keeps the better text quant rather than the larger encoder. ``auto``'s int8 falls back to
  fp32 at load time if its embeddings fail their check against fp32 (unless ``int8_cosine``,
  from a cached conversion, already says how that check went): only where the budget holds
  fp32 too (else int8 is kept), and the plan shows that fallback and what it needs.
* **Speed limits** (``min_tokens_per_s``, ``max_first_answer_s``, with ``rates``): among
  the quants that fit, only those the speed model (:mod:`gguf_mcv.planning.speed`) predicts to
  meet them; none meeting them is a :class:`~gguf_mcv.errors.NoQuantFitsError` naming the
  fastest quant that fits. Without limits the choice is the same as without ``rates``.
* **Shrinking defaults**: when nothing fits with the defaults (``n_ctx`` 4096, an f16 KV
  cache) and the caller left them to the planner (``None``), it first tries a q8_0 KV cache
  (half the bytes, a quality loss far below one quant step), then the largest ``n_ctx`` of at
  least :data:`MIN_SHRUNK_CTX` with which some quant fits, and plans that; the plan says so
  (:attr:`Plan.shrunk`, its table and ``--json``). A value the caller gave is never changed.
* **Mapped vision weights**: when nothing fits even then, an ONNX encoder's weights stay in
  their memory-mapped file instead of being packed into anonymous memory (:data:`MAPPED_VISION`,
  ``memory.estimate``'s ``vision_mapped``): the encoder's and the text model's weights are read
  in turn, so only the larger set counts; what the two together exceed the budget by is read from
  disk again at every image, so among the quants that then fit the one that would hold the least
  (its need without the swap) is planned, with one parallel slot. Also said in the plan.
* **Explicit quant**: honoured even when it does not fit (after shrinking the defaults as
  above); the plan then has ``fits=False`` and a warning instead of raising, since the caller
  asked for it -- unless ``must_fit`` (local files loaded by ``load()``), which raises.
* **Nothing fits**: :class:`~gguf_mcv.errors.NoQuantFitsError` naming the smallest
  need, the budget, the ``n_ctx`` that would fit, what a q8_0 KV cache saves, and
  smaller models.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from .. import constants
from ..errors import ConfigError, NoQuantFitsError
from ..hardware import OS_RESERVE_FRACTION, OS_RESERVE_MIN, Hardware, cpu_family
from ..models.quants import normalize_quant, quality_rank
from ..models.shapes import TextShape, VisionShape
from ..options import (
    DETAILS,
    MAX_N_CTX,
    MIN_N_CTX,
    N_BATCH,
    check_int,
    check_parallel,
    check_vision_backend,
    check_vision_weights,
)
from ..units import format_size, parse_size
from ..vision.vision_backends import VisionSetup, choose_backend, choose_setup
from . import gpu_fit, memory, speed
from .speed import Rates, SpeedPrediction

PREFERENCES = ("quality", "speed", "size")
#: Share of the host's free RAM kept free when no budget is given, and its floor in bytes
#: (inside a container's memory limit, :attr:`Hardware.ram_reserve` keeps less).
RESERVE_FRACTION = OS_RESERVE_FRACTION
RESERVE_MIN = OS_RESERVE_MIN
#: Share of free VRAM left unused (fragmentation, the display, other processes).
GPU_HEADROOM = 0.05
#: The smallest context worth suggesting: one full-detail image plus a short exchange.
MIN_SUGGESTED_CTX = 1024
#: The smallest context the planner shrinks a default one to on its own: a full-detail
#: image (640 tokens) or a 16-frame video, with room for a conversation about it.
MIN_SHRUNK_CTX = 2048
#: What a default f16 KV cache is shrunk to when nothing fits with it.
SHRUNK_KV = "q8_0"
#: Models to suggest when nothing fits (catalog names, smallest first).
SMALLER_MODELS = ("minicpm-v-4.6",)
DEFAULT_MMPROJ_FILE = "mmproj-model-f16.gguf"
#: Types the planner does not pick on its own (see :func:`_pick`).
UNQUANTIZED = ("F16", "BF16", "F32")


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
        if not self.shrunk:
            return ""
        asked = " / ".join(f"{s.setting}=" for s in self.shrunk)
        note = (f"Shrunk to fit the budget: {', '.join(map(str, self.shrunk))} (nothing fitted with the "
                f"defaults; pass {asked} to choose yourself).")
        if MAPPED_VISION in self.shrunk:
            note += (" The vision encoder reads its weights from their mapped file: slices take ~25 % longer, "
                     "and under memory pressure each new image reads them from disk again.")
        return note

    def images_note(self) -> str:
        """One sentence on the photo the ``images`` term assumes (and what detail="high" adds)."""
        note = (f"Images: a 12 MP photo asked about at detail={self.image_detail!r} "
                f"({format_size(self.estimate.images)} decoded).")
        if self.high_detail_extra > 0:
            note += (f" detail='high' decodes {format_size(self.high_detail_extra)} more: plan with "
                     "detail='high' if you ask for it.")
        return note

    def table(self) -> str:
        """An aligned, readable table of the rows, with the budget above it."""
        timed = self.speed is not None
        head: tuple[str, ...] = ("", "quant", "file size", "needs", "peak RSS")
        head += ("tok/s", "photo", "video") if timed else ()
        body = [("->" if r.chosen else "", r.quant, format_size(r.size), format_size(r.needed),
                 format_size(r.peak_rss)) + (_speed_cells(r) if timed else ()) for r in self.rows]
        head, body = head + ("verdict",), [row + (r.note,) for row, r in zip(body, self.rows, strict=True)]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        right = range(2, len(head) - 1)
        fmt = lambda row: "  ".join(  # noqa: E731
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        lines = [f"Model: {self.model}"] if self.model else []
        lines += [self.budget_note or f"RAM budget {format_size(self.budget)}"]
        lines += [self.shrunk_note()] if self.shrunk else []
        lines.append(fmt(head))
        lines += [fmt(row) for row in body]
        gpu = "no GPU offload"
        if self.n_gpu_layers or self.vision_on_gpu:
            layers = "all" if self.n_gpu_layers < 0 else str(self.n_gpu_layers)
            gpu = f"n_gpu_layers={layers}, vision on {'GPU' if self.vision_on_gpu else 'CPU'}"
        if self.slot_bytes:
            lines.append(f"Parallel slots (parallel=\"auto\"): {self.slots}, "
                         f"{format_size(self.slot_bytes)} each beyond the first.")
        lines.append(f"Vision encoder: {self.vision_backend} ({self.vision_backend_reason}); "
                     "its weights and working memory are in the figures above.")
        if self.vision is not None and self.vision.fallback is not None and self.fallback_bytes is not None:
            lines.append(f"If int8's embeddings fail their check against fp32 when it is first converted, "
                         f"load() runs {self.vision.fallback} instead: it needs {format_size(self.fallback_bytes)}, "
                         f"within the budget.")
        elif self.vision is not None and self.vision.over_budget is not None:
            lines.append(f"int8 is kept even if its embeddings fail their check against fp32: "
                         f"{self.vision.over_budget} would not fit the budget.")
        lines.append(self.images_note())
        lines.append(f"Chosen {self.quant}: n_ctx={self.n_ctx}, kv_cache_type={self.kv_cache_type}, "
                     f"n_threads={self.n_threads}, {gpu}.")
        if self.speed is not None and self.rates is not None:
            lines.append(f"Speed predicted from {self.rates.source}: tok/s = decode tokens per second; "
                         f"photo = seconds to the first token for a 12 MP photo at detail="
                         f"{self.speed.detail!r} ({self.speed.photo_slices} encoder passes); "
                         f"video = the same for {speed.VIDEO_FRAMES} frames.")
        lines += [f"Warning: {w}" for w in self.warnings]
        return "\n".join(lines)

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


@dataclass(frozen=True)
class _Setup:
    """Where things run, for one quant."""

    n_gpu_layers: int = 0  # llama.cpp's count; -1 = everything
    vision_on_gpu: bool = False
    backend: str | None = None
    unified: bool = False
    vision_backend: str = "llama.cpp"  #: who runs the vision encoder (resolved, never "auto")
    vision: VisionSetup | None = None  #: the whole decision (:func:`choose_setup`)


_Evaluated = tuple  # (QuantCandidate, memory.MemoryEstimate, _Setup)


@dataclass
class _Context:
    """Everything about the request that is the same for every quant."""

    arch: TextShape
    vision: VisionShape
    mmproj_size: int
    hardware: Hardware
    n_ctx: int
    kv_cache_type: str
    image_tokens: int
    budget: int
    gpu_free: int | None = None
    backend: str | None = None
    unified: bool = False
    cpu_only: bool = False  #: unified memory too small for a full offload: CPU alone
    rates: speed.Rates | None = None
    detail: str = "auto"
    min_tokens_per_s: float | None = None
    max_first_answer_s: float | None = None
    speeds: dict[str, speed.SpeedPrediction] | None = None  #: per quant, when rates are known
    vision_request: str = "auto"  #: the ``vision_backend`` asked for
    onnxruntime: str | None = None  #: onnxruntime's version where it imports, else None
    vision_moves: Callable[[str], str] | None = None  #: the native check's replacement for a backend
    int8_cosine: float | None = None  #: int8 vs fp32, from a cached conversion
    #: ONNX weights read from their mapped file, not packed (the last shrink: see ``memory.estimate``)
    vision_mapped: bool = False
    model: str = ""  #: the catalog name planned for ("" if unknown): not suggested as a smaller model
    given: LoadChoices = LoadChoices()  #: what the load fixed itself

    @property
    def limited(self) -> bool:
        return self.min_tokens_per_s is not None or self.max_first_answer_s is not None


def choose(
    candidates: Iterable[QuantCandidate],
    *,
    arch: TextShape,
    vision: VisionShape | None = None,
    mmproj_size: int,
    hardware: Hardware,
    ram_budget: int | str | None = None,
    n_ctx: int | None = None,
    kv_cache_type: str | None = None,
    quant: str | None = None,
    prefer: str = "quality",
    image_tokens: int | None = None,
    mmproj_file: str = DEFAULT_MMPROJ_FILE,
    rates: speed.Rates | None = None,
    detail: str = "auto",
    min_tokens_per_s: float | None = None,
    max_first_answer_s: float | None = None,
    vision_backend: str = "auto",
    onnxruntime: str | None = None,
    vision_moves: Callable[[str], str] | None = None,
    int8_cosine: float | None = None,
    must_fit: bool = False,
    model: str = "",
    vision_weights: str | None = None,
    given: LoadChoices | None = None,
) -> Plan:
    """Pick the quant and settings for ``hardware``; see the module docstring for the rules.

    ``given`` holds what a load fixed itself (threads, GPU layers, where the vision tower runs,
    parallel slots): the plan keeps those values, fits the rest around them and carries the lot,
    so that ``load()`` opens what the plan says (default: everything left to the plan). Layers or
    a tower offloaded by hand are not fitted to the GPU; ``parallel=N`` beyond what the budget
    holds is refused (:class:`~gguf_mcv.errors.NoQuantFitsError`).

    ``n_ctx`` and ``kv_cache_type`` left at None mean the defaults (4096, ``"f16"``), which the
    planner may shrink when nothing fits with them; given values are kept as they are.
    ``must_fit`` makes an explicit ``quant`` that does not fit raise
    :class:`~gguf_mcv.errors.NoQuantFitsError` instead of being planned with a warning.
    ``vision_weights`` (``"packed"``/``"mapped"``) fixes where an ONNX encoder keeps its weights;
    None lets the planner map them as its last shrink. ``model`` is the catalog name planned for,
    when there is one (it is then not suggested as a smaller model when nothing fits).

    ``arch`` is the text model's shape, ``vision`` the tower's (default SigLIP-400M).
    With ``rates`` (:func:`gguf_mcv.runtime.speed_probe.rates`) every row carries predicted
    speeds for a photo at ``detail``, and the speed limits can be used.
    ``vision_backend`` is ``load()``'s option; ``onnxruntime`` the version that imports
    on the machine planned for (None: it does not, so ``"auto"`` means llama.cpp);
    ``vision_moves`` the native check's verdict (a backend → the one that runs in its place)
    and ``int8_cosine`` a cached conversion's int8 check, as
    :func:`~gguf_mcv.vision.vision_backends.choose_setup` takes them (the resolver gathers them).
    """
    check_request(ram_budget=ram_budget, n_ctx=n_ctx, kv_cache_type=kv_cache_type, quant=quant, prefer=prefer,
                  detail=detail, min_tokens_per_s=min_tokens_per_s, max_first_answer_s=max_first_answer_s,
                  vision_backend=vision_backend, vision_weights=vision_weights)
    may_shrink = (n_ctx is None, kv_cache_type is None)
    n_ctx = constants.DEFAULT_N_CTX if n_ctx is None else n_ctx
    cands = _dedupe(candidates)
    if not cands:
        raise ConfigError("No quant files to choose from.")
    budget, budget_note = resolve_budget(hardware, ram_budget)
    ctx = _context(arch, vision, mmproj_size, hardware, n_ctx, kv_cache_type or "f16", image_tokens, budget)
    ctx.vision_request, ctx.onnxruntime = vision_backend, onnxruntime
    ctx.vision_moves, ctx.int8_cosine, ctx.model = vision_moves, int8_cosine, model
    ctx.vision_mapped = vision_weights == "mapped"
    ctx.given = given if given is not None else LoadChoices()
    if not isinstance(ctx.given, LoadChoices):
        raise ConfigError(f"given must be a LoadChoices or None, not {type(given).__name__}.")
    _speed_context(ctx, rates, detail, min_tokens_per_s, max_first_answer_s)
    want = _wanted(quant, cands)
    evaluated = _evaluate_all(cands, ctx)
    shrunk: tuple[Shrink, ...] = ()
    if not _any_fits(evaluated, ctx, want):
        smaller = _shrink(cands, ctx, want, *may_shrink, may_map=vision_weights is None)
        if smaller is not None:
            ctx, evaluated, shrunk = smaller
    _predict_all(evaluated, ctx)
    if want is not None:
        plan = _forced(want, evaluated, ctx, mmproj_file, budget_note, must_fit=must_fit)
    else:
        best, passed_over = _pick(evaluated, ctx, prefer)
        rows = _rows(evaluated, best[0], ctx, passed_over)
        plan = _plan(best, rows, ctx, mmproj_file, budget_note)
    high = memory.image_bytes(memory.DEFAULT_IMAGE_PIXELS, ctx.image_tokens, ctx.vision)  # all the slices
    plan = replace(plan, shrunk=shrunk, image_detail=ctx.detail,
                   high_detail_extra=max(0, high - plan.estimate.images) if ctx.detail != "high" else 0)
    _check_slots(plan)
    return plan


def _check_slots(plan: Plan) -> None:
    """Refuse ``parallel`` slots beyond the first that do not fit beside the chosen quant."""
    need = plan.predicted_bytes + (plan.parallel - 1) * plan.slot_bytes
    if plan.fits and plan.parallel > 1 and need > plan.budget:
        raise NoQuantFitsError(
            f"parallel={plan.parallel} needs about {format_size(need)} of RAM ({format_size(plan.slot_bytes)} per "
            f"slot beyond the first), but the budget is {format_size(plan.budget)}.\nWays out:\n"
            f"- parallel={plan.slots} (or 'auto', which takes what the budget holds).\n"
            "- a smaller n_ctx or kv_cache_type='q8_0' (each slot holds n_ctx positions).\n"
            "- free memory (close other programs) or pass a larger ram_budget if you know better.")


def check_request(*, ram_budget: Any = None, n_ctx: Any = None, kv_cache_type: Any = None, quant: Any = None,
                  prefer: Any = "quality", detail: Any = "auto", min_tokens_per_s: Any = None,
                  max_first_answer_s: Any = None, vision_backend: Any = "auto", vision_weights: Any = None) -> None:
    """The settings a plan is asked for, checked without any I/O (no probe, file or network):
    :class:`~gguf_mcv.errors.ConfigError` naming the first bad one and what is allowed.
    :func:`choose` runs it first; :func:`gguf_mcv.plan`, ``pull`` and ``load`` run it before
    they probe the machine, ask the Hub or read a file."""
    if prefer not in PREFERENCES:
        raise ConfigError(f"prefer must be one of {', '.join(PREFERENCES)}, not {prefer!r}.")
    if n_ctx is not None:
        check_int("n_ctx", n_ctx, low=MIN_N_CTX, high=MAX_N_CTX)
    if kv_cache_type is not None and (not isinstance(kv_cache_type, str)
                                      or kv_cache_type not in memory.KV_BYTES_PER_ELEMENT):
        raise ConfigError(f"kv_cache_type must be one of {', '.join(memory.KV_BYTES_PER_ELEMENT)} or None, "
                          f"not {kv_cache_type!r}.")
    if quant is not None:
        if not isinstance(quant, str):
            raise ConfigError(f"quant must be a quantization name such as 'Q4_K_M', not {type(quant).__name__}.")
        normalize_quant(quant)
    if ram_budget is not None:
        parse_size(ram_budget)
    if not isinstance(detail, str) or detail not in DETAILS:
        raise ConfigError(f"detail must be one of {', '.join(DETAILS)}, not {detail!r}.")
    speed.check_limit("min_tokens_per_s", min_tokens_per_s)
    speed.check_limit("max_first_answer_s", max_first_answer_s)
    check_vision_backend(vision_backend)
    check_vision_weights(vision_weights)


def candidates_from(quants: Mapping[str, Any]) -> list[QuantCandidate]:
    """Candidates from ``{quant: file}`` such as ``CatalogEntry.quants`` (objects with
    ``file``, ``size`` and optionally ``exact``)."""
    return [QuantCandidate(q, f.file, int(f.size), bool(getattr(f, "exact", True)))
            for q, f in quants.items()]


def resolve_budget(hardware: Hardware, ram_budget: int | str | None) -> tuple[int, str]:
    """(budget in bytes, a sentence saying where it came from)."""
    if ram_budget is not None:
        budget = parse_size(ram_budget)
        return budget, f"RAM budget {format_size(budget)} (given)."
    reserve = hardware.ram_reserve
    budget = max(0, hardware.available_ram - reserve)
    return budget, (f"RAM budget {format_size(budget)}: {format_size(hardware.available_ram)} available "
                    f"less a {format_size(reserve)} safety reserve.")


def default_image_tokens(vision: VisionShape | None = None) -> int:
    """Tokens of one full-detail image: overview + 9 slices of ``query_tokens`` (640 for 2.6)."""
    return 10 * (vision or VisionShape()).query_tokens


# --- evaluation -----------------------------------------------------------------------


def _context(arch, vision, mmproj_size, hardware, n_ctx, kv_cache_type, image_tokens, budget) -> _Context:
    ctx = _Context(arch=arch, vision=vision or VisionShape(),
                   mmproj_size=mmproj_size, hardware=hardware, n_ctx=n_ctx,
                   kv_cache_type=kv_cache_type,
                   image_tokens=image_tokens if image_tokens is not None else default_image_tokens(vision),
                   budget=budget)
    gpu = hardware.gpu
    if hardware.gpu_offload and gpu is not None:
        ctx.backend, ctx.unified = gpu.backend, gpu.unified
        if not gpu.unified and gpu.free_memory > 0:
            ctx.gpu_free = gpu.free_memory
    return ctx


def _estimate(c: QuantCandidate, ctx: _Context, setup: _Setup, n_ctx: int | None = None,
              kv_cache_type: str | None = None) -> memory.MemoryEstimate:
    return memory.estimate(
        model_size=c.size, text=ctx.arch, mmproj_size=ctx.mmproj_size, vision=ctx.vision,
        quant=c.quant, n_ctx=n_ctx or ctx.n_ctx, kv_cache_type=kv_cache_type or ctx.kv_cache_type,
        image_tokens=ctx.image_tokens, n_gpu_layers=setup.n_gpu_layers,
        vision_on_gpu=setup.vision_on_gpu, gpu_backend=setup.backend,
        unified_memory=setup.unified, cpu=cpu_family(ctx.hardware.machine),
        vision_backend=setup.vision_backend,
        # the photo decoded as ``detail`` cuts it on this encoder (auto: 4 slices on a CPU)
        image_slices=speed.slice_budget(ctx.detail, vision_on_gpu=setup.vision_on_gpu),
        vision_mapped=ctx.vision_mapped and setup.vision_backend.startswith("onnx-"),
    )


def _evaluate_all(cands: list[QuantCandidate], ctx: _Context) -> list[_Evaluated]:
    """Each quant with its estimate and GPU split on this machine."""
    evaluated = [(c, _estimate(c, ctx, s), s) for c in cands for s in [_with_vision_backend(_setup(c, ctx), c, ctx)]]
    if ctx.unified and not any(_fits(e, s, ctx) for _, e, s in evaluated):
        # a full offload costs RAM here (device copies, CUDA context, device compute
        # buffer); when no quant fits that way, plan for the CPU alone
        ctx.cpu_only = True
        evaluated = [(c, _estimate(c, ctx, s), s) for c in cands
                     for s in [_with_vision_backend(_Setup(backend=ctx.backend), c, ctx)]]
    return evaluated


def _wanted(quant: str | None, cands: list[QuantCandidate]) -> str | None:
    """The explicit quant's canonical name (None: none asked for); refused when not offered."""
    if quant is None:
        return None
    want = normalize_quant(quant)
    if not any(c.quant == want for c in cands):
        have = ", ".join(c.quant for c in sorted(cands, key=lambda c: quality_rank(c.quant)))
        raise ConfigError(f"Quant {want} is not available for this model; available: {have}.")
    return want


def _any_fits(evaluated: list[_Evaluated], ctx: _Context, want: str | None) -> bool:
    """Whether some quant fits (only ``want``, when a quant was asked for)."""
    return any(_fits(e, s, ctx) for c, e, s in evaluated if want is None or c.quant == want)


def _shrink(cands: list[QuantCandidate], ctx: _Context, want: str | None, may_ctx: bool,
            may_kv: bool, *, may_map: bool = True) -> tuple[_Context, list[_Evaluated], tuple[Shrink, ...]] | None:
    """The first smaller setup with which something fits (``want``, when asked for): a q8_0
    KV cache, then the largest ``n_ctx`` of at least :data:`MIN_SHRUNK_CTX` (with that KV
    cache) at which any quant fits; then the same two with an ONNX encoder's weights read from
    their mapped file (:data:`MAPPED_VISION`; unless ``may_map`` is False: ``vision_weights`` was
    given). None when the defaults may not change or nothing helps."""
    kv = SHRUNK_KV if may_kv and ctx.kv_cache_type == "f16" else ctx.kv_cache_type
    base = replace(ctx, kv_cache_type=kv, cpu_only=False)
    mapped = replace(base, vision_mapped=True)
    tries = [base] if kv != ctx.kv_cache_type else []
    tries += _ctx_to_fit(cands, base, want, may_ctx)
    if may_map and not ctx.vision_mapped:
        tries += [mapped, *_ctx_to_fit(cands, mapped, want, may_ctx)]
    for smaller in tries:
        evaluated = _evaluate_all(cands, smaller)
        if _any_fits(evaluated, smaller, want):
            shrunk = tuple(Shrink(name, getattr(ctx, name), getattr(smaller, name))
                           for name in ("n_ctx", "kv_cache_type") if getattr(ctx, name) != getattr(smaller, name))
            mapped_now = smaller.vision_mapped and not ctx.vision_mapped
            if mapped_now and any(s.vision is not None and not s.vision.packed for _, _, s in evaluated):
                shrunk += (MAPPED_VISION,)
            return smaller, evaluated, shrunk
    return None


def _ctx_to_fit(cands: list[QuantCandidate], ctx: _Context, want: str | None, may_ctx: bool) -> list[_Context]:
    """``ctx`` with the largest ``n_ctx`` of at least :data:`MIN_SHRUNK_CTX` at which some quant
    (``want``, when asked for) fits; empty when n_ctx may not change or none does."""
    if not may_ctx or ctx.n_ctx <= MIN_SHRUNK_CTX:
        return []
    sizes = [_largest_fitting_ctx(c, ctx, s, floor=MIN_SHRUNK_CTX)
             for c, _, s in _evaluate_all(cands, ctx) if want is None or c.quant == want]
    n = max((x for x in sizes if x is not None), default=None)
    return [replace(ctx, n_ctx=n, cpu_only=False)] if n is not None else []


def _pick(evaluated: list[_Evaluated], ctx: _Context, prefer: str) -> tuple[_Evaluated, str]:
    """The quant to plan, and the note for the fitting rows passed over."""
    passed_over = f"not chosen: prefer={prefer}"
    fitting = [(c, e, s) for c, e, s in evaluated if _fits(e, s, ctx)]
    if not fitting:
        raise NoQuantFitsError(_nothing_fits_message(evaluated, ctx))
    if ctx.limited:
        fast = [x for x in fitting if not _too_slow(x[0], ctx)]
        if not fast:
            raise NoQuantFitsError(_too_slow_message(fitting, ctx))
        fitting = fast
    whole = [x for x in fitting if _on_gpu_whole(x[2])]
    if whole:
        # with a GPU, "quality" means the best quant the GPU holds entirely: layers left
        # on the CPU (or a vision tower at ~9 s a slice) cost far more speed than one
        # quant step costs quality
        fitting = whole
    quantized = [x for x in fitting if x[0].quant not in UNQUANTIZED]
    if quantized:
        # F16/BF16/F32 double the bytes read per token for no visible gain over Q8_0: they
        # are planned only when asked for, or when a repo offers nothing else
        fitting = quantized
    if prefer == "quality":
        if _rereads(fitting, ctx):
            # mapped vision weights: what the process would hold with both weight sets (its need
            # without the swap) beyond the budget is read from disk again at every image, so the
            # quant that holds the least wins over a better one
            return (min(fitting, key=lambda x: (x[1].needed + x[1].swapped, -quality_rank(x[0].quant))),
                    "not chosen: with mapped vision weights the quant that holds the least wins")
        fitting = [x for x in fitting if x[1].needed + x[1].swapped <= ctx.budget]
        return max(fitting, key=lambda x: (quality_rank(x[0].quant), -x[0].size)), passed_over
    return min(fitting, key=lambda x: (x[0].size, -quality_rank(x[0].quant))), passed_over


def _rereads(fitting: list[_Evaluated], ctx: _Context) -> bool:
    """Whether every quant that fits would read dropped weights from disk again at each image
    (mapped vision weights that do not all fit beside the text model's)."""
    return bool(fitting) and all(e.needed + e.swapped > ctx.budget for _, e, _ in fitting)


def _with_vision_backend(s: _Setup, c: QuantCandidate, ctx: _Context) -> _Setup:
    """``s`` with the vision setup the loader carries out for it (:func:`choose_setup`)."""
    vision = choose_setup(ctx.vision_request, vision_gpu=s.vision_on_gpu, projector_type=ctx.vision.projector,
                          ort_version=ctx.onnxruntime, runs_instead=ctx.vision_moves, int8_cosine=ctx.int8_cosine,
                          fallback_fits=lambda b: _estimate(c, ctx, replace(s, vision_backend=b)).needed <= ctx.budget)
    if ctx.vision_mapped and vision.onnx:
        vision = replace(vision, packed=False)
    return replace(s, vision_backend=vision.backend, vision=vision)


def _setup(c: QuantCandidate, ctx: _Context) -> _Setup:
    g = ctx.given
    if g.by_hand:  # offloaded by hand: kept as given
        gpu = ctx.hardware.gpu
        backend = ctx.backend or (gpu.backend if gpu is not None else None) or "cuda"
        return _Setup(int(g.n_gpu_layers), bool(g.vision_gpu), backend, bool(gpu is not None and gpu.unified))
    # an ONNX backend asked for runs the encoder on the CPU (load() refuses it on the GPU)
    tower_may_offload = not ctx.vision_request.startswith("onnx") and g.vision_gpu is not False
    if ctx.backend is None or g.n_gpu_layers == 0:
        return _Setup()
    if ctx.unified:  # one pool for both: offload everything, it is what makes these fast
        return _Setup(-1, tower_may_offload, ctx.backend, True)
    if ctx.gpu_free is None:
        return _Setup(backend=ctx.backend)
    usable = int(ctx.gpu_free * (1 - GPU_HEADROOM))
    vision = memory.estimate(model_size=c.size, text=ctx.arch, mmproj_size=ctx.mmproj_size,
                             vision=ctx.vision, quant=c.quant, n_ctx=ctx.n_ctx,
                             kv_cache_type=ctx.kv_cache_type, vision_on_gpu=True,
                             gpu_backend=ctx.backend, cpu="none")
    vision_on_gpu = tower_may_offload and vision.gpu is not None and vision.gpu.total <= usable
    n = gpu_fit.fit_gpu_layers(ctx.gpu_free, model_size=c.size, text=ctx.arch, quant=c.quant,
                              n_ctx=ctx.n_ctx, kv_cache_type=ctx.kv_cache_type,
                              mmproj_size=ctx.mmproj_size, vision=ctx.vision,
                              vision_on_gpu=vision_on_gpu, gpu_backend=ctx.backend,
                              headroom=GPU_HEADROOM)
    return _Setup(-1 if n > ctx.arch.n_layers else n, vision_on_gpu, ctx.backend)


def _on_gpu_whole(s: _Setup) -> bool:
    return s.n_gpu_layers < 0 and s.vision_on_gpu


def _fits(e: memory.MemoryEstimate, s: _Setup, ctx: _Context) -> bool:
    if e.needed > ctx.budget:
        return False
    if e.gpu is not None and not s.unified and ctx.gpu_free is not None and not ctx.given.by_hand:
        return e.gpu.total <= ctx.gpu_free * (1 - GPU_HEADROOM)
    return True


# --- speed ----------------------------------------------------------------------------


def _speed_context(ctx: _Context, rates: speed.Rates | None, detail: str, min_tokens_per_s: Any,
                   max_first_answer_s: Any) -> None:
    ctx.min_tokens_per_s = None if min_tokens_per_s is None else float(min_tokens_per_s)  # checked: check_request
    ctx.max_first_answer_s = None if max_first_answer_s is None else float(max_first_answer_s)
    if rates is not None and not isinstance(rates, speed.Rates):
        raise ConfigError(f"rates must be a gguf_mcv.planning.speed.Rates, not {type(rates).__name__}.")
    if ctx.limited and rates is None:
        raise ConfigError("Speed limits need the machine's rates: pass rates= "
                          "(gguf_mcv.runtime.speed_probe.rates()).")
    ctx.rates, ctx.detail = rates, detail


def _predict_all(evaluated: list[_Evaluated], ctx: _Context) -> None:
    """Each quant's predicted speed with its own GPU split, when rates are known."""
    if ctx.rates is None:
        return
    ctx.speeds = {}
    for c, _, s in evaluated:
        layers = ctx.arch.n_layers + 1  # llama.cpp counts the output matrix as a layer
        share = 1.0 if s.n_gpu_layers < 0 else s.n_gpu_layers / layers
        gpu = speed.gpu_rates_for(s.backend, ctx.hardware.board_kind) if (share or s.vision_on_gpu) else None
        ctx.speeds[c.quant] = speed.predict(
            model_size=c.size, text=ctx.arch, quant=c.quant, vision=ctx.vision, rates=ctx.rates,
            detail=ctx.detail, kv_cache_type=ctx.kv_cache_type, gpu_share=share,
            vision_on_gpu=s.vision_on_gpu, gpu=gpu, weights=c.weights, vision_backend=s.vision_backend)


def _too_slow(c: QuantCandidate, ctx: _Context) -> str:
    """Why ``c`` misses the speed limits ("" when it meets them or there are none)."""
    p = (ctx.speeds or {}).get(c.quant)
    if p is None:
        return ""
    why = []
    if ctx.min_tokens_per_s is not None and p.decode_tokens_per_s < ctx.min_tokens_per_s:
        why.append(f"{p.decode_tokens_per_s:.1f} tok/s < {ctx.min_tokens_per_s:g}")
    if ctx.max_first_answer_s is not None and p.first_answer_s > ctx.max_first_answer_s:
        why.append(f"first answer {p.first_answer_s:.0f} s > {ctx.max_first_answer_s:g} s")
    return ", ".join(why)


def _too_slow_message(fitting: list[_Evaluated], ctx: _Context) -> str:
    speeds = ctx.speeds or {}
    fastest = max(fitting, key=lambda x: (speeds[x[0].quant].decode_tokens_per_s,
                                          -speeds[x[0].quant].first_answer_s))[0]
    quickest = min(fitting, key=lambda x: speeds[x[0].quant].first_answer_s)[0]
    p, q = speeds[fastest.quant], speeds[quickest.quant]
    limits = " and ".join(x for x in (
        f"at least {ctx.min_tokens_per_s:g} tokens/s" if ctx.min_tokens_per_s is not None else "",
        f"a first answer within {ctx.max_first_answer_s:g} s" if ctx.max_first_answer_s is not None else "",
    ) if x)
    lines = [
        f"No quantization that fits is predicted to give {limits}: the fastest that fits is "
        f"{fastest.quant} at {p.decode_tokens_per_s:.1f} tokens/s, first answer to a photo in "
        f"{p.first_answer_s:.0f} s (detail={ctx.detail!r}).",
        "Ways out:",
    ]
    if quickest is not fastest:
        lines.append(f"- the quickest first answer is {quickest.quant}'s, {q.first_answer_s:.0f} s.")
    if ctx.detail != "low":
        lines.append("- detail='low' encodes a photo in one slice instead of several.")
    smaller = _smaller_models(ctx)
    lines.append(f"- a smaller model, e.g. {', '.join(smaller)}, or relax the limits." if smaller
                 else "- relax the limits.")
    return "\n".join(lines)


def _speed_cells(r: PlanRow) -> tuple[str, str, str]:
    if r.decode_tokens_per_s is None or r.first_answer_s is None or r.video_first_answer_s is None:
        return "", "", ""
    return f"{r.decode_tokens_per_s:.1f}", f"{r.first_answer_s:.0f} s", f"{r.video_first_answer_s:.0f} s"


# --- outcomes -------------------------------------------------------------------------


def _rows(evaluated, chosen: QuantCandidate, ctx: _Context, passed_over: str) -> tuple[PlanRow, ...]:
    rows = []
    chosen_whole = any(_on_gpu_whole(s) for c, _, s in evaluated if c is chosen)
    for c, e, s in sorted(evaluated, key=lambda x: quality_rank(x[0].quant)):
        fits = _fits(e, s, ctx)
        slow = _too_slow(c, ctx) if ctx.limited else ""
        if c is chosen:
            note = "chosen: " + _spare(e, ctx)
        elif fits and slow:
            note = f"fits ({_spare(e, ctx)}) but too slow: {slow}"
        elif fits and not _on_gpu_whole(s) and chosen_whole:
            note = f"fits ({_spare(e, ctx)}) but not wholly on the GPU; a quant that is was preferred"
        elif fits and c.quant in UNQUANTIZED and chosen.quant not in UNQUANTIZED:
            note = f"fits ({_spare(e, ctx)}); unquantized: only when asked for (quant=)"
        elif fits:
            note = f"fits ({_spare(e, ctx)}); {passed_over}"
        elif e.needed > ctx.budget:
            note = f"needs {format_size(e.needed)}, budget {format_size(ctx.budget)}"
        else:
            note = f"GPU share {format_size(e.gpu.total)} exceeds free VRAM"
        if s.n_gpu_layers:
            total = ctx.arch.n_layers + 1  # llama.cpp counts the output matrix as a layer
            note += f"; {total if s.n_gpu_layers < 0 else s.n_gpu_layers}/{total} layers on GPU"
        if not c.exact:
            note += "; size estimated"
        p = (ctx.speeds or {}).get(c.quant)
        rows.append(PlanRow(c.quant, c.file, c.size, e.needed, e.total, fits, note,
                            s.n_gpu_layers, c is chosen,
                            p.decode_tokens_per_s if p else None, p.first_answer_s if p else None,
                            p.video_first_answer_s if p else None, s.vision_backend))
    return tuple(rows)


def _spare(e: memory.MemoryEstimate, ctx: _Context) -> str:
    return f"{format_size(ctx.budget - e.needed)} to spare"


def _plan(best, rows, ctx: _Context, mmproj_file: str, budget_note: str, *, fits: bool = True,
          warnings: Sequence[str] = ()) -> Plan:
    c, e, s = best
    if ctx.cpu_only:
        warnings = [*warnings, "no quant fits with everything offloaded to the GPU, which on "
                    "unified memory copies the weights; planned for the CPU alone"]
    per_slot = memory.slot_bytes(ctx.arch, ctx.n_ctx, ctx.kv_cache_type, vision=ctx.vision,
                                 vision_backend=s.vision_backend)
    fallback = s.vision.fallback if s.vision is not None else None
    fallback_bytes = _estimate(c, ctx, replace(s, vision_backend=fallback)).needed if fallback else None
    # mapped vision weights count on one sequence at a time (encode, then answer); parallel slots
    # would encode and answer at once and need both sets of weights together
    slots = 1 if ctx.vision_mapped else memory.parallel_for_budget(max(e.needed, fallback_bytes or 0), per_slot,
                                                                   ctx.budget)
    g = ctx.given
    threads = g.n_threads or ctx.hardware.recommended_threads
    return Plan(
        n_threads_batch=g.n_threads_batch or threads,
        parallel=slots if g.parallel == "auto" else int(g.parallel),
        hardware=ctx.hardware,
        given=g,
        slots=slots,
        slot_bytes=per_slot,
        quant=c.quant, files=(c.file, mmproj_file), predicted_bytes=e.needed, budget=ctx.budget,
        n_ctx=ctx.n_ctx, n_threads=threads, n_gpu_layers=s.n_gpu_layers,
        vision_on_gpu=s.vision_on_gpu, kv_cache_type=ctx.kv_cache_type, rows=rows, estimate=e,
        gpu_budget=ctx.gpu_free, fits=fits, warnings=tuple(warnings), budget_note=budget_note,
        speed=(ctx.speeds or {}).get(c.quant), rates=ctx.rates,
        vision_backend=s.vision_backend, vision_backend_reason=s.vision.reason if s.vision is not None else "",
        vision=s.vision, fallback_bytes=fallback_bytes,
    )


def _forced(want: str, evaluated, ctx: _Context, mmproj_file: str, budget_note: str, *,
            must_fit: bool = False) -> Plan:
    match = next(x for x in evaluated if x[0].quant == want)
    c, e, s = match
    fits = _fits(e, s, ctx)
    if not fits and must_fit:
        raise NoQuantFitsError(_nothing_fits_message([match], ctx, asked=True))
    warnings = [] if fits else [
        f"{c.quant} needs about {format_size(e.needed)} but the budget is "
        f"{format_size(ctx.budget)}: expect swapping, or the process being killed."
    ]
    slow = _too_slow(c, ctx) if ctx.limited else ""
    if slow:
        warnings.append(f"{c.quant} is predicted to miss the speed limits: {slow}.")
    rows = tuple(replace(r, note="chosen: asked for" + ("" if r.fits else " (does not fit)")) if r.chosen else r
                 for r in _rows(evaluated, c, ctx, "not asked for"))
    return _plan(match, rows, ctx, mmproj_file, budget_note, fits=fits, warnings=warnings)


def _nothing_fits_message(evaluated, ctx: _Context, *, asked: bool = False) -> str:
    """Why nothing fits and the ways out; ``asked``: ``evaluated`` is the one quant asked for."""
    c, e, s = min(evaluated, key=lambda x: x[1].needed)
    what = f"{c.quant} ({format_size(c.size)} file)" if asked else \
        f"No quantization fits: the smallest, {c.quant} ({format_size(c.size)} file),"
    lines = [
        f"{what} needs about {format_size(e.needed)} of RAM with n_ctx={ctx.n_ctx} and "
        f"kv_cache_type={ctx.kv_cache_type!r}, but the budget is {format_size(ctx.budget)}"
        f"{'; it does not fit' if asked else ''}.",
        "Ways out:",
    ]
    if asked:
        lines.append("- a smaller quant of this model (a smaller .gguf file).")
    fitting_ctx = _largest_fitting_ctx(c, ctx, s)
    if fitting_ctx is not None:
        lines.append(f"- a smaller context: n_ctx={fitting_ctx} fits with {c.quant}.")
    if ctx.kv_cache_type == "f16":
        q8 = _estimate(c, ctx, s, kv_cache_type="q8_0")
        verdict = "fits" if q8.needed <= ctx.budget else "still does not fit"
        lines.append(f"- kv_cache_type='q8_0' halves the KV cache: {c.quant} then needs "
                     f"{format_size(q8.needed)} ({verdict}).")
    int8 = _smaller_vision(c, ctx, s)
    if int8 is not None:
        verdict = "fits" if int8.needed <= ctx.budget else "still does not fit"
        lines.append(f"- vision_backend='onnx-int8' (or 'auto') runs the encoder in int8: {c.quant} then "
                     f"needs {format_size(int8.needed)} ({verdict}).")
    mapped = _mapped_vision(c, ctx, s)
    if mapped is not None:
        verdict = "fits" if mapped.needed <= ctx.budget else "still does not fit"
        lines.append(f"- vision_weights='mapped' reads the encoder's weights from their file (slices ~25 % "
                     f"slower): {c.quant} then needs {format_size(mapped.needed)} ({verdict}).")
    smaller = _smaller_models(ctx)
    if smaller:
        lines.append(f"- a smaller model, e.g. {', '.join(smaller)} (about 0.5 GB in Q4_K_M).")
    lines.append("- free memory (close other programs) or pass a larger ram_budget if you know better.")
    return "\n".join(lines)


def _smaller_models(ctx: _Context) -> list[str]:
    """:data:`SMALLER_MODELS` less the generation planned for (a variant such as
    ``minicpm-v-4.6-thinking`` is its generation's size: not a smaller model either)."""
    return [m for m in SMALLER_MODELS if not (ctx.model == m or ctx.model.startswith(m + "-"))]


def _mapped_vision(c: QuantCandidate, ctx: _Context, s: _Setup) -> memory.MemoryEstimate | None:
    """``c``'s estimate with the ONNX encoder's weights read from their mapped file, when the
    plan packed them (None when they are mapped already, or libmtmd runs the encoder)."""
    if ctx.vision_mapped or not s.vision_backend.startswith("onnx-"):
        return None
    return _estimate(c, replace(ctx, vision_mapped=True), s)


def _smaller_vision(c: QuantCandidate, ctx: _Context, s: _Setup) -> memory.MemoryEstimate | None:
    """``c``'s estimate with the int8 ONNX encoder, when the plan used libmtmd's on the CPU
    although onnx-int8 could run here (None otherwise)."""
    if s.vision_backend != "llama.cpp" or s.vision_on_gpu or ctx.onnxruntime is None:
        return None
    try:
        choose_backend("onnx-int8", vision_gpu=False, projector_type=ctx.vision.projector,
                       ort_version=ctx.onnxruntime)
    except ConfigError:
        return None
    int8 = _estimate(c, ctx, replace(s, vision_backend="onnx-int8"))
    return int8 if int8.needed < _estimate(c, ctx, s).needed else None


def _largest_fitting_ctx(c: QuantCandidate, ctx: _Context, s: _Setup,
                         floor: int = MIN_SUGGESTED_CTX) -> int | None:
    """The largest n_ctx (a multiple of 256 below the asked one, at least ``floor``) with
    which ``c`` fits.

    Memory grows with n_ctx, so a bisection finds it in a few dozen estimates even for
    an absurd ``n_ctx`` (a linear walk down from 10**10 would take hours).
    """
    fits = lambda steps: _estimate(c, ctx, s, n_ctx=steps * 256).needed <= ctx.budget  # noqa: E731
    low, high = -(-floor // 256), (ctx.n_ctx - 1) // 256
    if high < low or not fits(low):
        return None
    while low < high:  # invariant: fits(low)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low * 256


def _dedupe(candidates: Iterable[QuantCandidate]) -> list[QuantCandidate]:
    """Candidates with canonical quant names, one per quant (the first), unknown ones dropped."""
    seen: dict[str, QuantCandidate] = {}
    for c in candidates:
        try:
            q = normalize_quant(c.quant)
        except ConfigError:
            continue
        seen.setdefault(q, QuantCandidate(q, c.file, int(c.size), c.exact, getattr(c, "weights", None)))
    return list(seen.values())

