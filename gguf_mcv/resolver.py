"""From a model name to planned, fetched files: the layer above the planner and the Hub.

A name (catalog name or alias, Hub repo id, or ``"auto"``) is looked up in the
catalog, the repository's files are listed (:mod:`gguf_mcv.models.hub`), the quant is
chosen for this machine (:func:`gguf_mcv.planning.planner.choose`, which does no I/O) and
the two files are fetched. :func:`plan`, :func:`pull` and :func:`gguf_mcv.load`
all come through here; the planner and the Hub layer never call each other.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import environment
from .errors import ConfigError, NativeKernelError, NoQuantFitsError, OfflineError
from .hardware import Hardware, probe
from .models.catalog import CatalogEntry, load_catalog
from .models.headers import ProjectorHeader, read_projector_header, read_tensors, read_text_header, tensor_list
from .models.hub import RepoFiles, fetch, list_files, remote_text_header
from .models.quants import classify_gguf, normalize_quant
from .native_verdict import loads_repack_family
from .planning import memory
from .planning.planner import LoadChoices, Plan, QuantCandidate, candidates_from, check_request, choose
from .planning.speed import Rates, weight_profile

#: The settings :func:`~gguf_mcv.planning.planner.check_request` checks.
_REQUEST_SETTINGS = frozenset(inspect.signature(check_request).parameters)


@dataclass(frozen=True)
class ModelFiles:
    """Local paths of a text model and its projector, and where they came from."""

    model: Path
    mmproj: Path
    quant: str | None
    repo: str | None = None
    revision: str | None = None
    entry: CatalogEntry | None = None
    plan: Plan | None = None  #: how the quant was chosen, when it was planned


def resolve(model: str) -> tuple[str, CatalogEntry | None]:
    """A catalog name, alias or Hub repo id → (repo id, catalog entry or None)."""
    check_model_name(model)
    catalog = load_catalog()
    entry = catalog.find(model)
    if entry is not None:
        return entry.repo, entry
    if "/" in model and len(model.split("/")) == 2 and all(model.split("/")):
        return model, catalog.by_repo(model)
    return model, catalog.get(model)  # raises ModelNotFoundError with close matches


def check_model_name(model: Any) -> str:
    """``model`` when it can name a model (a non-empty string); ConfigError otherwise."""
    if not isinstance(model, str) or not model.strip():
        shown = repr(model) if isinstance(model, str) else type(model).__name__
        raise ConfigError(f"model must name a model: a catalog name (e.g. 'minicpm-v-2.6'), a Hub repo id "
                          f"or 'auto', not {shown}.")
    return model


def check_revision(revision: Any) -> str | None:
    """``revision`` when it is None or can name a branch, tag or commit; ConfigError otherwise."""
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ConfigError(f"revision must be a branch, tag or commit (a non-empty string), not {revision!r:.60}.")
    return revision


def check_plan(model: Any, *, revision: Any = None, **settings: Any) -> CatalogEntry | None:
    """The arguments of :func:`plan` / :func:`pull` checked before anything runs (no probe, no Hub
    request, no download): the name looked up in the catalog (a name it does not know and that is
    not a repo id raises :class:`~gguf_mcv.errors.ModelNotFoundError`), ``revision`` and the
    planning ``settings`` (:func:`~gguf_mcv.planning.planner.check_request`). The catalog entry,
    or None for ``"auto"`` and repos the catalog does not know."""
    check_request(**settings)
    check_revision(revision)
    return None if check_model_name(model) == "auto" else resolve(model)[1]


def plan(
    model: str,
    *,
    ram_budget: int | str | None = None,
    n_ctx: int | None = None,
    quant: str | None = None,
    prefer: str = "quality",
    kv_cache_type: str | None = None,
    revision: str | None = None,
    hardware: Hardware | None = None,
    detail: str = "auto",
    min_tokens_per_s: float | None = None,
    max_first_answer_s: float | None = None,
    rates: Rates | None = None,
    speed_probe: bool | None = None,
    vision_backend: str = "auto",
    vision_weights: str | None = None,
    given: LoadChoices | None = None,
) -> Plan:
    """Plan how to run ``model`` (a catalog name, a Hub repo id, or ``"auto"``) here.

    The quant files and their sizes come from the Hub (from the local cache when
    offline; from the catalog when the Hub cannot be reached at all); the text model's
    shape from the catalog, or for a repo the catalog does not know, from a ranged read
    of the model's header. ``ram_budget`` defaults to the available RAM less a reserve.
    ``model="auto"`` picks the most capable catalog model that fits. ``n_ctx`` and
    ``kv_cache_type`` left at None are the defaults (4096, f16), which the planner shrinks
    (to at least 2048, and q8_0) when nothing fits with them; the plan's ``shrunk`` says so.

    Every row carries predicted speeds (a photo at ``detail``, a 16-frame video) from
    ``rates``, by default this machine's (:func:`gguf_mcv.runtime.speed_probe.rates`: measured
    once, a few seconds; ``speed_probe=False`` or ``GGUF_MCV_NO_PROBE=1`` for the
    defaults). ``min_tokens_per_s`` and ``max_first_answer_s`` keep only quants (and,
    for ``"auto"``, models) predicted to meet them. ``vision_backend`` is ``load()``'s: the
    plan carries the vision setup ``load()`` carries out (``Plan.vision``: backend, precision,
    reason and int8's fallback, with the native check's verdict, run once per machine, applied)
    and the memory figures count its encoder (``"auto"``: ONNX Runtime int8 on a CPU where
    onnxruntime imports). ``vision_weights`` is ``load()``'s too: ``"packed"`` or ``"mapped"``
    fixes where an ONNX encoder keeps its weights; None lets the plan map them from their file
    as its last shrink when nothing fits otherwise (``Plan.vision.packed``). ``given`` holds what a
    load fixes itself (threads, GPU layers, vision on the GPU, parallel slots), which the plan keeps
    (:class:`~gguf_mcv.planning.planner.LoadChoices`; default: all left to the plan).
    """
    check_plan(model, revision=revision, ram_budget=ram_budget, n_ctx=n_ctx, quant=quant, prefer=prefer,
               kv_cache_type=kv_cache_type, detail=detail, min_tokens_per_s=min_tokens_per_s,
               max_first_answer_s=max_first_answer_s, vision_backend=vision_backend, vision_weights=vision_weights)
    _check_given(hardware=(hardware, Hardware), rates=(rates, Rates), given=(given, LoadChoices))
    if speed_probe is not None and not isinstance(speed_probe, bool):
        raise ConfigError(f"speed_probe must be True, False or None, not {speed_probe!r}.")
    hw = hardware or this_machine()
    options: dict[str, Any] = dict(ram_budget=ram_budget, n_ctx=n_ctx, quant=quant, prefer=prefer,
                                   kv_cache_type=kv_cache_type, hardware=hw, detail=detail,
                                   min_tokens_per_s=min_tokens_per_s, max_first_answer_s=max_first_answer_s,
                                   rates=rates or machine_rates(hw, speed_probe), vision_weights=vision_weights,
                                   given=given, **vision_inputs(vision_backend))
    if model == "auto":
        return _plan_auto(**options)
    repo, entry = resolve(model)
    try:
        listing: RepoFiles | None = list_files(repo, revision)
    except OfflineError:
        if entry is None:
            raise
        listing = None  # plan from the catalog's own file list
    return _plan_listing(model, listing, entry, **options)


def this_machine() -> Hardware:
    """This machine's probe (:func:`gguf_mcv.hardware.probe`), with the repack family its loads
    get: none where the native check found llama.cpp's extra buffer types crashing here."""
    hw = probe()
    return replace(hw, repack_family=loads_repack_family(hw.repack_family))


def _check_given(**values: tuple[Any, type]) -> None:
    """Each value None or an instance of its type; ConfigError naming the first that is not."""
    for name, (value, kind) in values.items():
        if value is not None and not isinstance(value, kind):
            raise ConfigError(f"{name} must be a {kind.__module__}.{kind.__name__} or None, "
                              f"not {type(value).__name__}.")


def machine_rates(hardware: Hardware, speed_probe: bool | None = None, *, refresh: bool = False) -> Rates:
    """The speed model's rates for ``hardware``'s recommended threads (cached probe or defaults;
    ``refresh`` probes again)."""
    from .runtime.speed_probe import rates  # lazy: numpy, and llama.cpp when it probes

    return rates(probe=speed_probe, threads=hardware.recommended_threads, refresh=refresh)


def vision_options(vision_backend: str = "auto") -> dict[str, Any]:
    """``vision_backend`` and the onnxruntime version that imports here, for
    :func:`~gguf_mcv.planning.planner.choose` (onnxruntime is imported only when it may be used)."""
    from .vision.onnx_vision import onnxruntime_version  # lazy: the loader's check, imports onnxruntime

    ort = onnxruntime_version() if vision_backend != "llama.cpp" else None
    return {"vision_backend": vision_backend, "onnxruntime": ort}


def vision_inputs(vision_backend: str = "auto", mmproj_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Everything :func:`~gguf_mcv.planning.planner.choose` needs to decide the vision setup as
    ``load()`` will: :func:`vision_options`, the native check's verdict on the backend it picks
    (checked in a child process once per machine and build, as the load does) and, for a local
    ``mmproj_path`` already converted, how int8 did against fp32."""
    options = vision_options(vision_backend)
    cosine = None
    if options["onnxruntime"] is not None and mmproj_path is not None:
        from .models.identity import file_identity
        from .vision.onnx_vision import known_int8_cosine

        cosine = known_int8_cosine(file_identity(mmproj_path))
    return {**options, "int8_cosine": cosine, "vision_moves": native_vision_moves(vision_backend)}


def native_vision_moves(vision_backend: str) -> Callable[[str], str]:
    """The native check's verdict as :func:`~gguf_mcv.vision.vision_backends.choose_setup` takes it:
    a backend → the backend that runs in its place here (:func:`gguf_mcv.runtime.native_check.decide`,
    asked once per backend). For planning an explicit backend that crashes is left as it is (the
    load refuses it, and ``gguf-mcv plan`` says so)."""
    from .runtime import native_check  # lazy: runs the check in a child process when not yet known

    @functools.cache
    def runs_instead(backend: str) -> str:
        try:
            decision = native_check.decide((), backend, vision_auto=vision_backend == "auto")
        except NativeKernelError:
            return backend
        return decision.vision_backend or backend

    return runs_instead


def plan_local(model_path: str | os.PathLike, mmproj_path: str | os.PathLike, *,
               hardware: Hardware | None = None, vision_backend: str = "auto", **options: Any) -> Plan:
    """:func:`~gguf_mcv.planning.planner.choose` for one local model file and its projector
    (shapes from their headers). ``rates``, the speed limits and ``vision_backend`` work as
    in :func:`plan`, and so does ``given``."""
    check_request(vision_backend=vision_backend, **{k: v for k, v in options.items() if k in _REQUEST_SETTINGS})
    _check_given(hardware=(hardware, Hardware), rates=(options.get("rates"), Rates),
                 given=(options.get("given"), LoadChoices))
    text, projector = read_text_header(model_path), read_projector_header(mmproj_path)
    info = classify_gguf(os.path.basename(os.fspath(model_path)))
    quant = info.quant if info is not None and info.quant else "Q4_K_M"  # only sizes the estimate
    weights = weight_profile(text.size, text.shape, quant, tensor_list(read_tensors(model_path)))
    candidate = QuantCandidate(quant, os.fspath(model_path), text.size, weights=weights)
    result = choose([candidate], arch=text.shape, vision=projector.shape, mmproj_size=projector.size,
                    mmproj_file=os.fspath(mmproj_path), hardware=hardware or this_machine(),
                    **{"model": _generation(projector), **options, **vision_inputs(vision_backend, mmproj_path),
                       "quant": quant})
    return replace(result, model=os.fspath(model_path))



def estimate_files(model_path: str | os.PathLike, mmproj_path: str | os.PathLike,
                   **kwargs: Any) -> memory.MemoryEstimate:
    """:func:`~gguf_mcv.planning.memory.estimate` for local files: sizes, shapes and the tensor list
    from their headers, and (unless ``cpu`` is given) the repack family loads get on this machine."""
    text, projector = read_text_header(model_path), read_projector_header(mmproj_path)
    kwargs.setdefault("tensors", tensor_list(read_tensors(model_path)))
    kwargs.setdefault("cpu", loads_repack_family())
    return memory.estimate(model_size=text.size, text=text.shape, mmproj_size=projector.size,
                           vision=projector.shape, **kwargs)

def _generation(projector: ProjectorHeader) -> str:
    """The catalog name of the generation a local projector belongs to ("" when the catalog has
    none of its kind): a refusal then does not suggest that generation as a smaller model."""
    for entry in load_catalog().entries():
        if (entry.projector_type, entry.minicpmv_version) == (projector.projector_type, projector.minicpmv_version):
            return entry.name
    return ""


def pull(
    model: str,
    *,
    quant: str | None = None,
    ram_budget: int | str | None = None,
    n_ctx: int | None = None,
    kv_cache_type: str | None = None,
    revision: str | None = None,
    progress: bool | None = None,
    min_tokens_per_s: float | None = None,
    max_first_answer_s: float | None = None,
    vision_backend: str = "auto",
    vision_weights: str | None = None,
    hardware: Hardware | None = None,
    given: LoadChoices | None = None,
) -> ModelFiles:
    """Make sure a model file and its mmproj are in the HF cache; return their paths.

    ``model`` is a catalog name, a Hub repo id or ``"auto"``. Without ``quant`` the
    planner picks the best quantization whose predicted memory fits ``ram_budget``
    (default: what this machine has free). Files already complete are not fetched
    again; every ``.gguf`` is checked against the Hub's sha256. ``progress`` shows
    download bars (default: when stderr is a terminal). ``min_tokens_per_s`` and
    ``max_first_answer_s`` keep only quants (models, for ``"auto"``) predicted to meet
    them, as in :func:`plan` (this machine is then probed once, see
    :mod:`gguf_mcv.runtime.speed_probe`). ``vision_backend`` and ``vision_weights`` are ``load()``'s
    (the plan counts their memory). ``hardware`` (default: this machine, probed when a plan is
    made) and ``given`` are :func:`plan`'s.
    ``n_ctx``/``kv_cache_type`` as in :func:`plan`: the returned ``plan`` holds what to load with.
    """
    check_plan(model, revision=revision, ram_budget=ram_budget, n_ctx=n_ctx, quant=quant,
               kv_cache_type=kv_cache_type, min_tokens_per_s=min_tokens_per_s,
               max_first_answer_s=max_first_answer_s, vision_backend=vision_backend, vision_weights=vision_weights)
    if progress is not None and not isinstance(progress, bool):
        raise ConfigError(f"progress must be True, False or None, not {progress!r}.")
    _check_given(hardware=(hardware, Hardware), given=(given, LoadChoices))
    planned = None
    limits: dict[str, Any] = dict(min_tokens_per_s=min_tokens_per_s, max_first_answer_s=max_first_answer_s)
    limited = min_tokens_per_s is not None or max_first_answer_s is not None
    if model == "auto":
        planned = plan("auto", ram_budget=ram_budget, n_ctx=n_ctx, quant=quant,
                       kv_cache_type=kv_cache_type, speed_probe=None if limited else False, hardware=hardware,
                       vision_backend=vision_backend, vision_weights=vision_weights, given=given, **limits)
        model, quant = planned.model, planned.quant
    repo, entry = resolve(model)
    listing = list_files(repo, revision)
    if quant is None:
        hw = hardware or this_machine()
        planned = _plan_listing(model, listing, entry, ram_budget=ram_budget, n_ctx=n_ctx,
                                kv_cache_type=kv_cache_type, hardware=hw,
                                rates=machine_rates(hw) if limited else None, vision_weights=vision_weights,
                                given=given, **vision_inputs(vision_backend), **limits)
        quant = planned.quant
    quant = normalize_quant(quant)
    preferred = entry.quants[quant].file if entry is not None and quant in entry.quants else None
    model_file = listing.model_file(quant, preferred)
    mmproj_file = listing.mmproj_for(model_file)
    paths = fetch(listing, [model_file, mmproj_file], progress=progress)
    return ModelFiles(paths[0], paths[1], quant, listing.repo, listing.revision, entry, planned)


def _plan_listing(model: str, listing: RepoFiles | None, entry: CatalogEntry | None, *,
                  hardware: Hardware, **options: Any) -> Plan:
    """:func:`choose` for a repo's files (or, with no listing, the catalog ``entry``'s)."""
    notes: list[str] = []
    if listing is None:
        assert entry is not None  # plan() only passes no listing for a catalog model
        candidates = candidates_from(entry.quants)
        mmproj_file, mmproj_size = entry.mmproj.file, entry.mmproj.size
        notes.append("the Hub could not be reached and nothing is cached: files and sizes are the "
                     "catalog's")
    else:
        candidates = []
        for q in listing.text_models():
            preferred = entry.quants[q].file if entry is not None and q in entry.quants else None
            f = listing.model_file(q, preferred)
            candidates.append(QuantCandidate(q, f.path, int(f.size or 0), f.size is not None))
        if not candidates:
            raise ConfigError(f"{listing.repo} has no text model .gguf files to plan with.")
        projector = listing.mmproj_for(listing.model_file(candidates[0].quant))
        mmproj_file, mmproj_size = projector.path, int(projector.size or 0)
    if entry is not None:
        arch, vision = entry.arch, entry.vision
    else:
        assert listing is not None
        smallest = min(candidates, key=lambda c: c.size)
        arch = remote_text_header(listing, listing.model_file(smallest.quant)).shape
        vision = None  # MiniCPM-V's SigLIP-400M tower
    result = choose(candidates, arch=arch, vision=vision, mmproj_size=mmproj_size,
                    mmproj_file=mmproj_file, hardware=hardware, model=entry.name if entry is not None else "",
                    **options)
    return replace(result, model=model, warnings=(*result.warnings, *notes))


def _plan_auto(*, hardware: Hardware, **options: Any) -> Plan:
    """The most capable catalog model (by rank) with a quant that fits (and meets the speed
    limits, when given); catalog sizes, no network."""
    needs = []
    # a model that fits with the default context and KV cache first; only then one that
    # fits once they are shrunk (a smaller model at full context beats a larger cramped one)
    defaults = {"n_ctx": options.get("n_ctx") or environment.DEFAULT_N_CTX,
                "kv_cache_type": options.get("kv_cache_type") or "f16",
                "vision_weights": options.get("vision_weights") or "packed"}
    for shrink in (False, True):
        for entry in load_catalog().entries():
            try:
                result = choose(candidates_from(entry.quants), arch=entry.arch, vision=entry.vision,
                                mmproj_size=entry.mmproj.size, mmproj_file=entry.mmproj.file, model=entry.name,
                                hardware=hardware, **{**options, "quant": None, **({} if shrink else defaults)})
            except NoQuantFitsError as exc:
                if shrink:
                    needs.append(f"{entry.name}: {str(exc).splitlines()[0]}")
                continue
            return replace(result, model=entry.name)
    limited = options.get("min_tokens_per_s") is not None or options.get("max_first_answer_s") is not None
    head = "No catalog model fits this machine" + (" and meets the speed limits" if limited else "")
    raise NoQuantFitsError(f"{head}.\n" + "\n".join(needs))
