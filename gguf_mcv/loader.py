"""``load()``: from a model name (or local files) to a ready :class:`~gguf_mcv.model.Model`.

The path a request travels: the catalog and the Hub (``hub.pull``, which plans the
quant from the RAM budget when none is given) give two files; their headers are
checked as a pair before llama.cpp sees them; then the text model and the vision
projector are loaded into an :class:`~gguf_mcv.engine.Engine`.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import constants, native
from .embed_cache import EmbeddingCache
from .engine import Engine, Sampling
from .errors import ConfigError, CorruptModelError, EngineError, ModelNotFoundError
from .headers import check_pair, read_projector_header, read_text_header
from .model import Model, ModelInfo
from .templates import FAMILIES, ChatTemplate, choose_template

KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")


def load(
    model: str | None = None,
    *,
    quant: str | None = None,
    ram_budget: int | str | None = None,
    model_path: str | os.PathLike | None = None,
    mmproj_path: str | os.PathLike | None = None,
    n_ctx: int = constants.DEFAULT_N_CTX,
    n_threads: int | None = None,
    n_threads_batch: int | None = None,
    n_gpu_layers: int | str = 0,
    vision_gpu: bool | None = None,
    flash_attn: bool | None = None,
    kv_cache_type: str = "f16",
    revision: str | None = None,
    chat_template: str | None = None,
    embed_cache: EmbeddingCache | None = None,
    allow_remote_media: bool = False,
    verbose: bool = False,
) -> Model:
    """Load a MiniCPM-V model and its vision projector; return a :class:`Model`.

    ``model`` is a catalog name (``"minicpm-v-2.6"``), a Hub repo id
    (``"openbmb/MiniCPM-V-2_6-gguf"``) or ``"auto"`` (the most capable catalog model
    that fits); or leave it out and pass local ``model_path`` and ``mmproj_path``.
    Without ``quant`` the quantization is planned from ``ram_budget`` (default: what
    the machine has free). ``n_gpu_layers="auto"`` offloads what the plan says fits
    (nothing on a CPU-only build); ``vision_gpu=None`` follows the plan when one was
    made for GPU offload, else keeps the vision encoder on the CPU.
    ``n_threads`` defaults to the machine's performance (or physical) cores.
    ``flash_attn=None`` lets llama.cpp decide for the vision encoder and turns it on
    for the text model only when a quantized KV cache needs it. ``chat_template``
    overrides the prompt format: a family name (``"chatml"``, ``"llama3"``,
    ``"qwen3"``) or Jinja source; by default the GGUF's own template is used, else
    the catalog family's. ``embed_cache`` shares an :class:`EmbeddingCache` (e.g.
    one with a disk tier) between models.
    """
    _check_options(n_ctx, kv_cache_type, flash_attn, n_gpu_layers, bool(vision_gpu))
    entry = None
    repo = None
    planned = None
    if model_path is not None or mmproj_path is not None:
        if model_path is None or mmproj_path is None:
            raise ConfigError("Pass both model_path and mmproj_path (the vision projector).")
        entry = _catalog_entry(model) if model is not None else None
        name = entry.display_name if entry is not None else (model or Path(model_path).stem)
    else:
        if not model:
            raise ConfigError("Name a model (e.g. load('minicpm-v-2.6')) or pass model_path and mmproj_path.")
        from .hub import pull

        if model == "auto":
            from .planner import plan

            planned = plan("auto", ram_budget=ram_budget, n_ctx=n_ctx, quant=quant,
                           kv_cache_type=kv_cache_type)
            model, quant = planned.model, planned.quant
        files = pull(model, quant=quant, ram_budget=ram_budget, n_ctx=n_ctx, revision=revision)
        model_path, mmproj_path, quant, repo = files.model, files.mmproj, files.quant, files.repo
        entry, planned = files.entry, files.plan or planned
        name = entry.display_name if entry is not None else files.repo
    text = read_text_header(model_path)
    projector = read_projector_header(mmproj_path)
    check_pair(text, projector, minicpmv_version=getattr(entry, "minicpmv_version", None))

    n_threads = n_threads or _default_threads()
    if n_gpu_layers == "auto" and planned is None:
        from .planner import plan_local

        planned = plan_local(model_path, mmproj_path, ram_budget=ram_budget, n_ctx=n_ctx,
                             kv_cache_type=kv_cache_type)
    n_gpu = planned.n_gpu_layers if n_gpu_layers == "auto" else _gpu_layers(n_gpu_layers)
    if vision_gpu is None:
        vision_gpu = bool(planned and n_gpu_layers == "auto" and planned.vision_on_gpu)
    llama = _open_llama(model_path, n_ctx, n_threads, n_threads_batch or n_threads, n_gpu,
                        flash_attn, kv_cache_type, verbose)
    try:
        engine = Engine(llama, mmproj_path, vision_on_gpu=vision_gpu, vision_flash_attn=flash_attn,
                        embed_cache=embed_cache, slice_size=projector.image_size or 448)
    except BaseException:
        llama.close()
        raise
    tokens = dict(bos_token=_token_text(llama, llama.token_bos()),
                  eos_token=_token_text(llama, llama.token_eos()))
    if chat_template in FAMILIES:
        template = choose_template(None, chat_template, **tokens)
    elif chat_template:
        template = ChatTemplate(chat_template, "custom", **tokens)
    else:
        template = choose_template(text.chat_template, getattr(entry, "template", None), **tokens)
    info = ModelInfo(
        name=name,
        model_path=os.fspath(model_path),
        mmproj_path=os.fspath(mmproj_path),
        quant=quant,
        repo=repo,
        template_origin=template.origin,
        can_think=bool(entry.thinking) if entry is not None else template.supports_thinking,
        thinking_default=bool(getattr(entry, "thinking_default", False)),
        n_ctx=n_ctx,
        slice_size=projector.image_size or 448,
        vision_gpu=vision_gpu,
    )
    if verbose:
        native.verbose_acquire()
    return Model(engine, info=info, template=template, sampling=_sampling(entry),
                 allow_remote_media=allow_remote_media, verbose=verbose)


def _check_options(n_ctx: int, kv_cache_type: str, flash_attn: bool | None,
                   n_gpu_layers: int | str, vision_gpu: bool) -> None:
    if n_ctx < 256:
        raise ConfigError(f"n_ctx={n_ctx} is too small: one image alone takes 64 to 660 positions.")
    if kv_cache_type not in KV_CACHE_TYPES:
        raise ConfigError(f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, not {kv_cache_type!r}.")
    if kv_cache_type != "f16" and flash_attn is False:
        raise ConfigError(
            f"A {kv_cache_type} KV cache needs flash attention in llama.cpp: "
            "drop flash_attn=False or use kv_cache_type='f16'."
        )
    # "auto" is allowed anywhere: the plan offloads nothing where nothing can be offloaded
    wants_gpu = vision_gpu or (isinstance(n_gpu_layers, int) and n_gpu_layers != 0)
    if wants_gpu and not _gpu_offload_supported():
        raise ConfigError(
            "GPU offload was asked for, but this llama-cpp-python build is CPU-only. Rebuild it "
            "with CMAKE_ARGS='-DGGML_CUDA=on' (NVIDIA/Jetson) or '-DGGML_METAL=on' (Apple), or "
            "use n_gpu_layers=0 and vision_gpu=False."
        )


def _gpu_offload_supported() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def _gpu_layers(n_gpu_layers: int | str) -> int:
    if not isinstance(n_gpu_layers, int) or n_gpu_layers < -1:
        raise ConfigError("n_gpu_layers must be an int >= -1 (-1 = all layers) or 'auto'.")
    return n_gpu_layers


def _default_threads() -> int:
    from .hardware import probe

    return probe().recommended_threads


def _open_llama(model_path, n_ctx, n_threads, n_threads_batch, n_gpu_layers, flash_attn,
                kv_cache_type, verbose):
    import llama_cpp

    native.install_logging()
    native.clear_recent()
    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
               "q4_0": llama_cpp.GGML_TYPE_Q4_0}[kv_cache_type]
    try:
        return llama_cpp.Llama(
            model_path=os.fspath(model_path), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
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


def _catalog_entry(name: str):
    from .catalog import load_catalog

    try:
        return load_catalog().get(name)
    except ModelNotFoundError:
        return None


def _sampling(entry) -> Sampling:
    s = getattr(entry, "sampling", None)
    if s is None:
        return Sampling()
    return Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                    repeat_penalty=s.repeat_penalty)
