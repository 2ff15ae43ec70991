"""``load()``: from a model name (or local files) to a ready :class:`~gguf_mcv.model.Model`.

The path a request travels: :mod:`gguf_mcv.resolver` turns the name into two local
files (catalog, plan, Hub); their headers are checked as a pair before llama.cpp
sees them; then the text model and the vision projector are loaded into an
:class:`~gguf_mcv.runtime.engine.Engine`.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import environment, llama_log
from .errors import ConfigError, CorruptModelError, EngineError, ModelNotFoundError
from .model import Model, ModelInfo
from .models.catalog import CatalogEntry, lookup
from .models.headers import ProjectorHeader, TextHeader, check_pair, read_projector_header, read_text_header
from .options import LoadOptions, Sampling
from .planning.planner import LoadChoices, Plan, check_request
from .prompt.templates import FAMILIES, ChatTemplate, choose_template
from .resolver import check_plan, check_revision, plan_local, pull, this_machine, vision_inputs
from .runtime import native_check
from .runtime.engine import Engine, VisionEncoder, file_identity
from .runtime.slots import Scheduler
from .vision.embed_cache import EmbeddingCache
from .vision.vision_backends import VisionSetup, choose_setup

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
    vision_weights: str | None = None,
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
    many as the memory budget holds (at most 8). ``vision_weights`` is where an ONNX encoder keeps
    its weights: ``"packed"`` into anonymous memory (fastest), ``"mapped"`` read from their
    memory-mapped file (int8 slices ~25 % slower; the kernel may drop them while the text model
    answers and read them again for the next image), None (default): packed unless the plan maps
    them as its last shrink to fit the budget (a logged warning says so).
    """
    options = _checked(dict(locals()))  # the arguments, as given: nothing else is defined yet
    if kv_cache_type is None and flash_attn is False:
        kv_cache_type = "f16"  # a quantized KV cache needs flash attention: not the planner's to pick
    given = LoadChoices(n_threads=options.n_threads, n_threads_batch=options.n_threads_batch,
                        n_gpu_layers=options.n_gpu_layers, vision_gpu=options.vision_gpu, parallel=options.parallel)
    settings: dict[str, Any] = dict(ram_budget=ram_budget, n_ctx=n_ctx, kv_cache_type=kv_cache_type,
                                    vision_backend=vision_backend, vision_weights=vision_weights,
                                    hardware=this_machine(), given=given)  # the one probe of this load
    local = model_path is not None
    planned: Plan | None = None
    if local:
        assert model_path is not None and mmproj_path is not None  # _checked: both or neither
        entry, repo = lookup(model), None
        name = entry.display_name if entry is not None else (model or Path(model_path).stem)
        quant_name = quant
    else:
        assert model is not None  # _checked: a name when no files are given
        files = pull(model, quant=quant, revision=revision, min_tokens_per_s=min_tokens_per_s,
                     max_first_answer_s=max_first_answer_s, **settings)
        model_path, mmproj_path, quant_name, repo = files.model, files.mmproj, files.quant, files.repo
        entry, planned = files.entry, files.plan
        name = entry.display_name if entry is not None else (files.repo or str(model))
    text = read_text_header(model_path)
    projector = read_projector_header(mmproj_path)
    check_pair(text, projector, minicpmv_version=entry.minicpmv_version if entry is not None else None,
               projector_type=entry.projector_type if entry is not None else None)
    if planned is None:  # local files, or a quant named: planned from the files' own headers
        # local files that cannot fit are refused (a named quant from the Hub is honoured with a
        # warning, as plan() does); layers offloaded by hand are the caller's to fit
        planned = plan_local(model_path, mmproj_path, must_fit=local and not given.by_hand, **settings)
    for note in ((planned.shrunk_note(),) if planned.shrunk else ()) + planned.warnings:
        log.warning("%s", note)
    options = carried_out(options, planned)
    assert planned.vision is not None  # choose() decides the vision setup of every plan
    # the verdicts are known by now (kept): this asks no child process again, and refuses a backend
    # asked for by name whose kernels crash here (NativeKernelError)
    kernels = native_check.decide(native_check.weight_types(model_path),
                                  None if options.vision_gpu else planned.vision.backend,
                                  vision_auto=options.vision_backend == "auto", what=os.fspath(model_path))
    return _open(model_path, mmproj_path, text, projector, options, planned, kernels, entry,
                 name=name, quant=quant_name, repo=repo, chat_template=chat_template,
                 embed_cache=embed_cache, allow_remote_media=allow_remote_media, verbose=verbose)


def carried_out(options: LoadOptions, planned: Plan) -> LoadOptions:
    """``options`` as the plan says to load them: its context, KV cache, threads, GPU layers, vision
    placement, parallel slots and batch size (values the caller gave were kept by the plan)."""
    return replace(options, n_ctx=planned.n_ctx, kv_cache_type=planned.kv_cache_type,
                   n_threads=planned.n_threads, n_threads_batch=planned.n_threads_batch,
                   n_gpu_layers=planned.n_gpu_layers, vision_gpu=planned.vision_on_gpu,
                   parallel=planned.parallel, n_batch=planned.n_batch)


def check_load(**arguments: Any) -> LoadOptions:
    """The checks :func:`load` runs on ``arguments`` (its keywords) before anything else -- before
    the machine is probed, the Hub asked, a file read or llama.cpp started -- for a caller that loads
    later or elsewhere (``gguf-mcv serve``'s worker, Ray workers): the :class:`LoadOptions` they make.
    A bad argument raises :class:`~gguf_mcv.errors.ConfigError` (a missing local file,
    :class:`~gguf_mcv.errors.ModelNotFoundError`; an unknown catalog name too)."""
    try:
        bound = inspect.signature(load).bind(**arguments)
    except TypeError as exc:
        raise ConfigError(f"load() cannot take these arguments: {exc}.") from None
    bound.apply_defaults()
    return _checked(bound.arguments)


def _checked(a: dict[str, Any]) -> LoadOptions:
    """:func:`check_load` for all of :func:`load`'s arguments, by name."""
    check_request(ram_budget=a["ram_budget"], n_ctx=a["n_ctx"], kv_cache_type=a["kv_cache_type"], quant=a["quant"],
                  min_tokens_per_s=a["min_tokens_per_s"], max_first_answer_s=a["max_first_answer_s"],
                  vision_backend=a["vision_backend"], vision_weights=a["vision_weights"])
    options = LoadOptions(n_ctx=environment.DEFAULT_N_CTX if a["n_ctx"] is None else a["n_ctx"],
                          n_threads=a["n_threads"], n_threads_batch=a["n_threads_batch"],
                          n_gpu_layers=a["n_gpu_layers"], vision_gpu=a["vision_gpu"], flash_attn=a["flash_attn"],
                          kv_cache_type=a["kv_cache_type"] or "f16", vision_backend=a["vision_backend"],
                          mmproj_precision=a["mmproj_precision"], parallel=a["parallel"],
                          vision_weights=a["vision_weights"])
    for flag in ("allow_remote_media", "verbose"):
        if not isinstance(a[flag], bool):
            raise ConfigError(f"{flag} must be True or False, not {a[flag]!r}.")
    if a["chat_template"] is not None and (not isinstance(a["chat_template"], str) or not a["chat_template"].strip()):
        raise ConfigError("chat_template must be a template family name "
                          f"({', '.join(FAMILIES)}) or Jinja source, not {a['chat_template']!r:.60}.")
    if a["embed_cache"] is not None and not isinstance(a["embed_cache"], EmbeddingCache):
        raise ConfigError(f"embed_cache must be a gguf_mcv.EmbeddingCache or None, "
                          f"not {type(a['embed_cache']).__name__}.")
    check_revision(a["revision"])
    if a["model_path"] is not None or a["mmproj_path"] is not None:
        _check_local(a)
    elif a["model"] is None:
        raise ConfigError("Name a model (e.g. load('minicpm-v-2.6')) or pass model_path and mmproj_path.")
    else:
        check_plan(a["model"])  # the name known, before the Hub is asked
    if options.wants_gpu and not _gpu_offload_supported():
        raise ConfigError(
            "GPU offload was asked for, but this llama-cpp-python build is CPU-only. Rebuild it "
            "with CMAKE_ARGS='-DGGML_CUDA=on' (NVIDIA/Jetson) or '-DGGML_METAL=on' (Apple), or "
            "use n_gpu_layers=0 and vision_gpu=False."
        )
    return options


def _check_local(a: dict[str, Any]) -> None:
    """Local files: both given, each an existing file, and no speed limits (nothing to choose)."""
    if a["model_path"] is None or a["mmproj_path"] is None:
        raise ConfigError("Pass both model_path and mmproj_path (the vision projector).")
    for name in ("model_path", "mmproj_path"):
        if not isinstance(a[name], (str, os.PathLike)) or isinstance(os.fspath(a[name]), bytes) \
                or not os.fspath(a[name]):
            raise ConfigError(f"{name} must be a path (str or os.PathLike), not {a[name]!r:.60}.")
        if not os.path.isfile(a[name]):
            raise ModelNotFoundError(f"{name} {os.fspath(a[name])} is not a file: give the path of the "
                                     f"{'text model' if name == 'model_path' else 'vision projector'} .gguf.")
    if a["min_tokens_per_s"] is not None or a["max_first_answer_s"] is not None:
        raise ConfigError("Speed limits choose a model and quant; local files leave nothing to choose. "
                          "Use `gguf-mcv plan FILE.gguf` (or gguf_mcv.plan) to see their predicted speed.")
    if a["model"] is not None and not isinstance(a["model"], str):
        raise ConfigError(f"model (the name shown for local files) must be a string, not {type(a['model']).__name__}.")


def _open(model_path: str | os.PathLike, mmproj_path: str | os.PathLike, text: TextHeader,
          projector: ProjectorHeader, options: LoadOptions, planned: Plan, kernels: native_check.Decision,
          entry: CatalogEntry | None, *, name: str, quant: str | None, repo: str | None,
          chat_template: str | None, embed_cache: EmbeddingCache | None,
          allow_remote_media: bool, verbose: bool) -> Model:
    """Load the checked pair into llama.cpp as ``planned`` says (``options`` carried out from it) and
    wrap it in a :class:`Model`."""
    assert planned.vision is not None and options.n_threads_batch is not None  # carried_out: resolved
    vision_gpu = bool(options.vision_gpu)
    slice_size = projector.shape.image_size
    backend, reason, encoder, libmtmd_mmproj = _carry_out(planned.vision, options, mmproj_path,
                                                          options.n_threads_batch)
    slots = int(options.parallel)
    llama = _open_llama(model_path, options, verbose=verbose, extra_bufts=kernels.extra_bufts)
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
        plan=planned,
    )
    if verbose:
        llama_log.verbose_acquire()
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


def _with_sequences(llama, n_seq: int) -> None:
    """Give ``llama`` a context of ``n_seq`` sequences, each in a KV stream of its own.

    llama-cpp-python's ``Llama`` has no ``n_seq_max`` setting, so its context is freed and
    made again with the same parameters plus these (``Llama._ctx``, as of 0.3.36). Not unified
    (as llama-server's explicit ``--parallel N``): in one unified cache every token attends
    over the cells of every sequence, masked, so one client's decoding slowed as the other
    slots filled (27.5 against 16.5 tok/s with four slots of 1850 positions on the bench
    model). A prefix copied between sequences is then a copy of the buffer, not shared cells.
    """
    from llama_cpp import _internals

    params = llama.context_params
    params.n_seq_max = n_seq
    params.kv_unified = False
    llama._ctx.close()  # first, so the two KV caches are never allocated together
    llama_log.clear_recent()
    try:
        llama._ctx = _internals.LlamaContext(model=llama._model, params=params, verbose=llama.verbose)
    except ValueError as exc:
        raise EngineError(f"llama.cpp could not make a context of {n_seq} sequences: "
                          f"{llama_log.recent_errors() or exc}. Try a smaller parallel or n_ctx.") from exc


def vision_setup(mmproj_path: str | os.PathLike, *, vision_backend: str, mmproj_precision: str, vision_gpu: bool,
                 n_threads: int) -> tuple[str, str, VisionEncoder | None, str | os.PathLike]:
    """(backend, reason, ONNX encoder or None, the mmproj libmtmd loads) for these settings where no
    plan is made (:class:`gguf_mcv.chat_handler.MiniCPMVChatHandler`): the setup decided by the
    function the planner uses, with the same native check, then carried out as :func:`load` does."""
    options = LoadOptions(vision_backend=vision_backend, mmproj_precision=mmproj_precision, vision_gpu=vision_gpu)
    inputs = vision_inputs("llama.cpp" if vision_gpu else vision_backend, mmproj_path)
    vision = choose_setup(vision_backend, vision_gpu=vision_gpu,
                          projector_type=read_projector_header(mmproj_path).projector_type,
                          ort_version=inputs["onnxruntime"], runs_instead=inputs["vision_moves"],
                          int8_cosine=inputs["int8_cosine"])
    # refuses a backend asked for by name whose kernels crash here, as load() does
    native_check.decide((), None if vision_gpu else vision.backend, vision_auto=vision_backend == "auto",
                        what=os.fspath(mmproj_path))
    return _carry_out(vision, options, mmproj_path, n_threads)


def _carry_out(vision: VisionSetup, options: LoadOptions, mmproj_path: str | os.PathLike,
               n_threads: int) -> tuple[str, str, VisionEncoder | None, str | os.PathLike]:
    """(backend, reason, encoder, the mmproj libmtmd loads) for the decided ``vision``: for an ONNX
    backend the converted encoder and a stand-in mmproj without the tower's weights (no double
    loading). What is left to run time is the setup's own: int8's check against fp32 at its first
    conversion (:meth:`VisionSetup.validated`, the fallback the plan showed), and under ``auto`` a
    conversion that cannot be written at all (libmtmd needs none)."""
    from .vision import onnx_vision

    if not vision.onnx:
        return _libmtmd(options, mmproj_path, vision)
    identity = file_identity(mmproj_path)
    # int8 is validated against fp32 in this process: only where its kernels are known to run
    # (where they crash, the native check has already moved an ONNX backend to fp32)
    int8_runs = native_check.vision_safe("onnx-int8")
    try:
        converted = onnx_vision.prepare(mmproj_path, identity, progress=onnx_vision.progress_bar(),
                                        validate_int8=int8_runs)
    except OSError as exc:  # NotEnoughDiskError included
        if options.vision_backend != "auto":
            raise
        return _libmtmd(options, mmproj_path, vision.unconverted(f"{type(exc).__name__}: {exc}"))
    if int8_runs:
        vision = vision.validated(converted.int8_cosine)
    encoder = onnx_vision.OnnxVision(converted, vision.precision, identity, n_threads=n_threads, packed=vision.packed)
    return vision.backend, vision.reason, encoder, onnx_vision.standin(mmproj_path, identity)


def _libmtmd(options: LoadOptions, mmproj_path: str | os.PathLike,
             vision: VisionSetup) -> tuple[str, str, None, str | os.PathLike]:
    """The llama.cpp backend's setup: no ONNX encoder, the mmproj at the precision asked for."""
    mmproj, note = _precision(options, mmproj_path, vision.vision_gpu)
    return "llama.cpp", f"{vision.reason}; mmproj {note}", None, mmproj


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


def _open_llama(model_path: str | os.PathLike, options: LoadOptions, *, verbose: bool, extra_bufts: bool = True):
    """llama.cpp's model and context for ``options`` (resolved: threads and GPU layers given,
    ``parallel`` a count of slots sharing one context)."""
    from .runtime.llama_load import llama_kwargs, open_llama

    kwargs = llama_kwargs(options)
    n_gpu_layers = kwargs["n_gpu_layers"]
    llama_log.install()
    llama_log.clear_recent()
    try:
        return open_llama(model_path, extra_bufts=extra_bufts, verbose=verbose, **kwargs)
    except ValueError as exc:
        details = llama_log.recent_errors() or str(exc)
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
