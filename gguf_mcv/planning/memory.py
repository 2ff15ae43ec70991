"""Predict the peak memory of a loaded MiniCPM-V model answering one image question.

:func:`estimate` works from what is known before anything is downloaded: the text
GGUF's size, the text model's shape, the mmproj's size, the vision tower's shape,
``n_ctx``, the KV cache type and where layers run. It predicts the process's peak
resident set (what ``getrusage().ru_maxrss`` reports) term by term; each term's
comment says where in llama.cpp (llama-cpp-python 0.3.36) it comes from, and the
constants were measured with ``tools/bench_memory.py`` (x86_64, Python 3.11, CPU build).

Two quantities matter and they differ:

* ``total`` -- the peak RSS on a machine with memory to spare. llama.cpp maps the
  text GGUF with ``MAP_POPULATE`` (llama-mmap.cpp), so the *whole file* is resident
  after loading, including tensors it then copies elsewhere (repacked for the CPU,
  offloaded to a GPU) and never reads again.
* ``needed`` -- what the process cannot do without: ``total`` minus those clean,
  never-read-again file pages (the kernel drops them under pressure, cgroup limits
  included), plus what a long text prompt can add to the compute buffer. The
  planner fits ``needed`` to the budget. Checked under cgroup v1 memory limits with
  the benchmark's Q4_0 (peak RSS 1.6 GiB, ``needed`` less the long-prompt term
  1.43 GiB): it ran at 1.43 GiB and at 1.23 GiB without slowing down (file pages are
  re-read on demand) and was OOM-killed at 1.10 GiB, just under its anonymous memory.

``needed`` is deliberately conservative about file pages: token_embd rows a prompt
never uses and the libraries' code stay counted.

The vision encoder's terms depend on who runs it (``vision_backend``): libmtmd holds the
mmproj's tensors and one slice's compute buffer; ONNX Runtime (``onnx-int8``/``onnx-fp32``,
:mod:`gguf_mcv.vision.onnx_vision`) holds the converted graph's weights (:func:`onnx_weight_bytes`),
its arena for one slice (:func:`onnx_arena_bytes`) and its own library, while libmtmd then
loads only a stand-in mmproj of a few KB.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

from ..errors import ConfigError
from ..models.quants import normalize_quant
from ..models.shapes import TextShape, VisionShape
from ..options import VISION_BACKENDS as ASKABLE_BACKENDS
from ..options import check_vision_backend
from .calibration import (  # noqa: F401  (the memory model's constants, re-exported by name)
    _EMBD_TYPE,
    CUDA_CONTEXT_VRAM,
    CUDA_HOST_OVERHEAD,
    DEFAULT_IMAGE_PIXELS,
    DEFAULT_IMAGE_TOKENS,
    GGML_TYPE_BITS,
    GRAPH_NODE_BYTES,
    HYBRID_TENSORS_PER_LAYER,
    IMAGE_COPIES,
    IMAGE_MARKER_TOKENS,
    KV_BYTES_PER_ELEMENT,
    MERGE_BYTES,
    METAL_OVERHEAD,
    ONNX_POS_ROWS,
    ORT_RUNTIME,
    ORT_SCORE_COPIES,
    PROMPT_TEXT_TOKENS,
    QUANT_TYPE_MIX,
    RECURRENT_CHECKPOINTS,
    REPACKED_TYPES,
    RESAMPLER_TENSORS,
    RUNTIME_BASE,
    TEXT_EMBD_TENSORS,
    TEXT_FF_TENSORS,
    VIT_WIDTH_TENSORS,
    VOCAB_BYTES_PER_TOKEN,
)

#: Who may run the vision encoder, as :func:`estimate` takes it ("auto" resolved first).
VISION_BACKENDS = tuple(b for b in ASKABLE_BACKENDS if b != "auto")

# --- the estimate -----------------------------------------------------------------------


@dataclass(frozen=True)
class GpuMemory:
    """Device memory (VRAM, or the shared pool on unified memory) in bytes."""

    weights: int
    kv_cache: int
    compute: int
    vision_weights: int
    vision_compute: int
    overhead: int

    @property
    def total(self) -> int:
        return (self.weights + self.kv_cache + self.compute + self.vision_weights
                + self.vision_compute + self.overhead)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted host memory in bytes, term by term; see the module docstring."""

    weights: int  #: text GGUF pages mapped in RAM (file-backed)
    repacked: int  #: anonymous copies the CPU backend makes of some weight types
    kv_cache: int
    compute: int  #: text compute buffer pages one image question touches
    vision_weights: int
    vision_compute: int  #: one slice's encoder graph plus the matmul work buffer
    images: int  #: decoded image and its f32 slices while the prompt is tokenized
    vocab: int  #: llama.cpp's tokenizer tables
    overhead: int  #: Python, libraries, contexts (RUNTIME_BASE, hybrid graph metadata, + GPU runtime, + ONNX Runtime)
    reclaimable: int  #: file pages in ``weights`` never read after loading
    long_prompt: int  #: extra compute pages a full 512-token batch at full context touches
    gpu: GpuMemory | None = None
    #: hybrid models: the recurrent layers' state and the engine's checkpoints of it
    recurrent: int = 0
    #: the GPU shares RAM (Jetson, Apple): ``gpu.total`` is counted in ``needed`` too
    unified: bool = False
    #: who runs the vision encoder: ``vision_weights``/``vision_compute`` are libmtmd's for
    #: "llama.cpp", ONNX Runtime's weights and arena for "onnx-int8"/"onnx-fp32"
    vision_backend: str = "llama.cpp"
    #: ONNX weights read from their memory-mapped file instead of packed into anonymous memory
    #: (``vision_mapped``): the encoder's and the text model's weights are then file pages that are
    #: never read at the same time, so this much of them (the smaller set) is never needed at once
    swapped: int = 0

    @property
    def runtime(self) -> int:
        """Peak RSS while answering: every resident term together."""
        return (self.weights + self.repacked + self.kv_cache + self.compute + self.vision_weights
                + self.vision_compute + self.images + self.vocab + self.overhead + self.recurrent)

    @property
    def total(self) -> int:
        """Predicted peak RSS (``ru_maxrss``) of load + one image question."""
        return self.runtime

    @property
    def needed(self) -> int:
        """RAM the process needs: ``total`` less reclaimable pages, plus a long prompt's
        compute, less what mapped vision weights and the text weights never need at once
        (``swapped``), plus the GPU's allocations when they come out of the same RAM."""
        ram = self.runtime - self.reclaimable + self.long_prompt - self.swapped
        if self.unified and self.gpu is not None:
            ram += self.gpu.total
        return ram

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(total=self.total, needed=self.needed, runtime=self.runtime)
        if self.gpu is not None:
            d["gpu"]["total"] = self.gpu.total
        return d


def kv_cache_bytes(text: TextShape, n_ctx: int, kv_cache_type: str = "f16",
                   layers: int | None = None) -> int:
    """K and V for ``layers`` (default: every KV layer) at ``n_ctx`` cells.

    llama-kv-cache.cpp: per layer a K and a V tensor of n_head_kv*head_dim x kv_size,
    kv_size = n_ctx rounded up to 256 (llama-context.cpp), zeroed at creation
    (``ggml_backend_buffer_clear``) so every page is resident from the start.
    """
    if kv_cache_type not in KV_BYTES_PER_ELEMENT:
        raise ConfigError(f"kv_cache_type must be one of {', '.join(KV_BYTES_PER_ELEMENT)}, "
                          f"not {kv_cache_type!r}.")
    t = text
    layers = t.kv_layers if layers is None else layers
    cells = _pad(n_ctx, 256)
    return int(2 * layers * t.n_head_kv * t.head_dim * cells * KV_BYTES_PER_ELEMENT[kv_cache_type])


def recurrent_bytes(text: TextShape, *, on_cpu: float = 1.0) -> int:
    """A hybrid model's recurrent state: llama.cpp's RS buffer (one sequence, f32; the
    ``on_cpu`` share of it stays in RAM) plus the engine's checkpoints, each a copy of
    that state kept in host memory (at most :data:`RECURRENT_CHECKPOINTS`)."""
    state = text.recurrent_values * 4
    return int(state * on_cpu + state * RECURRENT_CHECKPOINTS)


def graph_meta_bytes(text: TextShape, n_ubatch: int = 512) -> int:
    """What a hybrid model's larger graph reservation adds over a regular model's (0 for
    attention-only models, whose graph metadata is part of :data:`RUNTIME_BASE`)."""
    if not text.recurrent_values:
        return 0
    n_tensors = text.n_layers * HYBRID_TENSORS_PER_LAYER + 3
    hybrid = max(n_ubatch * 40, 32 * n_tensors)
    regular = max(1024, 8 * n_tensors)
    return max(0, hybrid - regular) * GRAPH_NODE_BYTES


def text_compute_bytes(text: TextShape, n_tokens: int, n_kv: int, *, flash_attn: bool,
                       n_outputs: int = 1) -> int:
    """Peak of llama.cpp's text graph for one ubatch of ``n_tokens`` against ``n_kv`` cells.

    ggml's allocator reuses memory between ops, so the buffer is the largest of three
    phases: attention (the scores n_head x T x K f32 plus the T x K f32 mask without
    flash attention, an f16 mask with it, beside ~6 T x n_embd tensors), the FFN
    (gate, up and their product, T x n_ff each) and the output (n_outputs x n_vocab
    f32 logits).
    """
    t = text
    embd = n_tokens * t.n_embd * 4
    if flash_attn:
        scores = n_tokens * n_kv * 2
    else:
        scores = (t.n_head + 1) * n_tokens * n_kv * 4
    attention = TEXT_EMBD_TENSORS * embd + scores
    ffn = 2 * embd + TEXT_FF_TENSORS * n_tokens * t.ff * 4
    output = n_outputs * t.n_vocab * 4 + 2 * embd
    return max(attention, ffn, output)


def vision_compute_bytes(vision: VisionShape | None, text_width: int, *,
                         flash_attn: bool = True, mmproj_bytes_per_weight: float = 2.0) -> int:
    """clip.cpp's compute buffer for one slice plus the CPU matmul work buffer.

    The buffer (``reserve_compute_meta``) is the larger of a ViT block (FFN hidden
    state + residual-width tensors, plus the 16 x 1024 x 1024 attention scores without
    flash attention) and the resampler (tensors of patches x text width). The CPU
    backend also converts each matmul's activations to the weights' type in a work
    buffer: patches x ff at f16 for an f16 mmproj. MiniCPM-V 4.6's merger adds its mask.
    """
    v = vision or VisionShape()
    p = v.patches
    vit = p * 4 * (v.ff + VIT_WIDTH_TENSORS * v.width)
    if not flash_attn:
        vit += v.heads * p * p * 4
    resampler = p * 4 * RESAMPLER_TENSORS * text_width
    work = p * v.ff * mmproj_bytes_per_weight
    # MiniCPM-V 4.6's window-attention merger takes a patches x patches f32 block-diagonal
    # mask as a graph input (minicpmv.cpp, vit_merger_window_mask): beside the rest
    window_mask = p * p * 4 if v.projector == "minicpmv4_6" else 0
    return int(max(vit, resampler) + work + window_mask)


def onnx_matmul_params(vision: VisionShape) -> int:
    """Weights of the SigLIP blocks' MatMuls (Q, K, V, output, FFN up and down): the part
    the int8 graph quantizes."""
    v = vision
    return v.blocks * (4 * v.width * v.width + 2 * v.width * v.ff)


def onnx_weight_bytes(vision: VisionShape | None, text_width: int, mmproj_size: int,
                      variant: str = "int8") -> int:
    """Bytes of the ONNX graph's weights (``onnx_graph``) that ONNX Runtime holds in memory.

    The tower: patch embedding, the 4900-row position table and the post-norm in fp32, the
    blocks' MatMuls int8 with one f32 scale per column in the ``int8`` variant (fp32 in
    ``fp32``), biases and LayerNorms f32. The projector: the resampler from its shape, fp32 in both
    variants (the 2-D sin/cos keys are an input, not a weight); another projector (MiniCPM-V 4.6's merger) from what
    the F16 mmproj holds beyond the tower: half of it in ``int8`` (int8 matrices, and f32 norms
    and biases the mmproj holds in f32), twice in ``fp32``. Checked against every conversion
    of the test presets.
    Never more than twice ``mmproj_size`` (the whole F16 file in fp32), which bounds a tower
    nobody described (``VisionShape()``'s SigLIP-400M defaults) by the file actually planned.
    """
    if variant not in ("int8", "fp32"):
        raise ConfigError(f"ONNX variant must be 'int8' or 'fp32', not {variant!r}.")
    v = vision or VisionShape()
    w, ff, patch = v.width, v.ff, 3 * v.patch_size**2
    matmuls = onnx_matmul_params(v)
    small = v.blocks * (9 * w + ff) * 4  # q/k/v/out/ffn biases and two LayerNorms per block
    embed = (w * patch + w + ONNX_POS_ROWS * w + 2 * w) * 4  # patch conv + bias, positions, post_ln
    if variant == "int8":
        blocks = matmuls + v.blocks * (5 * w + ff) * 4 + small  # int8 + per-column scales
    else:
        blocks = matmuls * 4 + small
    if v.projector == "resampler":  # fp32 in both variants (onnx_vision.int8_scope)
        d, q = text_width, v.query_tokens
        projector = (d * w + 5 * d * d + q * d + 10 * d) * 4  # kv, q/k/v/out + proj, queries, biases, LNs
    else:
        tower_f16 = matmuls * 2 + small + (w * patch + ONNX_POS_ROWS * w) * 2 + 3 * w * 4
        projector = max(0, mmproj_size - tower_f16) * (1 if variant == "int8" else 4) // 2
    return int(min(embed + blocks + projector, 2 * mmproj_size))


def onnx_arena_bytes(vision: VisionShape | None) -> int:
    """ONNX Runtime's arena for one slice: :data:`ORT_SCORE_COPIES` f32 attention score
    tensors (heads x patches^2); MiniCPM-V 4.6's window mask (patches^2 f32) is an input."""
    v = vision or VisionShape()
    p = v.patches
    window_mask = p * p * 4 if v.projector == "minicpmv4_6" else 0
    return int(ORT_SCORE_COPIES * v.heads * p * p * 4 + window_mask)


def image_bytes(image_pixels: int, image_tokens: int, vision: VisionShape | None = None) -> int:
    """The decoded image (IMAGE_COPIES x W*H*3 of what is decoded, see :func:`decoded_size`;
    when it is resized for its slices, two copies of the resized one: gguf_mcv's and libmtmd's
    bitmap) and libmtmd's f32 slices held by the prompt."""
    v = vision or VisionShape()
    slices = max(1, -(-image_tokens // v.query_tokens))
    decoded, resized = decoded_size(image_pixels, image_tokens, v)
    held = IMAGE_COPIES * image_pixels * 3  # decoded at full size
    if resized != decoded:
        held = IMAGE_COPIES * decoded[0] * decoded[1] * 3 + 2 * resized[0] * resized[1] * 3
    return int(held + slices * v.image_size**2 * 3 * 4)


def decoded_size(image_pixels: int, image_tokens: int,
                 vision: VisionShape | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
    """(decoded, resized) size of a 4:3 JPEG photo of ``image_pixels`` asked about for
    ``image_tokens`` (an overview and slices of ``query_tokens`` each): when its slices need it
    smaller, ``gguf_mcv.vision.media`` decodes it at 1/2, 1/4 or 1/8 scale (JPEG draft mode), no
    smaller than the resize; else at full size (then libmtmd resizes it: resized == decoded)."""
    from ..vision.media import draft_scale  # lazy: Pillow
    from ..vision.slicing import MAX_SLICES, count_slices, fit_slices

    v = vision or VisionShape()
    width = max(1, round((image_pixels * 4 / 3) ** 0.5))
    full = (width, max(1, image_pixels // width))
    max_slices = min(MAX_SLICES, max(0, image_tokens // max(1, v.query_tokens) - 1))
    if count_slices(*full, v.image_size or 448) <= max_slices:
        return full, full
    resized = fit_slices(*full, max_slices, v.image_size or 448)
    scale = draft_scale(full, resized)
    return (-(-full[0] // scale), -(-full[1] // scale)), resized


def vocab_bytes(text: TextShape) -> int:
    """llama.cpp's tokenizer tables and per-token buffers."""
    t = text
    merges = t.n_merges if t.n_merges is not None else t.n_vocab
    return t.n_vocab * VOCAB_BYTES_PER_TOKEN + merges * MERGE_BYTES


# --- weights ----------------------------------------------------------------------------


def embedding_bytes(text: TextShape, quant: str | None) -> tuple[int, int]:
    """(token_embd, output) bytes in a file of ``quant`` (output 0 when tied)."""
    t = text
    q = _quant(quant)
    embd_type = _EMBD_TYPE.get(q, q if q in GGML_TYPE_BITS else "Q8_0")
    if t.tied_embeddings:  # llama-quant.cpp quantizes a tied token_embd as the output matrix
        embd_type = output_type(q)
    n = t.n_vocab * t.n_embd
    token_embd = int(n * GGML_TYPE_BITS[embd_type] / 8)
    output = 0 if t.tied_embeddings else int(n * GGML_TYPE_BITS[output_type(q)] / 8)
    return token_embd, output


def output_type(quant: str) -> str:
    """The output matrix's type: Q6_K below Q8_0 (llama-quant.cpp), else the quant's own."""
    return quant if quant in ("Q8_0", "F16", "BF16", "F32") else "Q6_K"


def layer_bytes(model_size: int, text: TextShape, quant: str | None) -> int:
    """One repeating layer's weights: (file - token_embd - output) / n_layers."""
    t = text
    token_embd, output = embedding_bytes(t, quant)
    return max(0, model_size - token_embd - output) // max(1, t.n_layers)


def repacked_bytes(model_size: int, text: TextShape, quant: str | None, cpu: str = "none",
                   tensors: Iterable[tuple[str, str, int]] | None = None) -> int:
    """Bytes the CPU backend copies into repacked form at load.

    Exact from ``tensors`` -- (name, ggml type name, bytes) for every tensor in the file,
    as a GGUF header lists them -- else from :data:`QUANT_TYPE_MIX` for ``quant``.
    """
    types = REPACKED_TYPES[cpu]
    if tensors is not None:
        return sum(n for name, typ, n in tensors
                   if typ.upper() in types and name != "token_embd.weight" and not name.endswith(".bias"))
    t, q = text, _quant(quant)
    token_embd, output = embedding_bytes(t, q)
    mix = QUANT_TYPE_MIX.get(q, {q: 1.0})
    share = sum(part for typ, part in mix.items() if typ in types)
    layers = share * max(0, model_size - token_embd - output)
    return int(layers) + (output if output_type(q) in types else 0)


# --- putting it together ----------------------------------------------------------------


def estimate(
    *,
    model_size: int,
    text: TextShape,
    mmproj_size: int,
    vision: VisionShape | None = None,
    quant: str | None = None,
    n_ctx: int = 4096,
    kv_cache_type: str = "f16",
    n_ubatch: int = 512,
    image_tokens: int | None = None,
    image_pixels: int = DEFAULT_IMAGE_PIXELS,
    n_gpu_layers: int = 0,
    vision_on_gpu: bool = False,
    gpu_backend: str | None = None,
    unified_memory: bool = False,
    flash_attn: bool | None = None,
    cpu: str = "none",
    tensors: Iterable[tuple[str, str, int]] | None = None,
    vision_backend: str = "llama.cpp",
    image_slices: int | None = None,
    vision_mapped: bool = False,
) -> MemoryEstimate:
    """Predict the memory of ``gguf_mcv.load(...)`` followed by one image question.

    ``model_size``/``mmproj_size`` are the GGUF file sizes in bytes; ``text`` a
    :class:`TextShape` (or catalog ``Arch`` / ``TextHeader``); ``vision`` a
    :class:`VisionShape` (default SigLIP-400M). ``n_gpu_layers`` counts like llama.cpp:
    the output matrix first, then repeating layers from the last; -1 = everything.
    ``gpu_backend`` is ``"cuda"`` or ``"metal"`` when anything is offloaded;
    ``unified_memory`` says the GPU allocates from the same RAM. ``cpu`` is a key of
    :data:`REPACKED_TYPES` (default ``"none"``: no repacked copy; the machine's family is a fact
    the caller passes, e.g. :func:`gguf_mcv.native_verdict.loads_repack_family`); ``tensors`` the file's tensor list
    (name, type, bytes) when its header is at hand, for exact repacking. ``vision_backend``
    is who runs the encoder ("llama.cpp", "onnx-int8" or "onnx-fp32"; resolve "auto" first,
    with :func:`gguf_mcv.vision.vision_backends.choose_backend`). ``image_slices``: the most slices
    the question's photo is cut into (its detail's budget, :func:`gguf_mcv.planning.speed.slice_budget`),
    which decides how large it is decoded (``images``); None: as many as ``image_tokens`` holds.
    ``vision_mapped``: an ONNX encoder whose weights stay in their mapped file (not packed): the
    encoder's file pages and the text model's are needed in turn, never together (the engine
    encodes a prompt's images before it evaluates any of them), so ``needed`` counts only the
    larger of the two sets (``swapped``); ``total`` is unchanged (with RAM to spare both stay).
    """
    t, v = text, vision or VisionShape()
    check_vision_backend(vision_backend, resolved=True)
    onnx = vision_backend != "llama.cpp"
    if vision_mapped and not onnx:
        raise ConfigError("vision_mapped needs an ONNX vision backend: libmtmd reads the mmproj into its own buffers.")
    if onnx and vision_on_gpu:
        raise ConfigError(f"vision_backend={vision_backend!r} runs the encoder on the CPU; "
                          "it cannot be combined with vision_on_gpu.")
    image_tokens = DEFAULT_IMAGE_TOKENS if image_tokens is None else image_tokens
    if (n_gpu_layers or vision_on_gpu) and gpu_backend is None:
        raise ConfigError("n_gpu_layers and vision_on_gpu need gpu_backend ('cuda' or 'metal').")
    # llama.cpp offloads the output matrix first, then repeating layers from the last
    n_gpu = t.n_layers + 1 if n_gpu_layers < 0 else min(n_gpu_layers, t.n_layers + 1)
    gpu_layers = max(0, n_gpu - 1)
    gpu_kv_layers = round(t.kv_layers * gpu_layers / max(1, t.n_layers))
    # llama.cpp's flash attention for the text model: gguf_mcv's loader turns it on only
    # for a quantized KV cache (which needs it); libmtmd's "auto" turns it on for clip.
    fa_text = flash_attn if flash_attn is not None else kv_cache_type != "f16"
    fa_vision = flash_attn if flash_attn is not None else True
    gpu = None
    if (n_gpu or vision_on_gpu) and gpu_backend is not None:
        gpu = _gpu_memory(model_size, t, v, quant, n_gpu, gpu_kv_layers, mmproj_size if vision_on_gpu else 0,
                          n_ctx, kv_cache_type, n_ubatch, fa_text, fa_vision, gpu_backend)
    # Offloaded weights were faulted in by MAP_POPULATE, copied to the device and never
    # read again: reclaimable. Metal wraps the mapping itself: nothing copied.
    offloaded = gpu.weights if gpu is not None and gpu_backend == "cuda" else 0
    # Only layers left on the CPU are repacked (the extra buffer types are CPU ones).
    repacked = int(repacked_bytes(model_size, t, quant, cpu, tensors) * (1 - gpu_layers / max(1, t.n_layers)))
    # One image question runs ubatches of at most one slice (64 embeddings) or a short
    # text run, against the cells filled so far (KV view padded to 256), 1 output row.
    prompt = image_tokens + IMAGE_MARKER_TOKENS + PROMPT_TEXT_TOKENS
    compute = text_compute_bytes(t, v.query_tokens, min(_pad(prompt, 256), _pad(n_ctx, 256)),
                                 flash_attn=fa_text)
    # A long text prompt: a full ubatch against a full cache (still 1 output row: the
    # engine asks logits for the last token only; the 512-row reserve stays untouched).
    worst = text_compute_bytes(t, n_ubatch, _pad(n_ctx, 256), flash_attn=fa_text)
    vision_weights = _vision_weights(v, t.n_embd, mmproj_size, vision_backend, vision_on_gpu)
    reclaimable = repacked + offloaded
    return MemoryEstimate(
        # MAP_POPULATE faults the whole file in at load (llama-mmap.cpp), token_embd rows
        # never used included; llama.cpp then unmaps only the header and the ranges
        # before/after the first/last tensor kept on the CPU (llama-model-loader.cpp).
        weights=model_size,
        repacked=repacked,
        kv_cache=kv_cache_bytes(t, n_ctx, kv_cache_type, t.kv_layers - gpu_kv_layers),
        compute=compute,
        vision_weights=vision_weights,
        vision_compute=(onnx_arena_bytes(v) if onnx else 0 if vision_on_gpu
                        else vision_compute_bytes(v, t.n_embd, flash_attn=fa_vision)),
        images=image_bytes(image_pixels, _decoded_tokens(image_tokens, image_slices, v), v),
        vocab=vocab_bytes(t),
        overhead=(RUNTIME_BASE + graph_meta_bytes(t, n_ubatch) + (ORT_RUNTIME if onnx else 0)
                  + (CUDA_HOST_OVERHEAD if gpu_backend == "cuda" else 0)),
        reclaimable=reclaimable,
        long_prompt=max(0, worst - compute),
        gpu=gpu,
        recurrent=recurrent_bytes(t, on_cpu=1 - gpu_layers / max(1, t.n_layers)),
        unified=unified_memory,
        vision_backend=vision_backend,
        # the text pages read while answering (not the repacked/offloaded originals) against the
        # encoder's: whichever is smaller can be dropped while the other set is read
        swapped=min(max(0, model_size - reclaimable), vision_weights) if vision_mapped else 0,
    )


def _decoded_tokens(image_tokens: int, image_slices: int | None, v: VisionShape) -> int:
    """The image tokens of the photo the ``images`` term decodes: ``image_tokens``, no more than
    an overview and ``image_slices`` slices."""
    if image_slices is None:
        return image_tokens
    return min(image_tokens, (max(0, image_slices) + 1) * v.query_tokens)


def _vision_weights(v: VisionShape, text_width: int, mmproj_size: int, backend: str, on_gpu: bool) -> int:
    """The encoder's weights in RAM: clip.cpp reads every mmproj tensor into its own buffer
    (no mmap: ~ the file's size); with ONNX Runtime, the converted graph's weights (libmtmd
    then holds a stand-in of a few KB)."""
    if backend != "llama.cpp":
        return onnx_weight_bytes(v, text_width, mmproj_size, backend.removeprefix("onnx-"))
    return 0 if on_gpu else mmproj_size


def _gpu_memory(model_size: int, t: TextShape, v: VisionShape, quant: str | None, n_gpu: int,
                kv_layers: int, mmproj_size: int, n_ctx: int, kv_cache_type: str, n_ubatch: int,
                fa_text: bool, fa_vision: bool, backend: str) -> GpuMemory:
    """Device memory for ``n_gpu`` offloaded layers (output first) and an optional tower."""
    _, output = embedding_bytes(t, quant)
    weights = (output + (n_gpu - 1) * layer_bytes(model_size, t, quant)) if n_gpu else 0
    return GpuMemory(
        # Metal wraps the mmap'd file (shared memory): the weights are already in RAM
        weights=weights if backend == "cuda" else 0,
        kv_cache=kv_cache_bytes(t, n_ctx, kv_cache_type, kv_layers),
        # device buffers are allocated whole (cudaMalloc): the full 512-row reserve
        compute=reserved_compute_bytes(t, n_ctx, n_ubatch, fa_text) if n_gpu else 0,
        vision_weights=mmproj_size,
        vision_compute=vision_compute_bytes(v, t.n_embd, flash_attn=fa_vision) if mmproj_size else 0,
        overhead=CUDA_CONTEXT_VRAM if backend == "cuda" else METAL_OVERHEAD,
    )


def reserved_compute_bytes(text: TextShape, n_ctx: int, n_ubatch: int = 512,
                           flash_attn: bool = False) -> int:
    """The text compute buffer llama.cpp allocates (``sched_reserve``): a full ubatch of
    ``n_ubatch`` tokens with ``n_ubatch`` output rows against the whole cache."""
    t = text
    return text_compute_bytes(t, n_ubatch, _pad(n_ctx, 256), flash_attn=flash_attn,
                              n_outputs=n_ubatch)


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _quant(quant: str | None) -> str:
    if quant is None:
        return "Q8_0"
    try:
        return normalize_quant(quant)
    except ConfigError:
        return str(quant).upper()


#: ``parallel="auto"`` stops here: on a CPU one batch of 8 tokens already costs about as much
#: as evaluating them one by one would gain (measured: 8 tokens ≈ 2.2× one token on 2 cores).
AUTO_MAX_PARALLEL = 8


def slot_bytes(text: TextShape, n_ctx: int, kv_cache_type: str = "f16", *, vision: VisionShape | None = None,
               vision_backend: str = "llama.cpp") -> int:
    """What one more parallel slot costs: its KV cells (``n_ctx`` of them, in llama.cpp's
    unified cache), its row of the decode batch (one more logits row and activations), on
    a hybrid model its recurrent state with the slot's checkpoints of it, and -- with
    ``vision`` -- the image a slot's prompt holds while it waits for the encoder: libmtmd's
    f32 slices of a full-detail image (and the ONNX backend's own copy of them; measured
    with 16 clients: ~25 MiB per waiting slot on SigLIP's 448-pixel slices)."""
    row = text.n_vocab * 4 + TEXT_EMBD_TENSORS * text.n_embd * 4
    waiting = 0
    if vision is not None:
        waiting = pending_slices_bytes(vision) * (2 if vision_backend.startswith("onnx") else 1)
    return kv_cache_bytes(text, n_ctx, kv_cache_type) + row + recurrent_bytes(text) + waiting


def pending_slices_bytes(vision: VisionShape) -> int:
    """The f32 pixels of a full-detail image's slices (the overview and 9 more)."""
    return 10 * vision.image_size**2 * 3 * 4


def parallel_for_budget(needed_one: int, per_slot: int, budget: int,
                        limit: int = AUTO_MAX_PARALLEL) -> int:
    """How many slots fit: one always (``needed_one`` is checked by the quant plan), then as
    many more ``per_slot`` as the rest of ``budget`` holds, at most ``limit``."""
    spare = max(0, budget - needed_one)
    return max(1, min(limit, 1 + spare // max(1, per_slot)))
