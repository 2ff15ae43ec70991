"""The plan as people read it: the table of quants with the budget above it and the notes below
(``gguf-mcv plan``, :meth:`gguf_mcv.planning.plan.Plan.table`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..units import format_size
from . import speed

if TYPE_CHECKING:
    from .plan import Plan, PlanRow


def shrunk_note(plan: Plan) -> str:
    """One sentence on :attr:`shrunk` ("" when nothing was shrunk)."""
    if not plan.shrunk:
        return ""
    asked = " / ".join(f"{s.setting}=" for s in plan.shrunk)
    note = (f"Shrunk to fit the budget: {', '.join(map(str, plan.shrunk))} (nothing fitted with the "
            f"defaults; pass {asked} to choose yourself).")
    if any(s.setting == "vision_weights" for s in plan.shrunk):
        note += (" The vision encoder reads its weights from their mapped file: slices take ~25 % longer, "
                 "and under memory pressure each new image reads them from disk again.")
    return note


def images_note(plan: Plan) -> str:
    """One sentence on the photo the ``images`` term assumes (and what detail="high" adds)."""
    note = (f"Images: a 12 MP photo asked about at detail={plan.image_detail!r} "
            f"({format_size(plan.estimate.images)} decoded).")
    if plan.high_detail_extra > 0:
        note += (f" detail='high' decodes {format_size(plan.high_detail_extra)} more: plan with "
                 "detail='high' if you ask for it.")
    return note


def table(plan: Plan) -> str:
    """An aligned, readable table of the rows, with the budget above it."""
    timed = plan.speed is not None
    head: tuple[str, ...] = ("", "quant", "file size", "needs", "peak RSS")
    head += ("tok/s", "photo", "video") if timed else ()
    body = [("->" if r.chosen else "", r.quant, format_size(r.size), format_size(r.needed),
             format_size(r.peak_rss)) + (_speed_cells(r) if timed else ()) for r in plan.rows]
    head, body = head + ("verdict",), [row + (r.note,) for row, r in zip(body, plan.rows, strict=True)]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    right = range(2, len(head) - 1)
    fmt = lambda row: "  ".join(  # noqa: E731
        c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
    ).rstrip()
    lines = [f"Model: {plan.model}"] if plan.model else []
    lines += [plan.budget_note or f"RAM budget {format_size(plan.budget)}"]
    lines += [plan.shrunk_note()] if plan.shrunk else []
    lines.append(fmt(head))
    lines += [fmt(row) for row in body]
    gpu = "no GPU offload"
    if plan.n_gpu_layers or plan.vision_on_gpu:
        layers = "all" if plan.n_gpu_layers < 0 else str(plan.n_gpu_layers)
        gpu = f"n_gpu_layers={layers}, vision on {'GPU' if plan.vision_on_gpu else 'CPU'}"
    if plan.slot_bytes:
        lines.append(f"Parallel slots (parallel=\"auto\"): {plan.slots}, "
                     f"{format_size(plan.slot_bytes)} each beyond the first.")
    lines.append(f"Vision encoder: {plan.vision_backend} ({plan.vision_backend_reason}); "
                 "its weights and working memory are in the figures above.")
    if plan.vision is not None and plan.vision.fallback is not None and plan.fallback_bytes is not None:
        lines.append(f"If int8's embeddings fail their check against fp32 when it is first converted, "
                     f"load() runs {plan.vision.fallback} instead: it needs {format_size(plan.fallback_bytes)}, "
                     f"within the budget.")
    elif plan.vision is not None and plan.vision.over_budget is not None:
        lines.append(f"int8 is kept even if its embeddings fail their check against fp32: "
                     f"{plan.vision.over_budget} would not fit the budget.")
    lines.append(plan.images_note())
    lines.append(f"Chosen {plan.quant}: n_ctx={plan.n_ctx}, kv_cache_type={plan.kv_cache_type}, "
                 f"n_threads={plan.n_threads}, {gpu}.")
    if plan.speed is not None and plan.rates is not None:
        lines.append(f"Speed predicted from {plan.rates.source}: tok/s = decode tokens per second; "
                     f"photo = seconds to the first token for a 12 MP photo at detail="
                     f"{plan.speed.detail!r} ({plan.speed.photo_slices} encoder passes); "
                     f"video = the same for {speed.VIDEO_FRAMES} frames.")
    lines += [f"Warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _speed_cells(r: PlanRow) -> tuple[str, str, str]:
    if r.decode_tokens_per_s is None or r.first_answer_s is None or r.video_first_answer_s is None:
        return "", "", ""
    return f"{r.decode_tokens_per_s:.1f}", f"{r.first_answer_s:.0f} s", f"{r.video_first_answer_s:.0f} s"
