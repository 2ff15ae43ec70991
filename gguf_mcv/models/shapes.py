"""The two towers' shapes: one frozen type each, made from a GGUF header or a catalog entry.

The memory model and the planner need the same few numbers whether a model is only
named in the catalog, on the Hub (its header read by range) or on disk. They all
arrive here as a :class:`TextShape` and a :class:`VisionShape`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

#: n_ff when it is not known: Qwen2 (7B: 18944/3584, 0.5B: 4864/896) ~5.4x the width.
FF_RATIO = 5.4
#: Tokens per slice when an mmproj does not say (clip.cpp: 96 for MiniCPM-Llama3-V 2.5,
#: whose minicpmv_version is 2; 64 for the later resamplers).
_QUERY_TOKENS_BY_VERSION = {2: 96}
_DEFAULT_QUERY_TOKENS = 64


@dataclass(frozen=True)
class TextShape:
    """The text model's numbers: layers, widths, heads, vocabulary."""

    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_kv_layers: int | None = None  #: layers with a KV cache (hybrid models); None = all
    n_ff: int | None = None  #: FFN width; None = FF_RATIO x n_embd
    n_merges: int | None = None  #: BPE merges; None = n_vocab (BPE tokenizers have ~as many)
    tied_embeddings: bool = False  #: no separate output matrix (it reuses token_embd)
    architecture: str = ""  #: llama.cpp's ``general.architecture``
    n_ctx_train: int = 0  #: the context length it was trained for (0: unknown)
    # hybrid models' recurrent (gated delta net) layers; 0 on attention-only models
    ssm_conv_kernel: int = 0
    ssm_inner_size: int = 0
    ssm_state_size: int = 0
    ssm_group_count: int = 0

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]) -> "TextShape":
        """From a text GGUF's metadata and tensor shapes (numpy order; may be empty for a
        header prefix, then the vocabulary size comes from the token list)."""
        arch = str(fields.get("general.architecture", ""))

        def num(key: str, default: int = 0) -> int:
            return int(_scalar(fields.get(f"{arch}.{key}", default)))

        n_embd, n_head = num("embedding_length"), num("attention.head_count")
        n_layers, interval = num("block_count"), num("full_attention_interval")
        embd = tensor_shapes.get("token_embd.weight")
        tokens = fields.get("tokenizer.ggml.tokens")
        merges = fields.get("tokenizer.ggml.merges")
        return cls(
            n_layers=n_layers, n_embd=n_embd, n_head=n_head,
            n_head_kv=num("attention.head_count_kv", n_head),
            head_dim=num("attention.key_length", n_embd // n_head if n_head else 0),
            n_vocab=embd[0] if embd else _length(tokens),
            n_ff=num("feed_forward_length") or None,
            n_merges=_length(merges) if merges is not None else (0 if tensor_shapes else None),
            tied_embeddings=bool(tensor_shapes) and "output.weight" not in tensor_shapes,
            architecture=arch, n_ctx_train=num("context_length"),
            # llama.cpp (qwen35): layer i keeps a KV cache when (i + 1) % interval == 0
            n_kv_layers=n_layers // interval if interval else None,
            ssm_conv_kernel=num("ssm.conv_kernel"), ssm_inner_size=num("ssm.inner_size"),
            ssm_state_size=num("ssm.state_size"), ssm_group_count=num("ssm.group_count"),
        )  # fmt: skip

    @property
    def kv_layers(self) -> int:
        """Layers that keep a KV cache."""
        return self.n_kv_layers if self.n_kv_layers is not None else self.n_layers

    @property
    def ff(self) -> int:
        """The FFN width (estimated from the embedding width when unknown)."""
        return self.n_ff if self.n_ff else round(FF_RATIO * self.n_embd)

    @property
    def recurrent_values(self) -> int:
        """f32 values of one sequence's recurrent state, summed over the recurrent layers.

        llama.cpp's ``n_embd_r`` (the convolution's last kernel-1 inputs: the value
        channels plus keys and queries of every group) plus ``n_embd_s`` (the delta
        net's state, state size x inner size) per layer that keeps no KV cache.
        """
        if not self.ssm_inner_size:
            return 0
        conv = max(0, self.ssm_conv_kernel - 1) * (self.ssm_inner_size + 2 * self.ssm_group_count
                                                   * self.ssm_state_size)
        state = self.ssm_state_size * self.ssm_inner_size
        return (self.n_layers - self.kv_layers) * (conv + state)

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> int:
        """KV-cache bytes one token costs (keys and values, every attention layer)."""
        return int(2 * self.kv_layers * self.n_head_kv * self.head_dim * bytes_per_value)


@dataclass(frozen=True)
class VisionShape:
    """The vision tower (SigLIP-400M in every MiniCPM-V since 2.5) and its slicing.

    The defaults are SigLIP-400M's; ``VisionShape()`` stands for a tower nobody described.
    """

    width: int = 1152
    blocks: int = 27
    heads: int = 16
    ff: int = 4304
    patch_size: int = 14
    image_size: int = 448
    query_tokens: int = 64
    #: blocks that see every patch before a 2x2 token merger (MiniCPM-V 4.6's
    #: ``minicpmv4_6``: the merger follows block ``wa_layer_indexes[0]``, the later
    #: blocks see a quarter of the patches); None: every block sees every patch
    full_blocks: int | None = None
    #: clip.cpp's projector: ``resampler`` (2.5 to 4.5) or ``minicpmv4_6`` (window-attention merger)
    projector: str = "resampler"

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any]) -> "VisionShape":
        """From an mmproj's metadata, as written (0 where a key is missing, which
        :mod:`gguf_mcv.models.headers` refuses)."""
        def num(key: str) -> int:
            return int(_scalar(fields.get(key, 0)))

        version = fields.get("clip.minicpmv_version")
        default_queries = _QUERY_TOKENS_BY_VERSION.get(int(_scalar(version or 0)), _DEFAULT_QUERY_TOKENS)
        merger = fields.get("clip.vision.wa_layer_indexes")
        merges = fields.get("clip.projector_type") == "minicpmv4_6" and merger not in (None, [])
        return cls(
            width=num("clip.vision.embedding_length"), blocks=num("clip.vision.block_count"),
            heads=num("clip.vision.attention.head_count"), ff=num("clip.vision.feed_forward_length"),
            patch_size=num("clip.vision.patch_size"), image_size=num("clip.vision.image_size"),
            query_tokens=num("clip.minicpmv_query_num") or default_queries,
            full_blocks=int(_scalar(merger)) + 1 if merges else None,
            projector=str(_scalar(fields.get("clip.projector_type") or "resampler")),
        )  # fmt: skip

    @property
    def patches(self) -> int:
        """Patches per slice: (448 / 14)^2 = 1024."""
        return (self.image_size // self.patch_size) ** 2 if self.patch_size else 0


def _scalar(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value


def _length(value: Any) -> int:
    """Length of a metadata array kept whole (a list) or summarised (has ``count``)."""
    if isinstance(value, list):
        return len(value)
    return int(getattr(value, "count", 0))
