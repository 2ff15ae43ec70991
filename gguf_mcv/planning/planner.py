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

from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..errors import ConfigError, NoQuantFitsError
from ..hardware import OS_RESERVE_FRACTION, OS_RESERVE_MIN, Hardware
from ..models.quants import normalize_quant, quality_rank
from ..models.shapes import TextShape, VisionShape
from ..options import (
    DEFAULT_N_CTX,
    DETAILS,
    MAX_N_CTX,
    MIN_N_CTX,
    check_int,
    check_vision_backend,
    check_vision_weights,
)
from ..units import format_size, parse_size
from ..vision.vision_backends import choose_setup
from . import gpu_fit, memory, speed
from .evaluation import (  # noqa: F401  (GPU_HEADROOM, default_image_tokens: the planner's, by name)
    GPU_HEADROOM,
    Context,
    Evaluated,
    Setup,
    default_image_tokens,
    estimate_setup,
    make_context,
    on_gpu_whole,
    setup_fits,
)
from .plan import MAPPED_VISION, LoadChoices, Plan, PlanRow, QuantCandidate, Shrink  # noqa: F401
from .refusals import largest_fitting_ctx, nothing_fits_message, too_slow, too_slow_message

PREFERENCES = ("quality", "speed", "size")
#: Share of the host's free RAM kept free when no budget is given, and its floor in bytes
#: (inside a container's memory limit, :attr:`Hardware.ram_reserve` keeps less).
RESERVE_FRACTION = OS_RESERVE_FRACTION
RESERVE_MIN = OS_RESERVE_MIN
#: The smallest context the planner shrinks a default one to on its own: a full-detail
#: image (640 tokens) or a 16-frame video, with room for a conversation about it.
MIN_SHRUNK_CTX = 2048
#: What a default f16 KV cache is shrunk to when nothing fits with it.
SHRUNK_KV = "q8_0"
DEFAULT_MMPROJ_FILE = "mmproj-model-f16.gguf"
#: Types the planner does not pick on its own (see :func:`_pick`).
UNQUANTIZED = ("F16", "BF16", "F32")


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
    n_ctx = DEFAULT_N_CTX if n_ctx is None else n_ctx
    cands = _dedupe(candidates)
    if not cands:
        raise ConfigError("No quant files to choose from.")
    budget, budget_note = resolve_budget(hardware, ram_budget)
    ctx = make_context(arch, vision, mmproj_size, hardware, n_ctx, kv_cache_type or "f16", image_tokens, budget)
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


# --- evaluation -----------------------------------------------------------------------


def _evaluate_all(cands: list[QuantCandidate], ctx: Context) -> list[Evaluated]:
    """Each quant with its estimate and GPU split on this machine."""
    evaluated = [(c, estimate_setup(c, ctx, s), s)
                 for c in cands for s in [_with_vision_backend(_setup(c, ctx), c, ctx)]]
    if ctx.unified and not any(setup_fits(e, s, ctx) for _, e, s in evaluated):
        # a full offload costs RAM here (device copies, CUDA context, device compute
        # buffer); when no quant fits that way, plan for the CPU alone
        ctx.cpu_only = True
        evaluated = [(c, estimate_setup(c, ctx, s), s) for c in cands
                     for s in [_with_vision_backend(Setup(backend=ctx.backend), c, ctx)]]
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


def _any_fits(evaluated: list[Evaluated], ctx: Context, want: str | None) -> bool:
    """Whether some quant fits (only ``want``, when a quant was asked for)."""
    return any(setup_fits(e, s, ctx) for c, e, s in evaluated if want is None or c.quant == want)


def _shrink(cands: list[QuantCandidate], ctx: Context, want: str | None, may_ctx: bool,
            may_kv: bool, *, may_map: bool = True) -> tuple[Context, list[Evaluated], tuple[Shrink, ...]] | None:
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


def _ctx_to_fit(cands: list[QuantCandidate], ctx: Context, want: str | None, may_ctx: bool) -> list[Context]:
    """``ctx`` with the largest ``n_ctx`` of at least :data:`MIN_SHRUNK_CTX` at which some quant
    (``want``, when asked for) fits; empty when n_ctx may not change or none does."""
    if not may_ctx or ctx.n_ctx <= MIN_SHRUNK_CTX:
        return []
    sizes = [largest_fitting_ctx(c, ctx, s, floor=MIN_SHRUNK_CTX)
             for c, _, s in _evaluate_all(cands, ctx) if want is None or c.quant == want]
    n = max((x for x in sizes if x is not None), default=None)
    return [replace(ctx, n_ctx=n, cpu_only=False)] if n is not None else []


def _pick(evaluated: list[Evaluated], ctx: Context, prefer: str) -> tuple[Evaluated, str]:
    """The quant to plan, and the note for the fitting rows passed over."""
    passed_over = f"not chosen: prefer={prefer}"
    fitting = [(c, e, s) for c, e, s in evaluated if setup_fits(e, s, ctx)]
    if not fitting:
        raise NoQuantFitsError(nothing_fits_message(evaluated, ctx))
    if ctx.limited:
        fast = [x for x in fitting if not too_slow(x[0], ctx)]
        if not fast:
            raise NoQuantFitsError(too_slow_message(fitting, ctx))
        fitting = fast
    whole = [x for x in fitting if on_gpu_whole(x[2])]
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


def _rereads(fitting: list[Evaluated], ctx: Context) -> bool:
    """Whether every quant that fits would read dropped weights from disk again at each image
    (mapped vision weights that do not all fit beside the text model's)."""
    return bool(fitting) and all(e.needed + e.swapped > ctx.budget for _, e, _ in fitting)


def _with_vision_backend(s: Setup, c: QuantCandidate, ctx: Context) -> Setup:
    """``s`` with the vision setup the loader carries out for it (:func:`choose_setup`)."""
    vision = choose_setup(ctx.vision_request, vision_gpu=s.vision_on_gpu, projector_type=ctx.vision.projector,
                          ort_version=ctx.onnxruntime, runs_instead=ctx.vision_moves, int8_cosine=ctx.int8_cosine,
                          fallback_fits=lambda b: estimate_setup(c, ctx, replace(s, vision_backend=b)).needed
                          <= ctx.budget)
    if ctx.vision_mapped and vision.onnx:
        vision = replace(vision, packed=False)
    return replace(s, vision_backend=vision.backend, vision=vision)


def _setup(c: QuantCandidate, ctx: Context) -> Setup:
    g = ctx.given
    if g.by_hand:  # offloaded by hand: kept as given
        gpu = ctx.hardware.gpu
        backend = ctx.backend or (gpu.backend if gpu is not None else None) or "cuda"
        return Setup(int(g.n_gpu_layers), bool(g.vision_gpu), backend, bool(gpu is not None and gpu.unified))
    # an ONNX backend asked for runs the encoder on the CPU (load() refuses it on the GPU)
    tower_may_offload = not ctx.vision_request.startswith("onnx") and g.vision_gpu is not False
    if ctx.backend is None or g.n_gpu_layers == 0:
        return Setup()
    if ctx.unified:  # one pool for both: offload everything, it is what makes these fast
        return Setup(-1, tower_may_offload, ctx.backend, True)
    if ctx.gpu_free is None:
        return Setup(backend=ctx.backend)
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
    return Setup(-1 if n > ctx.arch.n_layers else n, vision_on_gpu, ctx.backend)


# --- speed ----------------------------------------------------------------------------


def _speed_context(ctx: Context, rates: speed.Rates | None, detail: str, min_tokens_per_s: Any,
                   max_first_answer_s: Any) -> None:
    ctx.min_tokens_per_s = None if min_tokens_per_s is None else float(min_tokens_per_s)  # checked: check_request
    ctx.max_first_answer_s = None if max_first_answer_s is None else float(max_first_answer_s)
    if rates is not None and not isinstance(rates, speed.Rates):
        raise ConfigError(f"rates must be a gguf_mcv.planning.speed.Rates, not {type(rates).__name__}.")
    if ctx.limited and rates is None:
        raise ConfigError("Speed limits need the machine's rates: pass rates= "
                          "(gguf_mcv.runtime.speed_probe.rates()).")
    ctx.rates, ctx.detail = rates, detail


def _predict_all(evaluated: list[Evaluated], ctx: Context) -> None:
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


# --- outcomes -------------------------------------------------------------------------


def _rows(evaluated, chosen: QuantCandidate, ctx: Context, passed_over: str) -> tuple[PlanRow, ...]:
    rows = []
    chosen_whole = any(on_gpu_whole(s) for c, _, s in evaluated if c is chosen)
    for c, e, s in sorted(evaluated, key=lambda x: quality_rank(x[0].quant)):
        fits = setup_fits(e, s, ctx)
        slow = too_slow(c, ctx) if ctx.limited else ""
        if c is chosen:
            note = "chosen: " + _spare(e, ctx)
        elif fits and slow:
            note = f"fits ({_spare(e, ctx)}) but too slow: {slow}"
        elif fits and not on_gpu_whole(s) and chosen_whole:
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


def _spare(e: memory.MemoryEstimate, ctx: Context) -> str:
    return f"{format_size(ctx.budget - e.needed)} to spare"


def _plan(best, rows, ctx: Context, mmproj_file: str, budget_note: str, *, fits: bool = True,
          warnings: Sequence[str] = ()) -> Plan:
    c, e, s = best
    if ctx.cpu_only:
        warnings = [*warnings, "no quant fits with everything offloaded to the GPU, which on "
                    "unified memory copies the weights; planned for the CPU alone"]
    per_slot = memory.slot_bytes(ctx.arch, ctx.n_ctx, ctx.kv_cache_type, vision=ctx.vision,
                                 vision_backend=s.vision_backend)
    fallback = s.vision.fallback if s.vision is not None else None
    fallback_bytes = estimate_setup(c, ctx, replace(s, vision_backend=fallback)).needed if fallback else None
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


def _forced(want: str, evaluated, ctx: Context, mmproj_file: str, budget_note: str, *,
            must_fit: bool = False) -> Plan:
    match = next(x for x in evaluated if x[0].quant == want)
    c, e, s = match
    fits = setup_fits(e, s, ctx)
    if not fits and must_fit:
        raise NoQuantFitsError(nothing_fits_message([match], ctx, asked=True))
    warnings = [] if fits else [
        f"{c.quant} needs about {format_size(e.needed)} but the budget is "
        f"{format_size(ctx.budget)}: expect swapping, or the process being killed."
    ]
    slow = too_slow(c, ctx) if ctx.limited else ""
    if slow:
        warnings.append(f"{c.quant} is predicted to miss the speed limits: {slow}.")
    rows = tuple(replace(r, note="chosen: asked for" + ("" if r.fits else " (does not fit)")) if r.chosen else r
                 for r in _rows(evaluated, c, ctx, "not asked for"))
    return _plan(match, rows, ctx, mmproj_file, budget_note, fits=fits, warnings=warnings)


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

