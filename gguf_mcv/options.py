"""What a caller may set, checked once, where it is defined: sampling, answers, loading.

The library, the command line and both HTTP APIs build these same values, so a
setting is refused the same way everywhere: a :class:`~gguf_mcv.errors.ConfigError`
naming the setting, its value and what is allowed.
"""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from dataclasses import dataclass, fields, replace
from typing import Any, Collection, Sequence, TypedDict

from .errors import ConfigError

KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")
#: how much of an image the encoder sees (gguf_mcv.vision.slicing)
DETAILS = ("auto", "low", "high")
#: who runs the vision encoder: libmtmd, or ONNX Runtime on a graph converted from the mmproj
VISION_BACKENDS = ("auto", "llama.cpp", "onnx-int8", "onnx-fp32")
#: the weights libmtmd encodes with: "auto" (a BF16 copy where the CPU has AVX512-BF16), the
#: mmproj "as-is", or always a "bf16" copy (gguf_mcv.vision.mmproj_bf16)
MMPROJ_PRECISIONS = ("auto", "as-is", "bf16")
#: Smallest context: one image alone takes 64 to 660 positions.
MIN_N_CTX = 256
#: Largest context accepted (llama.cpp allocates the KV cache for all of it up front).
MAX_N_CTX = 2**20
DEFAULT_MAX_TOKENS = 512
#: More threads than this per core only makes llama.cpp and OpenMP thrash (or crash:
#: 100000 threads abort inside libgomp).
MAX_THREADS_PER_CORE = 4
#: Most parallel slots accepted (llama.cpp allows 256 sequences; past a few dozen a CPU gains
#: nothing and each slot holds a whole KV cache).
MAX_PARALLEL = 64
#: A stop list this long is a mistake, not a request.
MAX_STOP_STRINGS = 16

# (low, low inclusive, high) for each float/int sampling setting; outside these
# llama.cpp samples garbage or refuses.
_RANGES: dict[str, tuple[float, bool, float]] = {
    "temperature": (0.0, True, 5.0), "top_p": (0.0, False, 1.0), "top_k": (0, True, 100_000),
    "min_p": (0.0, True, 1.0), "repeat_penalty": (0.0, False, 5.0),
}


@dataclass(frozen=True)
class Sampling:
    """Sampling settings for one generation (defaults: MiniCPM-V's published ones)."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 100
    min_p: float = 0.0
    repeat_penalty: float = 1.05
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, (low, inclusive, high) in _RANGES.items():
            value = getattr(self, name)
            if name == "top_k":
                check_int("top_k", value, low=int(low), high=int(high))
                continue
            number = check_number(name, value)
            if not ((number >= low if inclusive else number > low) and number <= high):
                bound = "[" if inclusive else "("
                raise ConfigError(f"{name} must be in {bound}{low}, {high}], not {value!r}.")
        if self.seed is not None:
            check_int("seed", self.seed)

    def with_overrides(self, **overrides: Any) -> "Sampling":
        """A copy with the given settings changed; ``None`` keeps the current value."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"Unknown sampling setting(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(known))}.")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


class SamplingKeywords(TypedDict, total=False):
    """The sampling keywords every question takes (``Model.ask``, ``ask_video``, ``chat_completion``,
    ``Chat.send``, ``Chat.regenerate``): each overrides the model's :class:`Sampling`; ``None``
    keeps it. An unknown keyword raises :class:`~gguf_mcv.errors.ConfigError` naming it."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repeat_penalty: float | None
    seed: int | None


def check_sampling(**settings: Any) -> dict[str, Any]:
    """``settings`` (sampling keywords, ``None`` for unset) checked as :class:`Sampling` checks
    them; returned unchanged. For the edges (CLI, HTTP) that pass them on later."""
    Sampling().with_overrides(**settings)
    return settings


def check_vision_backend(value: Any, *, resolved: bool = False) -> str:
    """``value`` when it names a vision backend (:data:`VISION_BACKENDS`; with ``resolved``, not
    ``"auto"``: who runs the encoder once the rule has been applied); ConfigError otherwise."""
    allowed = tuple(b for b in VISION_BACKENDS if not (resolved and b == "auto"))
    if not isinstance(value, str) or value not in allowed:
        resolve = " here (resolve 'auto' first)" if resolved and value == "auto" else ""
        raise ConfigError(f"vision_backend must be one of {', '.join(allowed)}{resolve}, not {value!r}.")
    return value


#: Where an ONNX encoder keeps its weights (``vision_weights=``): packed into anonymous memory
#: (fastest), or read from their memory-mapped file (the kernel may drop them while the text model
#: answers: for small budgets). None leaves it to the planner (packed unless nothing fits otherwise).
VISION_WEIGHTS = ("packed", "mapped")


def check_vision_weights(value: Any) -> str | None:
    """``value`` when it is None or one of :data:`VISION_WEIGHTS`; ConfigError otherwise."""
    if value is not None and value not in VISION_WEIGHTS:
        raise ConfigError(f"vision_weights must be one of {', '.join(VISION_WEIGHTS)} or None, not {value!r}.")
    return value


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int within [low, high]; ConfigError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, not {type(value).__name__} {value!r}.")
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"between {low} and {high}" if low is not None and high is not None else (
            f"at least {low}" if low is not None else f"at most {high}")
        raise ConfigError(f"{name} must be {span}, not {value}.")
    return value


def check_number(name: str, value: Any) -> float:
    """``value`` as a finite float; ConfigError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, not {type(value).__name__} {value!r}.")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range (1.8e308)
        raise ConfigError(f"{name} must be a finite number, not an integer of {int(value).bit_length()} "
                          "bits.") from None
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be a finite number, not {value!r}.")
    return number


def check_url(name: str, url: str, *, host_for: Collection[str] = ()) -> urllib.parse.SplitResult:
    """``url`` split as urllib reads it, checked: :class:`ConfigError` naming ``name`` where urllib
    would raise ``ValueError`` later (an unclosed IPv6 bracket, a port that is not a number from 1
    to 65535), and, for a scheme in ``host_for``, where there is no host. Messages show the URL's
    scheme and host only (its user info masked: camera URLs carry passwords)."""
    shown = _url_head(url)
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{name} {shown} is not a URL that can be read ({exc}): write it as "
                          "scheme://host:port/path, with a port from 1 to 65535 and an IPv6 address in "
                          "brackets (rtsp://[::1]:8554/live).") from None
    if port == 0:
        raise ConfigError(f"{name} {shown} has port 0: use a port from 1 to 65535.")
    if parts.scheme.lower() in host_for and not parts.hostname:
        raise ConfigError(f"{name} {shown} names no host: write it as {parts.scheme}://host:port/path.")
    return parts


def _url_head(url: str) -> str:
    """``url``'s scheme and host part, user info masked (``rtsp://***@cam:554``), for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return repr(url[:60])
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    _, at, hostport = netloc.rpartition("@")
    return repr(f"{scheme[:20]}://{'***@' if at else ''}{hostport[:100]}")


def check_max_tokens(value: Any) -> int:
    """The answer's token budget: an int of at least 1."""
    return check_int("max_tokens", value, low=1)


def stop_list(stop: str | Sequence[str] | None) -> list[str]:
    """Stop strings as a list: one string (as the OpenAI API allows) or a sequence of them."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Sequence):
        raise ConfigError(f"stop must be a string or a list of strings, not {type(stop).__name__}.")
    if len(stop) > MAX_STOP_STRINGS:
        raise ConfigError(f"stop lists {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed.")
    for s in stop:
        if not isinstance(s, str):
            raise ConfigError(f"stop must list strings, not {type(s).__name__} {s!r}.")
    return [s for s in stop if s]


def check_text(name: str, value: Any) -> str:
    """A prompt or message text: a str that can be encoded as UTF-8 (no lone surrogates)."""
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, not {type(value).__name__}.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{name} is not valid Unicode text (a lone surrogate at position {exc.start}): "
            "decode the input with errors='replace' first."
        ) from None
    return value


@dataclass(frozen=True)
class GenerationOptions:
    """How one answer is generated: the value :meth:`~gguf_mcv.runtime.engine.Engine.generate` takes.

    ``grammar`` (GBNF, checked with ``Engine.check_grammar``) constrains the tokens — from the
    start, or only once the text ``grammar_after`` (``</think>``) was generated. With ``may_open``
    (``<think>``) the answer may instead begin with that text, and is then free until
    ``grammar_after``. With ``must_answer``, a model that ends inside the free block gets
    ``grammar_after`` written for it, and must then give the constrained answer.
    """

    sampling: Sampling = Sampling()
    max_tokens: int = DEFAULT_MAX_TOKENS
    grammar: str | None = None
    grammar_after: str | None = None
    may_open: str | None = None
    must_answer: bool = True

    def __post_init__(self) -> None:
        check_max_tokens(self.max_tokens)


def check_parallel(value: Any) -> int | str:
    """``parallel``: "auto" or a number of slots from 1 to :data:`MAX_PARALLEL`."""
    if value == "auto":
        return value
    if isinstance(value, str):
        raise ConfigError(f"parallel must be 'auto' or a number of slots, not {value!r}.")
    return check_int("parallel", value, low=1, high=MAX_PARALLEL)


def max_threads() -> int:
    """The most threads accepted on this machine."""
    return MAX_THREADS_PER_CORE * (os.cpu_count() or 1)


#: The context a load gets unless told otherwise (the planner may shrink it when nothing fits).
DEFAULT_N_CTX = 4096
#: llama.cpp's batch sizes for every load (one ubatch of a prompt, the compute buffer's reserve)
N_BATCH = 512


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded into llama.cpp; checked when made."""

    n_ctx: int = 4096
    n_threads: int | None = None  #: None: the machine's recommended count
    n_threads_batch: int | None = None  #: None: same as n_threads
    n_gpu_layers: int | str = 0  #: layers to offload; -1 all; "auto" from the plan
    vision_gpu: bool | None = None
    flash_attn: bool | None = None
    kv_cache_type: str = "f16"
    vision_backend: str = "auto"
    mmproj_precision: str = "auto"
    parallel: int | str = 1  #: answers at once (slots, each with n_ctx positions); "auto" from memory
    vision_weights: str | None = None  #: see :data:`VISION_WEIGHTS`
    n_batch: int = N_BATCH  #: llama.cpp's n_batch and n_ubatch (the plan's)

    def __post_init__(self) -> None:
        check_int("n_ctx", self.n_ctx, low=MIN_N_CTX, high=MAX_N_CTX)
        check_parallel(self.parallel)
        check_vision_weights(self.vision_weights)
        for name in ("n_threads", "n_threads_batch"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=1, high=max_threads())
        if self.n_gpu_layers != "auto":
            if isinstance(self.n_gpu_layers, str):
                raise ConfigError(f"n_gpu_layers must be an int >= -1 (-1 = all) or 'auto', "
                                  f"not {self.n_gpu_layers!r}.")
            check_int("n_gpu_layers", self.n_gpu_layers, low=-1)
        for name in ("vision_gpu", "flash_attn"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"{name} must be True, False or None, not {getattr(self, name)!r}.")
        if self.kv_cache_type not in KV_CACHE_TYPES:
            raise ConfigError(f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, "
                              f"not {self.kv_cache_type!r}.")
        check_vision_backend(self.vision_backend)
        if self.mmproj_precision not in MMPROJ_PRECISIONS:
            raise ConfigError(f"mmproj_precision must be one of {', '.join(MMPROJ_PRECISIONS)}, "
                              f"not {self.mmproj_precision!r}.")
        if self.mmproj_precision == "bf16" and self.vision_backend.startswith("onnx"):
            raise ConfigError(f"mmproj_precision='bf16' is for the llama.cpp vision backend, not "
                              f"{self.vision_backend!r}: drop it or use vision_backend='llama.cpp'.")
        if self.vision_backend.startswith("onnx") and self.vision_gpu:
            raise ConfigError(f"vision_backend={self.vision_backend!r} runs on the CPU: drop vision_gpu=True "
                              "or use vision_backend='llama.cpp'.")
        if self.kv_cache_type != "f16" and self.flash_attn is False:
            raise ConfigError(
                f"A {self.kv_cache_type} KV cache needs flash attention in llama.cpp: "
                "drop flash_attn=False or use kv_cache_type='f16'."
            )

    @property
    def wants_gpu(self) -> bool:
        """Whether offload to a GPU was asked for explicitly ("auto" asks for nothing)."""
        return bool(self.vision_gpu) or (isinstance(self.n_gpu_layers, int) and self.n_gpu_layers != 0)
