"""Calibrated constants of the memory model: each measured with ``tools/bench_memory.py`` (or taken
from llama.cpp's sources, named beside it); :mod:`gguf_mcv.planning.memory` adds them up."""

from __future__ import annotations

_MiB = 2**20

# --- calibrated constants (tools/bench_memory.py) --------------------------------------

#: Process after ``import gguf_mcv`` plus llama.cpp's libraries, a llama context and a
#: libmtmd context with every size-dependent term below removed: Python, numpy, PIL,
#: gguf, libllama/libggml/libmtmd code pages, OpenMP threads, small C++ structures.
#: OpenCV is not in it: it is imported only when a video is read (measured 13.4 MiB
#: lower once it no longer came with ``import gguf_mcv``). pydantic is in it since the catalog is
#: validated with it (``import gguf_mcv``: 46.8 -> 54.7 MiB, measured 2026-12-02). Recalibrate when
#: imports change.
RUNTIME_BASE = 85 * _MiB
#: llama.cpp's vocabulary per token (llama-vocab.cpp: ``id_to_token`` entries with their
#: text, ``token_to_id`` hash map, token-to-piece cache), plus the context's logits
#: output buffer (n_vocab floats, llama-context.cpp ``output_reserve``) and
#: llama-cpp-python's candidate array (12 bytes per token); less the ~20 bytes per token
#: of the file's header, which llama.cpp unmaps after loading. Measured: 151424 more
#: tokens cost 28.0 MiB of anonymous memory and 3.2 MiB less of the mapped file.
VOCAB_BYTES_PER_TOKEN = 175
#: One BPE merge in llama.cpp's ``bpe_ranks`` map (pair of strings -> rank), less its
#: unmapped header bytes. Measured: 151387 merges cost 15.8 MiB.
MERGE_BYTES = 92
#: Decoded input image: gguf_mcv keeps its RGB array, PIL's decode buffer and libmtmd's
#: bitmap copy live during tokenizing; measured ~3.2 copies of W*H*3 bytes.
IMAGE_COPIES = 3.2
#: Where the vision encoder's compute graph peaks, in f32 activations of one slice
#: (clip.cpp, graph for 1024 patches): in a ViT block the FFN hidden state
#: (patches x ff) plus ~3.5 residual-width tensors; in the resampler ~3.75 tensors of
#: patches x text width. Fitted to clip's "compute buffer size" log across widths.
VIT_WIDTH_TENSORS = 3.5
RESAMPLER_TENSORS = 3.75
#: Text compute graph (llama-graph.cpp, one ubatch of T tokens against K cached cells):
#: in the attention phase ~6 tensors of T x n_embd (residual, norm, Q/K/V, output) live
#: beside the scores; the FFN phase holds 3 tensors of T x n_ff (gate, up, product).
#: Checked against llama.cpp's "compute buffer size" log for T=512 (within 2 %).
TEXT_EMBD_TENSORS = 6
TEXT_FF_TENSORS = 3
#: Copies of a hybrid model's recurrent state the engine keeps to rewind to
#: (``runtime.sequence.MAX_CHECKPOINTS``; the two are checked to agree by the tests).
RECURRENT_CHECKPOINTS = 2
#: Graph metadata per node of llama.cpp's compute graphs (two ``llm_graph_result`` meta
#: buffers of ggml_tensor_overhead() per node plus the scheduler's hash sets). Regular
#: models' few thousand nodes are inside RUNTIME_BASE; hybrid models reserve
#: max(n_ubatch x 40, 32 x n_tensors) nodes (llama-context.cpp ``graph_max_nodes``)
#: instead of max(1024, 8 x n_tensors). Measured: the 4.6 tiny preset's peak was 20.2 MiB
#: over the estimate without this term, for 19456 extra nodes.
GRAPH_NODE_BYTES = 1088
#: Tensors per repeating layer of a hybrid text model (the 4.6 presets: 55 tensors for 4
#: layers, 320 for 24), to size ``graph_max_nodes`` before a header is read.
HYBRID_TENSORS_PER_LAYER = 13
#: Text positions of a typical image question besides image tokens (system prompt,
#: markers, question, answer) -- sizes the KV view the attention reads.
PROMPT_TEXT_TOKENS = 96

#: ONNX Runtime's library, session and thread pool: measured as the RSS the ONNX backends
#: add beyond their weights and arena (tiny and bench presets, tools/bench_memory.py).
ORT_RUNTIME = 25 * _MiB
#: f32 copies of the attention scores (heads x patches x patches) alive at once in ONNX
#: Runtime's arena: the QK^T MatMul's output and the Softmax's (no fused attention on the
#: CPU provider for this graph). Fitted: the arena of the 16-head bench tower at 1024
#: patches is 2 x 64 MiB, of the 4-head tiny tower 2 x 16 MiB.
ORT_SCORE_COPIES = 2
#: Rows of libmtmd's learned position table the ONNX graph keeps (POS_GRID^2 = 70 x 70).
ONNX_POS_ROWS = 4900

# --- assumptions that could not be measured here (no GPU on the calibration machine) ---

#: VRAM a CUDA context, cuBLAS workspace and llama.cpp's pools take before any tensor.
CUDA_CONTEXT_VRAM = 350 * _MiB
#: Host RAM the CUDA runtime libraries add to the process (code, kernels, pinned staging).
CUDA_HOST_OVERHEAD = 300 * _MiB
#: Metal's command buffers and library on Apple Silicon (shared memory).
METAL_OVERHEAD = 150 * _MiB


#: Bytes per KV element including block overhead: f16 2; q8_0 34 bytes per 32 values;
#: q4_0 18 bytes per 32 (ggml-common.h block_q8_0 / block_q4_0).
KV_BYTES_PER_ELEMENT = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}

#: One image at full detail on 2.6-style models: overview + 3x3 slices, 64 tokens each.
DEFAULT_IMAGE_TOKENS = 640
#: Marker tokens around those slices (<image>, </image>, <slice>, </slice>, newlines).
IMAGE_MARKER_TOKENS = 22
#: The decoded image the planner assumes: a 12-megapixel phone photo.
DEFAULT_IMAGE_PIXELS = 4000 * 3000

# --- CPU repacking ----------------------------------------------------------------------

#: ggml types the CPU backend rewrites into an interleaved copy at load time, per CPU
#: family (ggml-cpu/repack.cpp, ``ggml_repack_get_optimal_repack_type``). The copy is
#: anonymous memory; the mmap'd original stays mapped, so peak RSS counts both. Only
#: layer and output matrices qualify: token_embd is read with get_rows, which the
#: repacked layout does not support.
REPACKED_TYPES: dict[str, frozenset[str]] = {
    "x86-avx2": frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"}),
    "x86-avx512": frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4", "Q2_K"}),
    "arm-dotprod": frozenset({"Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "MXFP4"}),
    "none": frozenset(),
}

#: Share of the repeating layers' bytes in each ggml type, per quant, as llama-quant.cpp
#: mixes them (e.g. Q4_K_M keeps attn_v and ffn_down of some layers in Q6_K). Measured
#: on a 28-layer, 8:1 GQA Qwen2 shape whose rows are multiples of 256 (as in every real
#: MiniCPM-V); narrower rows fall back to other types. Used only when the file's tensor
#: list is unknown; it sizes ``repacked`` (so ``total``), never ``needed``.
QUANT_TYPE_MIX: dict[str, dict[str, float]] = {
    "Q2_K": {"Q2_K": 0.58, "Q3_K": 0.41, "Q4_K": 0.01},
    "Q3_K_S": {"Q3_K": 1.0},
    "Q3_K_M": {"Q3_K": 0.58, "Q4_K": 0.40, "Q5_K": 0.02},
    "Q3_K_L": {"Q3_K": 0.53, "Q5_K": 0.47},
    "Q4_K_S": {"Q4_K": 0.96, "Q5_K": 0.04},
    "Q4_K_M": {"Q4_K": 0.80, "Q6_K": 0.20},
    "Q5_K_S": {"Q5_K": 1.0},
    "Q5_K_M": {"Q5_K": 0.83, "Q6_K": 0.17},
    "IQ4_XS": {"IQ4_XS": 1.0},
}  # other quants: every layer matrix in the quant's own type (Q4_0, Q5_1, Q6_K, Q8_0...)

#: Bits per weight of each ggml block type (ggml-common.h block sizes).
GGML_TYPE_BITS: dict[str, float] = {
    "F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K": 5.5, "Q5_1": 6,
    "Q5_0": 5.5, "Q4_K": 4.5, "Q4_1": 5, "Q4_0": 4.5, "IQ4_NL": 4.5, "IQ4_XS": 4.25,
    "Q3_K": 3.4375, "Q2_K": 2.625,
}  # fmt: skip
#: token_embd's type in llama.cpp's quant mixes (llama-quant.cpp); the output matrix
#: is Q6_K for everything below Q8_0.
_EMBD_TYPE = {"Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
              "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K",
              "IQ4_XS": "IQ4_XS"}  # fmt: skip
