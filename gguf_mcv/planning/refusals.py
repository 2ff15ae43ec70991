"""Why nothing fits, or nothing is fast enough, and the ways out: the messages of the planner's
:class:`~gguf_mcv.errors.NoQuantFitsError`."""

from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError
from ..units import format_size
from ..vision.vision_backends import choose_backend
from . import memory
from .evaluation import Context, Evaluated, Setup, estimate_setup
from .plan import QuantCandidate

#: The smallest context worth suggesting: one full-detail image plus a short exchange.
MIN_SUGGESTED_CTX = 1024
#: Models to suggest when nothing fits (catalog names, smallest first).
SMALLER_MODELS = ("minicpm-v-4.6",)


def too_slow(c: QuantCandidate, ctx: Context) -> str:
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


def too_slow_message(fitting: list[Evaluated], ctx: Context) -> str:
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


def nothing_fits_message(evaluated, ctx: Context, *, asked: bool = False) -> str:
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
    fitting_ctx = largest_fitting_ctx(c, ctx, s)
    if fitting_ctx is not None:
        lines.append(f"- a smaller context: n_ctx={fitting_ctx} fits with {c.quant}.")
    if ctx.kv_cache_type == "f16":
        q8 = estimate_setup(c, ctx, s, kv_cache_type="q8_0")
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


def _smaller_models(ctx: Context) -> list[str]:
    """:data:`SMALLER_MODELS` less the generation planned for (a variant such as
    ``minicpm-v-4.6-thinking`` is its generation's size: not a smaller model either)."""
    return [m for m in SMALLER_MODELS if not (ctx.model == m or ctx.model.startswith(m + "-"))]


def _mapped_vision(c: QuantCandidate, ctx: Context, s: Setup) -> memory.MemoryEstimate | None:
    """``c``'s estimate with the ONNX encoder's weights read from their mapped file, when the
    plan packed them (None when they are mapped already, or libmtmd runs the encoder)."""
    if ctx.vision_mapped or not s.vision_backend.startswith("onnx-"):
        return None
    return estimate_setup(c, replace(ctx, vision_mapped=True), s)


def _smaller_vision(c: QuantCandidate, ctx: Context, s: Setup) -> memory.MemoryEstimate | None:
    """``c``'s estimate with the int8 ONNX encoder, when the plan used libmtmd's on the CPU
    although onnx-int8 could run here (None otherwise)."""
    if s.vision_backend != "llama.cpp" or s.vision_on_gpu or ctx.onnxruntime is None:
        return None
    try:
        choose_backend("onnx-int8", vision_gpu=False, projector_type=ctx.vision.projector,
                       ort_version=ctx.onnxruntime)
    except ConfigError:
        return None
    int8 = estimate_setup(c, ctx, replace(s, vision_backend="onnx-int8"))
    return int8 if int8.needed < estimate_setup(c, ctx, s).needed else None


def largest_fitting_ctx(c: QuantCandidate, ctx: Context, s: Setup,
                         floor: int = MIN_SUGGESTED_CTX) -> int | None:
    """The largest n_ctx (a multiple of 256 below the asked one, at least ``floor``) with
    which ``c`` fits.

    Memory grows with n_ctx, so a bisection finds it in a few dozen estimates even for
    an absurd ``n_ctx`` (a linear walk down from 10**10 would take hours).
    """
    fits_at = lambda steps: estimate_setup(c, ctx, s, n_ctx=steps * 256).needed <= ctx.budget  # noqa: E731
    low, high = -(-floor // 256), (ctx.n_ctx - 1) // 256
    if high < low or not fits_at(low):
        return None
    while low < high:  # invariant: fits_at(low)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits_at(mid) else (low, mid - 1)
    return low * 256
