"""``load()``: from a model name (or local files) to a ready :class:`~gguf_mcv.model.Model`.

The path a request travels: :mod:`gguf_mcv.resolver` turns the name into two local
files (catalog, plan, Hub); their headers are checked as a pair before llama.cpp
sees them; then the text model and the vision projector are loaded into an
:class:`~gguf_mcv.runtime.engine.Engine`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import constants
from .errors import ConfigError, CorruptModelError, EngineError, NoQuantFitsError
from .hardware import probe
from .model import Model, ModelInfo
from .models.catalog import CatalogEntry, lookup
from .models.headers import ProjectorHeader, TextHeader, check_pair, read_projector_header, read_text_header
from .options import LoadOptions, Sampling
from .planning.memory import estimate_files, parallel_for_budget, slot_bytes
from .planning.planner import Plan, resolve_budget
from .prompt.templates import FAMILIES, ChatTemplate, choose_template
from .resolver import plan_local, pull
from .runtime import native, native_check
from .runtime.engine import Engine, VisionEncoder, file_identity
from .runtime.slots import Scheduler
from .units import format_size
from .vision.embed_cache import EmbeddingCache
from .vision.vision_backends import choose_backend

log = logging.getLogger(__name__)


def load(
    model: str | None = None,
    *,
    quant: str | None = None,
    ram_budget: int | str | None = None,
    model_path: str | os.PathLike | None = None,
    mmproj_path: str | os.PathLike | None = None,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    n_threads_batch: int | None = None,
    n_gpu_layers: int | str = 0,
    vision_gpu: bool | None = None,
    flash_attn: bool | None = None,
    kv_cache_type: str | None = None,
    vision_backend: str = "auto",
    mmproj_precision: str = "auto",
    revision: str | None = None,
    chat_template: str | None = None,
    embed_cache: EmbeddingCache | None = None,
    allow_remote_media: bool = False,
    verbose: bool = False,
    min_tokens_per_s: float | None = None,
    max_first_answer_s: float | None = None,
    parallel: int | str = 1,
) -> Model:
    """Load a MiniCPM-V model and its vision projector; return a :class:`Model`.

    ``model`` is a catalog name (``"minicpm-v-2.6"``), a Hub repo id
    (``"openbmb/MiniCPM-V-2_6-gguf"``) or ``"auto"`` (the most capable catalog model
    that fits); or leave it out and pass local ``model_path`` and ``mmproj_path``.
    Without ``quant`` the quantization is planned from ``ram_budget`` (default: what
    the machine has free). Local files are planned too, before anything is loaded: when their
    predicted memory exceeds ``ram_budget`` (default: the free RAM, container limits included,
    less a reserve) the load raises :class:`~gguf_mcv.errors.NoQuantFitsError` with the ways
    out; a larger ``ram_budget`` overrides the probe for callers who know better (not checked
    when layers are offloaded by hand: ``n_gpu_layers`` > 0 or ``vision_gpu=True``).
    ``n_ctx`` (default 4096) and ``kv_cache_type`` (default ``"f16"``) left at None may be
    shrunk by the plan -- to a context of at least 2048 and a q8_0 KV cache -- when nothing
    fits with them (``model.info.n_ctx`` and a logged warning say so); values given are kept.
    ``n_gpu_layers="auto"`` offloads what the plan says fits
    (nothing on a CPU-only build); ``vision_gpu=None`` follows the plan when one was
    made for GPU offload, else keeps the vision encoder on the CPU.
    ``n_threads`` defaults to the machine's performance (or physical) cores.
    ``flash_attn=None`` lets llama.cpp decide for the vision encoder and turns it on
    for the text model only when a quantized KV cache needs it. ``chat_template``
    overrides the prompt format: a family name (``"chatml"``, ``"llama3"``,
    ``"qwen3"``) or Jinja source; by default the GGUF's own template is used, else
    the catalog family's. ``embed_cache`` shares an :class:`EmbeddingCache` (e.g.
    one with a disk tier) between models. ``min_tokens_per_s`` and ``max_first_answer_s``
    make the plan keep only quants (and, for ``"auto"``, models) predicted to meet them
    (:func:`gguf_mcv.plan`). ``vision_backend`` picks who runs the vision encoder:
    ``"llama.cpp"`` (libmtmd), ``"onnx-int8"`` / ``"onnx-fp32"`` (ONNX Runtime, a graph
    converted once from the mmproj) or ``"auto"`` (see ``gguf_mcv.vision.vision_backends.choose_backend``);
    ``model.info`` says which and why. ``mmproj_precision`` is for the ``llama.cpp`` backend:
    ``"auto"`` encodes with a BF16 copy of a large F16 mmproj (made once in the cache) when the
    CPU has AVX512-BF16 and the encoder runs on it, ``"bf16"`` always, ``"as-is"`` never
    (:mod:`gguf_mcv.vision.mmproj_bf16`); ``model.info.vision_backend_reason`` says which.
    ``parallel=N`` answers up to N questions at once (N slots of ``n_ctx`` positions each in
    one llama.cpp context, decoded together: see :mod:`gguf_mcv.runtime.slots`); ``"auto"`` takes as
    many as the memory budget holds (at most 8).
    """
    options = LoadOptions(n_ctx=constants.DEFAULT_N_CTX if n_ctx is None else n_ctx, n_threads=n_threads,
                          n_threads_batch=n_threads_batch, n_gpu_layers=n_gpu_layers, vision_gpu=vision_gpu,
                          flash_attn=flash_attn, kv_cache_type=kv_cache_type or "f16",
                          vision_backend=vision_backend, mmproj_precision=mmproj_precision, parallel=parallel)
    if kv_cache_type is None and flash_attn is False:
        kv_cache_type = "f16"  # a quantized KV cache needs flash attention: not the planner's to pick
    if options.wants_gpu and not _gpu_offload_supported():
        raise ConfigError(
            "GPU offload was asked for, but this llama-cpp-python build is CPU-only. Rebuild it "
            "with CMAKE_ARGS='-DGGML_CUDA=on' (NVIDIA/Jetson) or '-DGGML_METAL=on' (Apple), or "
            "use n_gpu_layers=0 and vision_gpu=False."
        )
    local = model_path is not None or mmproj_path is not None
    if local:
        if model_path is None or mmproj_path is None:
            raise ConfigError("Pass both model_path and mmproj_path (the vision projector).")
        if min_tokens_per_s is not None or max_first_answer_s is not None:
            raise ConfigError("Speed limits choose a model and quant; local files leave nothing to choose. "
                              "Use `gguf-mcv plan FILE.gguf` (or gguf_mcv.plan) to see their predicted speed.")
        entry, repo, planned = lookup(model), None, None
        name = entry.display_name if entry is not None else (model or Path(model_path).stem)
        quant_name = quant
    else:
        if not model or not isinstance(model, str):
            raise ConfigError("Name a model (e.g. load('minicpm-v-2.6')) or pass model_path and mmproj_path.")
        files = pull(model, quant=quant, ram_budget=ram_budget, n_ctx=n_ctx,
                     kv_cache_type=kv_cache_type, revision=revision,
                     min_tokens_per_s=min_tokens_per_s, max_first_answer_s=max_first_answer_s,
                     vision_backend=vision_backend)
        model_path, mmproj_path, quant_name, repo = files.model, files.mmproj, files.quant, files.repo
        entry, planned = files.entry, files.plan
        name = entry.display_name if entry is not None else (files.repo or str(model))
    text = read_text_header(model_path)
    projector = read_projector_header(mmproj_path)
    check_pair(text, projector, minicpmv_version=entry.minicpmv_version if entry is not None else None,
               projector_type=entry.projector_type if entry is not None else None)
    if local:
        planned = _plan_local_load(model_path, mmproj_path, options, ram_budget, n_ctx, kv_cache_type)
    if planned is not None:
        options = _planned_options(options, planned)
    if options.parallel == "auto":
        options = replace(options, parallel=auto_parallel(model_path, mmproj_path, options, ram_budget))
    return _open(model_path, mmproj_path, text, projector, options, planned, entry,
                 name=name, quant=quant_name, repo=repo, chat_template=chat_template,
                 embed_cache=embed_cache, allow_remote_media=allow_remote_media, verbose=verbose)


def _plan_local_load(model_path: str | os.PathLike, mmproj_path: str | os.PathLike, options: LoadOptions,
                     ram_budget: int | str | None, n_ctx: int | None, kv_cache_type: str | None) -> Plan | None:
    """The plan for local files, refused (:class:`NoQuantFitsError`) when they cannot fit the
    budget even with the defaults shrunk; None when layers are offloaded by hand (the plan
    cannot describe that split)."""
    auto = options.n_gpu_layers == "auto"
    if not auto and (options.n_gpu_layers or options.vision_gpu):
        return None
    hardware = probe()
    if not auto:  # everything stays on the CPU: plan for that, whatever GPU the machine has
        hardware = replace(hardware, gpu_offload=False)
    return plan_local(model_path, mmproj_path, hardware=hardware, ram_budget=ram_budget, n_ctx=n_ctx,
                      kv_cache_type=kv_cache_type, vision_backend=options.vision_backend, must_fit=True)


def _planned_options(options: LoadOptions, planned: Plan) -> LoadOptions:
    """``options`` with the context and KV cache the plan chose; refused when ``parallel``
    slots beyond the first do not fit beside it."""
    if planned.shrunk:
        log.warning("%s", planned.shrunk_note())
    options = replace(options, n_ctx=planned.n_ctx, kv_cache_type=planned.kv_cache_type)
    slots = options.parallel if isinstance(options.parallel, int) else 1
    need = planned.predicted_bytes + (slots - 1) * planned.slot_bytes
    if planned.fits and slots > 1 and need > planned.budget:
        raise NoQuantFitsError(
            f"parallel={slots} needs about {format_size(need)} of RAM ({format_size(planned.slot_bytes)} per "
            f"slot beyond the first), but the budget is {format_size(planned.budget)}.\nWays out:\n"
            f"- parallel={planned.slots} (or 'auto', which takes what the budget holds).\n"
            "- a smaller n_ctx or kv_cache_type='q8_0' (each slot holds n_ctx positions).\n"
            "- free memory (close other programs) or pass a larger ram_budget if you know better.")
    return options


def auto_parallel(model_path: str | os.PathLike, mmproj_path: str | os.PathLike, options: LoadOptions,
                  ram_budget: int | str | None) -> int:
    """How many parallel slots the memory budget holds for these files (see
    :func:`memory.parallel_for_budget`): the plan's need for one, then a KV cache per slot."""
    budget, _ = resolve_budget(probe(), ram_budget)
    projector = read_projector_header(mmproj_path)
    backend, _ = _choose_vision_backend(options, projector, bool(options.vision_gpu))
    one = estimate_files(model_path, mmproj_path, n_ctx=options.n_ctx, kv_cache_type=options.kv_cache_type,
                         vision_backend=backend)
    text = read_text_header(model_path).shape
    per_slot = slot_bytes(text, options.n_ctx, options.kv_cache_type, vision=projector.shape, vision_backend=backend)
    return parallel_for_budget(one.needed, per_slot, budget)


def _open(model_path: str | os.PathLike, mmproj_path: str | os.PathLike, text: TextHeader,
          projector: ProjectorHeader, options: LoadOptions, planned: Plan | None,
          entry: CatalogEntry | None, *, name: str, quant: str | None, repo: str | None,
          chat_template: str | None, embed_cache: EmbeddingCache | None,
          allow_remote_media: bool, verbose: bool) -> Model:
    """Load the checked pair into llama.cpp and wrap it in a :class:`Model`."""
    auto = options.n_gpu_layers == "auto"
    n_threads = options.n_threads or probe().recommended_threads
    n_gpu = planned.n_gpu_layers if auto and planned is not None else options.n_gpu_layers
    vision_gpu = options.vision_gpu
    if vision_gpu is None:
        vision_gpu = bool(planned is not None and auto and planned.vision_on_gpu)
    slice_size = projector.shape.image_size
    chosen, kernels = _safe_vision_backend(options, projector, vision_gpu, native_check.weight_types(model_path),
                                           what=os.fspath(model_path))
    backend, reason, encoder, libmtmd_mmproj = _vision_backend(
        options, mmproj_path, projector, vision_gpu, options.n_threads_batch or n_threads, chosen=chosen)
    slots = int(options.parallel)
    llama = _open_llama(model_path, options.n_ctx * slots, n_threads, options.n_threads_batch or n_threads,
                        int(n_gpu), options.flash_attn, options.kv_cache_type, verbose,
                        extra_bufts=kernels.extra_bufts)
    scheduler = None
    try:
        if slots > 1:
            _with_sequences(llama, slots)
        engine = Engine(llama, libmtmd_mmproj, vision_on_gpu=vision_gpu,
                        vision_flash_attn=options.flash_attn, embed_cache=embed_cache,
                        slice_size=slice_size, encoder=encoder)
        if slots > 1:
            scheduler = Scheduler(engine, slots, options.n_ctx)
    except BaseException:
        llama.close()
        raise
    template = _template(llama, text, entry, chat_template)
    info = ModelInfo(
        name=name,
        model_path=os.fspath(model_path),
        mmproj_path=os.fspath(mmproj_path),
        quant=quant,
        repo=repo,
        template_origin=template.origin,
        can_think=bool(entry.thinking) if entry is not None else template.supports_thinking,
        thinking_default=bool(entry.thinking_default) if entry is not None else False,
        n_ctx=options.n_ctx,
        slice_size=slice_size,
        vision_gpu=vision_gpu,
        vision_backend=backend,
        vision_backend_reason=reason,
        parallel=slots,
    )
    if verbose:
        native.verbose_acquire()
    return Model(engine, info=info, template=template, sampling=_sampling(entry),
                 allow_remote_media=allow_remote_media, verbose=verbose, scheduler=scheduler)


def checked_llama(model_path: str | os.PathLike, **llama_kwargs: Any) -> Any:
    """A ``llama_cpp.Llama`` for ``model_path`` loaded the way that works on this machine.

    Its matrix kernels are first tried in a child process (:mod:`gguf_mcv.runtime.native_check`);
    when llama.cpp's extra buffer types (AMX, repacking) crash there, the model is loaded
    without them and a notice says so once. Use it where you would call ``llama_cpp.Llama``
    for :class:`gguf_mcv.MiniCPMVChatHandler`. Raises
    :class:`~gguf_mcv.errors.NativeKernelError` when no kernel set is safe.
    """
    from .runtime.llama_load import open_llama

    decision = native_check.decide(native_check.weight_types(model_path), what=os.fspath(model_path))
    return open_llama(model_path, extra_bufts=decision.extra_bufts, **llama_kwargs)


def _safe_vision_backend(options: LoadOptions, projector: ProjectorHeader, vision_gpu: bool,
                         text_types: Iterable[str], *, what: str) -> tuple[tuple[str, str], native_check.Decision]:
    """(backend, reason) by the rule (:func:`_choose_vision_backend`), moved where that backend's
    kernels crash on this machine, and the native check's decision for the text model's types
    too (:func:`native_check.decide`; the vision encoder is checked only when it runs on the CPU)."""
    backend, reason = _choose_vision_backend(options, projector, vision_gpu)
    kernels = native_check.decide(text_types, None if vision_gpu else backend,
                                  vision_auto=options.vision_backend == "auto", what=what)
    if kernels.vision_backend is not None and kernels.vision_backend != backend:
        backend, reason = kernels.vision_backend, f"{reason}; {backend} crashed on this machine (see the notice)"
    return (backend, reason), kernels


def _with_sequences(llama, n_seq: int) -> None:
    """Give ``llama`` a context of ``n_seq`` sequences in one unified KV cache.

    llama-cpp-python's ``Llama`` has no ``n_seq_max`` setting, so its context is freed and
    made again with the same parameters plus these (``Llama._ctx``, as of 0.3.36). Unified:
    every sequence may use any cell, so a prefix copied between sequences shares its cells.
    """
    from llama_cpp import _internals

    params = llama.context_params
    params.n_seq_max = n_seq
    params.kv_unified = True
    llama._ctx.close()  # first, so the two KV caches are never allocated together
    native.clear_recent()
    try:
        llama._ctx = _internals.LlamaContext(model=llama._model, params=params, verbose=llama.verbose)
    except ValueError as exc:
        raise EngineError(f"llama.cpp could not make a context of {n_seq} sequences: "
                          f"{native.recent_errors() or exc}. Try a smaller parallel or n_ctx.") from exc


def vision_setup(mmproj_path: str | os.PathLike, *, vision_backend: str, mmproj_precision: str, vision_gpu: bool,
                 n_threads: int) -> tuple[str, str, VisionEncoder | None, str | os.PathLike]:
    """(backend, reason, ONNX encoder or None, the mmproj libmtmd loads) for these settings, as
    :func:`load` does it (also used by :class:`gguf_mcv.chat_handler.MiniCPMVChatHandler`)."""
    options = LoadOptions(vision_backend=vision_backend, mmproj_precision=mmproj_precision, vision_gpu=vision_gpu)
    projector = read_projector_header(mmproj_path)
    chosen, _ = _safe_vision_backend(options, projector, vision_gpu, (), what=os.fspath(mmproj_path))
    return _vision_backend(options, mmproj_path, projector, vision_gpu, n_threads, chosen=chosen)


def _vision_backend(options: LoadOptions, mmproj_path: str | os.PathLike, projector: ProjectorHeader,
                    vision_gpu: bool, n_threads: int, *, chosen: tuple[str, str] | None = None,
                    ) -> tuple[str, str, VisionEncoder | None, str | os.PathLike]:
    """(backend, reason, encoder, the mmproj libmtmd loads): for an ONNX backend the converted
    encoder and a stand-in mmproj without the tower's weights (no double loading). ``chosen``
    is the (backend, reason) already decided, else the rule's."""
    from .vision import onnx_vision

    backend, reason = chosen or _choose_vision_backend(options, projector, vision_gpu)
    if backend == "llama.cpp":
        return _libmtmd(options, mmproj_path, vision_gpu, reason)
    identity = file_identity(mmproj_path)
    # int8 is validated against fp32 in this process: only where its kernels are known to run
    # (where they crash, native_check.decide has already moved an ONNX backend to fp32)
    int8_runs = native_check.vision_safe("onnx-int8")
    try:
        converted = onnx_vision.prepare(mmproj_path, identity, progress=onnx_vision.progress_bar(),
                                        validate_int8=int8_runs)
    except OSError as exc:  # NotEnoughDiskError included
        if options.vision_backend != "auto":
            raise
        # the conversion cache cannot be written (full, read-only, in the way): libmtmd needs none
        return _libmtmd(options, mmproj_path, vision_gpu,
                        f"auto: the ONNX conversion cannot be made ({type(exc).__name__}: {exc})")
    if int8_runs and options.vision_backend == "auto" and not converted.int8_ok:
        backend = "onnx-fp32"
        reason = (f"auto: int8 embeddings agree with fp32 only to cosine {converted.int8_cosine:.4f} "
                  f"(< {onnx_vision.INT8_MIN_COSINE}) on this mmproj")
    elif int8_runs:
        reason += f"; int8 vs fp32 cosine {converted.int8_cosine:.4f}"
    encoder = onnx_vision.OnnxVision(converted, backend.removeprefix("onnx-"), identity, n_threads=n_threads)
    return backend, reason, encoder, onnx_vision.standin(mmproj_path, identity)


def _libmtmd(options: LoadOptions, mmproj_path: str | os.PathLike, vision_gpu: bool,
             reason: str) -> tuple[str, str, None, str | os.PathLike]:
    """The llama.cpp backend's setup: no ONNX encoder, the mmproj at the precision asked for."""
    mmproj, note = _precision(options, mmproj_path, vision_gpu)
    return "llama.cpp", f"{reason}; mmproj {note}", None, mmproj


def _choose_vision_backend(options: LoadOptions, projector: ProjectorHeader, vision_gpu: bool) -> tuple[str, str]:
    """(backend, reason) by the rule the planner uses too (:mod:`gguf_mcv.vision.vision_backends`)."""
    from .vision.onnx_vision import onnxruntime_version

    # importing onnxruntime costs ~25 MiB of RSS: only when it may be used
    may_use = options.vision_backend != "llama.cpp" and not vision_gpu
    return choose_backend(options.vision_backend, vision_gpu=vision_gpu, projector_type=projector.projector_type,
                          ort_version=onnxruntime_version() if may_use else None)


def _precision(options: LoadOptions, mmproj_path: str | os.PathLike,
               vision_gpu: bool) -> tuple[str | os.PathLike, str]:
    """(the mmproj libmtmd loads, why) for ``options.mmproj_precision`` with the llama.cpp backend."""
    from .hardware import cpu_flags
    from .vision import mmproj_bf16

    if options.mmproj_precision == "as-is":
        return mmproj_path, "as-is"
    use, why = mmproj_bf16.choose(options.mmproj_precision, backend="llama.cpp", vision_gpu=vision_gpu,
                                  cpu_flags=cpu_flags(), f16_blocks=lambda: mmproj_bf16.has_f16_blocks(mmproj_path),
                                  size=os.path.getsize(mmproj_path))
    if not use:
        return mmproj_path, why
    try:
        return mmproj_bf16.prepare(mmproj_path, file_identity(mmproj_path)).path, why
    except OSError as exc:  # NotEnoughDiskError included: the cache cannot be written
        if options.mmproj_precision != "auto":
            raise
        return mmproj_path, f"as-is (auto: the BF16 copy cannot be made: {type(exc).__name__}: {exc})"


def _template(llama, text: TextHeader, entry: CatalogEntry | None, chat_template: str | None) -> ChatTemplate:
    tokens = dict(bos_token=_token_text(llama, llama.token_bos()),
                  eos_token=_token_text(llama, llama.token_eos()))
    if chat_template in FAMILIES:
        return choose_template(None, chat_template, **tokens)
    if chat_template:
        return ChatTemplate(chat_template, "custom", **tokens)
    return choose_template(text.chat_template, entry.template if entry is not None else None, **tokens)


def _gpu_offload_supported() -> bool:
    import llama_cpp  # lazy: loads llama.cpp's native library (~0.3 s)

    return bool(llama_cpp.llama_supports_gpu_offload())


def _open_llama(model_path, n_ctx, n_threads, n_threads_batch, n_gpu_layers, flash_attn,
                kv_cache_type, verbose, *, extra_bufts: bool = True):
    import llama_cpp  # lazy: loads llama.cpp's native library (~0.3 s)

    from .runtime.llama_load import open_llama

    native.install_logging()
    native.clear_recent()
    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
               "q4_0": llama_cpp.GGML_TYPE_Q4_0}[kv_cache_type]
    try:
        return open_llama(
            model_path, extra_bufts=extra_bufts, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
            n_threads=n_threads, n_threads_batch=n_threads_batch, n_gpu_layers=n_gpu_layers,
            flash_attn=bool(flash_attn) or kv_cache_type != "f16", type_k=kv_type, type_v=kv_type,
            verbose=verbose,
        )
    except ValueError as exc:
        details = native.recent_errors() or str(exc)
        if n_gpu_layers != 0:  # offloading can fail for reasons that have nothing to do with the file
            raise EngineError(
                f"llama.cpp could not load {model_path} with {n_gpu_layers} GPU layers: {details}. "
                "Try fewer GPU layers (n_gpu_layers)."
            ) from exc
        raise CorruptModelError(
            f"llama.cpp could not load {model_path}: {details}. The file is damaged: delete it "
            "and download it again."
        ) from exc


def _token_text(llama, token: int) -> str:
    if token < 0:
        return ""
    return llama.detokenize([token], special=True).decode("utf-8", errors="replace")


def _sampling(entry: CatalogEntry | None) -> Sampling:
    return entry.sampling if entry is not None else Sampling()
