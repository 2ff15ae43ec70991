"""The text of the status line ``gguf-mcv watch`` keeps on stderr (drawn by :func:`gguf_mcv.progress.status_line`)."""

from __future__ import annotations

from typing import Any


def describe_tick(seen: Any, lines: int) -> str:
    """What the last tick did, in one line."""
    what = "asked" if seen.asked else "unchanged"
    return (f"frame {seen.frame_index} · {seen.changed:.1%} changed · {seen.slices_encoded} encoded / "
          f"{seen.slices_reused} reused · {what} · {seen.latency_s:.2f} s · skipped {seen.frames_skipped} "
          f"frames, {seen.ticks_skipped} ticks · reconnects {seen.reconnects} · {lines} lines")
